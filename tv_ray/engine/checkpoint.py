"""The checkpoint: every verdict as it arrives, streamed to Parquet under OUT, so a killed run resumes.

    OUT/checkpoint/plan.json.gz      the plan itself (`tv-ray verify --resume OUT` needs nothing else)
    OUT/checkpoint/run.json          its SHA-256 and the settings that decide verdicts
    OUT/checkpoint/part-000001.parquet, ...   (key, verdict, tier, method, seconds, axioms, reason, ...)
    OUT/checkpoint/parts.json        each whole part's SHA-256, rewritten after each part

Verdicts belong to unique keys (each key is solved once; every obligation
with that key shares it), and keys are content hashes of the formulas, so a
re-generated run finds its solved keys again whatever order it generates
them in. Each part is written to a temporary name and renamed: a run killed
at any moment leaves whole parts only, and loses at most the verdicts since
the last flush. A resumed run takes the plan and the settings that decide
verdicts (solvers, timeout, seed, symmetry) from the checkpoint, and refuses
one whose plan file or any listed part was changed since (a verdict taken on
resume is never solved again, so it must be the one the solver gave). A part
that `parts.json` does not list (the run was killed between writing the two)
is not trusted: its keys are solved again.
"""
from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from tv_ray.engine.solve import Verdict
from tv_ray.errors import CheckpointError
from tv_ray.plan import Plan, pack

PLAN = "plan.json.gz"       # gzip-compressed (`Plan.save`): a frontier plan's JSON is ~100 MiB
FLUSH_ROWS = 2000
FLUSH_SECONDS = 2.0
SCHEMA = pa.schema([("key", pa.string()), ("verdict", pa.string()), ("tier", pa.int8()), ("method", pa.string()),
                    ("seconds", pa.float64()), ("axioms", pa.list_(pa.string())), ("reason", pa.string()),
                    ("element", pa.int64()), ("point", pa.string()), ("values", pa.list_(pa.string()))])


class Checkpoint:
    """Verdicts by key under `OUT/checkpoint`; `add` buffers, `flush` writes one Parquet part."""

    def __init__(self, out: str | Path):
        self.dir = Path(out) / "checkpoint"
        self.verdicts: dict[str, Verdict] = {}
        self._buffer: list[tuple[str, Verdict]] = []
        self._flushed = time.monotonic()
        self._parts = 0
        self._digests: dict[str, str] = {}        # part file name -> SHA-256 (`parts.json`)

    @property
    def plan_file(self) -> Path:
        """The copy of the run's plan (gzip-compressed)."""
        return self.dir / PLAN

    # -- starting and resuming ------------------------------------------------------------------
    def start(self, plan: Plan, settings: dict, source: str | Path | None = None) -> None:
        """A new run: clear any old checkpoint, keep the plan and the settings. `source`: the file `plan` was read
        from, copied as it is (compressed) rather than written again (llama3-405b: 9 s)."""
        self.discard()
        self.dir.mkdir(parents=True, exist_ok=True)
        if source is None:
            plan.save(self.plan_file)
        else:
            pack(source, self.plan_file)
        run = {"plan_sha256": sha256_file(self.plan_file), "settings": settings}
        _atomic_write(self.dir / "run.json", json.dumps(run, indent=1, sort_keys=True) + "\n")

    def discard(self) -> None:
        """Remove the run kept here (a plan that turned out invalid leaves nothing to resume)."""
        if self.dir.exists():
            for f in self.dir.iterdir():
                f.unlink()

    def resume(self) -> tuple[Plan, dict]:
        """The checkpoint's plan and settings, its solved keys loaded (`verdicts`)."""
        try:
            run = json.loads((self.dir / "run.json").read_text())
            digest = sha256_file(self.plan_file)
        except (OSError, ValueError) as err:
            raise CheckpointError(f"{self.dir}: no checkpoint to resume ({err})") from None
        if digest != run["plan_sha256"]:
            raise CheckpointError(f"{self.plan_file} was changed after the run started (SHA-256 "
                                  f"{digest[:12]}…, recorded {run['plan_sha256'][:12]}…)")
        try:
            self._digests = json.loads((self.dir / "parts.json").read_text())
        except FileNotFoundError:
            self._digests = {}
        except (OSError, ValueError) as err:
            raise CheckpointError(f"{self.dir / 'parts.json'}: unreadable ({err})") from None
        for name, recorded in sorted(self._digests.items()):
            path = self.dir / name
            if not path.exists():
                raise CheckpointError(f"{path}: listed in parts.json but missing")
            digest = sha256_file(path)
            if digest != recorded:
                raise CheckpointError(f"{path} was changed after it was written (SHA-256 {digest[:12]}…, "
                                      f"recorded {recorded[:12]}…)")
            try:
                table = pq.read_table(path, schema=SCHEMA)
            except (OSError, pa.ArrowInvalid) as err:
                raise CheckpointError(f"{path}: unreadable checkpoint part ({err})") from None
            for row in table.to_pylist():
                self.verdicts[row["key"]] = _verdict(row)
        self._parts = max((int(p.stem.split("-")[1]) for p in self.dir.glob("part-*.parquet")), default=0)
        return Plan.load(self.plan_file), run["settings"]

    # -- streaming --------------------------------------------------------------------------------
    def add(self, key: str, verdict: Verdict) -> None:
        self.verdicts[key] = verdict
        self._buffer.append((key, verdict))
        if len(self._buffer) >= FLUSH_ROWS or time.monotonic() - self._flushed >= FLUSH_SECONDS:
            self.flush()

    def flush(self) -> None:
        self._flushed = time.monotonic()
        if not self._buffer:
            return
        rows = [_row(key, v) for key, v in self._buffer]
        table = pa.Table.from_pylist(rows, schema=SCHEMA)
        self._parts += 1
        path = self.dir / f"part-{self._parts:06d}.parquet"
        sink = pa.BufferOutputStream()
        pq.write_table(table, sink, compression="zstd")
        data = sink.getvalue()
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(data)
        os.replace(tmp, path)
        self._digests[path.name] = hashlib.sha256(data).hexdigest()
        _atomic_write(self.dir / "parts.json", json.dumps(self._digests, indent=0, sort_keys=True) + "\n")
        self._buffer.clear()


def _row(key: str, v: Verdict) -> dict:
    return {"key": key, "verdict": v.verdict, "tier": v.tier, "method": v.method, "seconds": v.seconds,
            "axioms": list(v.axioms), "reason": v.reason, "element": v.element, "point": json.dumps(v.point),
            "values": list(v.values)}


def _verdict(row: dict) -> Verdict:
    return Verdict(row["verdict"], row["tier"], row["method"], row["seconds"], tuple(row["axioms"] or ()),
                   row["reason"] or "", row["element"], json.loads(row["point"] or "{}"),
                   tuple(row["values"] or ("", "")))


def sha256_file(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


__all__ = ["Checkpoint", "CheckpointError"]
