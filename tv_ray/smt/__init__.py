"""Tier 2: term equations as pysmt formulas, raced across warm pysmt solvers (z3, cvc5, yices-smt2).

Solvers are chosen by name ("z3", "cvc5", "yices", as on the command line); a
verdict names the pysmt solver that gave it: "smt:z3", "smt:cvc5",
"smt:yices-smt2" (see `tv_ray.smt.solvers`). `EncodeError` lives in
`tv_ray.errors` (re-exported here and from `tv_ray.smt.encode`).

    >>> from tv_ray.terms import var, add
    >>> from tv_ray.smt import prove
    >>> x = var("x")
    >>> prove(add(x, x), x * 2, solvers=("z3",)).method
    'smt:z3'
"""
from tv_ray.smt.encode import EncodeError, Encoding, encode, encode_all
from tv_ray.smt.portfolio import CheckResult, RaceRecord, SolveRecord, prove, prove_all, prove_with_record, race
from tv_ray.smt.solvers import Backend, SolverBusy, SolverUnavailable, available_solvers, get_solver

__all__ = ["encode", "encode_all", "Encoding", "EncodeError", "prove", "prove_all", "prove_with_record", "race",
           "RaceRecord", "SolveRecord", "CheckResult", "Backend", "SolverBusy", "SolverUnavailable", "available_solvers", "get_solver"]
