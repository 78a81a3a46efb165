"""Several concrete runs at once: each value holds every run's, stacked along a leading axis.

The claims' concrete runs (`tv_ray.partition.claims.runs_for`) step the same
programs on a few points; on the reduced shapes each op costs its dispatch,
not its arithmetic, so one op on the runs stacked costs what one run's did.
`batched` evaluates a node on stacked arguments where its rule is the same
numpy expression with the stack's axis in front:

- elementwise ops (and addmm's bias): each argument's axes aligned after the
  stack's (numpy aligns trailing axes, so a bias of rank 1 would meet the stack's
  axis otherwise), and so an expand's input where it adds dims;
- matrix products: numpy's matmul treats leading axes as a batch;
- ops that name dims (views, slices, reductions, softmax, concatenation): each
  dim counted from the end, which a leading axis does not move, and a stated
  size (view, expand, slice_backward's input) with the stack's length in front.

Every other op returns None: its caller evaluates it run by run.
"""
from __future__ import annotations

from typing import Callable

import numpy as np

from tv_ray.ir import Node, Op
from tv_ray.ir.ops import ELEMENTWISE
from tv_ray.semantics.table import Context


def _from_end(dim: int, ndim: int) -> int:
    """The same axis of an `ndim`-dim tensor, counted from the end."""
    return dim - ndim if dim >= 0 else dim


def _dim(*names: str, extra: int = 0) -> Callable[[dict, int, int], dict]:
    """Attributes naming one dim each (of the input; `extra`: of a result with that many more dims) from the end."""
    return lambda a, ndim, runs: {**a, **{k: _from_end(a[k], ndim + extra) for k in names}}


def _sized(name: str, *dims: str) -> Callable[[dict, int, int], dict]:
    """A stated size with the stack's length in front (and dims `dims` counted from the end of that size)."""
    return lambda a, ndim, runs: {**a, name: (runs, *a[name]),
                                  **{k: _from_end(a[k], len(a[name])) for k in dims}}


LIFTED: dict[Op, Callable[[dict, int, int], dict]] = {
    Op.MM: lambda a, ndim, runs: a,
    Op.BMM: lambda a, ndim, runs: a,
    Op.VIEW: _sized("size"),
    Op.EXPAND: _sized("size"),
    Op.SLICE_BACKWARD: _sized("input_size", "dim"),
    Op.TRANSPOSE: _dim("dim0", "dim1"),
    Op.SLICE: _dim("dim"),
    Op.SQUEEZE: _dim("dim"),
    Op.UNSQUEEZE: _dim("dim", extra=1),
    Op.CAT: _dim("dim"),
    Op.SOFTMAX: _dim("dim"),
    Op.SOFTMAX_BACKWARD: _dim("dim"),
    Op.LOG_SOFTMAX: _dim("dim"),
    Op.LOG_SOFTMAX_BACKWARD: _dim("dim"),
    **{op: (lambda a, ndim, runs: {**a, "dims": [_from_end(d, ndim) for d in a["dims"] or range(ndim)]})
       for op in (Op.SUM, Op.MEAN, Op.AMAX)},        # no dims: all of them
}
ALIGNED = ELEMENTWISE | {Op.ADDMM}


def batched(node: Node, args: list[np.ndarray], attrs: dict, shape: tuple[int, ...], concrete: Callable,
            ctx: Context) -> np.ndarray | None:
    """`node` evaluated on `args` stacked along axis 0 (`attrs`, `shape`: its attributes and stated shape at the
    runs' dims, `concrete` its rule), or None where it is evaluated run by run: an op of neither kind above, or
    one whose input has no dims."""
    if not args:
        return None
    runs, rank = args[0].shape[0], len(shape) + 1
    if node.op in ALIGNED or node.op is Op.EXPAND:      # an expand's new dims go after the stack's too
        args = [a.reshape((runs,) + (1,) * (rank - a.ndim) + a.shape[1:]) if a.ndim < rank else a for a in args]
    if node.op in ALIGNED:
        return np.asarray(concrete(args, attrs, ctx))
    lift = LIFTED.get(node.op)
    if lift is None or args[0].ndim < 2:
        return None
    return np.asarray(concrete(args, lift(attrs, args[0].ndim - 1, runs), ctx))


__all__ = ["batched", "LIFTED", "ALIGNED"]
