"""Layouts through views: cut factors survive merges and splits; impossible splits are refused."""
from __future__ import annotations

import pytest

from tv_ray.errors import ParallelConfigError
from tv_ray.ir.dims import Expr
from tv_ray.parallel.layout import Factor, Layout, view_layout

E = Expr.of
DIMS = {"b": 4, "h": 6, "s": 8, "d": 10}
SIZES = {"dp": 2, "tp": 2}


def test_merge_of_two_cut_dims_keeps_both_factors_and_splits_back():
    x = Layout.make([[Factor(E("b"), ("dp",))], [Factor(E("h"), ("tp",))], [Factor(E("s"))]])
    merged = view_layout(x, (E("b*h"), E("s")), SIZES, DIMS, "v")
    assert merged.dims[0] == (Factor(E("b"), ("dp",)), Factor(E("h"), ("tp",)))
    assert merged.local_shape(SIZES) == (E("b*h/4"), E("s"))
    back = view_layout(merged, (E("b"), E("h"), E("s")), SIZES, DIMS, "v")
    assert back == x


def test_split_keeps_the_cut_on_the_outer_part():
    x = Layout.make([[Factor(E("h*d"), ("tp",))]])
    split = view_layout(x, (E("h"), E("d")), SIZES, DIMS, "v")
    assert split.dims == ((Factor(E("h"), ("tp",)),), (Factor(E("d")),))


def test_split_that_the_cut_does_not_divide_is_refused():
    x = Layout.make([[Factor(E("h*d"), ("tp",))]])
    with pytest.raises(ParallelConfigError) as err:
        view_layout(x, (E("3"), E("2*d")), {"tp": 2}, DIMS, "view v")
    assert str(err.value) == "view v: view splits a dimension cut by tp into 3: 2 does not divide 3 = 3"


def test_uncut_trailing_factors_merge_into_the_cut_one():
    a = Layout.make([[Factor(E("b"), ("dp",)), Factor(E("s"))]])
    b = Layout.make([[Factor(E("b*s"), ("dp",))]])
    assert a == b


def test_partial_max_does_not_pass_through_negation():
    from tv_ray.ir.graph import Node
    from tv_ray.parallel.rules import Env, decide
    x = Layout.make([[Factor(E("b"))]], {"tp": "max"})
    node = Node.make("n", "neg", ["x"], {}, (E("b"),))
    env = Env(SIZES, DIMS, {"x": (E("b"),)}, {"x": True})
    decision = decide(node, [x], env)
    assert decision.inputs[0].partial == () and decision.out.partial == ()


def test_partial_sum_passes_through_negation():
    from tv_ray.ir.graph import Node
    from tv_ray.parallel.rules import Env, decide
    x = Layout.make([[Factor(E("b"))]], {"tp": "sum"})
    node = Node.make("n", "neg", ["x"], {}, (E("b"),))
    env = Env(SIZES, DIMS, {"x": (E("b"),)}, {"x": True})
    assert decide(node, [x], env).out.partial == (("tp", "sum"),)
