"""Rules for elementwise ops: unary functions, broadcasting binary ops, clamp, where and cast.

The uniform families are tables (op -> numpy function); each table row is
registered as that op's one block. Binary ops take two tensors, or one tensor
and the scalar attribute `other`, with numpy broadcasting; the result dtype
follows ATen's promotion (bool < int < float) and the concrete result is
computed in float64 / int64 and then put in that dtype.
"""
from __future__ import annotations

import math
from typing import Callable

import numpy as np

from tv_ray.errors import GraphError
from tv_ray.ir.ops import Op
from tv_ray.semantics.shapes import broadcast
from tv_ray.semantics.table import (dtype_name, numpy_dtype, promote, rule, same_as_first,
                                    scalar_dtype)

_erf = np.vectorize(math.erf, otypes=[np.float64])


def _sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def _gelu(x, approximate: str):
    if approximate == "none":
        return 0.5 * x * (1.0 + _erf(x / math.sqrt(2.0)))
    if approximate == "tanh":
        return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))
    raise GraphError(f"gelu: approximate must be 'none' or 'tanh', got {approximate!r}")


def _same_shape(shapes, attrs, ctx):
    return tuple(shapes[0])


def _float_result(dtypes, attrs):
    return "float"


# -- unary ------------------------------------------------------------------------
# op -> (function on a float64/int64 array, whether the result keeps the input dtype)
UNARY_FUNCTIONS: dict[Op, tuple[Callable, bool]] = {
    Op.NEG: (np.negative, True),
    Op.ABS: (np.abs, True),
    Op.RSQRT: (lambda x: 1.0 / np.sqrt(x), False),
    Op.SQRT: (np.sqrt, False),
    Op.RECIPROCAL: (lambda x: 1.0 / x, False),
    Op.EXP: (np.exp, False),
    Op.LOG: (np.log, False),
    Op.SIGMOID: (_sigmoid, False),
    Op.SILU: (lambda x: x * _sigmoid(x), False),
    Op.TANH: (np.tanh, False),
    Op.COS: (np.cos, False),
    Op.SIN: (np.sin, False),
}


def _register_unary(op: Op, fn: Callable, keeps_dtype: bool) -> None:
    rule(op, shape=_same_shape, dtype=same_as_first if keeps_dtype else _float_result,
         concrete=lambda xs, a, ctx: np.asarray(fn(xs[0] if keeps_dtype else xs[0].astype(np.float64))))


for _op, (_fn, _keeps) in UNARY_FUNCTIONS.items():
    _register_unary(_op, _fn, _keeps)

rule(Op.GELU, shape=_same_shape, dtype=_float_result,
     concrete=lambda xs, a, ctx: _gelu(xs[0].astype(np.float64), a["approximate"]))


def _cast_dtype(dtypes, attrs):
    numpy_dtype(attrs["dtype"])  # rejects token and unknown names
    return attrs["dtype"]


rule(Op.CAST, shape=_same_shape, dtype=_cast_dtype,
     concrete=lambda xs, a, ctx: xs[0].astype(numpy_dtype(a["dtype"])))


# -- binary -----------------------------------------------------------------------
def _operands(xs: list, attrs: dict, op: Op) -> tuple:
    """The two operands: two tensors, or one tensor and the scalar attribute `other`."""
    if len(xs) == 2 and "other" not in attrs:
        return xs[0], xs[1]
    if len(xs) == 1 and "other" in attrs:
        return xs[0], attrs["other"]
    raise GraphError(f"{op} takes two tensors, or one tensor and the attribute 'other'; "
                     f"got {len(xs)} tensor(s) and {'an' if 'other' in attrs else 'no'} 'other'")


def _operand_dtypes(dtypes: list[str], attrs: dict, op: Op) -> tuple[str, str]:
    return _operands(dtypes, {**attrs, "other": scalar_dtype(attrs["other"])} if "other" in attrs else attrs, op)


def _binary_shape(op: Op):
    def shape(shapes, attrs, ctx):
        _operands(shapes, attrs, op)
        return broadcast(shapes, str(op))
    return shape


def _scaled(attrs: dict, b):
    return b * attrs["alpha"] if "alpha" in attrs else b


# op -> (function of the two operands and the attrs, result dtype from the operand dtypes)
BINARY_FUNCTIONS: dict[Op, tuple[Callable, Callable[[str, str], str]]] = {
    Op.ADD: (lambda x, y, a: x + _scaled(a, y), promote),
    Op.SUB: (lambda x, y, a: x - _scaled(a, y), promote),
    Op.MUL: (lambda x, y, a: x * y, promote),
    Op.DIV: (lambda x, y, a: np.true_divide(x, y), lambda p, q: "float"),
    Op.MAXIMUM: (lambda x, y, a: np.maximum(x, y), promote),
    Op.MINIMUM: (lambda x, y, a: np.minimum(x, y), promote),
    Op.EQ: (lambda x, y, a: np.equal(x, y), lambda p, q: "bool"),
    Op.NE: (lambda x, y, a: np.not_equal(x, y), lambda p, q: "bool"),
    Op.LT: (lambda x, y, a: np.less(x, y), lambda p, q: "bool"),
    Op.GE: (lambda x, y, a: np.greater_equal(x, y), lambda p, q: "bool"),
    Op.LOGICAL_AND: (lambda x, y, a: np.logical_and(x, y), lambda p, q: "bool"),
    Op.LOGICAL_OR: (lambda x, y, a: np.logical_or(x, y), lambda p, q: "bool"),
}


def _register_binary(op: Op, fn: Callable, result: Callable[[str, str], str]) -> None:
    def dtype(dtypes, attrs):
        return result(*_operand_dtypes(dtypes, attrs, op))

    def concrete(xs, attrs, ctx):
        x, y = _operands(xs, attrs, op)
        out = np.asarray(fn(x, y, attrs))
        return out.astype(numpy_dtype(dtype([dtype_name(v) for v in xs], attrs)), copy=False)

    rule(op, shape=_binary_shape(op), dtype=dtype, concrete=concrete)


for _op, (_fn, _result) in BINARY_FUNCTIONS.items():
    _register_binary(_op, _fn, _result)


# -- pow: x ** exponent (attr), base (attr) ** x, or x ** y ---------------------------
def _pow_operands(xs: list, attrs: dict) -> tuple:
    given = [key for key in ("exponent", "base") if key in attrs]
    if len(xs) == 2 and not given:
        return xs[0], xs[1]
    if len(xs) == 1 and given == ["exponent"]:
        return xs[0], attrs["exponent"]
    if len(xs) == 1 and given == ["base"]:
        return attrs["base"], xs[0]
    raise GraphError(f"pow takes two tensors, or one tensor and exactly one of the attributes "
                     f"'exponent' and 'base'; got {len(xs)} tensor(s) and {given or 'neither'}")


def _pow_dtype(dtypes, attrs):
    scalars = {key: scalar_dtype(attrs[key]) for key in ("exponent", "base") if key in attrs}
    return promote(*_pow_operands(dtypes, scalars))


def _pow_shape(shapes, attrs, ctx):
    _pow_operands(shapes, attrs)
    return broadcast(shapes, "pow")


def _pow(xs, attrs, ctx):
    x, y = _pow_operands(xs, attrs)
    return np.asarray(np.power(np.asarray(x, dtype=np.float64), y)).astype(
        numpy_dtype(_pow_dtype([dtype_name(v) for v in xs], attrs)))


rule(Op.POW, shape=_pow_shape, dtype=_pow_dtype, concrete=_pow)


# -- clamp and where ----------------------------------------------------------------------
def _clamp_dtype(dtypes, attrs):
    return promote(dtypes[0], *(scalar_dtype(attrs[k]) for k in ("min", "max") if k in attrs))


def _clamp(xs, attrs, ctx):
    # ATen clamps with min first, then max (so min > max gives max everywhere).
    out = xs[0]
    if "min" in attrs:
        out = np.maximum(out, attrs["min"])
    if "max" in attrs:
        out = np.minimum(out, attrs["max"])
    return np.asarray(out).astype(numpy_dtype(_clamp_dtype([dtype_name(xs[0])], attrs)))


rule(Op.CLAMP, shape=_same_shape, dtype=_clamp_dtype, concrete=_clamp)

rule(Op.WHERE, shape=lambda shapes, a, ctx: broadcast(shapes, "where"),
     dtype=lambda dtypes, a: promote(dtypes[1], dtypes[2]),
     concrete=lambda xs, a, ctx: np.where(xs[0].astype(bool), xs[1], xs[2]).astype(
         numpy_dtype(promote(dtype_name(xs[1]), dtype_name(xs[2])))))
