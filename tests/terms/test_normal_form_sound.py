"""Soundness and canonicity harness: on random terms, a term and its normal form never differ at a
random point, and the normal form is a fixed point of normal_form (normal forms are canonical)."""
from __future__ import annotations

import random

import pytest

from tv_ray.terms import (Refuted, add, app, const, div, exp, log, max_, mul, normal_form, pow_, prove_equal, refute,
                          sub, var)
from tv_ray.terms.normal import NormaliseError

LEAVES = [var("x"), var("y"), var("z"), const(2), const(-1), const("1/3")]


def random_term(rng: random.Random, depth: int):
    if depth == 0 or rng.random() < 0.2:
        return rng.choice(LEAVES)
    a, b = random_term(rng, depth - 1), random_term(rng, depth - 1)
    build = rng.choice([
        lambda: add(a, b), lambda: sub(a, b), lambda: mul(a, b), lambda: div(a, b), lambda: exp(a),
        lambda: exp(sub(a, b)), lambda: log(add(exp(a), exp(b))), lambda: log(mul(a, b)), lambda: max_(a, b),
        lambda: max_(b, max_(a, b)), lambda: app("tanh", a), lambda: log(div(exp(a), add(exp(b), const(1)))),
        # the shapes behind the idempotency bugs: a scaled inverse inverted again, a sum over a monomial
        lambda: div(const(2), div(a, b)), lambda: div(b, mul(a, add(a, b))),
    ])
    return build()


SEEDS = 25
TERMS_PER_SEED = 40  # 1000 random terms in all


@pytest.mark.parametrize("seed", range(SEEDS))
def test_normal_form_has_the_value_of_the_term_and_is_a_fixed_point(seed):
    rng = random.Random(seed)
    checked = 0
    for _ in range(TERMS_PER_SEED):
        t = random_term(rng, 4)
        try:
            n = normal_form(t)
        except NormaliseError:
            continue
        assert normal_form(n) is n, (t, n, normal_form(n))
        assert prove_equal(t, n).proved, (t, n)
        assert not isinstance(refute(t, n, points=3, seed=seed), Refuted), (t, n)
        checked += 1
    assert checked >= 0.7 * TERMS_PER_SEED


x, y, z = var("x"), var("y"), var("z")
Q = add(x, y)

# Minimised from the harness failures of the first normaliser (normal_form(n) != n).
FIXED_POINT_REGRESSIONS = [
    # (P^-1)^-1 with a constant: the monomial inverse left (P^-1)^-1, which prints as the unexpanded sum P
    ("inverse_of_scaled_inverse", div(const(1), div(const(2), Q))),
    ("inverse_of_inverse_times_atom", mul(z, pow_(mul(const(-1), pow_(log(add(exp(const(-1)), exp(const("1/3")))),
                                                                         -1)), -1))),
    ("inverse_of_inverse_of_max", mul(const(2), pow_(mul(pow_(add(z, y), -1), max_(const("1/3"), const(2))), -1))),
    # leading coefficient picked before dividing out the common monomial: P was not primitive
    ("lead_after_common_monomial", div(const(1), add(div(log(add(exp(const(-1)), exp(x))), x), div(const(-1), x)))),
    ("lead_after_common_exp", div(const(1), mul(sub(exp(sub(const(2), z)), y), exp(const("-5/3"))))),
    ("lead_after_common_in_log", log(add(mul(exp(z), exp(x)), mul(const(2), exp(x))))),
]


@pytest.mark.parametrize("name,term", FIXED_POINT_REGRESSIONS, ids=[c[0] for c in FIXED_POINT_REGRESSIONS])
def test_normal_form_is_a_fixed_point_on_minimised_failures(name, term):
    n = normal_form(term)
    assert normal_form(n) is n, (term, n, normal_form(n))
    assert not isinstance(refute(term, n, points=4), Refuted)


def test_scaled_inverse_inverted_is_the_expanded_polynomial_and_still_cancels():
    assert normal_form(div(const(1), div(const(2), Q))) is normal_form(add(div(x, const(2)), div(y, const(2))))
    # the inverse atom is kept while multiplying, so Q^-1 · (2·Q^-1)^-1 still cancels to ½
    assert prove_equal(mul(pow_(Q, -1), pow_(mul(const(2), pow_(Q, -1)), -1)), const("1/2")).proved


def test_a_denominator_that_cancels_only_after_expansion_is_a_division_by_zero():
    zero = sub(pow_(mul(const(2), pow_(Q, -1)), -1), div(Q, const(2)))
    with pytest.raises(NormaliseError):
        normal_form(div(const(1), zero))
    with pytest.raises(NormaliseError):
        normal_form(log(zero))
