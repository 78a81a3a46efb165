"""Tier 2: SMT-LIB encoding of term equations, solver backends (z3, cvc5, yices) and the racing portfolio.

    >>> from tv_ray.terms import var, add
    >>> from tv_ray.smt import prove
    >>> x = var("x")
    >>> prove(add(x, x), x * 2, solvers=("z3",)).proved
    True
"""
from tv_ray.smt.encode import EncodeError, Encoding, encode
from tv_ray.smt.portfolio import RaceRecord, SolveRecord, prove, prove_with_record, race
from tv_ray.smt.solvers import CheckResult, Solver, SubprocessSolver, get_solver

__all__ = ["encode", "Encoding", "EncodeError", "prove", "prove_with_record", "race", "RaceRecord", "SolveRecord",
           "CheckResult", "Solver", "SubprocessSolver", "get_solver"]
