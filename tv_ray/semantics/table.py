"""The semantics rule table: for each op one Rule holding its shape, dtype, concrete and group rules.

Every interpretation of a graph (lint, the float64 interpreter, the plan
simulator, the symbolic encoders) looks an op up here with `rule_for`; an op
without the rule asked for is an `UnknownOpError` naming it, never a silent
identity. Each rule module registers one block per op with `rule(...)`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from tv_ray.errors import GraphError, ShapeError, TvRayError, UnknownOpError
from tv_ray.ir.dims import Dims, Expr
from tv_ray.ir.graph import Node
from tv_ray.ir.ops import Op


@dataclass(frozen=True)
class Context:
    """Where a rule runs: the mesh axis sizes (programs) and this rank's coordinates (concrete runs)."""

    axis_sizes: Mapping[str, int] = field(default_factory=dict)
    coords: Mapping[str, int] = field(default_factory=dict)

    def group_size(self, axes: Sequence[str]) -> int:
        """The number of members of a group spanning `axes`."""
        size = 1
        for axis in axes:
            size *= self._lookup(self.axis_sizes, axis, "size")
        return size

    def group_position(self, axes: Sequence[str]) -> int:
        """This rank's position in its group along `axes` (mixed radix, first axis outermost)."""
        position = 0
        for axis in axes:
            size = self._lookup(self.axis_sizes, axis, "size")
            coord = self._lookup(self.coords, axis, "coordinate")
            if not 0 <= coord < size:
                raise ShapeError(f"coordinate {coord} on mesh axis {axis!r} is outside [0, {size})")
            position = position * size + coord
        return position

    @staticmethod
    def _lookup(table: Mapping[str, int], axis: str, what: str) -> int:
        if axis not in table:
            known = ", ".join(sorted(table)) or "none"
            raise ShapeError(f"mesh axis {axis!r} has no {what} in this context (known axes: {known}); "
                             f"run the program with the plan's mesh")
        return table[axis]


ShapeRule = Callable[[list[tuple], dict, Context], tuple]
DtypeRule = Callable[[list[str], dict], str]
ConcreteRule = Callable[[list[np.ndarray], dict, Context], np.ndarray]
GroupRule = Callable[[list[np.ndarray], dict], list[np.ndarray]]


def same_as_first(dtypes: list[str], attrs: dict) -> str:
    """The default dtype rule: the first input's dtype, or float for ops without inputs."""
    return dtypes[0] if dtypes else "float"


@dataclass(frozen=True)
class Rule:
    """All the semantics of one op, registered in one block."""

    op: Op
    shape: ShapeRule
    dtype: DtypeRule
    concrete: ConcreteRule | None
    group: GroupRule | None


RULES: dict[Op, Rule] = {}


def rule(op: Op, *, shape: ShapeRule, dtype: DtypeRule = same_as_first,
         concrete: ConcreteRule | None = None, group: GroupRule | None = None) -> None:
    """Register the rules of `op`; registering an op twice is an error."""
    if op in RULES:
        raise TvRayError(f"op {op} already has rules registered; each op is registered in exactly one block")
    RULES[op] = Rule(op, shape, dtype, concrete, group)


def rule_for(op: Op, kind: str = "shape") -> Rule:
    """The Rule of `op`, which must define a `kind` rule (shape, dtype, concrete or group)."""
    found = RULES.get(op)
    if found is None or getattr(found, kind) is None:
        raise UnknownOpError(f"no {kind} rule for op {op}", op=str(op))
    return found


# -- dtypes --------------------------------------------------------------------
NUMPY_DTYPES: Mapping[str, Any] = {"float": np.float64, "int": np.int64, "bool": np.bool_}
_PROMOTION = ("bool", "int", "float")


def numpy_dtype(dtype: str) -> Any:
    """The numpy dtype a tv_ray dtype is computed in (float64, int64, bool)."""
    if dtype not in NUMPY_DTYPES:
        raise GraphError(f"dtype {dtype!r} has no values; one of {', '.join(NUMPY_DTYPES)}")
    return NUMPY_DTYPES[dtype]


def dtype_name(array: np.ndarray) -> str:
    """The tv_ray dtype of a numpy array."""
    kind = np.asarray(array).dtype.kind
    if kind == "b":
        return "bool"
    if kind in "iu":
        return "int"
    if kind == "f":
        return "float"
    raise GraphError(f"numpy dtype {np.asarray(array).dtype} is not a tv_ray dtype")


def promote(*dtypes: str) -> str:
    """Type promotion over bool < int < float, as ATen does for same-category tensors."""
    for dtype in dtypes:
        if dtype not in _PROMOTION:
            raise GraphError(f"dtype {dtype!r} cannot take part in arithmetic")
    return max(dtypes, key=_PROMOTION.index)


def scalar_dtype(value: float) -> str:
    """The dtype a scalar attribute contributes: int if it is integral (attrs store numbers as floats)."""
    return "int" if float(value).is_integer() else "float"


# -- attribute instantiation --------------------------------------------------
def instantiate(value: Any, dims: Dims) -> Any:
    """An attribute or shape with every Expr evaluated at `dims`."""
    if isinstance(value, Expr):
        return value.eval(dims)
    if isinstance(value, tuple) and any(isinstance(v, Expr) for v in value):
        return tuple(instantiate(v, dims) for v in value)
    return value


def instantiate_attrs(node: Node, dims: Dims) -> dict:
    """The node's attributes with every shape expression evaluated to an int at `dims`."""
    try:
        return {key: instantiate(value, dims) for key, value in node.attrs}
    except ShapeError as err:
        raise ShapeError(f"node {node.name} = {node.op}(...): attribute {err}", node=node.name) from None


def instantiate_shape(shape: Sequence, dims: Dims) -> tuple[int, ...]:
    return tuple(d.eval(dims) if isinstance(d, Expr) else d for d in shape)
