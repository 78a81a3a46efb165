"""A certificate's content with the timings left out: what two engines must agree on byte for byte; the CI
subset of the verify grid (bench/verify_grid.py) every engine is compared on."""
from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq

TIMINGS = {"phases_s", "executor", "command", "manifest_sha256", "obligations"}


def content(out: Path) -> tuple[dict, list, list]:
    manifest = json.loads((out / "certificate.json").read_text())
    del manifest["reduction"]["seconds"]
    # how many stages took a template's key unbuilt depends on which shards shared a job (and so a template table):
    # the same stages and keys either way, compared below
    del manifest["symmetry"]["templated"]
    table = pq.read_table(out / "obligations.parquet").drop(["seconds"]).to_pylist()
    return {k: v for k, v in manifest.items() if k not in TIMINGS}, table, \
        pq.read_table(out / "instances.parquet").to_pylist()


GRID_SUBSET = [   # (model, parallel, flags, optim, tied, shards)
    ("llama3-tiny", "dp=2,tp=2", {"sp": True, "zero": 1}, "adamw", None, None),
    ("gpt2-tiny", "tp=2,pp=2,mb=2", {"zero": 0}, "sgd", False, None),
    ("llama3-tiny", "dp=2,pp=2,mb=2", {"zero": 3}, "sgd", None, True),      # one pipeline stage per shard
    ("llama3-tiny", "dp=2,tp=2", {"zero": 2}, "adamw", None, None),
    ("gpt2-tiny", "dp=2,tp=2,pp=2,mb=2", {"sp": True}, "adamw", None, None),     # dp mirrored, microbatches moved
    ("llama3-tiny", "mb=2", {"zero": 0}, "adamw", True, None),
]
GRID_IDS = [f"{m}-{p}-{f}-{o}" + ("-shards" if s else "") for m, p, f, o, _, s in GRID_SUBSET]
