"""One-hot indicator variables: how a real value that depends on an integer data element is written.

``onehot:<element>=<v>/<n>`` is 1 when the integer data element (a token id in
[0, n)) equals v, else 0; the indicator of the last value is eliminated
(1 − Σ others) so forms are canonical. Tier 1 draws them one-hot, and a
solver's counterexample counts only if its indicators are one-hot.
"""
from __future__ import annotations

import random
from fractions import Fraction
from typing import Mapping

from tv_ray.terms.term import ONE, Term, sum_, var

PREFIX = "onehot:"


def indicator(base: str, v: int, n: int) -> Term:
    """δ(base = v) for a data element with range [0, n)."""
    if v < n - 1:
        return var(f"{PREFIX}{base}={v}/{n}")
    return ONE - sum_([var(f"{PREFIX}{base}={u}/{n}") for u in range(n - 1)])


def is_indicator(name: str) -> bool:
    return name.startswith(PREFIX)


def parse(name: str) -> tuple[str, int, int]:
    """``onehot:tokens[0,1]=2/4`` -> ("tokens[0,1]", 2, 4)."""
    base, _, rest = name[len(PREFIX):].rpartition("=")
    v, _, n = rest.partition("/")
    return base, int(v), int(n)


def draw(names: list[str], rng: random.Random) -> dict[str, Fraction]:
    """A consistent value for every indicator named: one data value per element, drawn uniformly."""
    chosen: dict[str, int] = {}
    out = {}
    for name in names:
        base, v, n = parse(name)
        if base not in chosen:
            chosen[base] = rng.randrange(n)
        out[name] = Fraction(int(chosen[base] == v))
    return out


def consistent(point: Mapping[str, Fraction]) -> bool:
    """Are the point's indicators 0/1 with at most one 1 per data element?"""
    ones: dict[str, int] = {}
    for name, value in point.items():
        if not is_indicator(name):
            continue
        if value not in (0, 1):
            return False
        if value == 1:
            base = parse(name)[0]
            ones[base] = ones.get(base, 0) + 1
            if ones[base] > 1:
                return False
    return True


__all__ = ["indicator", "is_indicator", "parse", "draw", "consistent", "PREFIX"]
