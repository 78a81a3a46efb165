"""Like terms collected: the same value as the term (random terms, random points), a fixed point, and the parts
of a partial claim summed whole collapse to the claimed tensor."""
from __future__ import annotations

import random

import pytest

from tv_ray.terms import Refuted, add, app, const, mul, neg, normal_form, prove_equal, refute, sub, sum_, var
from tv_ray.terms.linear import collect
from tv_ray.terms.normal import NormaliseError

from .test_normal_form_sound import random_term


@pytest.mark.parametrize("seed", range(10))
def test_collected_terms_have_the_value_of_the_term_and_are_a_fixed_point(seed):
    rng = random.Random(seed)
    for _ in range(40):
        t = random_term(rng, 4)
        c = collect(t)
        assert collect(c) is c, (t, c)
        assert not isinstance(refute(t, c, points=3, seed=seed), Refuted), (t, c)
        try:
            normal_form(t)
        except NormaliseError:
            continue
        assert prove_equal(t, c).proved, (t, c)


def test_every_part_of_a_partial_claim_summed_is_the_claimed_tensor():
    g = var("grad[0,0]")
    parts = [var(f"part#{p}[0,0]") for p in range(511)]
    last = sub(g, sum_(parts))                      # the last member's part: the tensor minus the others'
    by_tp = [sum_(parts[t * 64:(t + 1) * 64]) for t in range(7)] + [add(sum_(parts[448:]), last)]
    total = sum_(by_tp)                             # a dp all-reduce on each tp rank, then the tp sum
    assert len(total.args) == 513                   # the 511 parts, the tensor, and (-1)·(the 511 parts)
    assert collect(total) is g


def test_what_is_not_a_sum_or_a_constant_multiple_is_kept_as_built():
    x, y = var("x"), var("y")
    inner = add(x, neg(x), y)                       # the constructors keep x + (-1)·x
    kept = mul(inner, app("exp", inner))
    assert collect(kept) is kept
    assert collect(add(kept, mul(const(3), kept), const(2), const(-2))) is mul(const(4), kept)
    assert collect(add(x, neg(add(x, y)))) is neg(y)
    assert collect(sub(x, x)) is const(0)
