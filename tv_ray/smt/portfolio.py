"""Tier 2: prove `lhs == rhs` for all real values by racing warm pysmt solvers; first definite answer wins.

    >>> from tv_ray.terms import var, mul, add
    >>> x, y = var("x"), var("y")
    >>> prove(mul(add(x, y), add(x, y)), add(x * x, 2 * x * y, y * y), solvers=("z3",)).method
    'smt:z3'

A verdict names the pysmt solver that gave it: "smt:z3", "smt:cvc5" or
"smt:yices-smt2" (see `tv_ray.smt.solvers`); the record of
`prove_with_record` holds every solver's answer, version and time, and the
pysmt version.

Soundness:
- only an "unsat" answer proves, and only after a second query shows the
  assumptions (division guards and lemmas) are satisfiable — otherwise the
  proof would be vacuous;
- a "sat" answer is reported as Refuted only after its model is replayed:
  both sides evaluated exactly (Fractions) at the model's point, with the
  model's values for uninterpreted functions (checked to be a function), and
  found to differ; a model that needs exp/log (real functions the solver saw
  as uninterpreted) or an irrational value does not replay and gives Unknown;
- timeouts, crashes, interrupts, busy or unavailable solvers, and an unsat
  contradicted by another solver's sat, are Unknown with reasons.

Threads: pysmt's formula manager is not thread-safe, so one proof runs at a
time per process (a lock), formulas are asserted and models read in the
calling thread, and only each solver's check runs in a worker thread.
"""
from __future__ import annotations

import os
import queue
import threading
import time
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Callable, Iterable, Sequence

from pysmt.fnode import FNode
from pysmt.shortcuts import Real
from pysmt.smtlib.printers import to_smtlib

from tv_ray.errors import NoReplay
from tv_ray.smt.encode import INTERPRETED, EncodeError, Encoding, encode, encode_all
from tv_ray.smt.solvers import (GRACE_S, LOSER_WAIT_S, PYSMT_VERSION, RECYCLE_AFTER, STATUSES, Backend, get_solver,
                                recycle)
from tv_ray.terms.result import Proved, Refuted, Unknown
from tv_ray.terms.term import Kind, Term, app, fold, mul, postorder, pow_, rebuild

_PROVE_LOCK = threading.Lock()
AT_ZERO_S = 2.0     # the limit on the assumptions' check where every variable is 0
_queries = 0                  # proofs since the pysmt environment was last recycled


def _new_lock() -> None:
    global _PROVE_LOCK
    _PROVE_LOCK = threading.Lock()      # a forked child's: the parent's may have been held by another thread


os.register_at_fork(after_in_child=_new_lock)


@dataclass
class CheckResult:
    """What one solver said about one query; `model` maps symbol name -> value (after "sat")."""

    status: str
    solver: str
    version: str = ""
    reason: str = ""
    model: dict[str, Fraction | str] = field(default_factory=dict)
    seconds: float = 0.0

    def __post_init__(self):
        if self.status not in STATUSES:
            raise ValueError(f"status {self.status!r} is not one of {STATUSES}")


@dataclass
class RaceRecord:
    """What each solver said for one query (for certificates and measurements)."""

    logic: str
    winner: CheckResult | None
    results: list[CheckResult] = field(default_factory=list)
    seconds: float = 0.0


@dataclass
class SolveRecord:
    """The claim's race and, for a proof, the assumption-consistency race."""

    claim: RaceRecord | None = None
    assumptions: RaceRecord | None = None
    pysmt_version: str = PYSMT_VERSION


class _Job:
    """One backend's check in a worker thread; a job abandoned by the race frees its backend itself."""

    def __init__(self, backend: Backend, answers: "queue.Queue", stop_at: float) -> None:
        self.backend = backend
        self.started = time.perf_counter()
        self.stop_at = stop_at              # when to interrupt it
        self.abandon_at: float | None = None
        self.why = ""                       # why it was interrupted
        self._answers = answers
        self._lock = threading.Lock()
        self._done = False
        self._abandoned = False
        threading.Thread(target=self._run, name=f"tv_ray-smt-{backend.solver}", daemon=True).start()

    def _run(self) -> None:
        status, reason = self.backend.solve()
        with self._lock:
            self._done = True
            if not self._abandoned:
                self._answers.put((self, status, reason, time.perf_counter() - self.started))
                return
        self.backend.finish()

    def interrupt(self, why: str) -> None:
        self.why = why
        self.backend.interrupt()
        self.abandon_at = time.perf_counter() + GRACE_S

    def abandon(self) -> bool:
        """Leave the check to finish on its own; False if it already has (its answer is queued)."""
        with self._lock:
            self._abandoned = not self._done
            return self._abandoned


def race(formula: FNode, logic, backends: Sequence[Backend], timeout_s: float,
         symbols: Sequence[FNode] = ()) -> tuple[CheckResult | None, list[CheckResult]]:
    """Check `formula` on every backend at once; return the first sat/unsat answer (or None) and all answers.

    A "sat" answer comes with the values of `symbols`. Then the others are interrupted — a process, whose
    interrupt is a kill and a restart for the next query, only after `LOSER_WAIT_S` more. At the timeout
    the backends are interrupted, those with a timeout of their own `GRACE_S` later. An answer that arrives
    meanwhile still counts (a solver may answer late when another holds the GIL); a check still running
    `GRACE_S` after its interrupt is abandoned (recorded as unknown) and frees its backend when it returns.
    """
    started = time.perf_counter()
    results: list[CheckResult] = []
    answers: "queue.Queue" = queue.Queue()
    pending: list[_Job] = []
    for b in backends:
        t0 = time.perf_counter()
        try:
            b.start(formula, logic, timeout_s)
        except Exception as e:
            results.append(CheckResult("unknown", b.solver, b.version(), f"{type(e).__name__}: {e}"[:500],
                                       seconds=time.perf_counter() - t0))
            continue
        pending.append(_Job(b, answers, started + timeout_s + (GRACE_S if b.own_timeout else 0.0)))

    done: list[_Job] = []
    winner: CheckResult | None = None
    while pending:
        now = time.perf_counter()
        for job in list(pending):
            if job.abandon_at is None and now >= job.stop_at:
                job.interrupt(f"interrupted: {winner.solver} answered first" if winner
                              else f"timeout after {timeout_s:g} s")
            elif job.abandon_at is not None and now >= job.abandon_at and job.abandon():
                pending.remove(job)
                results.append(CheckResult("unknown", job.backend.solver, job.backend.version(),
                                           f"{job.why}; did not stop within {GRACE_S:g} s (abandoned)",
                                           seconds=now - job.started))
        if not pending:
            break
        wake = min(j.stop_at if j.abandon_at is None else j.abandon_at for j in pending)
        try:
            job, status, reason, seconds = answers.get(timeout=max(0.0, wake - time.perf_counter()))
        except queue.Empty:
            continue
        pending.remove(job)
        done.append(job)
        r = CheckResult(status, job.backend.solver, job.backend.version(), reason, seconds=seconds)
        if status == "sat" and winner is None and symbols:
            try:
                r.model = job.backend.values(symbols)
            except Exception as e:
                r = CheckResult("unknown", r.solver, r.version, f"said sat, but its model could not be read: "
                                                                f"{type(e).__name__}: {e}"[:500], seconds=seconds)
        if r.status == "unknown" and (job.why or time.perf_counter() >= started + timeout_s):
            r.reason = f"{job.why or f'timeout after {timeout_s:g} s'} ({r.reason})"
        results.append(r)
        if r.status != "unknown" and winner is None:
            winner = r
            now = time.perf_counter()
            for j in pending:
                j.stop_at = min(j.stop_at, now + (LOSER_WAIT_S if j.backend.interrupt_restarts else 0.0))
    for job in done:
        job.backend.finish()
    return winner, results


def _race_record(enc: Encoding, claim: bool, backends, timeout_s, model: bool = True) -> RaceRecord:
    """`model`: read a "sat" answer's values (for a replay)."""
    start = time.perf_counter()
    winner, results = race(enc.formula(claim), enc.logic, backends, timeout_s,
                           enc.value_symbols if claim and model else ())
    return RaceRecord(str(enc.logic), winner, results, time.perf_counter() - start)


def _assumptions_record(enc: Encoding, backends, timeout_s) -> RaceRecord:
    """Whether the assumptions (guards, lemmas) can hold together: first where every variable is 0 — the solvers
    settle that instance in milliseconds, and a model of it, with the variables 0, is a model of the assumptions —
    then anywhere. In general, the exp / log lemmas of a softmax make a non-linear problem: 3 s for yices, and
    past a 10 s limit on a loaded machine (a clipped cross-entropy's norm on an FSDP × TP mesh, 136 lemmas)."""
    start = time.perf_counter()
    at_zero = enc.formula(False).substitute({symbol: Real(0) for symbol in enc.variables})
    winner, results = race(at_zero, enc.logic, backends, min(timeout_s, AT_ZERO_S))
    if winner is not None and winner.status == "sat":
        return RaceRecord(f"{enc.logic}, variables 0", winner, results, time.perf_counter() - start)
    return _race_record(enc, False, backends, timeout_s)


def _reasons(results: Iterable[CheckResult]) -> str:
    return "; ".join(f"{r.solver}: {r.status} ({r.reason})" for r in results) or "no solver ran"


def prove(lhs: Term, rhs: Term, lemmas: Iterable[tuple[Term, Term]] = (),
          solvers: Sequence[str | Backend] = ("z3", "cvc5", "yices"),
          timeout_s: float = 10) -> Proved | Refuted | Unknown:
    """Tier 2: Proved(method="smt:<solver>"), Refuted(replayed point) or Unknown(reason)."""
    return prove_with_record(lhs, rhs, lemmas, solvers, timeout_s)[0]


def prove_with_record(lhs: Term, rhs: Term, lemmas: Iterable[tuple[Term, Term]] = (),
                      solvers: Sequence[str | Backend] = ("z3", "cvc5", "yices"),
                      timeout_s: float = 10) -> tuple[Proved | Refuted | Unknown, SolveRecord]:
    """`prove`, plus what every solver answered (versions, timings, reasons) and the pysmt version."""
    lemmas = tuple(lemmas)
    return _proof(lambda: encode(*_taken_out(lemmas, lhs, rhs), lemmas), lemmas, solvers, timeout_s,
                  lambda enc, winner: replay(enc, lhs, rhs, lemmas, winner))


def prove_all(equations: Iterable[tuple[Term, Term]], lemmas: Iterable[tuple[Term, Term]] = (),
              solvers: Sequence[str | Backend] = ("z3", "cvc5", "yices"), timeout_s: float = 10) -> Proved | Unknown:
    """Every equation in one query (`encode_all`): Proved when none differs anywhere its sides are defined, as `prove`
    proves one (the assumptions shown consistent — every equation's guards at once). A point where one differs is
    not replayed: Unknown, and `prove` on each names the equation and replays it. One solver call for a stage key's
    equations instead of one each: a key of 512 took 1.1 s so, 11.8 s one by one (llama3-405b, 16 layers)."""
    lemmas = tuple(lemmas)
    equations = tuple(_taken_out(lemmas, *pair) for pair in equations)
    return _proof(lambda: encode_all(equations, lemmas), lemmas, solvers, timeout_s, None)[0]


def roots_squared(*roots: Term) -> tuple[Term, ...]:
    """The terms with each product of square roots of one argument taken out — sqrt(a)ⁿ as a^⌊n/2⌋ (times sqrt(a)
    for odd n, n of either sign; a power of a product as the product of powers), ``pow[0.5]`` as ``sqrt`` —: the
    ground lemmas `ground_lemmas` gives the solvers
    (sqrt(a)·sqrt(a) = a, pow[0.5](a) = sqrt(a)), applied before they run; they hold wherever both sides are
    defined, as every equation here does. Left to the solvers, products of roots are non-linear arithmetic they
    time out on: a clipped gradient's global norm on an FSDP × TP mesh sums 84 squares of roots of parts."""
    memo: dict[Term, Term] = {}

    def visit(node: Term, args: list[Term]) -> Term:
        if node.kind is Kind.APP and node.payload == "pow[0.5]":
            return app("sqrt", *args)
        if node.kind is Kind.MUL or node.kind is Kind.POW:
            if node.kind is Kind.MUL:
                factors = [(a, 1) for a in args]
            elif args[0].kind is Kind.MUL:
                factors = [(a, node.payload) for a in args[0].args]
            else:
                factors = [(args[0], node.payload)]
            powers: dict[Term, int] = {}
            rest = []
            for base, n in factors:
                if base.kind is Kind.POW and _root(base.args[0]):
                    base, n = base.args[0], base.payload * n
                if _root(base):
                    powers[base] = powers.get(base, 0) + n
                else:
                    rest.append(pow_(base, n))
            if any(abs(n) >= 2 for n in powers.values()):
                for root, n in powers.items():
                    half, odd = divmod(n, 2)
                    rest += [pow_(root.args[0], half), pow_(root, odd)]
                return mul(*rest)
        return rebuild(node, args)
    return tuple(fold(root, visit, memo) for root in roots)


def _taken_out(lemmas: tuple, *roots: Term) -> tuple[Term, ...]:
    """`roots_squared` where the lemmas hold a square root's (`ground_lemmas` gives one for every root in the
    equations); the terms as they are otherwise — no pass over every query's terms."""
    if any(a.kind is Kind.MUL and _root(a.args[0]) for a, _ in lemmas):
        return roots_squared(*roots)
    return roots


def _root(term: Term) -> bool:
    return term.kind is Kind.APP and term.payload == "sqrt"


def _proof(make: Callable[[], Encoding], lemmas: tuple, solvers: Sequence[str | Backend], timeout_s: float,
           refute: Callable[[Encoding, CheckResult], Refuted | Unknown] | None) \
        -> tuple[Proved | Refuted | Unknown, SolveRecord]:
    """Race the query `make` encodes; an unsat answer proves once the assumptions are shown consistent. `refute`: a
    "sat" answer's verdict from its model (None: Unknown, no model read)."""
    record = SolveRecord()
    backends = [s if isinstance(s, Backend) else get_solver(s) for s in solvers]
    if not backends:
        return Unknown("no solver given"), record
    global _queries
    with _PROVE_LOCK:
        _queries += 1
        if _queries > RECYCLE_AFTER and recycle():
            _queries = 1
        try:
            enc = make()
        except EncodeError as e:
            return Unknown(f"not encoded: {e}"), record
        record.claim = _race_record(enc, True, backends, timeout_s, model=refute is not None)
        winner = record.claim.winner
        if winner is None:
            return Unknown(f"no solver answered: {_reasons(record.claim.results)}"), record
        if winner.status == "sat" and refute is None:
            return Unknown(f"{winner.solver} found a point where some equation's sides differ (not replayed: "
                           f"prove each alone to name it)"), record
        if winner.status == "sat":
            return refute(enc, winner), record
        if any(r.status == "sat" for r in record.claim.results):
            return Unknown(f"solvers disagree: {_reasons(record.claim.results)}"), record
        # unsat: the proof counts only if the assumptions can hold together
        if enc.guards or enc.carried or enc.lemmas:
            record.assumptions = _assumptions_record(enc, backends, timeout_s)
            w = record.assumptions.winner
            if w is None:
                return Unknown(f"{winner.solver} said unsat, but no solver showed the assumptions (guards, "
                               f"lemmas) consistent: {_reasons(record.assumptions.results)}"), record
            if w.status == "unsat":
                guards = [to_smtlib(g, daggify=False) for g in enc.guards + enc.carried]
                return Unknown(f"assumptions are inconsistent ({w.solver}): guards {guards} and {len(lemmas)} "
                               f"lemma(s) hold nowhere, so the proof would be vacuous"), record
    axioms = tuple(f"lemma:{a.key[:16]}={b.key[:16]}" for a, b in lemmas)
    return Proved(method=f"smt:{winner.solver}", axioms=axioms), record


# -- replay ------------------------------------------------------------------------------------

def replay(enc: Encoding, lhs: Term, rhs: Term, lemmas: Sequence[tuple[Term, Term]],
           answer: CheckResult) -> Refuted | Unknown:
    """Refuted if the model of a "sat" answer, evaluated exactly, makes the sides differ; else Unknown."""
    try:
        point = {}
        for sym, name in enc.variables.items():
            point[name] = _rational(answer.model.get(sym.symbol_name(), Fraction(0)), name)
        app_value = {}
        for sym, node in enc.applications.items():
            if node.payload in INTERPRETED:
                raise NoReplay(f"the model gives {node.payload} (a real function, uninterpreted for the "
                                f"solver) arbitrary values")
            if sym.symbol_name() not in answer.model:
                raise NoReplay(f"no value for application {sym.symbol_name()}")
            app_value[node] = _rational(answer.model[sym.symbol_name()], sym.symbol_name())
        values, functions = _evaluate((lhs, rhs) + tuple(t for p in lemmas for t in p), point, app_value)
    except NoReplay as e:
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
    raise NoReplay(f"{what} = {v} is not rational")


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
                raise NoReplay("a denominator is 0 at the model's point")
            v = vs[0] ** node.payload
        elif node.payload == "max":
            v = max(vs)
        else:
            v = app_value[node]
            table = functions.setdefault(f"{node.payload}/{len(vs)}", {})
            args = tuple(vs)
            if table.setdefault(args, v) != v:
                raise NoReplay(f"{node.payload}{args} has two values in the model")
        memo[node] = v
    return [memo[r] for r in roots], functions


__all__ = ["prove", "prove_all", "prove_with_record", "race", "replay", "CheckResult", "RaceRecord", "SolveRecord", "GRACE_S"]
