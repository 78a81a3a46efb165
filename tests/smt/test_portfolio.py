"""Tier 2: encoding, backends and the portfolio on the shared term corpus, plus every failure mode."""
from __future__ import annotations

import os
import sys
import time
from fractions import Fraction

import pytest

from tests.terms.corpus import BY_NAME, CASES
from tv_ray.smt.encode import encode
from tv_ray.smt.portfolio import prove, prove_with_record
from tv_ray.smt.solvers import CheckResult, Solver, SubprocessSolver, get_solver, parse_output
from tv_ray.terms import Kind, add, const, div, exp, from_table, log, mul, neg, postorder, pow_, sub, to_table, var

SOLVERS = ("z3", "cvc5", "yices")


def _has_exp_log(*terms):
    return any(n.kind is Kind.APP and n.payload in ("exp", "log") for n in postorder(*terms))


POLY_PROVED = [c for c in CASES if c[3] in ("proved", "gap") and not _has_exp_log(c[1], c[2])]
POLY_BUGS = [c for c in CASES if c[3] == "bug" and not _has_exp_log(c[1], c[2])]
EXP_BUGS = [c for c in CASES if c[3] == "bug" and _has_exp_log(c[1], c[2])]


def _exact(term, point, functions=None):
    """Independent exact evaluation (no uninterpreted functions except from `functions`)."""
    memo = {}
    for n in postorder(term):
        vs = [memo[a] for a in n.args]
        if n.kind is Kind.CONST:
            memo[n] = n.payload
        elif n.kind is Kind.VAR:
            memo[n] = point[n.payload]
        elif n.kind is Kind.ADD:
            memo[n] = sum(vs, Fraction(0))
        elif n.kind is Kind.MUL:
            v = Fraction(1)
            for x in vs:
                v *= x
            memo[n] = v
        elif n.kind is Kind.POW:
            memo[n] = vs[0] ** n.payload
        elif n.payload == "max":
            memo[n] = max(vs)
        else:
            memo[n] = functions[f"{n.payload}/{len(vs)}"][tuple(vs)]
    return memo[term]


# -- proofs -------------------------------------------------------------------------------------

@pytest.mark.parametrize("solver", SOLVERS)
@pytest.mark.parametrize("case", POLY_PROVED, ids=lambda c: c[0])
def test_polynomial_identities_proved_by_each_solver(case, solver):
    _, lhs, rhs, _ = case
    result = prove(lhs, rhs, solvers=(solver,), timeout_s=10)
    assert result.verdict == "proved", result
    assert result.method == f"smt:{solver}"


@pytest.mark.parametrize("case", POLY_PROVED, ids=lambda c: c[0])
def test_polynomial_identities_proved_by_portfolio(case):
    _, lhs, rhs, _ = case
    result, record = prove_with_record(lhs, rhs, timeout_s=10)
    assert result.proved, result
    assert result.method in {f"smt:{s}" for s in SOLVERS}
    assert all(r.version for r in record.claim.results)


# -- refutations --------------------------------------------------------------------------------

@pytest.mark.parametrize("solver", SOLVERS + ("portfolio",))
@pytest.mark.parametrize("case", POLY_BUGS, ids=lambda c: c[0])
def test_bugs_refuted_with_replayed_point(case, solver):
    _, lhs, rhs, _ = case
    solvers = SOLVERS if solver == "portfolio" else (solver,)
    result = prove(lhs, rhs, solvers=solvers, timeout_s=10)
    assert not result.proved
    if result.verdict == "refuted":
        assert result.lhs_value == _exact(lhs, result.point, result.functions)
        assert result.rhs_value == _exact(rhs, result.point, result.functions)
        assert result.lhs_value != result.rhs_value
    else:
        assert result.verdict == "unknown"


def test_wrong_scale_bug_is_refuted_by_exactly_two():
    _, lhs, rhs, _ = BY_NAME["dp_grad_sum_not_avg"]
    result = prove(lhs, rhs, solvers=("z3",), timeout_s=10)
    assert result.verdict == "refuted", result
    assert result.lhs_value == 2 * result.rhs_value != 0


@pytest.mark.parametrize("case", EXP_BUGS, ids=lambda c: c[0])
def test_exp_log_bugs_never_proved(case):
    _, lhs, rhs, _ = case
    result = prove(lhs, rhs, timeout_s=5)
    assert result.verdict == "unknown"
    assert "did not replay" in result.reason


# -- guards, lemmas, vacuity --------------------------------------------------------------------

def test_x_over_x_is_proved_only_under_its_guard():
    x = var("x")
    enc = encode(div(x, x), const(1))
    assert "(assert (not (= x0 0.0)))" in enc.text
    assert enc.guards == ("(not (= x0 0.0))",)
    assert prove(div(x, x), const(1), solvers=("z3",)).proved
    # without the guard the claim is false at 0 (SMT-LIB's x/0 is unspecified): z3 finds it
    unguarded = enc.text.replace("(assert (not (= x0 0.0)))\n", "")
    assert get_solver("z3").check(unguarded, 5).status == "sat"


def test_identically_zero_denominator_is_not_a_vacuous_proof():
    x = var("x")
    lhs = div(x, add(x, neg(x)))   # x/(x - x): defined nowhere
    result = prove(lhs, const(5), solvers=("z3", "yices"))
    assert result.verdict == "unknown"
    assert "inconsistent" in result.reason


def test_division_by_constant_zero_is_unknown():
    x = var("x")
    result = prove(mul(x, pow_(const(0), -1)), x, solvers=("z3",))
    assert result.verdict == "unknown" and "constant 0" in result.reason


def test_inconsistent_lemma_is_not_a_proof():
    x, y = var("x"), var("y")
    result = prove(x, y, lemmas=[(x, add(x, const(1)))], solvers=("z3",))
    assert result.verdict == "unknown" and "inconsistent" in result.reason


def test_ground_lemmas_prove_max_cancelled_log_sum_exp():
    a, b, m = var("a"), var("b"), var("m")
    s = add(exp(a), exp(b))
    lhs = add(log(add(exp(sub(a, m)), exp(sub(b, m)))), m)
    rhs = log(s)
    assert prove(lhs, rhs, solvers=("z3",)).verdict == "unknown"
    lemmas = [(exp(sub(a, m)), div(exp(a), exp(m))), (exp(sub(b, m)), div(exp(b), exp(m))),
              (log(div(s, exp(m))), sub(log(s), m))]
    for solver in SOLVERS:
        result = prove(lhs, rhs, lemmas=lemmas, solvers=(solver,))
        assert result.proved, (solver, result)
        assert len(result.axioms) == 3


def test_encoding_is_deterministic_and_keyed():
    _, lhs, rhs, _ = BY_NAME["tp2_mlp_all_reduce"]
    a = encode(lhs, rhs)
    lhs2, rhs2 = from_table(to_table(lhs, rhs))
    b = encode(lhs2, rhs2)
    assert a.text == b.text and a.key == b.key and len(a.key) == 64
    assert a.logic == "QF_UFNRA"
    x, y = var("x"), var("y")
    assert encode(add(x, y), mul(const(2), x)).logic == "QF_LRA"


# -- failing backends ---------------------------------------------------------------------------

class Sleeper(Solver):
    """Ignores its timeout entirely."""
    name = "sleeper"

    def _check(self, text, timeout_s):
        time.sleep(timeout_s + 30)
        return CheckResult("unsat", self.name)


class Raiser(Solver):
    name = "raiser"

    def _check(self, text, timeout_s):
        raise RuntimeError("segfault-ish")


class Garbage(Solver):
    name = "garbage"

    def _check(self, text, timeout_s):
        return "unsat"


class Invented(Solver):
    name = "invented"

    def _check(self, text, timeout_s):
        return CheckResult("proved", self.name)


class LyingSat(Solver):
    """Says sat with a model that does not make the sides differ."""
    name = "liar"

    def _check(self, text, timeout_s):
        return CheckResult("sat", self.name, model={})


def test_hanging_backend_is_abandoned_at_the_timeout():
    x = var("x")
    start = time.perf_counter()
    result = prove(add(x, x), mul(const(2), x), solvers=(Sleeper(),), timeout_s=0.5)
    assert result.verdict == "unknown" and "abandoned" in result.reason
    assert time.perf_counter() - start < 3


def test_hanging_subprocess_is_killed_at_the_timeout():
    hang = SubprocessSolver("hang", [sys.executable, "-c", "import time; time.sleep(60)"])
    x = var("x")
    start = time.perf_counter()
    result = prove(add(x, x), mul(const(2), x), solvers=(hang,), timeout_s=0.5)
    assert time.perf_counter() - start < 3
    assert result.verdict == "unknown" and "timeout" in result.reason and "killed" in result.reason
    with pytest.raises(ProcessLookupError):
        os.kill(hang.last_pid, 0)


def test_losing_subprocess_is_killed_when_another_solver_answers():
    hang = SubprocessSolver("hang", [sys.executable, "-c", "import time; time.sleep(60)"])
    x = var("x")
    start = time.perf_counter()
    result = prove(add(x, x), mul(const(2), x), solvers=(hang, "z3"), timeout_s=20)
    assert result.method == "smt:z3"
    time.sleep(0.2)
    assert time.perf_counter() - start < 5
    with pytest.raises(ProcessLookupError):
        os.kill(hang.last_pid, 0)


@pytest.mark.parametrize("backend", [Raiser(), Garbage(), Invented(), LyingSat()], ids=lambda b: b.name)
def test_broken_backend_gives_unknown(backend):
    x, y = var("x"), var("y")
    for lhs, rhs in ((add(x, y), add(y, x)), (x, y)):
        result = prove(lhs, rhs, solvers=(backend,), timeout_s=2)
        assert result.verdict == "unknown", result


@pytest.mark.parametrize("output,status", [
    ("unsat\n", "unsat"), ("sat\n((x0 (- (/ 1 3))))\n", "sat"), ("(error \"bad\")\nunsat\n", "unknown"),
    ("Segmentation fault\n", "unknown"), ("", "unknown"), ("unsat (((", "unknown"), ("timeout\n", "unknown"),
])
def test_solver_output_parsing_never_invents_unsat(output, status):
    r = parse_output("fake", output, ["x0"])
    assert r.status == status, r
    if status == "sat":
        assert r.model == {"x0": Fraction(-1, 3)}


def test_missing_yices_binary_is_unknown_and_portfolio_still_answers():
    missing = SubprocessSolver("yices", ["/nonexistent/yices-smt2"], ["/nonexistent/yices-smt2", "--version"])
    x, y = var("x"), var("y")
    r = missing.check("(declare-fun x () Real)(assert (< x x))", 2)
    assert r.status == "unknown" and "not found" in r.reason
    result = prove(mul(add(x, y), add(x, y)), add(mul(x, x), mul(const(2), x, y), mul(y, y)),
                   solvers=(missing, "z3"))
    assert result.proved and result.method == "smt:z3"


def test_subprocess_binary_printing_errors_is_unknown():
    bad = SubprocessSolver("bad", [sys.executable, "-c", "print('(error \"no\")'); print('unsat')"])
    x, y = var("x"), var("y")
    result = prove(x, y, solvers=(bad,), timeout_s=5)
    assert result.verdict == "unknown" and "solver error" in result.reason


def test_versions_are_recorded():
    for name in SOLVERS:
        r = get_solver(name).check("(set-logic QF_LRA)(declare-fun x () Real)(assert (< x x))", 5)
        assert r.status == "unsat" and r.version and "unavailable" not in r.version, r
