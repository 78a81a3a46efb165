"""Soundness harness: on random terms, a term and its normal form never differ at a random point."""
from __future__ import annotations

import random

import pytest

from tv_ray.terms import Refuted, add, app, const, div, exp, log, max_, mul, normal_form, prove_equal, refute, sub, var
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
    ])
    return build()


@pytest.mark.parametrize("seed", range(6))
def test_normal_form_has_the_value_of_the_term(seed):
    rng = random.Random(seed)
    checked = 0
    for _ in range(40):
        t = random_term(rng, 4)
        try:
            n = normal_form(t)
        except NormaliseError:
            continue
        assert not isinstance(refute(t, n, points=3, seed=seed), Refuted), (t, n)
        # Known gap (not a soundness issue): normal_form is not always idempotent on these random terms.
        checked += 1
    assert checked >= 30
