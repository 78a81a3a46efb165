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
from tv_ray.plan import Fixed, Lineage


def _region(layout: Layout, mb_index: int | None, microbatches: int) -> tuple[tuple, tuple] | str:
    """The (slice, partial) a tensor of `layout` holds (its microbatch split at `mb_index`), as in a `Lineage`, or
    why the layout has none."""
    slices = []
    for d, dim in enumerate(layout.dims):
        cut = [f for f in dim if f.axes]
        if not cut:
            continue
        if dim[0].axes != cut[0].axes or len(cut) > 1:
            return f"has a strided layout {layout}; lineage needs contiguous slices"
        slices.append((d, tuple(a if a != MB else Fixed(mb_index, microbatches) for a in dim[0].axes)))
    if any(kind != "sum" for _, kind in layout.partial):
        return "is a partial max; reduce it first"
    if any(a == MB for a, _ in layout.partial):
        return "is one microbatch's share of a sum"
    return tuple(slices), tuple(a for a, _ in layout.partial)


def lineage_entry(tensor: str, logical: str, layout: Layout, where: Mapping[str, int], mb_index: int | None,
                  microbatches: int) -> Lineage:
    region = _region(layout, mb_index, microbatches)
    if isinstance(region, str):
        raise ParallelConfigError(f"boundary tensor {tensor} {region}")
    return Lineage(tuple(where.items()), tensor, logical, *region)


def interior_entries(lowering: Lowering, logical: Graph, program: Graph, where: Mapping[str, int]) -> list[Lineage]:
    """Intermediate lineage for the ops of one stage program (a received copy holds what was sent)."""
    entries = []
    pinned = tuple(where.items())
    # (layout, microbatch) -> `_region`, a frontier plan having 10^5 ops: by the layout's identity (the lowering
    # holds each layout, and shares it between the ops it gives it), not its hash of nested tuples
    regions: dict[tuple, tuple | str] = {}
    for node in program.nodes:
        source = node.name.split("<")[0] if node.op == Op.RECV else node.name
        held = lowering.holds.get(source)
        if held is None or node.dtype != "float":
            continue
        name, layout, mb_index = held
        if name not in logical or logical.dtype_of(name) != "float":
            continue
        region = regions.get((id(layout), mb_index))
        if region is None:
            region = regions[id(layout), mb_index] = _region(layout, mb_index, lowering.microbatches)
        if not isinstance(region, str):
            entries.append(Lineage(pinned, node.name, name, *region))
    return entries
