"""Shape arithmetic that works alike on concrete ints and on symbolic `Expr` dimensions.

Only ``+ - *``, exact division and equality are used, so one shape rule serves
lint at full size, at reduced size and symbolically. Where a rule needs an
order (slice clamping, select, top-k), `known_le` decides it for every size
>= 1 of the dims when the difference, with each dim written as 1 + a
non-negative variable, has coefficients of one sign; otherwise the rule
raises instead of guessing.
"""
from __future__ import annotations

import functools
from typing import Sequence

from tv_ray.errors import ShapeError, TvRayError
from tv_ray.ir.dims import Expr

Dim = int | Expr


def fmt(shape: Sequence[Dim]) -> str:
    """A shape as ``[batch*seq, 12]``."""
    return "[" + ", ".join(str(d) for d in shape) + "]"


def is_const(d: Dim) -> bool:
    return not isinstance(d, Expr) or d.is_const


def const(d: Dim) -> int:
    return d.const_value() if isinstance(d, Expr) else int(d)


def simplify(d: Dim) -> Dim:
    """An integer-valued constant Expr as an int; anything else unchanged."""
    if isinstance(d, Expr) and d.is_const and all(coef.denominator == 1 for _, coef in d.terms):
        return d.const_value()
    return d


def _at_least_one(e: Expr) -> Expr | None:
    """e with every dim n replaced by n + 1, so that "for all dims >= 1" becomes "for all dims >= 0"."""
    out = Expr.const(0)
    for mono, coef in e.terms:
        term = Expr.const(coef)
        for name, exp in mono:
            if exp < 0:
                return None
            for _ in range(exp):
                term = term * (Expr.dim(name) + 1)
        out = out + term
    return out


@functools.lru_cache(maxsize=4096)   # Expr is hash-consed; lint asks about the same few differences per node
def _surely_nonneg(e: Expr) -> bool:
    shifted = _at_least_one(e)
    return shifted is not None and all(coef >= 0 for _, coef in shifted.terms)


def known_le(a: Dim, b: Dim) -> bool | None:
    """Whether a <= b for every size >= 1 of the dims; None when that depends on the sizes."""
    if type(a) is int and type(b) is int:   # lint at concrete dims: no polynomial needed
        return a <= b
    if _surely_nonneg(Expr.of(b) - a):
        return True
    if _surely_nonneg(Expr.of(a) - b):
        return False
    return None


def dim_min(a: Dim, b: Dim, what: str) -> Dim:
    """min(a, b), decided for every size of the dims; raises when it depends on them."""
    le = known_le(a, b)
    if le is None:
        raise ShapeError(f"{what}: cannot tell whether {a} <= {b} for every size of the dims")
    return a if le else b


def norm_dim(dim: int, rank: int, what: str) -> int:
    """A dim attribute in [0, rank), counting negative dims from the end as ATen does."""
    wrapped = dim + rank if dim < 0 else dim
    if not 0 <= wrapped < rank:
        raise ShapeError(f"{what}: dim {dim} is out of range for a tensor of rank {rank}")
    return wrapped


def exact_div(a: Dim, b: Dim, what: str) -> Dim:
    """a / b where the division must be exact; symbolic quotients are checked when instantiated."""
    if b == 0:
        raise ShapeError(f"{what}: division of {a} by zero")
    if is_const(a) and is_const(b):
        if const(a) % const(b):
            raise ShapeError(f"{what}: {a} is not divisible by {b}")
        return const(a) // const(b)
    try:
        return simplify(Expr.of(a) / b)
    except TvRayError as err:
        raise ShapeError(f"{what}: {err}") from None


def numel(shape: Sequence[Dim]) -> Dim:
    total: Dim = 1
    for d in shape:
        total = total * d
    return simplify(total) if isinstance(total, Expr) else total


def broadcast(shapes: Sequence[Sequence[Dim]], what: str) -> tuple[Dim, ...]:
    """numpy broadcasting: align trailing dims; a dim of 1 stretches to the other size."""
    rank = max((len(s) for s in shapes), default=0)
    out: list[Dim] = []
    for i in range(rank):
        size: Dim = 1
        for shape in shapes:
            d = shape[i - rank + len(shape)] if i - rank + len(shape) >= 0 else 1
            if d == 1 or d == size:
                continue
            if size != 1:
                raise ShapeError(f"{what}: shapes {' and '.join(fmt(s) for s in shapes)} do not broadcast "
                                 f"(dim {i - rank}: {size} vs {d})")
            size = d
        out.append(size)
    return tuple(out)


def same_shape(a: Sequence[Dim], b: Sequence[Dim]) -> bool:
    if type(a) is tuple and type(b) is tuple:
        return a == b   # the same test, elementwise in C
    return len(a) == len(b) and all(x == y for x, y in zip(a, b))


def require_rank(shape: Sequence[Dim], ranks: Sequence[int], what: str) -> None:
    if len(shape) not in ranks:
        want = " or ".join(str(r) for r in ranks)
        raise ShapeError(f"{what}: expected a tensor of rank {want}, got {fmt(shape)}")


def require_equal(a: Dim, b: Dim, what: str) -> None:
    if not a == b:
        raise ShapeError(f"{what}: {a} != {b}")
