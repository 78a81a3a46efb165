"""A certificate's content with the timings left out: what two engines must agree on byte for byte."""
from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq

TIMINGS = {"phases_s", "executor", "command", "manifest_sha256", "obligations"}


def content(out: Path) -> tuple[dict, list]:
    manifest = json.loads((out / "certificate.json").read_text())
    del manifest["reduction"]["seconds"]
    table = pq.read_table(out / "obligations.parquet").drop(["seconds"]).to_pylist()
    return {k: v for k, v in manifest.items() if k not in TIMINGS}, table
