"""Boundary lineage from layouts: the plan entries saying which logical slice (or partial sum) a rank's tensor holds."""
from __future__ import annotations

from typing import Mapping

from tv_ray.errors import ParallelConfigError
from tv_ray.parallel.layout import Layout
from tv_ray.parallel.lower import MB


def lineage_entry(tensor: str, logical: str, layout: Layout, where: Mapping[str, int], mb_index: int | None,
                  microbatches: int) -> dict:
    entry: dict = {"where": dict(where), "tensor": tensor, "logical": logical}
    slices = []
    for d, dim in enumerate(layout.dims):
        cut = [f for f in dim if f.axes]
        if not cut:
            continue
        if dim[0].axes != cut[0].axes or len(cut) > 1:
            raise ParallelConfigError(f"boundary tensor {tensor} has a strided layout {layout}; "
                                      f"lineage needs contiguous slices")
        split = [a if a != MB else {"index": mb_index, "of": microbatches} for a in dim[0].axes]
        slices.append({"dim": d, "split": split})
    if slices:
        entry["slice"] = slices
    partial = [a for a, kind in layout.partial if a != MB]
    if any(kind != "sum" for _, kind in layout.partial):
        raise ParallelConfigError(f"boundary tensor {tensor} is a partial max; reduce it first")
    if partial:
        entry["partial"] = partial
    return entry
