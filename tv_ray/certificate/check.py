"""The independent checker: re-validate a certificate against the plan it names.

`check_certificate(OUT)`:

1. the manifest's own digest, the obligations file's digest and the plan
   file's digest must match (any changed byte fails, naming the file);
2. from the plan alone, shape reduction, claims, stages and keys are
   derived again and must equal the certificate's: same reduced dims, the
   same obligation ids with the same keys and the same DAG edges (a deleted
   or edited row fails, naming the obligation);
3. every row must be `proved`, and the composition is re-checked: every
   stage input is boundary lineage or a proved stage, every logical output
   (loss, each gradient, each updated parameter and state) is covered, and
   updated state leaves with its input lineage;
4. every unique key (or `sample` of them, chosen deterministically) is solved
   again by a different method than the one recorded: keys closed by the
   normaliser go to the SMT solvers, keys closed by a solver go to the
   normaliser or another solver. A key that only its recorded method proves
   is counted (`same_method`), never silently passed; one that nothing
   re-proves fails the check.
"""
from __future__ import annotations

import json
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow.parquet as pq

from tv_ray.certificate.write import FORMAT, MANIFEST, TABLE, manifest_digest, sha256_file
from tv_ray.engine.driver import composition_problems, obligations_of
from tv_ray.engine.solve import Budget, solve
from tv_ray.errors import CertificateError, PlanError
from tv_ray.plan import Plan


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
        raise CertificateError(f"{path}: format {manifest.get('format')!r}, expected {FORMAT!r}")
    if manifest_digest(manifest) != manifest.get("manifest_sha256"):
        raise CertificateError(f"{path}: manifest_sha256 does not match the manifest's content; "
                               f"the manifest was edited after verification")
    table = out / manifest["obligations"]["file"]
    if not table.exists() or sha256_file(table) != manifest["obligations"]["sha256"]:
        raise CertificateError(f"{table}: sha256 does not match the manifest; the obligation table was changed")
    plan_path = Path(manifest["plan"]["path"])
    plan_path = plan_path if plan_path.is_absolute() else out / plan_path
    if not plan_path.exists():
        raise CertificateError(f"{plan_path}: the plan the certificate names is missing")
    if sha256_file(plan_path) != manifest["plan"]["sha256"]:
        raise CertificateError(f"{plan_path}: sha256 does not match the certificate; the plan was changed after "
                               f"verification")
    return manifest, plan_path


def _other_budget(method: str, solvers: tuple[str, ...], timeout_s: float) -> list[tuple[str, Budget]]:
    """Methods to try, different ones first, then the recorded one as a last resort."""
    smt = ("smt", Budget(solvers=solvers, timeout_s=timeout_s, tiers=(2,)))
    norm = ("normalised", Budget(tiers=(0,)))
    return [smt, norm] if method.startswith("normalised") else [norm, smt]


def check_certificate(out: str | Path, sample: int | None = None, solvers: tuple[str, ...] = ("z3", "yices"),
                      timeout_s: float = 10.0, seed: int = 0) -> CheckReport:
    """Re-validate the certificate under `out`; raises CertificateError naming what failed."""
    started = time.perf_counter()
    out = Path(out)
    manifest, plan_path = _load(out)
    rows = pq.read_table(out / TABLE).to_pylist()
    try:
        plan = Plan.load(plan_path)
    except PlanError as e:
        raise CertificateError(f"{plan_path}: {e}") from None
    reduction, _, _, part, keys = obligations_of(plan, manifest["settings"].get("seed", 0),
                                                 manifest.get("claims_dropped", []),
                                                 manifest["settings"].get("symmetry", True))
    if reduction.reduced != manifest["reduction"]["reduced"]:
        raise CertificateError(f"reduced dims {reduction.reduced} differ from the certificate's "
                               f"{manifest['reduction']['reduced']}")
    recorded = {r["id"]: r for r in rows}
    if len(recorded) != len(rows):
        raise CertificateError(f"{TABLE}: an obligation id appears twice")
    derived = {o.id: o for o in part.every()}
    keys = {oid: o.key for oid, o in derived.items()}
    for oid in derived:
        if oid not in recorded:
            raise CertificateError(f"obligation {oid} ({derived[oid].claim.describe()}) is missing from {TABLE}")
    for oid, row in recorded.items():
        ob = derived.get(oid)
        if ob is None:
            raise CertificateError(f"{TABLE}: obligation {oid} is not a stage of this plan")
        if row["key"] != keys[oid]:
            raise CertificateError(f"obligation {oid}: recorded key {row['key'][:16]}… but its formula hashes to "
                                   f"{keys[oid][:16]}…")
        if list(row["reads"]) != list(ob.reads):
            raise CertificateError(f"obligation {oid}: recorded inputs {row['reads']} differ from the plan's "
                                   f"{list(ob.reads)}")
        if row["verdict"] != "proved":
            raise CertificateError(f"obligation {oid} is recorded as {row['verdict']}; a certificate needs every "
                                   f"obligation proved")
    problems = composition_problems(plan, part, set(recorded))
    if problems:
        raise CertificateError(f"composition does not hold: {problems[0]}")
    report = CheckReport(obligations=len(rows))
    by_key: dict[str, str] = {}
    for row in rows:
        by_key.setdefault(row["key"], row["method"])
    report.unique = len(by_key)
    chosen = sorted(by_key)
    if sample is not None and sample < len(chosen):
        chosen = sorted(random.Random(seed).sample(chosen, sample))
    for key in chosen:
        lhs, rhs = part.formulas[key]
        for i, (name, budget) in enumerate(_other_budget(by_key[key], solvers, timeout_s)):
            verdict = solve(lhs, rhs, budget)
            if verdict.proved:
                report.resolved += 1
                report.methods[name] = report.methods.get(name, 0) + 1
                if i == 0:
                    report.different_method += 1
                else:
                    report.same_method += 1
                break
        else:
            raise CertificateError(f"key {key[:16]}… (obligation {ob.id}, {ob.claim.describe()}) was recorded as "
                                   f"{by_key[key]} but the checker could not prove it again: {verdict.reason}")
    report.seconds = time.perf_counter() - started
    return report


__all__ = ["check_certificate", "CheckReport"]
