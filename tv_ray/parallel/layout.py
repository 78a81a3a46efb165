"""Layouts: how a rank's local tensor relates to its logical tensor along each mesh axis.

Each logical dimension is a list of `Factor`s (outer to inner) whose sizes
multiply to the dimension's size; a factor may be cut by mesh axes (outer to
inner), so the local dimension is the product of the factors' sizes divided
by their axes' sizes. A view that merges a batch dimension cut by ``dp`` with
a head dimension cut by ``tp`` keeps both factors, and splitting the view back
restores them. `partial` lists the axes over which the local tensor is a
partial sum (or max) of the logical one.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Iterable, Mapping

from tv_ray.errors import ParallelConfigError
from tv_ray.ir.dims import Expr

ONE = Expr.const(1)


@dataclass(frozen=True)
class Factor:
    size: Expr
    axes: tuple[str, ...] = ()


Dim = tuple[Factor, ...]


def canonical(factors: Iterable[Factor]) -> Dim:
    """Drop size-1 uncut factors and merge each uncut factor into the one before it.

    Cutting the outer factor of a contiguous block cuts the block the same way,
    so ``(B cut by dp) x (S)`` and ``(B*S cut by dp)`` are the same layout.
    """
    out: list[Factor] = []
    for f in factors:
        if not f.axes and f.size == ONE:
            continue
        if out and not f.axes:
            out[-1] = Factor(out[-1].size * f.size, out[-1].axes)
        else:
            out.append(f)
    return tuple(out) if out else (Factor(ONE),)


@dataclass(frozen=True)
class Layout:
    dims: tuple[Dim, ...]
    partial: tuple[tuple[str, str], ...] = ()   # sorted (axis, "sum" | "max")

    @staticmethod
    def replicated(shape: Iterable[Expr]) -> "Layout":
        return Layout(tuple(canonical([Factor(Expr.of(d))]) for d in shape))

    @staticmethod
    def make(dims: Iterable[Iterable[Factor]], partial: Mapping[str, str] | Iterable = ()) -> "Layout":
        part = tuple(sorted(dict(partial).items()))
        return Layout(tuple(canonical(d) for d in dims), part)

    @property
    def rank(self) -> int:
        return len(self.dims)

    @functools.cached_property
    def _shape(self) -> tuple[Expr, ...]:
        out = []
        for dim in self.dims:
            size = ONE
            for f in dim:
                size = size * f.size
            out.append(size)
        return tuple(out)

    def logical_shape(self) -> tuple[Expr, ...]:
        return self._shape

    def local_shape(self, sizes: Mapping[str, int]) -> tuple[Expr, ...]:
        out = []
        for dim in self.dims:
            size = ONE
            for f in dim:
                cut = 1
                for a in f.axes:
                    cut *= sizes[a]
                size = size * (f.size / cut)
            out.append(size)
        return tuple(out)

    def dim_axes(self, d: int) -> tuple[str, ...]:
        return tuple(a for f in self.dims[d] for a in f.axes)

    def axes(self) -> set[str]:
        return {a for d in range(self.rank) for a in self.dim_axes(d)} | {a for a, _ in self.partial}

    def uses(self, axis: str) -> bool:
        return axis in self.axes()

    def sharded_dim(self, axis: str) -> int | None:
        for d in range(self.rank):
            if axis in self.dim_axes(d):
                return d
        return None

    def with_dim(self, d: int, factors: Iterable[Factor]) -> "Layout":
        dims = list(self.dims)
        dims[d] = canonical(factors)
        return Layout(tuple(dims), self.partial)

    def with_partial(self, partial: Mapping[str, str]) -> "Layout":
        return Layout(self.dims, tuple(sorted(dict(partial).items())))

    def without_partial(self) -> "Layout":
        return Layout(self.dims, ())

    def replicate_dim(self, d: int) -> "Layout":
        size = self.logical_shape()[d]
        return self.with_dim(d, [Factor(size)])

    def __str__(self) -> str:
        def dim(factors: Dim) -> str:
            return "*".join(f"{f.size}" + (f"|{'.'.join(f.axes)}" if f.axes else "") for f in factors)
        part = "".join(f" P({a}:{k})" for a, k in self.partial)
        return "[" + ", ".join(dim(d) for d in self.dims) + "]" + part


def axis_product(axes: Iterable[str], sizes: Mapping[str, int]) -> int:
    out = 1
    for a in axes:
        out *= sizes[a]
    return out


def check_divides(size: Expr, cut: int, dims: Mapping[str, int], what: str) -> None:
    """A factor of `size` cut `cut` ways must divide exactly at the full dims."""
    value = size.eval(dims)
    if value % cut:
        raise ParallelConfigError(f"{what}: {cut} does not divide {size} = {value}")


def view_layout(src: Layout, out_shape: tuple[Expr, ...], sizes: Mapping[str, int],
                dims: Mapping[str, int], where: str) -> Layout:
    """The layout of ``view(x, out_shape)`` for x laid out as `src`.

    Input factors are consumed in order by the output dimensions; a factor that
    straddles an output boundary is split, and its axes stay with the outer part
    (which must be divisible by them).
    """
    pending = [f for dim in src.dims for f in dim if f.axes or f.size != ONE]
    out_dims: list[list[Factor]] = []
    for target in out_shape:
        target = Expr.of(target)
        got: list[Factor] = []
        product = ONE
        while product != target:
            if not pending:
                raise ParallelConfigError(f"{where}: cannot follow the layout {src} through view to "
                                          f"{[str(d) for d in out_shape]}")
            f = pending.pop(0)
            need = target / product
            fv, nv = f.size.eval(dims), need.eval(dims)
            if fv <= nv:
                got.append(f)
                product = product * f.size
                continue
            if fv % nv:
                raise ParallelConfigError(f"{where}: view splits {f.size} into {need}, which does not divide it")
            outer, inner = Factor(need, f.axes), Factor(f.size / need)
            if f.axes:
                check_divides(need, axis_product(f.axes, sizes), dims,
                              f"{where}: view splits a dimension cut by {'.'.join(f.axes)} into {need}")
            got.append(outer)
            pending.insert(0, inner)
            product = product * need
        out_dims.append(got)
    if any(f.axes for f in pending):
        raise ParallelConfigError(f"{where}: view drops a cut factor of {src}")
    return Layout(tuple(canonical(d) for d in out_dims), src.partial)
