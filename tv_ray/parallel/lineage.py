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


def _region(layout: Layout) -> tuple[tuple, tuple] | str:
    """The (slice, partial) a tensor of `layout` holds, as in a `Lineage` but with its microbatch split still the
    axis MB (`_at_microbatch`), or why the layout has none."""
    slices = []
    for d, dim in enumerate(layout.dims):
        cut = [f for f in dim if f.axes]
        if not cut:
            continue
        if dim[0].axes != cut[0].axes or len(cut) > 1:
            return f"has a strided layout {layout}; lineage needs contiguous slices"
        slices.append((d, dim[0].axes))
    if any(kind != "sum" for _, kind in layout.partial):
        return "is a partial max; reduce it first"
    if any(a == MB for a, _ in layout.partial):
        return "is one microbatch's share of a sum"
    return tuple(slices), tuple(a for a, _ in layout.partial)


def _at_microbatch(region: tuple[tuple, tuple], mb_index: int | None, microbatches: int) -> tuple[tuple, tuple]:
    """A `_region`'s microbatch split as the fixed factor of microbatch `mb_index`."""
    slices, partial = region
    return tuple((d, tuple(a if a != MB else Fixed(mb_index, microbatches) for a in axes)) for d, axes in slices), \
        partial


def lineage_entry(tensor: str, logical: str, layout: Layout, where: Mapping[str, int], mb_index: int | None,
                  microbatches: int) -> Lineage:
    region = _region(layout)
    if isinstance(region, str):
        raise ParallelConfigError(f"boundary tensor {tensor} {region}")
    return Lineage(tuple(where.items()), tensor, logical, *_at_microbatch(region, mb_index, microbatches))


def interior_entries(lowering: Lowering, logical: Graph, program: Graph, where: Mapping[str, int]) -> list[Lineage]:
    """Intermediate lineage for the ops of one stage program (a received copy holds what was sent)."""
    entries = []
    pinned = tuple(where.items())
    # layout -> `_region` with its microbatch split left as MB, a frontier plan having 10^5 ops: by the layout's
    # identity (the lowering holds each layout, and shares it between the ops it gives it — every microbatch's copy
    # of an op), not its hash of nested tuples; each distinct region kept once (`alike`), and (region, microbatch)
    # -> the region at that microbatch
    by_layout: dict[int, tuple | str] = {}
    alike: dict[tuple, tuple] = {}
    regions: dict[tuple, tuple] = {}
    micro = lowering.microbatches
    for node in program.nodes:
        source = node.name.split("<")[0] if node.op == Op.RECV else node.name
        held = lowering.holds.get(source)
        if held is None or node.dtype != "float":
            continue
        name, layout, mb_index = held
        if name not in logical or logical.dtype_of(name) != "float":
            continue
        any_mb = by_layout.get(id(layout))
        if any_mb is None:
            any_mb = _region(layout)
            any_mb = by_layout[id(layout)] = any_mb if isinstance(any_mb, str) else alike.setdefault(any_mb, any_mb)
        if isinstance(any_mb, str):
            continue
        region = regions.get((id(any_mb), mb_index))
        if region is None:
            region = regions[id(any_mb), mb_index] = _at_microbatch(any_mb, mb_index, micro)
        entries.append(Lineage(pinned, node.name, name, *region))
    return entries
