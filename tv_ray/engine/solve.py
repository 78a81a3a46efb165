"""Solving one unique obligation through the tiers: normalise (0), random points (1), SMT portfolio (2).

An obligation is a list of equations ``lhs[i] == rhs[i]``. Tier 0 proves the
equations whose two sides are the very same (interned) term — by reflexivity,
method ``identical`` (a stage whose like terms were collected, such as the
loss summed over a whole batch in two associations) — and those whose normal
forms agree; tier 1 looks for a point where one of the
rest fails (a counterexample at once); tier 2 races the solvers on the
equations still open, with the ground lemmas the normaliser can state (each
exp / log application equals its normal form): all of them in one query
(`prove_all`), else each alone — which names the one that fails. The verdict is `proved` only when every equation was
proved by a tier that proves; `refuted` when one equation has a replayed
counterexample; otherwise `unknown` with the reason — never a guess.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Sequence

from tv_ray.certificate.outcome import Status, Verdict
from tv_ray.errors import SettingsError
from tv_ray.smt import prove_all, prove_with_record
from tv_ray.smt.solvers import BACKENDS
from tv_ray.terms import Refuted, Term, refute
from tv_ray.terms.normal import NormaliseError, Normaliser, ground_lemmas
from tv_ray.terms.onehot import consistent



@dataclass(frozen=True)
class Budget:
    """Which tiers may run and how long a solver may take per equation. Raises SettingsError for a solver
    that does not exist or a timeout that is not a positive number of seconds."""

    solvers: tuple[str, ...] = ("z3", "cvc5", "yices")
    timeout_s: float = 10.0
    tiers: tuple[int, ...] = (0, 1, 2)
    points: int = 4
    seed: int = 0

    def __post_init__(self):
        unknown = [s for s in self.solvers if s not in BACKENDS]
        if unknown or not self.solvers:
            raise SettingsError(f"solvers {','.join(self.solvers) or '(none)'}: "
                                f"{'unknown ' + ', '.join(map(repr, unknown)) if unknown else 'none given'}; "
                                f"choose from {','.join(BACKENDS)}", setting="solvers")
        if not (isinstance(self.timeout_s, (int, float)) and math.isfinite(self.timeout_s) and self.timeout_s > 0):
            raise SettingsError(f"timeout {self.timeout_s!r}: a solver timeout must be a positive number of "
                                f"seconds", setting="timeout")


def _refuted(i: int, r: Refuted, tier: int, method: str, started: float) -> Verdict:
    return Verdict.of(r, tier, time.perf_counter() - started, element=i, method=method)


def solve(lhs: Sequence[Term], rhs: Sequence[Term], budget: Budget = Budget()) -> Verdict:
    """The verdict of ``lhs[i] == rhs[i] for all i`` (over the reals, for every value of every variable)."""
    started = time.perf_counter()
    open_ = list(range(len(lhs)))
    axioms: set[str] = set()
    methods: set[str] = set()
    tier = 0
    if 0 in budget.tiers:
        open_ = [i for i in open_ if lhs[i] is not rhs[i]]
        if len(open_) < len(lhs):
            methods.add("identical")
        norm = Normaliser()
        still = []
        for i in open_:
            try:
                equal = norm.normalise(lhs[i]) == norm.normalise(rhs[i])
            except NormaliseError:
                equal = False
            if not equal:
                still.append(i)
                if 1 in budget.tiers and len(still) == 1:
                    # the first equation the normaliser cannot close: a counterexample now saves the rest
                    r = refute(lhs[i], rhs[i], points=budget.points, seed=budget.seed)
                    if isinstance(r, Refuted):
                        return _refuted(i, r, 1, "random-point", started)
        if len(still) < len(open_):
            methods.add("normalised")
            axioms |= set(norm.axioms)
        open_ = still
    if open_ and 1 in budget.tiers:
        tier = 1
        for i in open_:
            r = refute(lhs[i], rhs[i], points=budget.points, seed=budget.seed)
            if isinstance(r, Refuted):
                return _refuted(i, r, 1, "random-point", started)
    reasons: list[str] = []
    if open_ and 2 in budget.tiers:
        tier = 2
        if len(open_) > 1:
            equations = [(lhs[i], rhs[i]) for i in open_]
            lemmas, used = ground_lemmas(*(t for pair in equations for t in pair))
            result = prove_all(equations, lemmas, budget.solvers, budget.timeout_s)
            if result.proved:
                methods.add(result.method)
                axioms |= set(result.axioms) | (set(used) if lemmas else set())
                open_ = []
        still = []
        for i in open_:
            lemmas, used = ground_lemmas(lhs[i], rhs[i])
            result, _ = prove_with_record(lhs[i], rhs[i], lemmas, budget.solvers, budget.timeout_s)
            if result.proved:
                methods.add(result.method)
                axioms |= set(result.axioms) | (set(used) if lemmas else set())
            elif isinstance(result, Refuted) and consistent(result.point):
                return _refuted(i, result, 2, "smt", started)
            else:
                still.append(i)
                reasons.append(getattr(result, "reason", "a solver model that is not a valid data assignment"))
        open_ = still
    seconds = time.perf_counter() - started
    method = "+".join(sorted(methods)) or "none"
    if not open_:
        return Verdict(Status.PROVED, tier, method, seconds, tuple(sorted(axioms)))
    i = open_[0]
    why = reasons[0] if reasons else "normal forms differ and no counterexample was found"
    return Verdict(Status.UNKNOWN, tier, method, seconds, tuple(sorted(axioms)),
                   reason=f"{len(open_)} of {len(lhs)} equation(s) open; equation {i}: {why}")


__all__ = ["Verdict", "Budget", "solve"]   # Verdict: tv_ray.certificate.outcome's
