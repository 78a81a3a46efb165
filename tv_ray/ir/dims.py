"""Shape expressions: integer polynomials over named model dimensions.

A captured graph's shapes and shape arguments are `Expr`s such as
``batch*seq``, ``heads*head_dim/2`` or ``kv_heads*head_dim + 2``; a table of
dimension values (`Dims`) instantiates them at full or at reduced size.
`Expr` supports ``+ - *`` and exact division by a constant or a monomial, so
shape rules written with ordinary arithmetic work on ints and `Expr` alike.
"""
from __future__ import annotations

import ast
import functools
from fractions import Fraction
from typing import Mapping, Union

from tv_ray.errors import ShapeError

# A monomial is a sorted tuple of (dim name, exponent) pairs; () is the constant 1.
Monomial = tuple[tuple[str, int], ...]
Dims = Mapping[str, int]


def _mono_mul(a: Monomial, b: Monomial) -> Monomial:
    powers: dict[str, int] = dict(a)
    for name, exp in b:
        powers[name] = powers.get(name, 0) + exp
    return tuple(sorted((n, e) for n, e in powers.items() if e != 0))


_INTERNED: dict[tuple, "Expr"] = {}


class Expr:
    """An immutable polynomial with rational coefficients over dimension names."""

    __slots__ = ("terms", "_hash", "_text", "_const", "_json")

    def __new__(cls, terms: Mapping[Monomial, Fraction] | None = None) -> "Expr":
        clean = tuple(sorted((m, Fraction(c)) for m, c in (terms or {}).items() if c != 0))
        self = _INTERNED.get(clean)
        if self is not None:
            return self     # hash-consed: equal expressions are one object
        self = object.__new__(cls)
        object.__setattr__(self, "terms", clean)
        # a constant hashes as its number, since it compares equal to it
        constant = all(m == () for m, _ in clean)
        object.__setattr__(self, "_hash", hash(clean[0][1] if clean else 0) if constant else hash(clean))
        object.__setattr__(self, "_text", None)
        object.__setattr__(self, "_const", constant)   # read per dim by lint and to_json
        object.__setattr__(self, "_json", None)
        _INTERNED[clean] = self
        return self

    def __reduce__(self):
        return (Expr, (dict(self.terms),))

    def __setattr__(self, *_):
        raise AttributeError("Expr is immutable")

    # -- construction -------------------------------------------------------
    @staticmethod
    def const(value: int | Fraction) -> "Expr":
        return Expr({(): Fraction(value)})

    @staticmethod
    def dim(name: str) -> "Expr":
        if not name.isidentifier():
            raise ShapeError(f"dimension name {name!r} is not an identifier")
        return Expr({((name, 1),): Fraction(1)})

    @staticmethod
    def of(value: "ExprLike") -> "Expr":
        """Coerce an int, Fraction, string (parsed) or Expr to an Expr."""
        if isinstance(value, Expr):
            return value
        if isinstance(value, bool):
            raise ShapeError(f"a boolean is not a shape expression: {value!r}")
        if isinstance(value, (int, Fraction)):
            return Expr.const(value)
        if isinstance(value, str):
            return parse(value)
        raise ShapeError(f"not a shape expression: {value!r}")

    # -- queries ------------------------------------------------------------
    @property
    def is_const(self) -> bool:
        return self._const

    @property
    def free_dims(self) -> frozenset[str]:
        return frozenset(n for m, _ in self.terms for n, _ in m)

    def const_value(self) -> int:
        """The integer value of a constant expression."""
        if not self.is_const:
            raise ShapeError(f"shape expression {self} is not a constant")
        value = self.terms[0][1] if self.terms else Fraction(0)
        if value.denominator != 1:
            raise ShapeError(f"shape expression {self} is not an integer")
        return int(value)

    def eval(self, dims: Dims) -> int:
        """Evaluate at a table of dimension values; the result must be an integer."""
        if self._const:
            return self.const_value()
        num, den = 0, 1             # in ints: Fraction arithmetic here was a third of a concrete run's time
        for mono, coef in self.terms:
            n, d = coef.numerator, coef.denominator
            for name, exp in mono:
                if name not in dims:
                    raise ShapeError(f"shape expression {self} uses dimension {name!r}, "
                                     f"which the dims table does not define")
                if exp >= 0:
                    n *= dims[name] ** exp
                else:
                    d *= dims[name] ** -exp
            num, den = num * d + n * den, den * d
        if num % den:
            raise ShapeError(f"shape expression {self} is not an integer at {dict(dims)}: {Fraction(num, den)}")
        return num // den

    # -- arithmetic ---------------------------------------------------------
    def __add__(self, other: "ExprLike") -> "Expr":
        out = dict(self.terms)
        for m, c in Expr.of(other).terms:
            out[m] = out.get(m, Fraction(0)) + c
        return Expr(out)

    __radd__ = __add__

    def __neg__(self) -> "Expr":
        return Expr({m: -c for m, c in self.terms})

    def __sub__(self, other: "ExprLike") -> "Expr":
        return self + (-Expr.of(other))

    def __rsub__(self, other: "ExprLike") -> "Expr":
        return Expr.of(other) - self

    def __mul__(self, other: "ExprLike") -> "Expr":
        out: dict[Monomial, Fraction] = {}
        for ma, ca in self.terms:
            for mb, cb in Expr.of(other).terms:
                m = _mono_mul(ma, mb)
                out[m] = out.get(m, Fraction(0)) + ca * cb
        return Expr(out)

    __rmul__ = __mul__

    def __truediv__(self, other: "ExprLike") -> "Expr":
        div = Expr.of(other)
        if len(div.terms) != 1:
            raise ShapeError(f"cannot divide {self} by the sum {div}: only by a constant or a monomial")
        (mono, coef), = div.terms
        inverse = tuple((n, -e) for n, e in mono)
        return Expr({_mono_mul(m, inverse): c / coef for m, c in self.terms})

    __floordiv__ = __truediv__  # shape arithmetic is exact; eval() rejects fractions

    def __rtruediv__(self, other: "ExprLike") -> "Expr":
        return Expr.of(other) / self

    # -- comparison and hashing ----------------------------------------------
    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        if isinstance(other, (int, Fraction, str)) and not isinstance(other, bool):
            other = Expr.of(other)
        return isinstance(other, Expr) and self.terms == other.terms

    def __hash__(self) -> int:
        return self._hash

    def __repr__(self) -> str:
        return f"Expr({str(self)!r})"

    def __str__(self) -> str:
        if self._text is None:
            object.__setattr__(self, "_text", self._format())
        return self._text

    def _format(self) -> str:
        if not self.terms:
            return "0"
        parts = []
        for mono, coef in sorted(self.terms, key=lambda t: (-len(t[0]), t[0])):
            num = [n if e == 1 else f"{n}^{e}" for n, e in mono if e > 0]
            den = [n if e == -1 else f"{n}^{-e}" for n, e in mono if e < 0]
            if coef.numerator != 1 or not num:
                num.insert(0, str(abs(coef.numerator)) if coef.numerator != -1 or not num else "1")
            if coef.denominator != 1:
                den.insert(0, str(coef.denominator))
            text = "*".join(num) + "".join("/" + d for d in den)
            if text.startswith("1*"):
                text = text[2:]
            sign = "-" if coef < 0 else "+"
            parts.append((sign, text))
        out = ("-" if parts[0][0] == "-" else "") + parts[0][1]
        for sign, text in parts[1:]:
            out += f" {sign} {text}"
        return out

    def to_json(self) -> int | str:
        """An int for constants, otherwise the expression's text."""
        if self._json is None:   # cached: a plan writes the same few hundred expressions ~10^6 times
            object.__setattr__(self, "_json", self.const_value() if self._const and self._is_int() else str(self))
        return self._json

    def _is_int(self) -> bool:
        return not self.terms or self.terms[0][1].denominator == 1


ExprLike = Union[Expr, int, Fraction, str]


@functools.lru_cache(maxsize=65536)
def parse(text: str) -> Expr:
    """Parse ``batch*seq/2 + 3`` or ``d^2`` into an Expr (only + - * / ^ and parentheses)."""
    try:
        tree = ast.parse(text.replace("^", "**"), mode="eval")
    except SyntaxError:
        raise ShapeError(f"cannot parse shape expression {text!r}") from None

    def build(node: ast.AST) -> Expr:
        if isinstance(node, ast.Expression):
            return build(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, int) and not isinstance(node.value, bool):
            return Expr.const(node.value)
        if isinstance(node, ast.Name):
            return Expr.dim(node.id)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            inner = build(node.operand)
            return -inner if isinstance(node.op, ast.USub) else inner
        if isinstance(node, ast.BinOp):
            left, right = build(node.left), build(node.right)
            if isinstance(node.op, ast.Add):
                return left + right
            if isinstance(node.op, ast.Sub):
                return left - right
            if isinstance(node.op, ast.Mult):
                return left * right
            if isinstance(node.op, ast.Div):
                return left / right
            if isinstance(node.op, ast.Pow) and right.is_const:
                exp = right.const_value()
                result = Expr.const(1)
                for _ in range(abs(exp)):
                    result = result * left
                return result if exp >= 0 else Expr.const(1) / result
        raise ShapeError(f"cannot parse shape expression {text!r}: only integers, dimension "
                         f"names, + - * / ^ and parentheses are allowed")

    return build(tree)


def evaluate(value: ExprLike, dims: Dims) -> int:
    """Evaluate an int or an Expr at `dims`."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    return Expr.of(value).eval(dims)
