"""Rules for mesh-aware ops: a rank's view of the mesh (axis_index, local_chunk) and communication.

A collective's shape rule sees one member and the group size from
`ctx.axis_sizes`; its `group` rule takes every member's input, in group order,
and returns every member's output (semantics in docs/plan-format.md). send
and recv have shape rules only: the plan simulator moves their data.
"""
from __future__ import annotations

import numpy as np

from tv_ray.errors import GraphError, ShapeError, SimulationError
from tv_ray.ir.ops import REDUCE_KINDS, Op
from tv_ray.semantics.shapes import exact_div, fmt, norm_dim
from tv_ray.semantics.table import numpy_dtype, rule


def _resized(shape, dim: int, size) -> tuple:
    return tuple(shape[:dim]) + (size,) + tuple(shape[dim + 1:])


def _split_shape(shape, dim_attr: int, parts, what: str) -> tuple:
    dim = norm_dim(dim_attr, len(shape), what)
    return _resized(shape, dim, exact_div(shape[dim], parts, f"{what}: dim {dim_attr} of {fmt(shape)} "
                                                              f"into {parts} chunks"))


def _chunks(x: np.ndarray, dim_attr: int, parts: int, what: str) -> list[np.ndarray]:
    dim = norm_dim(dim_attr, x.ndim, what)
    if x.shape[dim] % parts:
        raise ShapeError(f"{what}: dim {dim_attr} of {fmt(x.shape)} is not divisible into {parts} chunks")
    return np.split(x, parts, axis=dim)


# -- a rank's view of the mesh ---------------------------------------------------------------
rule(Op.AXIS_INDEX, shape=lambda shapes, a, ctx: (), dtype=lambda dtypes, a: "int",
     concrete=lambda xs, a, ctx: np.asarray(ctx.group_position(a["axes"]), dtype=np.int64))

rule(Op.LOCAL_CHUNK,
     shape=lambda shapes, a, ctx: _split_shape(shapes[0], a["dim"], ctx.group_size(a["axes"]), "local_chunk"),
     concrete=lambda xs, a, ctx: _chunks(xs[0], a["dim"], ctx.group_size(a["axes"]),
                                         "local_chunk")[ctx.group_position(a["axes"])].copy())


# -- collectives ---------------------------------------------------------------------------------
def _same_member_shapes(xs: list[np.ndarray], what: str) -> None:
    for position, x in enumerate(xs):
        if x.shape != xs[0].shape:
            raise SimulationError(f"{what}: group member {position} has shape {fmt(x.shape)} but member 0 "
                                  f"has {fmt(xs[0].shape)}")


def _reduced(xs: list[np.ndarray], kind: str, what: str) -> np.ndarray:
    if kind not in REDUCE_KINDS:
        raise GraphError(f"{what}: reduce must be one of {', '.join(REDUCE_KINDS)}, got {kind!r}")
    _same_member_shapes(xs, what)
    stacked = np.stack(xs)
    reductions = {"sum": lambda: np.sum(stacked, axis=0),
                  "avg": lambda: np.sum(stacked, axis=0) / len(xs),
                  "max": lambda: np.amax(stacked, axis=0)}
    return np.asarray(reductions[kind]()).astype(xs[0].dtype if kind != "avg" else np.float64)


def _all_reduce(xs, attrs):
    out = _reduced(xs, attrs["reduce"], "all_reduce")
    return [out.copy() for _ in xs]


def _all_reduce_shape(shapes, attrs, ctx):
    ctx.group_size(attrs["axes"])  # the group must exist on this mesh
    return tuple(shapes[0])


rule(Op.ALL_REDUCE, shape=_all_reduce_shape,
     dtype=lambda dtypes, a: "float" if a["reduce"] == "avg" else dtypes[0],
     group=_all_reduce)


def _all_gather_shape(shapes, attrs, ctx):
    dim = norm_dim(attrs["dim"], len(shapes[0]), "all_gather")
    return _resized(shapes[0], dim, shapes[0][dim] * ctx.group_size(attrs["axes"]))


def _all_gather(xs, attrs):
    _same_member_shapes(xs, "all_gather")
    out = np.concatenate(xs, axis=norm_dim(attrs["dim"], xs[0].ndim, "all_gather"))
    return [out.copy() for _ in xs]


rule(Op.ALL_GATHER, shape=_all_gather_shape, group=_all_gather)


def _reduce_scatter(xs, attrs):
    total = _reduced(xs, attrs["reduce"], "reduce_scatter")
    return [chunk.copy() for chunk in _chunks(total, attrs["dim"], len(xs), "reduce_scatter")]


rule(Op.REDUCE_SCATTER,
     shape=lambda shapes, a, ctx: _split_shape(shapes[0], a["dim"], ctx.group_size(a["axes"]), "reduce_scatter"),
     dtype=lambda dtypes, a: "float" if a["reduce"] == "avg" else dtypes[0],
     group=_reduce_scatter)


def _all_to_all_shape(shapes, attrs, ctx):
    size = ctx.group_size(attrs["axes"])
    split = _split_shape(shapes[0], attrs["split_dim"], size, "all_to_all")
    concat = norm_dim(attrs["concat_dim"], len(split), "all_to_all")
    return _resized(split, concat, split[concat] * size)


def _all_to_all(xs, attrs):
    _same_member_shapes(xs, "all_to_all")
    sent = [_chunks(x, attrs["split_dim"], len(xs), "all_to_all") for x in xs]
    concat = norm_dim(attrs["concat_dim"], xs[0].ndim, "all_to_all")
    return [np.concatenate([sent[src][dst] for src in range(len(xs))], axis=concat) for dst in range(len(xs))]


rule(Op.ALL_TO_ALL, shape=_all_to_all_shape, group=_all_to_all)


def _root(attrs, size: int) -> int:
    if not 0 <= attrs["root"] < size:
        raise ShapeError(f"broadcast: root {attrs['root']} is not a group position in [0, {size})")
    return attrs["root"]


def _broadcast_shape(shapes, attrs, ctx):
    _root(attrs, ctx.group_size(attrs["axes"]))
    return tuple(shapes[0])


def _broadcast(xs, attrs):
    _same_member_shapes(xs, "broadcast")
    root = xs[_root(attrs, len(xs))]
    return [root.copy() for _ in xs]


rule(Op.BROADCAST, shape=_broadcast_shape, group=_broadcast)


# -- point to point (data moved by the plan simulator) --------------------------------------------
def _recv_dtype(dtypes, attrs):
    numpy_dtype(attrs["dtype"])  # a recv carries values: float, int or bool
    return attrs["dtype"]


rule(Op.SEND, shape=lambda shapes, a, ctx: (), dtype=lambda dtypes, a: "token")
rule(Op.RECV, shape=lambda shapes, a, ctx: tuple(a["size"]), dtype=_recv_dtype)
