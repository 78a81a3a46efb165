"""An SMT-LIB 2 process around a pysmt solver: `python serve.py cvc5` answers on stdout like a solver binary.

Why: cvc5's python API holds the GIL while it checks and cannot be interrupted
(its `tlimit-per` does not stop every procedure), so inside the prover's
process it would stall a race for as long as it runs. Behind this process it
is driven by pysmt's `SmtLibSolver` like yices-smt2: it runs in parallel with
the other solvers and is killed at the timeout or when another solver wins.

Commands are read with pysmt's `SmtLibParser` and run on pysmt's own solver
(`CVC5Solver`), one set-logic per process. Every command is answered
(`success`, `sat` / `unsat` / `unknown`, a get-value list, or
`(error "...")`), so the parent never waits on a command it cannot tell
apart. Run as a file, not as `-m tv_ray.smt.serve`: importing the tv_ray
package would load far more than pysmt and the solver (seconds per start).

    $ printf '(set-logic QF_LRA)(declare-fun x () Real)(assert (< x x))(check-sat)\\n' | python serve.py cvc5
    success
    success
    success
    unsat
"""
from __future__ import annotations

import sys

import pysmt.smtlib.commands as smtcmd
from pysmt.environment import get_env
from pysmt.exceptions import SolverReturnedUnknownResultError
from pysmt.smtlib.parser import SmtLibParser
from pysmt.smtlib.printers import to_smtlib


def _cvc5(logic):
    from pysmt.solvers.cvcfive import CVC5Solver
    return CVC5Solver(get_env(), logic, generate_models=True, incremental=True)


SOLVERS = {"cvc5": _cvc5}
FORWARDED_OPTIONS = {":tlimit-per"}   # options passed on to the solver; the rest are the protocol's own


class Session:
    """The state of one process: its solver, created by set-logic."""

    def __init__(self, make) -> None:
        self.make = make
        self.solver = None

    def _solver(self):
        if self.solver is None:
            raise RuntimeError("no set-logic before this command")
        return self.solver

    def set_logic(self, cmd) -> str:
        if self.solver is not None:
            raise RuntimeError("set-logic twice (one logic per process)")
        self.solver = self.make(cmd.args[0])
        return "success"

    def set_option(self, cmd) -> str:
        name, value = cmd.args
        if name in FORWARDED_OPTIONS:
            self._solver().set_option(name[1:], str(value))
        return "success"

    def assert_(self, cmd) -> str:
        self._solver().add_assertion(cmd.args[0])
        return "success"

    def push(self, cmd) -> str:
        self._solver().push(int(cmd.args[0]) if cmd.args else 1)
        return "success"

    def pop(self, cmd) -> str:
        self._solver().pop(int(cmd.args[0]) if cmd.args else 1)
        return "success"

    def check_sat(self, cmd) -> str:
        try:
            return "sat" if self._solver().solve() else "unsat"
        except SolverReturnedUnknownResultError:
            return "unknown"

    def get_value(self, cmd) -> str:
        solver = self._solver()
        pairs = (f"({to_smtlib(t, daggify=False)} {to_smtlib(solver.get_value(t), daggify=False)})"
                 for t in cmd.args)
        return "(" + " ".join(pairs) + ")"

    def declared(self, cmd) -> str:  # the parser has made the symbol already
        return "success"

    HANDLERS = {smtcmd.SET_LOGIC: set_logic, smtcmd.SET_OPTION: set_option, smtcmd.ASSERT: assert_,
                smtcmd.PUSH: push, smtcmd.POP: pop, smtcmd.CHECK_SAT: check_sat, smtcmd.GET_VALUE: get_value,
                smtcmd.DECLARE_FUN: declared, smtcmd.DECLARE_CONST: declared}

    def answer(self, cmd) -> str:
        handler = self.HANDLERS.get(cmd.name)
        if handler is None:
            raise RuntimeError(f"unsupported command {cmd.name}")
        return handler(self, cmd)


def _error(e: Exception) -> str:
    text = f"{type(e).__name__}: {e}".replace('"', '""').replace("\n", " ")
    return f'(error "{text}")'


def serve(name: str, stdin=sys.stdin, stdout=sys.stdout) -> int:
    """Answer the commands on `stdin` with solver `name` until exit or end of input."""
    session = Session(SOLVERS[name])
    commands = SmtLibParser(interactive=True).get_command_generator(stdin)
    while True:
        try:
            cmd = next(commands)
        except StopIteration:
            return 0
        except Exception as e:  # unreadable input: the stream's position is lost, so stop after saying why
            stdout.write(_error(e) + "\n")
            stdout.flush()
            return 1
        if cmd.name == smtcmd.EXIT:
            return 0
        try:
            out = session.answer(cmd)
        except Exception as e:
            out = _error(e)
        stdout.write(out + "\n")
        stdout.flush()


if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.argv[1] not in SOLVERS:
        sys.exit(f"usage: python {sys.argv[0]} {{{'|'.join(SOLVERS)}}}")
    sys.exit(serve(sys.argv[1]))
