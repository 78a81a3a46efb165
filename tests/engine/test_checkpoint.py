"""The checkpoint: a run stopped at any point resumes solving only what is missing, with the same result;
a checkpoint that cannot be trusted is refused with what is wrong."""
from __future__ import annotations

import gzip
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tv_ray import api
from tv_ray.engine.checkpoint import Checkpoint, CheckpointError, sha256_file
from tv_ray.engine.executor import LocalExecutor
from tv_ray.engine.solve import Verdict

BIN = Path(sys.executable).parent
PROVED = Verdict("proved", 2, "smt:z3", 0.1)


class Stops(LocalExecutor):
    """Solves `n` keys, then the run is stopped (as by Ctrl-C)."""

    def __init__(self, n: int):
        super().__init__()
        self.n = n

    def run(self, batches, budget):
        for i, item in enumerate(super().run(batches, budget)):
            if i == self.n:
                raise KeyboardInterrupt
            yield item


class Counts(LocalExecutor):
    def __init__(self):
        super().__init__()
        self.keys: list[str] = []

    def run(self, batches, budget):
        for key, verdict in super().run(batches, budget):
            self.keys.append(key)
            yield key, verdict


@pytest.fixture(scope="module")
def plan():
    return api.parallelize(api.capture_step("llama3-tiny", optim="adamw", clip=1.0), "dp=2,tp=2", model="llama3-tiny")


def _content(out: Path) -> dict:
    manifest = json.loads((out / "certificate.json").read_text())
    return {k: manifest[k] for k in ("counts", "tiers", "settings", "symmetry", "stage_dag", "axioms")}


def test_a_stopped_run_resumes_solving_only_what_is_missing(plan, tmp_path):
    out = tmp_path / "out"
    with pytest.raises(KeyboardInterrupt):
        api.verify(plan, solvers=("z3",), executor=Stops(60), checkpoint=out, progress=False)
    saved = Checkpoint(out)
    saved.resume()
    assert len(saved.verdicts) == 60                    # every verdict taken before the stop was flushed
    counting = Counts()
    result = api.verify(checkpoint=out, resume=True, executor=counting, progress=False)
    assert result.proved and result.outcome.resumed == 60
    assert len(counting.keys) == result.outcome.counts()["unique"] - 60 and not set(counting.keys) & set(saved.verdicts)
    result.save(out)
    fresh = api.verify(plan, solvers=("z3",), engine="local", progress=False)
    fresh.save(tmp_path / "fresh")
    assert _content(out) == _content(tmp_path / "fresh")


def test_a_plan_read_from_a_file_is_kept_as_that_files_bytes_never_written_again(plan, tmp_path, monkeypatch):
    """The checkpoint and the certificate copy the plan file (llama3-405b: writing it again took 9 s each)."""
    source, out = tmp_path / "plan.json", tmp_path / "out"
    plan.save(source)
    monkeypatch.setattr(type(plan), "save", lambda *a, **k: pytest.fail("the plan was written again"))
    with pytest.raises(KeyboardInterrupt):
        api.verify(str(source), solvers=("z3",), executor=Stops(5), checkpoint=out, progress=False)
    kept = out / "checkpoint" / "plan.json.gz"
    assert gzip.decompress(kept.read_bytes()) == source.read_bytes()
    result = api.verify(checkpoint=out, resume=True, executor=LocalExecutor(), progress=False)
    assert result.proved
    result.save(out)
    assert (out / "plan.json.gz").read_bytes() == kept.read_bytes()


def test_a_killed_cli_run_resumes_from_its_checkpoint(tmp_path):
    out = tmp_path / "out"
    # every key solved 30 ms late (tests/engine/faults.py): the run always has keys left when it is killed
    run = subprocess.Popen([sys.executable, str(Path(__file__).parent / "faults.py"), "0.03", "verify", "--model",
                            "llama3-tiny", "--parallel", "dp=2,tp=2,pp=2", "-o", str(out), "--engine", "local",
                            "--solvers", "z3", "-q"])
    deadline = time.monotonic() + 300
    while not list((out / "checkpoint").glob("part-*.parquet")) and time.monotonic() < deadline and run.poll() is None:
        time.sleep(0.2)
    os.kill(run.pid, signal.SIGKILL)
    run.wait()
    assert run.returncode == -signal.SIGKILL and not (out / "certificate.json").exists()
    done = subprocess.run([str(BIN / "tv-ray"), "verify", "--resume", str(out), "--engine", "local"],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "PROVED" in done.stdout and "resumed: " in done.stdout and (out / "certificate.json").exists()


def _started(plan, out: Path) -> Checkpoint:
    saved = Checkpoint(out)
    saved.start(plan, {"solvers": ["z3"], "timeout_s": 10.0, "seed": 0, "symmetry": True})
    return saved


def test_a_checkpoint_whose_plan_was_edited_is_refused(plan, tmp_path):
    out = tmp_path / "out"
    _started(plan, out)
    path = out / "checkpoint" / "plan.json.gz"
    text = gzip.decompress(path.read_bytes()).decode()
    path.write_bytes(gzip.compress(text.replace('"dp": 2', '"dp": 4', 1).encode()))
    with pytest.raises(CheckpointError) as err:
        Checkpoint(out).resume()
    assert str(err.value).startswith(f"{path} was changed after the run started (SHA-256 ")


def test_a_checkpoint_part_changed_after_it_was_written_is_refused(plan, tmp_path):
    out = tmp_path / "out"
    saved = _started(plan, out)
    saved.add("k1", Verdict("refuted", 1, "random point", 0.1))
    saved.flush()
    path = out / "checkpoint" / "part-000001.parquet"
    table = pq.read_table(path)
    flipped = table.set_column(table.schema.get_field_index("verdict"), "verdict", pa.array(["proved"]))
    pq.write_table(flipped, path)
    with pytest.raises(CheckpointError) as err:
        Checkpoint(out).resume()
    assert str(err.value).startswith(f"{path} was changed after it was written (SHA-256 ")


def test_a_listed_checkpoint_part_that_is_torn_or_missing_is_refused(plan, tmp_path):
    out = tmp_path / "out"
    _started(plan, out)
    torn = out / "checkpoint" / "part-000001.parquet"
    torn.write_bytes(b"PAR1 torn")
    (out / "checkpoint" / "parts.json").write_text(json.dumps({torn.name: sha256_file(torn)}))
    with pytest.raises(CheckpointError) as err:
        Checkpoint(out).resume()
    assert str(err.value).startswith(f"{torn}: unreadable checkpoint part")
    torn.unlink()
    with pytest.raises(CheckpointError) as err:
        Checkpoint(out).resume()
    assert str(err.value) == f"{torn}: listed in parts.json but missing"


def test_a_part_written_without_its_digest_is_not_trusted(plan, tmp_path):
    out = tmp_path / "out"
    saved = _started(plan, out)
    for key in ("k1", "k2"):
        saved.add(key, PROVED)
        saved.flush()
    digests = json.loads((out / "checkpoint" / "parts.json").read_text())
    del digests["part-000002.parquet"]           # killed between writing part 2 and its digest
    (out / "checkpoint" / "parts.json").write_text(json.dumps(digests))
    resumed = Checkpoint(out)
    resumed.resume()
    assert set(resumed.verdicts) == {"k1"}
    resumed.add("k3", PROVED)
    resumed.flush()                              # a new part never overwrites one on disk
    assert sorted(p.name for p in (out / "checkpoint").glob("part-*")) == \
        ["part-000001.parquet", "part-000002.parquet", "part-000003.parquet"]


def test_resuming_nothing_says_so(tmp_path):
    with pytest.raises(CheckpointError) as err:
        Checkpoint(tmp_path / "none").resume()
    assert str(err.value).startswith(f"{tmp_path / 'none' / 'checkpoint'}: no checkpoint to resume")
