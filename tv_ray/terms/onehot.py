"""One-hot indicator variables: how a real value that depends on an integer data element is written.

The indicator of the value v of an integer data element (a token id in
[0, n)) is the variable named ``element.indicator(v, n)`` (an `Atom`, text
``onehot:<element>=<v>/<n>``): 1 when the element equals v, else 0; the
indicator of the last value is eliminated (1 − Σ others) so forms are
canonical. Tier 1 draws them one-hot, and a solver's counterexample counts
only if its indicators are one-hot.
"""
from __future__ import annotations

import random
from fractions import Fraction
from typing import Mapping

from tv_ray.terms.atom import Atom
from tv_ray.terms.term import ONE, Term, sum_, var


def indicator(element: Atom, v: int, n: int) -> Term:
    """δ(element = v) for a data element with range [0, n)."""
    if v < n - 1:
        return var(element.indicator(v, n))
    return ONE - sum_([var(element.indicator(u, n)) for u in range(n - 1)])


def is_indicator(name) -> bool:
    """Is the variable name (a str or an Atom) a one-hot indicator?"""
    return isinstance(name, Atom) and name.onehot is not None


def draw(names: list[Atom], rng: random.Random) -> dict[Atom, Fraction]:
    """A consistent value for every indicator named: one data value per element, drawn uniformly."""
    chosen: dict[Atom, int] = {}
    out = {}
    for name in names:
        v, n = name.onehot
        if name.element not in chosen:
            chosen[name.element] = rng.randrange(n)
        out[name] = Fraction(int(chosen[name.element] == v))
    return out


def consistent(point: Mapping) -> bool:
    """Are the point's indicators 0/1 with at most one 1 per data element?"""
    ones: dict[Atom, int] = {}
    for name, value in point.items():
        if not is_indicator(name):
            continue
        if value not in (0, 1):
            return False
        if value == 1:
            ones[name.element] = ones.get(name.element, 0) + 1
            if ones[name.element] > 1:
                return False
    return True


__all__ = ["indicator", "is_indicator", "draw", "consistent"]
