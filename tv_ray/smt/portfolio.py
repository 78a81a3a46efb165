"""Tier 2: prove `lhs == rhs` for all real values by racing SMT solvers; first definite answer wins.

    >>> from tv_ray.terms import var, mul, add
    >>> x, y = var("x"), var("y")
    >>> prove(mul(add(x, y), add(x, y)), add(x * x, 2 * x * y, y * y), solvers=("z3",)).method
    'smt:z3'

Soundness:
- only an "unsat" answer proves, and only after a second query shows the
  assumptions (division guards and lemmas) are satisfiable — otherwise the
  proof would be vacuous;
- a "sat" answer is reported as Refuted only after its model is replayed:
  both sides evaluated exactly (Fractions) at the model's point, with the
  model's values for uninterpreted functions (checked to be a function), and
  found to differ; a model that needs exp/log (real functions the solver saw
  as uninterpreted) or an irrational value does not replay and gives Unknown;
- timeouts, crashes, interrupts and disagreements are Unknown with reasons.
"""
from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Iterable, Sequence

from tv_ray.smt.encode import INTERPRETED, EncodeError, Encoding, encode
from tv_ray.smt.solvers import CheckResult, Solver, get_solver
from tv_ray.terms.result import Proved, Refuted, Unknown
from tv_ray.terms.term import Kind, Term, postorder

GRACE_S = 1.0  # how long past the timeout a backend may take to notice it before it is abandoned


@dataclass
class RaceRecord:
    """What each solver said for one query (for certificates and measurements)."""

    key: str
    logic: str
    winner: CheckResult | None
    results: list[CheckResult] = field(default_factory=list)
    seconds: float = 0.0


@dataclass
class SolveRecord:
    """The claim's race and, for a proof, the assumption-consistency race."""

    claim: RaceRecord | None = None
    assumptions: RaceRecord | None = None


def _resolve(solvers: Sequence[str | Solver]) -> list[Solver]:
    return [s if isinstance(s, Solver) else get_solver(s) for s in solvers]


def race(text: str, backends: Sequence[Solver], timeout_s: float) -> tuple[CheckResult | None, list[CheckResult]]:
    """Run every backend on `text` at once; return the first sat/unsat answer (or None) and all answers seen.

    Losers are interrupted; a backend still running `GRACE_S` after the timeout
    is abandoned and recorded as unknown.
    """
    answers: "queue.Queue[CheckResult]" = queue.Queue()

    def run(b: Solver) -> None:
        answers.put(b.check(text, timeout_s))

    threads = []
    for b in backends:
        t = threading.Thread(target=run, args=(b,), name=f"tv_ray-smt-{b.name}", daemon=True)
        t.start()
        threads.append(t)
    deadline = time.monotonic() + timeout_s + GRACE_S
    seen: list[CheckResult] = []
    winner = None
    while len(seen) < len(backends):
        left = deadline - time.monotonic()
        if left <= 0:
            break
        try:
            r = answers.get(timeout=left)
        except queue.Empty:
            break
        seen.append(r)
        if r.status in ("sat", "unsat"):
            winner = r
            break
    for b in backends:
        if b.name not in {r.solver for r in seen}:
            try:
                b.interrupt()
            except Exception:  # noqa: BLE001 — a loser that cannot be stopped still ends at its timeout
                pass
    if winner is None:
        answered = {r.solver for r in seen}
        for b in backends:
            if b.name not in answered:
                seen.append(CheckResult("unknown", b.name, reason=f"did not stop within {timeout_s:g} s "
                                                                   f"+ {GRACE_S:g} s grace (abandoned)"))
    return winner, seen


def _race_record(enc: Encoding, backends, timeout_s) -> RaceRecord:
    start = time.perf_counter()
    winner, results = race(enc.text, backends, timeout_s)
    return RaceRecord(enc.key, enc.logic, winner, results, time.perf_counter() - start)


def _reasons(results: Iterable[CheckResult]) -> str:
    return "; ".join(f"{r.solver}: {r.status} ({r.reason})" for r in results) or "no solver ran"


def prove(lhs: Term, rhs: Term, lemmas: Iterable[tuple[Term, Term]] = (),
          solvers: Sequence[str | Solver] = ("z3", "cvc5", "yices"), timeout_s: float = 10) -> Proved | Refuted | Unknown:
    """Tier 2: Proved(method="smt:<solver>"), Refuted(replayed point) or Unknown(reason)."""
    return prove_with_record(lhs, rhs, lemmas, solvers, timeout_s)[0]


def prove_with_record(lhs: Term, rhs: Term, lemmas: Iterable[tuple[Term, Term]] = (),
                      solvers: Sequence[str | Solver] = ("z3", "cvc5", "yices"),
                      timeout_s: float = 10) -> tuple[Proved | Refuted | Unknown, SolveRecord]:
    """`prove`, plus what every solver answered (versions, timings, reasons)."""
    lemmas = tuple(lemmas)
    record = SolveRecord()
    try:
        enc = encode(lhs, rhs, lemmas)
    except EncodeError as e:
        return Unknown(f"not encoded: {e}"), record
    backends = _resolve(solvers)
    if not backends:
        return Unknown("no solver given"), record
    record.claim = _race_record(enc, backends, timeout_s)
    winner = record.claim.winner
    if winner is None:
        return Unknown(f"no solver answered: {_reasons(record.claim.results)}"), record
    if winner.status == "sat":
        return replay(enc, lhs, rhs, lemmas, winner), record
    # unsat: the proof counts only if the assumptions can hold together
    axioms = tuple(f"lemma:{a.key[:16]}={b.key[:16]}" for a, b in lemmas)
    if enc.guards or lemmas:
        record.assumptions = _race_record(encode(lhs, rhs, lemmas, claim=False), backends, timeout_s)
        w = record.assumptions.winner
        if w is None:
            return Unknown(f"{winner.solver} said unsat, but no solver showed the assumptions (guards, lemmas) "
                           f"consistent: {_reasons(record.assumptions.results)}"), record
        if w.status == "unsat":
            return Unknown(f"assumptions are inconsistent ({w.solver}): guards {list(enc.guards)} and "
                           f"{len(lemmas)} lemma(s) hold nowhere, so the proof would be vacuous"), record
    return Proved(method=f"smt:{winner.solver}", axioms=axioms), record


# -- replay ------------------------------------------------------------------------------------

class _NoReplay(Exception):
    pass


def replay(enc: Encoding, lhs: Term, rhs: Term, lemmas: Sequence[tuple[Term, Term]],
           answer: CheckResult) -> Refuted | Unknown:
    """Refuted if the model of a "sat" answer, evaluated exactly, makes the sides differ; else Unknown."""
    try:
        point = {}
        for sym, name in enc.variables.items():
            point[name] = _rational(answer.model.get(sym, Fraction(0)), name)
        app_value = {}
        for sym, node in enc.applications.items():
            if node.payload in INTERPRETED:
                raise _NoReplay(f"the model gives {node.payload} (a real function, uninterpreted for the "
                                f"solver) arbitrary values")
            if sym not in answer.model:
                raise _NoReplay(f"no value for application {sym}")
            app_value[node] = _rational(answer.model[sym], sym)
        values, functions = _evaluate((lhs, rhs) + tuple(t for p in lemmas for t in p), point, app_value)
    except _NoReplay as e:
        return Unknown(f"solver model did not replay ({answer.solver}): {e}")
    lv, rv = values[0], values[1]
    for i in range(len(lemmas)):
        if values[2 + 2 * i] != values[3 + 2 * i]:
            return Unknown(f"solver model did not replay ({answer.solver}): lemma {i} is false at the model")
    if lv == rv:
        return Unknown(f"solver model did not replay ({answer.solver}): both sides are {lv} at the model's point")
    return Refuted(point=point, lhs_value=lv, rhs_value=rv, functions=functions)


def _rational(v, what: str) -> Fraction:
    if isinstance(v, Fraction):
        return v
    raise _NoReplay(f"{what} = {v} is not rational")


def _evaluate(roots: tuple[Term, ...], point: dict[str, Fraction], app_value: dict[Term, Fraction]):
    memo: dict[Term, Fraction] = {}
    functions: dict[str, dict[tuple, Fraction]] = {}
    for node in postorder(*roots):
        k = node.kind
        vs = [memo[a] for a in node.args]
        if k is Kind.CONST:
            v = node.payload
        elif k is Kind.VAR:
            v = point[node.payload]
        elif k is Kind.ADD:
            v = sum(vs, Fraction(0))
        elif k is Kind.MUL:
            v = Fraction(1)
            for x in vs:
                v *= x
        elif k is Kind.POW:
            if vs[0] == 0 and node.payload < 0:
                raise _NoReplay("a denominator is 0 at the model's point")
            v = vs[0] ** node.payload
        elif node.payload == "max":
            v = max(vs)
        else:
            v = app_value[node]
            table = functions.setdefault(f"{node.payload}/{len(vs)}", {})
            args = tuple(vs)
            if table.setdefault(args, v) != v:
                raise _NoReplay(f"{node.payload}{args} has two values in the model")
        memo[node] = v
    return [memo[r] for r in roots], functions


__all__ = ["prove", "prove_with_record", "race", "replay", "RaceRecord", "SolveRecord", "GRACE_S"]
