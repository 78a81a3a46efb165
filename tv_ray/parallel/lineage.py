"""Lineage from layouts: the plan entries saying which logical slice (or partial sum) a rank's tensor holds.

Boundary lineage (program inputs and outputs) must exist for every such
tensor; intermediate lineage (`interior_entries`) is written for every op
output whose layout is a plain slice or partial sum of a logical tensor, and
left out where it is not (a strided layout, a partial max, a per-microbatch
partial sum): the verifier infers those.
"""
from __future__ import annotations

from typing import Mapping

from tv_ray.errors import ParallelConfigError
from tv_ray.ir.graph import Graph
from tv_ray.ir.ops import Op
from tv_ray.parallel.layout import Layout
from tv_ray.parallel.lower import MB, Lowering


def _entry(tensor: str, logical: str, layout: Layout, where: Mapping[str, int], mb_index: int | None,
           microbatches: int) -> dict | str:
    """The entry, or why the layout has none."""
    entry: dict = {"where": dict(where), "tensor": tensor, "logical": logical}
    slices = []
    for d, dim in enumerate(layout.dims):
        cut = [f for f in dim if f.axes]
        if not cut:
            continue
        if dim[0].axes != cut[0].axes or len(cut) > 1:
            return f"{tensor} has a strided layout {layout}; lineage needs contiguous slices"
        split = [a if a != MB else {"index": mb_index, "of": microbatches} for a in dim[0].axes]
        slices.append({"dim": d, "split": split})
    if slices:
        entry["slice"] = slices
    if any(kind != "sum" for _, kind in layout.partial):
        return f"{tensor} is a partial max; reduce it first"
    if any(a == MB for a, _ in layout.partial):
        return f"{tensor} is one microbatch's share of a sum"
    partial = [a for a, _ in layout.partial]
    if partial:
        entry["partial"] = partial
    return entry


def lineage_entry(tensor: str, logical: str, layout: Layout, where: Mapping[str, int], mb_index: int | None,
                  microbatches: int) -> dict:
    entry = _entry(tensor, logical, layout, where, mb_index, microbatches)
    if isinstance(entry, str):
        raise ParallelConfigError(f"boundary tensor {entry}")
    return entry


def interior_entries(lowering: Lowering, logical: Graph, program: Graph, where: Mapping[str, int]) -> list[dict]:
    """Intermediate lineage for the ops of one stage program (a received copy holds what was sent)."""
    entries = []
    for node in program.nodes:
        source = node.name.split("<")[0] if node.op == Op.RECV else node.name
        held = lowering.holds.get(source)
        if held is None or node.dtype != "float":
            continue
        name, layout, mb_index = held
        if name not in logical or logical.dtype_of(name) != "float":
            continue
        entry = _entry(node.name, name, layout, where, mb_index, lowering.microbatches)
        if isinstance(entry, dict):
            entries.append(entry)
    return entries
