"""The independent checker: re-validate a certificate against the plan it names.

`check_certificate(OUT)`:

1. the manifest's own digest, the digests of the obligations file, of the
   instantiation map and of the plan file must match (any changed byte
   fails, naming the file);
2. from the plan alone, shape reduction, claims, stages and keys are
   derived again and must equal the certificate's: same reduced dims, the
   same recorded obligation ids with the same keys and the same DAG edges (a
   deleted or edited row fails, naming the obligation), and the same
   instantiation map — which recorded stage each stage not recorded renames,
   to which microbatch and dp rank (a changed row fails, naming it);
3. every row must be `proved`, and the composition is re-checked: every
   stage input is boundary lineage or a proved stage, every logical output
   (loss, each gradient, each updated parameter and state) is covered, and
   updated state leaves with its input lineage;
4. every unique key (or `sample` of them, chosen deterministically) is solved
   again by a different method than the one recorded: keys closed by the
   normaliser go to the SMT solvers, keys closed by a solver go to the
   normaliser or another solver. A key that only its recorded method proves
   fails the check (the check would not be independent for it) unless
   `allow_same_method`, which counts it (`same_method`); one that nothing
   re-proves fails the check. An equation whose sides the checker's own
   derivation made the very same term holds by reflexivity, whatever method
   recorded it (counted as ``identical``).

The checker shares no code with the prover beyond `tv_ray.partition` (the
derivation and the composition check), `tv_ray.terms` (the normaliser) and
`tv_ray.smt` (the solvers): it never imports `tv_ray.engine` (DESIGN.md,
rule 7; `tests/certificate/test_independence.py`).
"""
from __future__ import annotations

import json
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import pyarrow.parquet as pq
from tqdm import tqdm

from tv_ray.certificate.write import FORMAT, INSTANCES, MANIFEST, TABLE, manifest_digest, sha256_file
from tv_ray.errors import CertificateError, PlanError
from tv_ray.partition.compose import composition_problems
from tv_ray.partition.derive import Settings, derive
from tv_ray.plan import Plan
from tv_ray.plan_check import checked_beside
from tv_ray.processes import gc_paused, held_to_exit, in_processes
from tv_ray.smt import prove, prove_all
from tv_ray.terms import Term
from tv_ray.terms.normal import NormaliseError, Normaliser, ground_lemmas

ROWS_AT_ONCE = 1 << 22      # rows of the instantiation map compared at a time


@dataclass
class CheckReport:
    """What the checker did; `ok` only when every step passed."""

    obligations: int = 0
    unique: int = 0
    resolved: int = 0
    different_method: int = 0
    same_method: int = 0
    seconds: float = 0.0
    methods: dict[str, int] = field(default_factory=dict)
    phases: dict[str, float] = field(default_factory=dict)     # seconds: derive, compare, compose, re-prove

    def to_json(self) -> dict:
        return dict(self.__dict__)


def _load(out: Path) -> tuple[dict, Path]:
    path = out / MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError:
        raise CertificateError(f"{path}: no certificate here (a run that was not proved writes report.json)")
    except json.JSONDecodeError as e:
        raise CertificateError(f"{path}: not JSON ({e}); the manifest was damaged")
    if manifest.get("format") != FORMAT:
        raise CertificateError(f"{path}: format {manifest.get('format')!r}, expected {FORMAT!r} (another tv_ray "
                               f"version's keys and stages: verify the plan again with this one)")
    if manifest_digest(manifest) != manifest.get("manifest_sha256"):
        raise CertificateError(f"{path}: manifest_sha256 does not match the manifest's content; "
                               f"the manifest was edited after verification")
    for name, what in (("obligations", "the obligation table"), ("instances", "the instantiation map")):
        table = out / manifest[name]["file"]
        if not table.exists() or sha256_file(table) != manifest[name]["sha256"]:
            raise CertificateError(f"{table}: sha256 does not match the manifest; {what} was changed")
    plan_path = Path(manifest["plan"]["path"])
    plan_path = plan_path if plan_path.is_absolute() else out / plan_path
    if not plan_path.exists():
        raise CertificateError(f"{plan_path}: the plan the certificate names is missing")
    if sha256_file(plan_path) != manifest["plan"]["sha256"]:
        raise CertificateError(f"{plan_path}: sha256 does not match the certificate; the plan was changed after "
                               f"verification")
    return manifest, plan_path


def _normalised(lhs: list[Term], rhs: list[Term]) -> str:
    """'' when the normaliser gives every equation's sides one normal form, else why not."""
    norm = Normaliser()
    for i, (a, b) in enumerate(zip(lhs, rhs)):
        try:
            if norm.normalise(a) != norm.normalise(b):
                return f"equation {i}: normal forms differ"
        except NormaliseError as e:
            return f"equation {i}: {e}"
    return ""


def _by_smt(lhs: list[Term], rhs: list[Term], solvers: tuple[str, ...], timeout_s: float) -> str:
    """'' when the SMT solvers prove every equation (with the normaliser's ground lemmas), else why not: all at once
    in one query (`prove_all`), else one by one, which names the first that fails."""
    if not solvers:
        return "no solver left that did not give the recorded proof"
    if len(lhs) > 1 and prove_all(zip(lhs, rhs), ground_lemmas(*lhs, *rhs)[0], solvers, timeout_s).proved:
        return ""
    for i, (a, b) in enumerate(zip(lhs, rhs)):
        lemmas, _ = ground_lemmas(a, b)
        result = prove(a, b, lemmas, solvers, timeout_s)
        if not result.proved:
            return f"equation {i}: {getattr(result, 'reason', result.verdict)}"
    return ""


def _methods(recorded: str, solvers: tuple[str, ...], timeout_s: float) -> list[tuple[str, bool, Callable]]:
    """Ways to re-prove a key recorded as `recorded`, as (name, different from the recorded one, check): the
    different ones first — SMT for the normaliser's proof; the normaliser, then the solvers that did not give
    it, for a solver's — then the recorded one as a last resort."""
    parts = recorded.split("+")
    others = tuple(s for s in solvers if not any(p.startswith(f"smt:{s}") for p in parts))
    norm = lambda lhs, rhs: _normalised(lhs, rhs)                       # noqa: E731
    smt = lambda lhs, rhs: _by_smt(lhs, rhs, solvers, timeout_s)        # noqa: E731
    if not any(p.startswith("smt:") for p in parts):
        return [("smt", True, smt), ("normalised", False, norm)]
    return [("normalised", True, norm), ("smt", True, lambda lhs, rhs: _by_smt(lhs, rhs, others, timeout_s)),
            ("smt", False, smt)]


def _without_identical(recorded: str) -> str:
    return "+".join(p for p in recorded.split("+") if p != "identical")


def _reprove_key(lhs: list[Term], rhs: list[Term], recorded: str, solvers: tuple[str, ...],
                 timeout_s: float) -> tuple[str | None, bool, list[str]]:
    """(the method that re-proved the key, whether it differs from the `recorded` one, why the ones tried before
    it failed); (None, False, why) when none did. Equations whose sides are the very same term hold by
    reflexivity ("identical": no method needed, so a different one)."""
    open_ = [i for i, (a, b) in enumerate(zip(lhs, rhs)) if a is not b]
    if not open_:
        return "identical", True, []
    lhs, rhs = [lhs[i] for i in open_], [rhs[i] for i in open_]
    why = []
    for name, different, method in _methods(_without_identical(recorded), solvers, timeout_s):
        failed = method(lhs, rhs)
        if not failed:
            return name, different, why
        why.append(f"{name}: {failed}")
    return None, False, why


def _reprove(formulas: dict, jobs: list[tuple[str, str]], solvers: tuple[str, ...], timeout_s: float, workers: int,
             advance: Callable[[int], object]) -> dict[str, tuple[str | None, bool, list[str]]]:
    """`_reprove_key` for each (key, recorded method) in `jobs`, here or in `workers` forked processes (which
    inherit the formulas; the keys of most equations first, so that no long one is left to run alone), by key."""
    reprove = lambda key, recorded: _reprove_key(*formulas[key], recorded, solvers, timeout_s)   # noqa: E731
    if workers > 1 and len(jobs) > 1:
        jobs = sorted(jobs, key=lambda job: -len(formulas[job[0]][0]))
        results = in_processes(workers)(reprove, jobs)
    else:
        results = ((i, reprove(*job)) for i, job in enumerate(jobs))
    out = {}
    for i, result in results:
        out[jobs[i][0]] = result
        advance(1)
    return out


def _compare(part, table: Path, advance: Callable[[int], object] = lambda n: None) -> tuple[int, dict[str, str], dict]:
    """The table row by row against the plan's recorded stages, in stage order, streamed: (rows, recorded method
    by key, first obligation by key). Raises naming the first row that is missing, extra, out of order, of another
    formula or inputs, or not proved."""
    derived = iter(part.obligations)
    by_key: dict[str, str] = {}
    first: dict = {}
    rows = 0
    ob = next(derived, None)
    columns = ["id", "key", "reads", "verdict", "method"]
    for batch in pq.ParquetFile(table).iter_batches(batch_size=1 << 16, columns=columns):
        advance(batch.num_rows)
        for row in batch.to_pylist():
            rows += 1
            if ob is None:
                raise CertificateError(f"{TABLE}: obligation {row['id']} is not a stage of this plan")
            if row["id"] != str(ob.id):
                after = next(derived, None)
                if after is not None and row["id"] == str(after.id):
                    raise CertificateError(f"obligation {ob.id} ({ob.claim.describe()}) is missing from {TABLE} "
                                           f"at row {rows}, where stage order puts it")
                raise CertificateError(f"{TABLE}: row {rows} is obligation {row['id']} where the plan's stage "
                                       f"{rows} is {ob.id} (a row added, repeated or moved)")
            if row["key"] != ob.key:
                raise CertificateError(f"obligation {ob.id}: recorded key {row['key'][:16]}… but its formula "
                                       f"hashes to {ob.key[:16]}…")
            if list(row["reads"]) != [str(r) for r in ob.reads]:
                raise CertificateError(f"obligation {ob.id}: recorded inputs {row['reads']} differ from the "
                                       f"plan's {[str(r) for r in ob.reads]}")
            if row["verdict"] != "proved":
                raise CertificateError(f"obligation {ob.id} is recorded as {row['verdict']}; a certificate needs "
                                       f"every obligation proved")
            by_key.setdefault(row["key"], row["method"])
            first.setdefault(row["key"], ob)
            ob = next(derived, None)
    if ob is not None:
        raise CertificateError(f"obligation {ob.id} ({ob.claim.describe()}) is missing from {TABLE}")
    return rows, by_key, first


def _compare_instances(part, table: Path) -> int:
    """The instantiation map against the plan's stages not recorded (each a recorded stage moved to a microbatch
    and a dp rank's block, or a fan of one to each mirror of a representative, re-derived here), a record batch
    at a time; raises naming the first row that differs. The number of stages its rows stand for."""
    got = pq.ParquetFile(table)
    columns = ["rank", "stage", "microbatch", "mirrors"]
    if got.schema_arrow.names != columns:
        raise CertificateError(f"{INSTANCES}: columns {got.schema_arrow.names}, expected {columns}")
    if got.metadata.num_rows != len(part.copy_of):
        raise CertificateError(f"{INSTANCES}: {got.metadata.num_rows:,} rows where the plan's stages not recorded "
                               f"are {len(part.copy_of):,}")
    start = 0
    for batch in got.iter_batches(batch_size=ROWS_AT_ONCE):
        ranks, stages, mbs, fans = (batch.column(c).to_numpy(zero_copy_only=False) for c in columns)
        end = start + len(ranks)
        wrong = np.flatnonzero((ranks != part.copy_ranks[start:end]) | (stages != part.copy_of[start:end]) |
                               (mbs != part.copy_mb[start:end]) | (fans != part.copy_fan[start:end]))
        if len(wrong):
            j = int(wrong[0])
            i = start + j
            stage = part.obligations[int(part.copy_of[i])]
            raise CertificateError(f"{INSTANCES}: row {i + 1} renames stage row {int(stages[j]) + 1} to "
                                   f"{_whose(ranks[j], fans[j])}, microbatch {int(mbs[j])}, where the plan's row "
                                   f"{i + 1} of stages not recorded is stage {stage.id} renamed to "
                                   f"{_whose(part.copy_ranks[i], part.copy_fan[i])}, microbatch {int(part.copy_mb[i])}")
        start = end
    return part.copies


def _whose(rank, fan) -> str:
    return f"each mirror of rank {int(rank)}" if fan else f"rank {int(rank)}"


@gc_paused()         # as `tv_ray.verify` is: the check holds as many terms
def check_certificate(out: str | Path, sample: int | None = None, solvers: tuple[str, ...] = ("z3", "yices"),
                      timeout_s: float = 10.0, seed: int = 0, allow_same_method: bool = False,
                      progress: bool | None = None, workers: int = 1) -> CheckReport:
    """Re-validate the certificate under `out`; raises CertificateError naming what failed.

    A key that only its recorded method re-proves makes the check fail (it is then not independent for that
    key) unless `allow_same_method`. `progress`: bars on stderr for the rows compared and the keys re-proved
    (default: when stderr is a terminal). `workers`: processes the stages of a plan generated in pipeline
    shards are re-derived in (the same stages however many) and the keys re-proved in (the same verdicts; a
    failing key is named as with one, the first of them in key order)."""
    started = time.perf_counter()
    show = sys.stderr.isatty() if progress is None else progress
    out = Path(out)
    manifest, plan_path = _load(out)
    recorded = manifest["settings"]
    settings = Settings(recorded.get("seed", 0), recorded.get("symmetry", True), bool(manifest["stage_dag"].get("shards")),
                        recorded.get("templates", False))      # certificates from before templates have none
    try:
        plan = Plan.load(plan_path, check=False)
        with checked_beside(plan):      # validated while it is derived
            derivation = derive(plan, settings, manifest.get("claims_dropped", []), workers)
    except PlanError as e:
        raise CertificateError(f"{plan_path}: {e}") from None
    reduction, part = derivation.reduction, derivation.partition
    phases: dict[str, float] = {}

    def lap(phase: str) -> None:        # the seconds since the last phase ended
        phases[phase] = time.perf_counter() - started - sum(phases.values())

    lap("derive")
    if reduction.reduced != manifest["reduction"]["reduced"]:
        raise CertificateError(f"reduced dims {reduction.reduced} differ from the certificate's "
                               f"{manifest['reduction']['reduced']}")
    with tqdm(total=part.size, disable=not show, unit="row", desc="comparing", file=sys.stderr,
              dynamic_ncols=True) as bar:
        rows, by_key, first = _compare(part, out / TABLE, bar.update)
        rows += _compare_instances(part, out / INSTANCES)
        bar.update(part.copies)
    lap("compare")
    problems = composition_problems(plan, part, {o.id for o in part.obligations})
    if problems:
        raise CertificateError(f"composition does not hold: {problems[0]}")
    lap("compose")
    report = CheckReport(obligations=rows, phases=phases)
    report.unique = len(by_key)
    chosen = sorted(by_key)
    if sample is not None and sample < len(chosen):
        chosen = sorted(random.Random(seed).sample(chosen, sample))
    with tqdm(total=len(chosen), disable=not show, unit="key", desc="re-proving", file=sys.stderr,
              dynamic_ncols=True) as bar:
        reproved = _reprove(part.formulas, [(key, by_key[key]) for key in chosen], solvers, timeout_s, workers,
                            bar.update)
    lap("re-prove")
    for key in chosen:
        name, different, why = reproved[key]
        ob = first[key]
        if name is None:
            raise CertificateError(f"key {key[:16]}… (obligation {ob.id}, {ob.claim.describe()}) was recorded as "
                                   f"{by_key[key]} but the checker could not prove it again: {'; '.join(why)}",
                                   obligation=str(ob.id))
        if not different and not allow_same_method:
            raise CertificateError(
                f"key {key[:16]}… (obligation {ob.id}, {ob.claim.describe()}) was re-proved only by its "
                f"recorded method {_without_identical(by_key[key])} ({'; '.join(why)}): the check is not "
                f"independent for it; give other --solvers, a longer --timeout, or accept it with "
                f"--allow-same-method", obligation=str(ob.id))
        report.resolved += 1
        report.methods[name] = report.methods.get(name, 0) + 1
        if different:
            report.different_method += 1
        else:
            report.same_method += 1
    report.seconds = time.perf_counter() - started
    held_to_exit(derivation)
    return report


__all__ = ["check_certificate", "CheckReport"]
