"""Tier 1: refute an equation by evaluating both sides at random rational points.

Variables get random exact rationals; sums, products and integer powers stay
exact Fractions. `exp` and `log` are the real functions, evaluated with
mpmath at high precision so that every axiom the normaliser uses holds
numerically, `max` is the real max and a routing indicator the real top-k
(`tv_ray.terms.routing`). Every other application is an uninterpreted
function: a random function, memoised so that the same arguments give the
same value on both sides (arguments that are not exact are keyed by their
value rounded well below the working precision).

A mismatch is a counterexample at once: exact for rational values, beyond a
relative tolerance of 10^-(digits/2) otherwise. Agreement at every point is
only Unknown — random points never prove. Points where a denominator is 0,
a log argument is ≤ 0 or an exp argument beyond ±200 are resampled, smaller
after every few of them (a whole layer's backward in one formula leaves exp's
domain at most points of size 24).

    >>> from tv_ray.terms import var, add, mul, const
    >>> x, y = var("x"), var("y")
    >>> refute(add(x, y), mul(const(2), add(x, y))).verdict
    'refuted'
"""
from __future__ import annotations

import random
from fractions import Fraction
from typing import Any, Callable

import mpmath

from tv_ray.terms import onehot, routing
from tv_ray.errors import OutsideDomain
from tv_ray.terms.result import Refuted, Unknown
from tv_ray.terms.term import Kind, Term, postorder

DEFAULT_POINTS = 4
DEFAULT_DIGITS = 60
EXP_LIMIT = 200  # |x| above which exp(x) is not evaluated (the point is resampled)
SHRINKS = 5     # how many times `refute` draws its points 4 times smaller after `points` invalid ones


class _Evaluator:
    """Values of terms at one point; the random functions persist across points of one `refute` call."""

    def __init__(self, rng: random.Random, ctx: mpmath.ctx_mp.MPContext, key_digits: int) -> None:
        self.rng = rng
        self.ctx = ctx
        self.key_digits = key_digits
        self.tiny = ctx.mpf(10) ** (-(ctx.dps - 10))
        self.functions: dict[str, dict[tuple, Fraction]] = {}
        self._kinds: dict[Kind, Callable[[Term, list], Any]] = {
            Kind.CONST: lambda t, _: t.payload,
            Kind.VAR: lambda t, _: self.point[t.payload],
            Kind.ADD: lambda t, vs: self._sum(vs),
            Kind.MUL: lambda t, vs: self._product(vs),
            Kind.POW: lambda t, vs: self._power(vs[0], t.payload),
            Kind.APP: self._app,
        }
        self._apps: dict[str, Callable[[list], Any]] = {
            "exp": self._exp,
            "log": self._log,
            "max": self._max,
        }
        self.point: dict[str, Fraction] = {}

    def evaluate(self, roots: tuple[Term, ...], point: dict[str, Fraction]) -> list:
        self.point = point
        memo: dict[Term, Any] = {}
        for node in postorder(*roots):
            memo[node] = self._kinds[node.kind](node, [memo[a] for a in node.args])
        return [memo[r] for r in roots]

    # exact where possible: Fractions stay Fractions until an mpf joins them
    def _sum(self, vs: list):
        if all(isinstance(v, Fraction) for v in vs):
            return sum(vs, Fraction(0))
        return self.ctx.fsum(self._mpf(v) for v in vs)

    def _product(self, vs: list):
        if all(isinstance(v, Fraction) for v in vs):
            acc = Fraction(1)
            for v in vs:
                acc *= v
            return acc
        return self.ctx.fprod(self._mpf(v) for v in vs)

    def _power(self, v, n: int):
        if n < 0 and self._is_zero(v):
            raise OutsideDomain("zero denominator")
        if isinstance(v, Fraction):
            return v ** n
        return self._mpf(v) ** n

    def _is_zero(self, v) -> bool:
        return v == 0 if isinstance(v, Fraction) else abs(v) < self.tiny

    def _mpf(self, v):
        if isinstance(v, Fraction):
            return self.ctx.mpf(v.numerator) / v.denominator
        return v

    def _app(self, t: Term, vs: list):
        rule = self._apps.get(t.payload)
        if rule is not None:
            return rule(vs)
        routed = routing.parse(t.payload)
        if routed is not None:
            return Fraction(routing.evaluate(*routed, vs))
        table = self.functions.setdefault(f"{t.payload}/{len(vs)}", {})
        key = tuple(self._key(v) for v in vs)
        if key not in table:
            table[key] = Fraction(self.rng.randint(-50, 50), self.rng.randint(1, 13))
        return table[key]

    def _key(self, v) -> str:
        if isinstance(v, Fraction):
            # a rational argument and its high-precision image must share a key
            v = self._mpf(v)
        return self.ctx.nstr(v, self.key_digits)

    def _exp(self, vs: list):
        (v,) = vs
        if isinstance(v, Fraction) and v == 0:
            return Fraction(1)
        if abs(v) > EXP_LIMIT:
            # exp of exp of ... overflows any useful precision; another point is cheaper
            raise OutsideDomain(f"exp argument beyond ±{EXP_LIMIT}")
        return self.ctx.exp(self._mpf(v))

    def _log(self, vs: list):
        (v,) = vs
        if v <= 0 or self._is_zero(v):
            raise OutsideDomain("log of a non-positive value")
        if isinstance(v, Fraction) and v == 1:
            return Fraction(0)
        return self.ctx.log(self._mpf(v))

    def _max(self, vs: list):
        if all(isinstance(v, Fraction) for v in vs):
            return max(vs)
        return max(self._mpf(v) for v in vs)


def _random_point(rng: random.Random, names: list, shrink: int = 1) -> dict:
    """Random rationals (at most 24 / `shrink` in size); one-hot indicators of integer data get a consistent 0/1
    pattern."""
    point = {n: Fraction(rng.randint(-24, 24), rng.randint(1, 7) * shrink) for n in names
             if not onehot.is_indicator(n)}
    point.update(onehot.draw([n for n in names if onehot.is_indicator(n)], rng))
    return point


def refute(lhs: Term, rhs: Term, points: int = DEFAULT_POINTS, seed: int = 0, digits: int = DEFAULT_DIGITS,
           max_tries: int | None = None) -> Refuted | Unknown:
    """Tier 1: Refuted(point, lhs_value, rhs_value) at the first random point where the sides differ, else Unknown.

    Never returns Proved. `points` valid points are tried (invalid ones resampled, up to `max_tries`
    samples in all); the same `seed` gives the same points and the same random functions.

        >>> from tv_ray.terms import var, add, exp, mul
        >>> a, b = var("a"), var("b")
        >>> refute(exp(add(a, b)), mul(exp(a), exp(b))).reason
        'agreed at 4 points'
    """
    rng = random.Random(seed)
    ctx = mpmath.MPContext()
    ctx.dps = digits
    ev = _Evaluator(rng, ctx, key_digits=max(10, (digits * 2) // 3))
    names = sorted((n.payload for n in postorder(lhs, rhs) if n.kind is Kind.VAR), key=str)
    tolerance = ctx.mpf(10) ** (-(digits // 2))
    max_tries = max_tries if max_tries is not None else 16 * points
    valid = 0
    tries = 0
    skipped: list[str] = []
    while valid < points and tries < max_tries:
        tries += 1
        # after every `points` invalid samples the next are drawn 4 times smaller (down to 1/1024)
        point = _random_point(rng, names, shrink=4 ** min(len(skipped) // points, SHRINKS))
        try:
            lv, rv = ev.evaluate((lhs, rhs), point)
        except OutsideDomain as e:
            skipped.append(str(e))
            continue
        valid += 1
        if isinstance(lv, Fraction) and isinstance(rv, Fraction):
            differ = lv != rv
        else:
            l, r = ev._mpf(lv), ev._mpf(rv)
            differ = abs(l - r) > tolerance * max(1, abs(l), abs(r))
        if differ:
            functions = {name: dict(table) for name, table in ev.functions.items()}
            return Refuted(point=point, lhs_value=lv, rhs_value=rv, functions=functions)
    if valid == 0:
        why = sorted(set(skipped))
        return Unknown(f"no valid point in {tries} samples ({'; '.join(why)})")
    note = f" ({tries - valid} samples skipped: {'; '.join(sorted(set(skipped)))})" if skipped else ""
    return Unknown(f"agreed at {valid} points{note}")


__all__ = ["refute", "DEFAULT_POINTS", "DEFAULT_DIGITS"]
