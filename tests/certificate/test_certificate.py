"""Certificates: a proved run writes one, `tv-ray check` re-validates it, and any tampering fails with a named cause."""
import gc
import gzip
import os
import json
import re
import shutil
from types import SimpleNamespace

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tv_ray import api, processes
from tv_ray.certificate import check_certificate
from tv_ray.certificate.outcome import Replay
from tv_ray.certificate.write import manifest_digest, sha256_file
from tv_ray.cli import main
from tv_ray.errors import CertificateError
from tv_ray.plan import Plan

# one worker builds the certificate for every test here (the local executor: the Ray tests' worker is the longest)
pytestmark = pytest.mark.xdist_group("certificate")


@pytest.fixture(scope="module")
def certified(tmp_path_factory):
    graph = api.capture_step("llama3-tiny", optim="adamw", clip=1.0)
    plan = api.parallelize(graph, "dp=2,mb=2", model="llama3-tiny")
    result = api.verify(plan, progress=False, engine="local", jobs=1)
    assert result.proved, result.report["headline"]
    out = tmp_path_factory.mktemp("cert")
    result.save(out)
    return out


@pytest.fixture
def cert(certified, tmp_path):
    copy = tmp_path / "cert"
    shutil.copytree(certified, copy)
    return copy


def _rewrite(cert, edit, refresh_hashes: bool, name: str = "obligations"):
    """Edit the obligation table (or the instantiation map); with refresh_hashes also fix the manifest's digests
    (a careful forger)."""
    rows = pq.read_table(cert / f"{name}.parquet")
    table = edit(rows)
    pq.write_table(table, cert / f"{name}.parquet", compression="zstd")
    if refresh_hashes:
        manifest = json.loads((cert / "certificate.json").read_text())
        manifest[name]["sha256"] = sha256_file(cert / f"{name}.parquet")
        manifest["manifest_sha256"] = manifest_digest(manifest)
        (cert / "certificate.json").write_text(json.dumps(manifest))


def _flip_first_verdict(table):
    verdicts = table.column("verdict").to_pylist()
    verdicts[0] = "refuted"
    return table.set_column(table.schema.get_field_index("verdict"), "verdict", pa.array(verdicts))


def test_a_fresh_certificate_checks(cert):
    report = check_certificate(cert, sample=25)
    assert report.resolved == 25 and report.obligations > 1000
    assert list(report.phases) == ["derive", "compare", "compose", "re-prove"]
    assert all(s >= 0 for s in report.phases.values()) and sum(report.phases.values()) <= report.seconds
    manifest = json.loads((cert / "certificate.json").read_text())
    assert manifest["counts"]["proved"] == manifest["counts"]["obligations"]
    assert manifest["plan"]["path"] == "plan.json.gz" and manifest["reduction"]["reduced"]["batch"] == 8


def test_a_flipped_verdict_changes_the_table_hash(cert):
    _rewrite(cert, _flip_first_verdict, refresh_hashes=False)
    with pytest.raises(CertificateError, match="obligations.parquet: sha256 does not match the manifest; "
                                               "the obligation table was changed"):
        check_certificate(cert, sample=1)


def test_a_flipped_verdict_with_fixed_hashes_is_still_caught(cert):
    _rewrite(cert, _flip_first_verdict, refresh_hashes=True)
    first = pq.read_table(cert / "obligations.parquet").column("id")[0].as_py()
    with pytest.raises(CertificateError, match=f"obligation {first} is recorded as refuted; a certificate needs "
                                               f"every obligation proved"):
        check_certificate(cert, sample=1)


def test_a_deleted_row_is_named(cert):
    first = pq.read_table(cert / "obligations.parquet").column("id")[0].as_py()
    _rewrite(cert, lambda t: t.slice(1), refresh_hashes=True)
    with pytest.raises(CertificateError, match=f"obligation {first} .* is missing from obligations.parquet"):
        check_certificate(cert, sample=1)


def test_rows_out_of_stage_order_are_named(cert):
    ids = pq.read_table(cert / "obligations.parquet").column("id").to_pylist()
    _rewrite(cert, lambda t: pa.concat_tables([t.slice(1, 1), t.slice(0, 1), t.slice(2)]), refresh_hashes=True)
    with pytest.raises(CertificateError, match=f"obligation {ids[0]} .* is missing from obligations.parquet at row "
                                               f"1, where stage order puts it"):
        check_certificate(cert, sample=1)
    _rewrite(cert, lambda t: pa.concat_tables([t.slice(2, 1), t.slice(1)]), refresh_hashes=True)   # 2, 0, 2, ...
    with pytest.raises(CertificateError) as err:
        check_certificate(cert, sample=1)
    assert str(err.value) == (f"obligations.parquet: row 1 is obligation {ids[2]} where the plan's stage 1 is "
                              f"{ids[0]} (a row added, repeated or moved)")


def test_a_repeated_last_row_is_not_a_stage(cert):
    last = pq.read_table(cert / "obligations.parquet").column("id")[-1].as_py()
    _rewrite(cert, lambda t: pa.concat_tables([t, t.slice(t.num_rows - 1)]), refresh_hashes=True)
    with pytest.raises(CertificateError) as err:
        check_certificate(cert, sample=1)
    assert str(err.value) == f"obligations.parquet: obligation {last} is not a stage of this plan"


def test_mirrored_and_microbatch_stages_are_an_instantiation_map_of_the_recorded_ones(cert):
    manifest = json.loads((cert / "certificate.json").read_text())
    recorded, instances = pq.read_table(cert / "obligations.parquet"), pq.read_table(cert / "instances.parquet")
    assert recorded.num_rows == manifest["obligations"]["rows"] and instances.num_rows == manifest["instances"]["rows"]
    assert recorded.num_rows + manifest["instances"]["stages"] == manifest["counts"]["obligations"]
    ranks, mbs, fans = (instances.column(c).to_pylist() for c in ("rank", "microbatch", "mirrors"))
    # dp=2: rank 1 mirrors rank 0, each of its stages in a fan of rank 0's (one mirror: one stage a row)
    assert set(ranks) == {0} and manifest["instances"]["stages"] == instances.num_rows
    assert sum(fans) == manifest["symmetry"]["mirrored"] > recorded.num_rows / 2
    # rank 0's own: its stages of microbatch 1, kept as microbatch 0's renamed (rank 1 mirrors those too)
    assert {m for m, f in zip(mbs, fans) if not f} == {1} and fans.count(False) > recorded.num_rows / 3
    assert {m for m, f in zip(mbs, fans) if f} == {0, 1}


def test_an_instance_changed_without_its_hash_fails(cert):
    _rewrite(cert, lambda t: t.slice(1), refresh_hashes=False, name="instances")
    with pytest.raises(CertificateError, match="instances.parquet: sha256 does not match the manifest; the "
                                               "instantiation map was changed"):
        check_certificate(cert, sample=1)


def _set_instance(cert, column: str, row: int, value) -> None:
    """One cell of the instantiation map rewritten, its hash refreshed: only the comparison can catch it."""
    def edit(table):
        cells = table.column(column).to_pylist()
        cells[row] = value
        return table.set_column(table.schema.get_field_index(column), column,
                                pa.array(cells, table.schema.field(column).type))
    _rewrite(cert, edit, refresh_hashes=True, name="instances")


def test_an_instance_renaming_another_stage_is_named(cert):
    original = pq.read_table(cert / "instances.parquet").column("stage").to_pylist()[4]
    ids = pq.read_table(cert / "obligations.parquet").column("id").to_pylist()
    _set_instance(cert, "stage", 4, original + 1)
    with pytest.raises(CertificateError) as err:
        check_certificate(cert, sample=1)
    rank, mb, fan = (pq.read_table(cert / "instances.parquet").column(c)[4].as_py()
                     for c in ("rank", "microbatch", "mirrors"))
    whose = f"each mirror of rank {rank}" if fan else f"rank {rank}"
    assert str(err.value) == (f"instances.parquet: row 5 renames stage row {original + 2} to {whose}, microbatch "
                              f"{mb}, where the plan's row 5 of stages not recorded is stage {ids[original]} renamed "
                              f"to {whose}, microbatch {mb}")


def test_a_fan_made_one_stage_is_named(cert):
    table = pq.read_table(cert / "instances.parquet")
    row = table.column("mirrors").to_pylist().index(True)
    stage, rank, mb = (table.column(c)[row].as_py() for c in ("stage", "rank", "microbatch"))
    ids = pq.read_table(cert / "obligations.parquet").column("id").to_pylist()
    _set_instance(cert, "mirrors", row, False)
    with pytest.raises(CertificateError) as err:
        check_certificate(cert, sample=1)
    assert str(err.value) == (f"instances.parquet: row {row + 1} renames stage row {stage + 1} to rank {rank}, "
                              f"microbatch {mb}, where the plan's row {row + 1} of stages not recorded is stage "
                              f"{ids[stage]} renamed to each mirror of rank {rank}, microbatch {mb}")


def test_an_instance_moved_to_another_microbatch_is_named(cert, monkeypatch):
    import tv_ray.certificate.check as check_module
    monkeypatch.setattr(check_module, "ROWS_AT_ONCE", 3)         # the map compared 3 rows at a time
    table = pq.read_table(cert / "instances.parquet")
    row = max(i for i, mb in enumerate(table.column("microbatch").to_pylist()) if mb == 1)
    assert row > 3                                                # not in the first batch
    stage, rank, fan = (table.column(c)[row].as_py() for c in ("stage", "rank", "mirrors"))
    whose = f"each mirror of rank {rank}" if fan else f"rank {rank}"
    ids = pq.read_table(cert / "obligations.parquet").column("id").to_pylist()
    _set_instance(cert, "microbatch", row, 0)
    with pytest.raises(CertificateError) as err:
        check_certificate(cert, sample=1)
    assert str(err.value) == (f"instances.parquet: row {row + 1} renames stage row {stage + 1} to {whose}, "
                              f"microbatch 0, where the plan's row {row + 1} of stages not recorded is stage "
                              f"{ids[stage]} renamed to {whose}, microbatch 1")


def test_a_dropped_instance_is_counted(cert):
    n = pq.read_table(cert / "instances.parquet").num_rows
    _rewrite(cert, lambda t: t.slice(1), refresh_hashes=True, name="instances")
    with pytest.raises(CertificateError) as err:
        check_certificate(cert, sample=1)
    assert str(err.value) == f"instances.parquet: {n - 1:,} rows where the plan's stages not recorded are {n:,}"


def test_a_plan_edited_after_verification_fails(cert):
    plan = json.loads(gzip.decompress((cert / "plan.json.gz").read_bytes()))
    plan["lineage"] = plan["lineage"][::-1]
    (cert / "plan.json.gz").write_bytes(gzip.compress(json.dumps(plan).encode()))
    with pytest.raises(CertificateError, match="plan.json.gz: sha256 does not match the certificate; the plan was "
                                               "changed after verification"):
        check_certificate(cert, sample=1)


def test_a_plan_that_fails_validation_fails_the_check_with_its_error(cert, monkeypatch):
    """A careful forger's plan (its hashes refreshed) that is not a valid plan: the check, which validates the plan
    in a forked process while it derives the stages (`checked_beside`), fails with the plan's error — also where that
    process dies without answering (validated in the checker's own then)."""
    plan = json.loads(gzip.decompress((cert / "plan.json.gz").read_bytes()))
    program = next(iter(plan["programs"]))
    at = next(i for i, op in enumerate(plan["programs"][program]["ops"]) if isinstance(op, dict) and op.get("args"))
    plan["programs"][program]["ops"][at]["args"][0] = "nowhere"
    (cert / "plan.json.gz").write_bytes(gzip.compress(json.dumps(plan).encode()))
    manifest = json.loads((cert / "certificate.json").read_text())
    manifest["plan"]["sha256"] = sha256_file(cert / "plan.json.gz")
    manifest["manifest_sha256"] = manifest_digest(manifest)
    (cert / "certificate.json").write_text(json.dumps(manifest))
    with pytest.raises(CertificateError) as err:
        check_certificate(cert, sample=1)
    said = (f"{cert / 'plan.json.gz'}: programs.{program}.ops[{at}].args: embedding@0 = embedding(...) reads "
            f"'nowhere', which is not an input nor the result of an earlier op")
    assert at == 0 and str(err.value) == said
    monkeypatch.setattr(processes, "_answer", lambda fn, args, sender: os._exit(3))
    with pytest.raises(CertificateError) as again:
        check_certificate(cert, sample=1)
    assert str(again.value) == said


def test_a_plan_file_that_fails_validation_fails_the_verification_with_its_error(cert, tmp_path):
    """`verify` validates a plan file beside the verification (`checked_beside`): a plan that is not valid ends it
    with the plan's error, whatever the derivation made of it, and leaves no run to resume."""
    from tv_ray.errors import PlanError
    plan = json.loads(gzip.decompress((cert / "plan.json.gz").read_bytes()))
    program = next(iter(plan["programs"]))
    plan["programs"][program]["ops"][0]["shape"][-1] = "2"        # parsed as it is; the check computes the shape
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(plan))
    Plan.load(bad, check=False)
    started = []
    with pytest.raises(PlanError) as err:
        api.verify(str(bad), engine="local", jobs=1, progress=False, checkpoint=tmp_path / "out",
                   executor=SimpleNamespace(address="here", connect=lambda: started.append(
                       (tmp_path / "out" / "checkpoint" / "run.json").exists()), close=lambda: None))
    assert str(err.value) == (f"programs.{program}.ops[0]: node embedding@0 = embedding(embed.weight, tokens@0): "
                              f"stated shape [2, 16, 2] but embedding of [128, 32] and [2, 16] gives [2, 16, 32]; fix "
                              f"the stated shape or the inputs")
    assert started == [True] and not (tmp_path / "out" / "checkpoint" / "run.json").exists()


def test_an_edited_manifest_fails(cert):
    manifest = json.loads((cert / "certificate.json").read_text())
    manifest["axioms"] = [*manifest["axioms"], "exp_of_sum"]
    (cert / "certificate.json").write_text(json.dumps(manifest))
    with pytest.raises(CertificateError, match="manifest_sha256 does not match the manifest's content"):
        check_certificate(cert, sample=1)


def test_a_certificate_of_the_previous_format_is_named_as_such(cert):
    manifest = json.loads((cert / "certificate.json").read_text())
    manifest["format"] = "tv-ray-certificate/3"
    manifest["manifest_sha256"] = manifest_digest(manifest)
    (cert / "certificate.json").write_text(json.dumps(manifest))
    with pytest.raises(CertificateError) as err:
        check_certificate(cert, sample=1)
    assert str(err.value) == (f"{cert / 'certificate.json'}: format 'tv-ray-certificate/3', expected "
                              f"'tv-ray-certificate/7' (another tv_ray version's keys and stages: verify the plan "
                              f"again with this one)")


def test_a_verify_a_check_and_a_save_run_with_the_collector_paused_and_restore_it(cert, monkeypatch):
    import tv_ray.certificate.check as check
    import tv_ray.certificate.write as write
    import tv_ray.engine.driver as driver
    seen = []

    def stop(*args, **kwargs):
        seen.append(gc.isenabled())
        raise RuntimeError("stopped here")

    monkeypatch.setattr(driver, "verify_plan", stop)
    monkeypatch.setattr(check, "derive", stop)
    monkeypatch.setattr(write, "write_certificate", stop)
    assert gc.isenabled()
    with pytest.raises(RuntimeError, match="stopped here"):
        api.verify(Plan.load(cert / "plan.json.gz"), progress=False, engine="local")
    with pytest.raises(RuntimeError, match="stopped here"):
        check_certificate(cert)
    with pytest.raises(RuntimeError, match="stopped here"):
        api.Result(outcome=SimpleNamespace(proved=True), report={}, settings={}).save(cert)
    assert seen == [False, False, False] and gc.isenabled()


def test_keys_re_proved_in_two_processes_give_the_same_report_and_name_the_same_failing_key(normalised, monkeypatch):
    import tv_ray.certificate.check as check
    cert = normalised
    one, two = check_certificate(cert), check_certificate(cert, workers=2)
    assert two.methods == one.methods and two.methods.get("smt", 0) > 0
    assert (two.resolved, two.different_method, two.unique) == (one.resolved, one.different_method, one.unique) \
        and two.resolved == two.unique
    monkeypatch.setattr(check, "_by_smt", lambda lhs, rhs, solvers, timeout_s: "no SMT solver here")
    failed = []
    for workers in (1, 2):
        with pytest.raises(CertificateError) as raised:
            check_certificate(cert, workers=workers)
        failed.append(str(raised.value))
    assert failed[0] == failed[1] and "was re-proved only by its recorded method normalised (smt: no SMT solver " \
        "here)" in failed[0]


def test_a_keys_equations_are_re_proved_in_one_query_and_a_false_one_is_named_alone(monkeypatch):
    from tv_ray.certificate import check
    from tv_ray.terms import add, const, div, mul, var
    x, y = var("x"), var("y")
    alone = []
    prove = check.prove
    monkeypatch.setattr(check, "prove", lambda lhs, rhs, *rest: alone.append(lhs) or prove(lhs, rhs, *rest))
    assert check._by_smt([add(x, y), div(x, x)], [add(y, x), const(1)], ("z3",), 10.0) == ""
    assert alone == []                  # one query for both
    why = check._by_smt([add(x, y), mul(x, y), div(x, x)], [add(y, x), add(x, y), const(1)], ("z3",), 10.0)
    assert why.startswith("equation 1: ") and alone == [add(x, y), mul(x, y)], why


def test_check_and_explain_commands(cert, capsys):
    assert main(["check", str(cert), "--sample", "5"]) == 0
    out = capsys.readouterr().out
    assert "tv-ray check: OK" in out
    assert re.search(r"\n  derive \d+\.\ds · compare \d+\.\ds · compose \d+\.\ds · re-prove \d+\.\ds\n$", out), out
    assert main(["explain", str(cert)]) == 0
    assert "PROVED" in capsys.readouterr().out
    _rewrite(cert, _flip_first_verdict, refresh_hashes=False)
    assert main(["check", str(cert), "--sample", "5"]) == 1
    assert "FAILED" in capsys.readouterr().err


def test_a_replay_confirms_a_stage_only_past_rounding_relative_to_its_values():
    def confirms(physical, logical):
        return Replay(0.0, 0, np.array(physical), np.array(logical)).confirms

    assert not confirms([1.0, -np.inf], [1.0 + 1e-9, -np.inf])    # rounding, and equal infinities
    assert confirms([3e-3], [3e-3 + 5e-10])                          # small, but 1.7e-7 of the value
    assert not confirms([0.0], [1e-12])                              # both nothing
    assert confirms([1.0, 2.0], [1.0])                               # shapes differ
