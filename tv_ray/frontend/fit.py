"""Symbolic shapes by fitting: one graph captured at three probe dims tables -> one graph over named dims.

The three captures must have the same structure (ops, wiring, non-shape
attributes); otherwise the model is not shape-polymorphic and we stop. Every
shape entry and shape-valued attribute is fitted as a monomial
``c * dim1^e1 * dim2^e2 ...`` (rational c, integer e). The probe tables are
chosen so that, for every dim, the ratio of its values in tables A and B has a
prime factor no other dim's ratio has; the ratio of a value between A and B
then factors into exactly one exponent vector (unique by unique
factorisation), and table C checks the fit.

Float attributes that depend on the dims (the attention scale
``head_dim^(-1/2)``, mean-backward divisors) are fitted as ``c * dim^(k/2)``
forms; the node keeps the concrete float at the graph's dims and records the
form in ``meta["dims_float"]`` (``"other=0.5*head_dim^(-1/2)"``), which
`instantiate` re-evaluates. A float that fits no such form is a CaptureError.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace
from fractions import Fraction
from typing import Any, Mapping, Sequence

from tv_ray.errors import CaptureError
from tv_ray.ir import Expr, Graph, Node
from tv_ray.ir.ops import ATTRS

Dims = Mapping[str, int]
MAX_EXPONENT = 4
FLOAT_RTOL = 1e-12


def _valuation(p: int, n: int) -> int:
    count = 0
    while n and n % p == 0:
        n //= p
        count += 1
    return count


def _prime_factors(n: int) -> set[int]:
    out, f = set(), 2
    while f * f <= n:
        while n % f == 0:
            out.add(f)
            n //= f
        f += 1
    return out | ({n} if n > 1 else set())


@dataclass(frozen=True)
class FloatForm:
    """``coef * prod(dim^exp)`` with half-integer exponents: a float that scales with the dims."""

    coef: Fraction | float
    exps: tuple[tuple[str, Fraction], ...]

    def value(self, dims: Dims) -> float:
        out = float(self.coef)
        for name, exp in self.exps:
            out *= float(dims[name]) ** float(exp)
        return out

    def __str__(self) -> str:
        return "*".join([str(self.coef)] + [f"{n}^({e})" for n, e in self.exps])

    @staticmethod
    def parse(text: str) -> "FloatForm":
        coef_text, *factors = text.split("*")
        coef = Fraction(coef_text) if re.fullmatch(r"-?\d+(/\d+)?", coef_text) else float(coef_text)
        exps = []
        for factor in factors:
            match = re.fullmatch(r"(\w+)\^\((-?\d+(?:/\d+)?)\)", factor)
            if not match:
                raise CaptureError(f"malformed dims_float form {text!r}: factor {factor!r}")
            exps.append((match.group(1), Fraction(match.group(2))))
        return FloatForm(coef, tuple(exps))


class Fitter:
    """Fits values observed at the probe tables (A, B, C) as monomials of the named dims."""

    def __init__(self, tables: Sequence[Dims]):
        if len(tables) != 3:
            raise CaptureError(f"fitting needs exactly 3 probe dims tables, got {len(tables)}")
        self.tables = [dict(t) for t in tables]
        a, b = self.tables[0], self.tables[1]
        self.dims = tuple(a)
        for table in self.tables:
            if min(table.values()) < 2 or len(set(table.values())) != len(table):
                raise CaptureError(f"probe dims table {table} must have every dim >= 2 and distinct values")
        self.ratio = {d: Fraction(b[d], a[d]) for d in self.dims}
        self.prime: dict[str, int] = {}
        for d in self.dims:
            others = set().union(*(_prime_factors(self.ratio[o].numerator) | _prime_factors(self.ratio[o].denominator)
                                   for o in self.dims if o != d))
            private = sorted(_prime_factors(self.ratio[d].numerator) - others)
            if not private:
                raise CaptureError(f"probe tables do not separate dim {d!r}: its ratio {self.ratio[d]} between "
                                   f"tables A and B has no prime factor of its own; use ModelSpec.probe_dims()")
            self.prime[d] = private[0]
        self._ints: dict[tuple, Expr] = {}

    def _exponents(self, r: Fraction, scale: int) -> dict[str, int] | None:
        """Exponents e (times `scale`) with prod(ratio_d^e_d) == r, or None."""
        exps = {}
        for d in self.dims:
            p = self.prime[d]
            step = _valuation(p, self.ratio[d].numerator)
            got = _valuation(p, r.numerator) - _valuation(p, r.denominator)
            if got % step:
                return None
            if got:
                exps[d] = got // step
        if any(abs(e) > MAX_EXPONENT * scale for e in exps.values()):
            return None
        check = Fraction(1)
        for d, e in exps.items():
            check *= self.ratio[d] ** e
        return exps if check == r else None

    def fit_int(self, values: Sequence[int], where: str) -> Expr:
        values = tuple(int(v) for v in values)
        if values in self._ints:
            return self._ints[values]
        if len(set(values)) == 1:
            return self._ints.setdefault(values, Expr.const(values[0]))
        exps = self._exponents(Fraction(values[1], values[0]), 1) if values[0] else None
        fitted = None
        if exps is not None:
            coef = Fraction(values[0])
            for d, e in exps.items():
                coef /= Fraction(self.tables[0][d]) ** e
            fitted = Expr.const(coef) if not exps else Expr({tuple(sorted(exps.items())): coef})
            if any(fitted.eval(t) != v for t, v in zip(self.tables, values)):
                fitted = None
        if fitted is None:
            raise CaptureError(f"{where}: values {list(values)} at the probe dims {self.tables} fit no monomial "
                               f"c*dim^e of the dims {list(self.dims)}; the model's sizes must be products of "
                               f"its named dims")
        return self._ints.setdefault(values, fitted)

    def fit_float(self, values: Sequence[float], where: str) -> FloatForm | None:
        """None if the float is the same at every table; else its form."""
        if len(set(values)) == 1:
            return None
        fail = CaptureError(f"{where}: float values {list(values)} at the probe dims fit no form "
                            f"c*dim^(k/2) of the dims {list(self.dims)}")
        if any(v == 0 or not math.isfinite(v) for v in values) or len({v > 0 for v in values}) != 1:
            raise fail
        # squares of c*dim^(k/2) with rational c are rationals of small height: recover them exactly
        squares = [Fraction(v * v).limit_denominator(10 ** 6) for v in values[:2]]
        if not all(math.isclose(float(q), v * v, rel_tol=FLOAT_RTOL) for q, v in zip(squares, values)):
            raise fail
        twice = self._exponents(squares[1] / squares[0], 2)
        if twice is None:
            raise fail
        exps = tuple((d, Fraction(e, 2)) for d, e in sorted(twice.items()))
        coef = values[0] / FloatForm(1.0, exps).value(self.tables[0])
        exact = Fraction(coef).limit_denominator(10 ** 6)
        form = FloatForm(exact if math.isclose(float(exact), coef, rel_tol=FLOAT_RTOL) else coef, exps)
        if not all(math.isclose(form.value(t), v, rel_tol=1e-9) for t, v in zip(self.tables, values)):
            raise fail
        return form


# -- graphs -----------------------------------------------------------------------------------
def _differs(i: int, what: str, items: Sequence[Any], tables) -> CaptureError:
    shown = "; ".join(f"at {t}: {x}" for t, x in zip(tables, items))
    return CaptureError(f"model is not shape-polymorphic: node {i} differs ({what}) between the probe "
                        f"captures — {shown}. Shape reduction cannot apply; capture at fixed dims instead")


def _fit_attrs(fitter: Fitter, nodes: Sequence[Node], i: int, at: Dims) -> tuple[dict, list[str]]:
    first = nodes[0]
    where = f"node {i} ({first.name} = {first.op})"
    schema = ATTRS.get(first.op, {})
    attrs, forms = {}, []
    for key, value in first.attrs:
        kind = schema[key][0]
        values = [n.attr[key] for n in nodes]
        if kind == "expr":
            attrs[key] = fitter.fit_int([v.const_value() for v in values], f"{where} attribute {key}")
        elif kind == "exprs":
            if len({len(v) for v in values}) != 1:
                raise _differs(i, f"rank of attribute {key}", values, fitter.tables)
            attrs[key] = [fitter.fit_int([v[j].const_value() for v in values], f"{where} attribute {key}[{j}]")
                          for j in range(len(value))]
        elif kind == "float":
            form = fitter.fit_float(values, f"{where} attribute {key}")
            attrs[key] = value if form is None else form.value(at)
            if form is not None:
                forms.append(f"{key}={form}")
        elif len(set(values)) != 1:
            raise _differs(i, f"attribute {key}", values, fitter.tables)
        else:
            attrs[key] = value
    return attrs, forms


def _fit_shape(fitter: Fitter, shapes: Sequence[tuple], i: int, where: str) -> list[Expr]:
    if len({len(s) for s in shapes}) != 1:
        raise _differs(i, "rank", shapes, fitter.tables)
    return [fitter.fit_int([s[j].const_value() for s in shapes], f"{where} shape[{j}]")
            for j in range(len(shapes[0]))]


def fit_graphs(graphs: Sequence[Graph], tables: Sequence[Dims], at: Dims) -> Graph:
    """One graph over the named dims from captures at `tables`; dims-dependent floats evaluated at `at`."""
    fitter = Fitter(tables)
    first = graphs[0]
    if len({len(g.nodes) for g in graphs}) != 1:
        raise CaptureError(f"model is not shape-polymorphic: the probe captures have "
                           f"{[len(g.nodes) for g in graphs]} ops at the probe dims {list(tables)}")
    inputs = []
    for specs in zip(*(g.inputs for g in graphs)):
        s0 = specs[0]
        if len({(s.name, s.dtype, s.role, s.ignore) for s in specs}) != 1:
            raise _differs(-1, "inputs", specs, tables)
        high = None if s0.high is None else fitter.fit_int([s.high.const_value() for s in specs], f"input {s0.name} high")
        inputs.append(replace(s0, shape=tuple(_fit_shape(fitter, [s.shape for s in specs], -1, f"input {s0.name}")),
                              high=high))
    nodes = []
    for i, group in enumerate(zip(*(g.nodes for g in graphs))):
        n0 = group[0]
        for what, key in (("name", lambda n: n.name), ("op", lambda n: n.op), ("args", lambda n: n.args),
                          ("dtype", lambda n: n.dtype), ("attribute names", lambda n: [k for k, _ in n.attrs]),
                          ("provenance", lambda n: n.meta)):
            if len({repr(key(n)) for n in group}) != 1:
                raise _differs(i, what, [key(n) for n in group], tables)
        attrs, forms = _fit_attrs(fitter, group, i, at)
        meta = dict(n0.meta)
        if forms:
            meta["dims_float"] = "; ".join(forms)
        shape = _fit_shape(fitter, [n.shape for n in group], i, f"node {i} ({n0.name} = {n0.op})")
        nodes.append(Node.make(n0.name, n0.op, n0.args, attrs, shape, n0.dtype, meta))
    if len({g.outputs for g in graphs}) != 1:
        raise CaptureError("model is not shape-polymorphic: the probe captures have different outputs")
    return Graph(tuple(inputs), tuple(nodes), first.outputs, first.name)


def instantiate(graph: Graph, dims: Dims) -> Graph:
    """The graph at concrete `dims`: every shape expression evaluated, every dims_float re-evaluated."""
    def const(e: Expr) -> Expr:
        return Expr.const(e.eval(dims))

    inputs = tuple(replace(s, shape=tuple(map(const, s.shape)), high=None if s.high is None else const(s.high))
                   for s in graph.inputs)
    nodes = []
    for node in graph.nodes:
        schema = ATTRS.get(node.op, {})
        attrs = {}
        for key, value in node.attrs:
            kind = schema[key][0]
            attrs[key] = const(value) if kind == "expr" else [const(v) for v in value] if kind == "exprs" else value
        for item in filter(None, (node.get_meta("dims_float") or "").split("; ")):
            key, form = item.split("=", 1)
            attrs[key] = FloatForm.parse(form).value(dims)
        nodes.append(Node.make(node.name, node.op, node.args, attrs, map(const, node.shape), node.dtype, dict(node.meta)))
    return Graph(inputs, tuple(nodes), graph.outputs, graph.name)
