"""Property tests: broadcasting agrees with numpy; view and permute round trips give back the input."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tv_ray.errors import ShapeError
from tv_ray.ir.dims import Expr
from tv_ray.ir.ops import Op
from tv_ray.semantics import Context, rule_for
from tv_ray.semantics.shapes import broadcast

CTX = Context()
small_shape = st.lists(st.integers(1, 4), min_size=0, max_size=4).map(tuple)


def _numpy_broadcast_or_shape_error(a, b, ours):
    """numpy's broadcast shape of a and b; when numpy refuses, check that `ours` raises ShapeError (-> None)."""
    try:
        return np.broadcast_shapes(a, b)
    except ValueError:
        with pytest.raises(ShapeError):
            ours()
        return None


@settings(max_examples=200, deadline=None)
@given(small_shape, small_shape)
def test_broadcast_agrees_with_numpy(a, b):
    expected = _numpy_broadcast_or_shape_error(a, b, lambda: broadcast([a, b], "add"))
    if expected is None:
        return
    assert broadcast([a, b], "add") == expected
    x, y = np.ones(a), np.full(b, 2.0)
    out = rule_for(Op.ADD, "concrete").concrete([x, y], {}, CTX)
    assert out.shape == expected == rule_for(Op.ADD).shape([a, b], {}, CTX)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.sampled_from(["batch", "seq", 1]), min_size=0, max_size=3),
       st.lists(st.sampled_from(["batch", "seq", 1]), min_size=0, max_size=3))
def test_symbolic_broadcast_instantiates_like_numpy(a_names, b_names):
    dims = {"batch": 2, "seq": 3}
    a, b = (tuple(Expr.of(n) for n in names) for names in (a_names, b_names))
    concrete_a, concrete_b = (tuple(Expr.of(n).eval(dims) for n in names) for names in (a_names, b_names))
    expected = _numpy_broadcast_or_shape_error(concrete_a, concrete_b, lambda: broadcast([a, b], "mul"))
    if expected is None:
        return
    assert tuple(Expr.of(d).eval(dims) for d in broadcast([a, b], "mul")) == expected


@st.composite
def array_and_permutation(draw):
    shape = draw(st.lists(st.integers(1, 4), min_size=1, max_size=4))
    perm = draw(st.permutations(range(len(shape))))
    negative = draw(st.booleans())
    dims = [p - len(shape) if negative else p for p in perm]
    return np.arange(int(np.prod(shape)), dtype=np.float64).reshape(shape), dims


@settings(max_examples=100, deadline=None)
@given(array_and_permutation())
def test_permute_then_inverse_permute_is_identity(case):
    x, dims = case
    permute = rule_for(Op.PERMUTE)
    forward = {"dims": tuple(dims)}
    inverse = {"dims": tuple(int(i) for i in np.argsort([d % x.ndim for d in dims]))}
    y = permute.concrete([x], forward, CTX)
    assert y.shape == permute.shape([x.shape], forward, CTX)
    back = permute.concrete([y], inverse, CTX)
    np.testing.assert_array_equal(back, x)
    assert permute.shape([permute.shape([x.shape], forward, CTX)], inverse, CTX) == x.shape


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(1, 4), min_size=1, max_size=4), st.data())
def test_view_round_trip_through_any_factorisation(shape, data):
    x = np.arange(int(np.prod(shape)), dtype=np.float64).reshape(shape)
    other = data.draw(st.permutations(shape))  # same element count, other layout
    infer = data.draw(st.integers(-1, len(other) - 1))
    size = tuple(-1 if i == infer else d for i, d in enumerate(other))
    view = rule_for(Op.VIEW)
    y = view.concrete([x], {"size": size}, CTX)
    assert y.shape == view.shape([x.shape], {"size": size}, CTX) == tuple(other)
    back = view.concrete([y], {"size": tuple(shape)}, CTX)
    np.testing.assert_array_equal(back, x)
