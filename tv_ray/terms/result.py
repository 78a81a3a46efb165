"""The three-valued verdicts of the solving tiers: Proved, Refuted(counterexample), Unknown(reason).

Nothing turns Unknown into success: only `Proved` has `.proved == True`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any


@dataclass(frozen=True)
class Proved:
    """The two sides are equal; `method` says how ("normalised"), `axioms` which named axioms were used."""

    method: str
    axioms: tuple[str, ...] = ()
    verdict = "proved"
    proved = True


@dataclass(frozen=True)
class Refuted:
    """The two sides differ at `point` (variable name -> exact rational value).

    `lhs_value` / `rhs_value` are Fractions when both sides are rational there, else mpmath numbers.
    `functions` lists the values the uninterpreted functions took ({name: {args: value}}), so the
    point can be replayed; exp, log and max are the real functions.
    """

    point: dict[str, Fraction]
    lhs_value: Any
    rhs_value: Any
    functions: dict = field(default_factory=dict)
    verdict = "refuted"
    proved = False


@dataclass(frozen=True)
class Unknown:
    """Neither proved nor refuted; `reason` says why (normal forms differ, points agreed, ...)."""

    reason: str
    verdict = "unknown"
    proved = False
