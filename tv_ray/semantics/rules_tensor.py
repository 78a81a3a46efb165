"""Rules for tensor creation, matrix products and layout ops (views, slices, cat), as ATen defines them."""
from __future__ import annotations

import numpy as np

from tv_ray.errors import ShapeError
from tv_ray.ir.ops import Op
from tv_ray.semantics.shapes import (broadcast, const, dim_min, exact_div, fmt, is_const, known_le,
                                     norm_dim, numel, require_equal, require_rank, same_shape)
from tv_ray.semantics.table import dtype_name, numpy_dtype, promote, rule

# ATen writes "to the end" as INT64_MAX; no tensor dim comes near 2**62.
TO_THE_END = 2 ** 62

# -- creation ------------------------------------------------------------------
rule(Op.FULL,
     shape=lambda shapes, a, ctx: tuple(a["size"]),
     dtype=lambda dtypes, a: a.get("dtype", "float"),
     concrete=lambda xs, a, ctx: np.full(a["size"], a["value"], dtype=numpy_dtype(a.get("dtype", "float"))))

rule(Op.FULL_LIKE,
     shape=lambda shapes, a, ctx: tuple(shapes[0]),
     dtype=lambda dtypes, a: a.get("dtype", dtypes[0]),
     concrete=lambda xs, a, ctx: np.full(xs[0].shape, a["value"],
                                         dtype=numpy_dtype(a.get("dtype", dtype_name(xs[0])))))


def arange_length(start, end, step):
    if step == 0:
        raise ShapeError("arange: step is zero")
    if is_const(start) and is_const(end) and is_const(step):
        return max(0, -(-(const(end) - const(start)) // const(step)))
    return exact_div(end - start, step, f"arange({start}, {end}, {step})")


rule(Op.ARANGE,
     shape=lambda shapes, a, ctx: (arange_length(a["start"], a["end"], a["step"]),),
     dtype=lambda dtypes, a: a.get("dtype", "int"),
     concrete=lambda xs, a, ctx: np.arange(a["start"], a["end"], a["step"]).astype(
         numpy_dtype(a.get("dtype", "int"))))


def _triu_shape(shapes, a, ctx):
    require_rank(shapes[0][-2:], (2,), "triu")
    return tuple(shapes[0])


rule(Op.TRIU, shape=_triu_shape, concrete=lambda xs, a, ctx: np.triu(xs[0], a["diagonal"]))


# -- matrix products --------------------------------------------------------------
def _matmul_shape(a_shape, b_shape, rank: int, what: str) -> tuple:
    require_rank(a_shape, (rank,), f"{what} first operand")
    require_rank(b_shape, (rank,), f"{what} second operand")
    if not a_shape[-1] == b_shape[-2]:
        raise ShapeError(f"{what}: inner dims differ: {fmt(a_shape)} @ {fmt(b_shape)}")
    if rank == 3:
        require_equal(a_shape[0], b_shape[0], f"{what}: batch dims of {fmt(a_shape)} and {fmt(b_shape)}")
    return tuple(a_shape[:-1]) + (b_shape[-1],)


rule(Op.MM, shape=lambda s, a, ctx: _matmul_shape(s[0], s[1], 2, "mm"),
     concrete=lambda xs, a, ctx: xs[0] @ xs[1])

rule(Op.BMM, shape=lambda s, a, ctx: _matmul_shape(s[0], s[1], 3, "bmm"),
     concrete=lambda xs, a, ctx: xs[0] @ xs[1])


def _addmm_shape(s, a, ctx):
    out = _matmul_shape(s[1], s[2], 2, "addmm")
    if not same_shape(broadcast([s[0], out], "addmm bias"), out):
        raise ShapeError(f"addmm: bias {fmt(s[0])} does not broadcast to the product's shape {fmt(out)}")
    return out


rule(Op.ADDMM, shape=_addmm_shape, dtype=lambda d, a: d[1],
     concrete=lambda xs, a, ctx: xs[0] + xs[1] @ xs[2])


# -- views ----------------------------------------------------------------------------
def _view_shape(s, a, ctx):
    size = list(a["size"])
    inferred = [i for i, d in enumerate(size) if d == -1]
    if len(inferred) > 1:
        raise ShapeError(f"view to {fmt(size)}: only one dim may be -1")
    if inferred:
        known = numel(size[:inferred[0]] + size[inferred[0] + 1:])
        size[inferred[0]] = exact_div(numel(s[0]), known, f"view of {fmt(s[0])} to {fmt(a['size'])}")
    if not numel(size) == numel(s[0]):
        raise ShapeError(f"view of {fmt(s[0])} to {fmt(size)}: the element counts "
                         f"{numel(s[0])} and {numel(size)} differ")
    return tuple(size)


rule(Op.VIEW, shape=_view_shape, concrete=lambda xs, a, ctx: xs[0].reshape(a["size"]))


def _permutation(dims, rank: int) -> tuple[int, ...]:
    perm = tuple(norm_dim(d, rank, f"permute{list(dims)}") for d in dims)
    if sorted(perm) != list(range(rank)):
        raise ShapeError(f"permute{list(dims)} is not a permutation of the {rank} dims")
    return perm


rule(Op.PERMUTE,
     shape=lambda s, a, ctx: tuple(s[0][d] for d in _permutation(a["dims"], len(s[0]))),
     concrete=lambda xs, a, ctx: np.transpose(xs[0], _permutation(a["dims"], xs[0].ndim)))


def _transpose_shape(s, a, ctx):
    out = list(s[0])
    i, j = (norm_dim(a[k], len(out), "transpose") for k in ("dim0", "dim1"))
    out[i], out[j] = out[j], out[i]
    return tuple(out)


rule(Op.TRANSPOSE, shape=_transpose_shape,
     concrete=lambda xs, a, ctx: np.swapaxes(xs[0], a["dim0"], a["dim1"]))


def _expand_shape(s, a, ctx):
    size, shape = tuple(a["size"]), tuple(s[0])
    if len(size) < len(shape):
        raise ShapeError(f"expand of {fmt(shape)} to {fmt(size)}: fewer dims than the input")
    lead = len(size) - len(shape)
    out = list(size[:lead])
    for have, want in zip(shape, size[lead:]):
        target = have if want == -1 else want
        if not (have == target or have == 1):
            raise ShapeError(f"expand of {fmt(shape)} to {fmt(size)}: dim of size {have} cannot become {want}")
        out.append(target)
    return tuple(out)


rule(Op.EXPAND, shape=_expand_shape,
     concrete=lambda xs, a, ctx: np.broadcast_to(xs[0], _expand_shape([xs[0].shape], a, ctx)))


def _unsqueeze_shape(s, a, ctx):
    out = list(s[0])
    out.insert(norm_dim(a["dim"], len(out) + 1, "unsqueeze"), 1)
    return tuple(out)


rule(Op.UNSQUEEZE, shape=_unsqueeze_shape,
     concrete=lambda xs, a, ctx: np.expand_dims(xs[0], norm_dim(a["dim"], xs[0].ndim + 1, "unsqueeze")))


def _squeeze_shape(s, a, ctx):
    # ATen squeeze(dim) removes the dim only when it has size 1; a 0-d tensor stays as it is.
    if not s[0]:
        return ()
    dim = norm_dim(a["dim"], len(s[0]), "squeeze")
    return tuple(s[0][:dim]) + tuple(s[0][dim + 1:]) if s[0][dim] == 1 else tuple(s[0])


rule(Op.SQUEEZE, shape=_squeeze_shape,
     concrete=lambda xs, a, ctx: xs[0].reshape(_squeeze_shape([xs[0].shape], a, ctx)))

rule(Op.CLONE, shape=lambda s, a, ctx: tuple(s[0]), concrete=lambda xs, a, ctx: xs[0].copy())


# -- slices ------------------------------------------------------------------------------
def _slice_bounds(size, start, end, step, what: str):
    """ATen's slice: negative bounds count from the end, then both are clamped to [0, size]."""
    if step <= 0:
        raise ShapeError(f"{what}: step must be positive, got {step}")
    start = start + size if is_const(start) and const(start) < 0 else start
    end = end + size if is_const(end) and const(end) < 0 else end
    end = size if is_const(end) and const(end) >= TO_THE_END else end
    start = 0 if is_const(start) and const(start) < 0 else dim_min(start, size, what)
    end = dim_min(end, size, what)
    if is_const(end - start) and const(end - start) < 0:
        end = start
    return start, end


def _slice_shape_of(shape, dim, start, end, step, what):
    dim = norm_dim(dim, len(shape), what)
    lo, hi = _slice_bounds(shape[dim], start, end, step, what)
    length = (max(0, -(-const(hi - lo) // step)) if is_const(hi - lo)
              else hi - lo if step == 1 else exact_div(hi - lo, step, what))
    return tuple(shape[:dim]) + (length,) + tuple(shape[dim + 1:])


def _slice_index(ndim, a):
    dim = norm_dim(a["dim"], ndim, "slice")
    return (slice(None),) * dim + (slice(a["start"], a["end"], a["step"]),)


rule(Op.SLICE,
     shape=lambda s, a, ctx: _slice_shape_of(s[0], a["dim"], a["start"], a["end"], a["step"], "slice"),
     concrete=lambda xs, a, ctx: xs[0][_slice_index(xs[0].ndim, a)])


def _slice_backward_shape(s, a, ctx):
    size = tuple(a["input_size"])
    sliced = _slice_shape_of(size, a["dim"], a["start"], a["end"], a["step"], "slice_backward")
    if not same_shape(s[0], sliced):
        raise ShapeError(f"slice_backward: grad {fmt(s[0])} is not the shape {fmt(sliced)} "
                         f"of the slice of {fmt(size)}")
    return size


def _slice_backward(xs, a, ctx):
    out = np.zeros(a["input_size"], dtype=xs[0].dtype)
    out[_slice_index(out.ndim, a)] = xs[0]
    return out


rule(Op.SLICE_BACKWARD, shape=_slice_backward_shape, concrete=_slice_backward)


def _select_index(size, index, what):
    wrapped = index + size if is_const(index) and const(index) < 0 else index
    in_range = known_le(0, wrapped) and known_le(wrapped + 1, size)
    if in_range is None:
        raise ShapeError(f"{what}: cannot tell whether index {index} lies in [0, {size}) for every size of the dims")
    if not in_range:
        raise ShapeError(f"{what}: index {index} is out of range for a dim of size {size}")
    return wrapped


def _select_shape(s, a, ctx):
    dim = norm_dim(a["dim"], len(s[0]), "select")
    _select_index(s[0][dim], a["index"], "select")
    return tuple(s[0][:dim]) + tuple(s[0][dim + 1:])


def _select(xs, a, ctx):
    dim = norm_dim(a["dim"], xs[0].ndim, "select")
    return np.take(xs[0], _select_index(xs[0].shape[dim], a["index"], "select"), axis=dim)


rule(Op.SELECT, shape=_select_shape, concrete=_select)


def _cat_shape(s, a, ctx):
    first = s[0]
    dim = norm_dim(a["dim"], len(first), "cat")
    total = 0
    for shape in s:
        if len(shape) != len(first) or not all(x == y for i, (x, y) in enumerate(zip(shape, first)) if i != dim):
            raise ShapeError(f"cat along dim {a['dim']}: {fmt(shape)} does not match {fmt(first)} "
                             f"outside the cat dim")
        total = total + shape[dim]
    return tuple(first[:dim]) + (total,) + tuple(first[dim + 1:])


rule(Op.CAT, shape=_cat_shape, dtype=lambda dtypes, a: promote(*dtypes),
     concrete=lambda xs, a, ctx: np.concatenate(xs, axis=norm_dim(a["dim"], xs[0].ndim, "cat")))
