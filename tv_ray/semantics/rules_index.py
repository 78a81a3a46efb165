"""Rules for indexing ops: embedding and its backward, gather/scatter, index_select/index_add, top-k.

Index tensors are int; out-of-range indices are a `ShapeError` (ATen raises
too), never wrapped around as numpy's negative indexing would.
"""
from __future__ import annotations

import numpy as np

from tv_ray.errors import ShapeError
from tv_ray.ir.ops import Op
from tv_ray.semantics.shapes import fmt, known_le, norm_dim, numel, require_rank, same_shape
from tv_ray.semantics.table import promote, rule


def _check_range(index: np.ndarray, size: int, what: str) -> np.ndarray:
    if index.size and (index.min() < 0 or index.max() >= size):
        raise ShapeError(f"{what}: an index lies outside [0, {size})")
    return index


def _int_result(dtypes, attrs):
    return "int"


# -- embedding ----------------------------------------------------------------------------
def _embedding_shape(shapes, attrs, ctx):
    weight, indices = shapes
    require_rank(weight, (2,), "embedding weight")
    return tuple(indices) + (weight[1],)


rule(Op.EMBEDDING, shape=_embedding_shape,
     concrete=lambda xs, a, ctx: xs[0][_check_range(xs[1], xs[0].shape[0], "embedding")])


def _embedding_backward_shape(shapes, attrs, ctx):
    grad, indices = shapes
    if not (len(grad) == len(indices) + 1 and same_shape(grad[:-1], indices)):
        raise ShapeError(f"embedding_dense_backward: grad {fmt(grad)} is not indices {fmt(indices)} "
                         f"plus an embedding dim")
    return (attrs["num_weights"], grad[-1])


def _embedding_backward(xs, attrs, ctx):
    grad, indices = xs
    out = np.zeros((attrs["num_weights"], grad.shape[-1]), dtype=grad.dtype)
    flat = _check_range(indices.reshape(-1), attrs["num_weights"], "embedding_dense_backward")
    np.add.at(out, flat, grad.reshape(-1, grad.shape[-1]))
    return out


rule(Op.EMBEDDING_BACKWARD, shape=_embedding_backward_shape, concrete=_embedding_backward)


# -- gather and scatter ------------------------------------------------------------------------
def _check_index_fits(x, index, dim: int, what: str, src=None) -> None:
    """ATen: index has x's rank and is no larger than x (and than src) on every dim but `dim`."""
    if len(index) != len(x):
        raise ShapeError(f"{what}: index {fmt(index)} and input {fmt(x)} differ in rank")
    for i, size in enumerate(index):
        bounds = [x[i]] if i != dim else []
        bounds += [src[i]] if src is not None else []
        if any(known_le(size, bound) is False for bound in bounds):
            raise ShapeError(f"{what}: index {fmt(index)} is larger than input {fmt(x)}"
                             + (f" or src {fmt(src)}" if src is not None else "") + f" at dim {i}")


def _coords(x: np.ndarray, index: np.ndarray, dim: int, what: str) -> tuple:
    """The element coordinates of x that `index` addresses along `dim` (the others are positional)."""
    grid = list(np.indices(index.shape, sparse=True))
    grid[dim] = _check_range(index, x.shape[dim], what)
    return tuple(grid)


def _gather_shape(shapes, attrs, ctx):
    x, index = shapes
    _check_index_fits(x, index, norm_dim(attrs["dim"], len(x), "gather"), "gather")
    return tuple(index)


rule(Op.GATHER, shape=_gather_shape,
     concrete=lambda xs, a, ctx: xs[0][_coords(xs[0], xs[1], norm_dim(a["dim"], xs[0].ndim, "gather"), "gather")])


def _register_scatter(op: Op, accumulate: bool) -> None:
    def shape(shapes, attrs, ctx):
        x, index, src = shapes
        _check_index_fits(x, index, norm_dim(attrs["dim"], len(x), str(op)), str(op), src)
        return tuple(x)

    def concrete(xs, attrs, ctx):
        x, index, src = xs
        out = x.copy()
        where = _coords(x, index, norm_dim(attrs["dim"], x.ndim, str(op)), str(op))
        values = src[tuple(slice(0, n) for n in index.shape)]
        if accumulate:
            np.add.at(out, where, values)
        else:
            out[where] = values
        return out

    rule(op, shape=shape, dtype=lambda dtypes, a: promote(dtypes[0], dtypes[2]), concrete=concrete)


_register_scatter(Op.SCATTER, accumulate=False)
_register_scatter(Op.SCATTER_ADD, accumulate=True)


# -- index_select and index_add -----------------------------------------------------------------
def _index_length(index, what: str):
    require_rank(index, (0, 1), f"{what} index")
    return numel(index)


def _index_select_shape(shapes, attrs, ctx):
    x, index = shapes
    dim = norm_dim(attrs["dim"], len(x), "index_select")
    return tuple(x[:dim]) + (_index_length(index, "index_select"),) + tuple(x[dim + 1:])


def _index_select(xs, attrs, ctx):
    x, index = xs
    dim = norm_dim(attrs["dim"], x.ndim, "index_select")
    return np.take(x, _check_range(index.reshape(-1), x.shape[dim], "index_select"), axis=dim)


rule(Op.INDEX_SELECT, shape=_index_select_shape, concrete=_index_select)


def _index_add_shape(shapes, attrs, ctx):
    x, index, src = shapes
    dim = norm_dim(attrs["dim"], len(x), "index_add")
    expected = tuple(x[:dim]) + (_index_length(index, "index_add"),) + tuple(x[dim + 1:])
    if not same_shape(src, expected):
        raise ShapeError(f"index_add: src {fmt(src)} is not the shape {fmt(expected)} that input {fmt(x)} "
                         f"and index {fmt(index)} call for")
    return tuple(x)


def _index_add(xs, attrs, ctx):
    x, index, src = xs
    dim = norm_dim(attrs["dim"], x.ndim, "index_add")
    out = x.copy()
    flat = _check_range(index.reshape(-1), x.shape[dim], "index_add")
    np.add.at(np.moveaxis(out, dim, 0), flat, np.moveaxis(src, dim, 0))
    return out


rule(Op.INDEX_ADD, shape=_index_add_shape, dtype=lambda dtypes, a: promote(dtypes[0], dtypes[2]),
     concrete=_index_add)


# -- top-k ------------------------------------------------------------------------------------
# ATen's defaults largest=True, sorted=True; the op schema has no attributes for other choices.
def _topk_shape(shapes, attrs, ctx):
    x = shapes[0]
    dim = norm_dim(attrs["dim"], len(x), "topk")
    if known_le(attrs["k"], x[dim]) is not True:
        raise ShapeError(f"topk: k={attrs['k']} may exceed the size {x[dim]} of dim {attrs['dim']} of {fmt(x)}")
    return tuple(x[:dim]) + (attrs["k"],) + tuple(x[dim + 1:])


def _topk_order(x: np.ndarray, attrs: dict) -> tuple[np.ndarray, int]:
    dim = norm_dim(attrs["dim"], x.ndim, "topk")
    order = np.argsort(-x, axis=dim, kind="stable")
    return np.take(order, np.arange(attrs["k"]), axis=dim), dim


def _topk_values(xs, attrs, ctx):
    order, dim = _topk_order(xs[0], attrs)
    return np.take_along_axis(xs[0], order, axis=dim)


def _topk_mask_shape(shapes, attrs, ctx):
    _topk_shape(shapes, attrs, ctx)
    return tuple(shapes[0])


def _topk_mask(xs, attrs, ctx):
    """1.0 at the k largest elements along dim (the lower index first among equal ones), else 0.0."""
    order, dim = _topk_order(xs[0], attrs)
    mask = np.zeros(xs[0].shape, dtype=np.float64)
    np.put_along_axis(mask, order, 1.0, axis=dim)
    return mask


rule(Op.TOPK_VALUES, shape=_topk_shape, concrete=_topk_values)
rule(Op.TOPK_INDICES, shape=_topk_shape, dtype=_int_result,
     concrete=lambda xs, a, ctx: _topk_order(xs[0], a)[0].astype(np.int64))
rule(Op.TOPK_MASK, shape=_topk_mask_shape, concrete=_topk_mask)
