"""The fast JSON decoder of ops agrees with the checked one on every input, including the ones it declines."""
from __future__ import annotations

import copy
import itertools

import pytest

from plan.mlp_plans import dp_plan, pp_plan, tp_plan, zero_plan
from tv_ray.errors import GraphError, PlanError
from tv_ray.ir.dims import Expr
from tv_ray.ir.graph import Node, _node_fast, decode_attr

# Values that JSON can produce and that are easy to confuse: True == 1 == 1.0 in Python.
ODD = [True, False, 1, 1.0, 2.5, 0, -1, "", "x", "batch", "batch/2", "1+", "inf", None, [], {}, [True], [1.0],
       [1, 2], ["batch", 4], ["d", True], ["tp"], [""], {"pp": 1}, {"pp": True}]


def corpus_ops() -> list[dict]:
    ops = []
    for build in (tp_plan, dp_plan, zero_plan, pp_plan):
        obj = build()
        ops += obj["logical"]["ops"]
        for program in obj["programs"].values():
            ops += program["ops"]
    return ops


def variants(op: dict):
    """The op itself and the op with each field (and each attribute) replaced by each odd value or removed."""
    yield op
    for key in ("out", "op", "args", "attrs", "shape", "dtype", "meta", "extra"):
        without = {k: v for k, v in op.items() if k != key}
        yield without
        for value in ODD:
            yield {**copy.deepcopy(without), key: copy.deepcopy(value)}
    for key in op.get("attrs", {}):
        for value in ODD:
            yield {**op, "attrs": {**op["attrs"], key: copy.deepcopy(value)}}
    yield {**op, "meta": {"mb": [1, 2], "module": "m"}}
    yield {**op, "args": op["args"] + ["extra"]}


def outcome(decode, obj):
    try:
        return decode(obj)
    except (GraphError, PlanError) as err:
        return type(err), str(err)


@pytest.mark.parametrize("cls", [GraphError, PlanError])
def test_fast_path_builds_the_checked_node_or_declines(cls):
    checked = fast = 0
    for op in corpus_ops():
        for obj in variants(op):
            reference = outcome(lambda o: Node._from_json_checked(o, "p.ops[3]", cls), obj)
            node = _node_fast(obj)
            if node is not None:
                fast += 1
                assert node == reference, obj
                assert [type(v) for _, v in node.attrs] == [type(v) for _, v in reference.attrs], obj
            assert outcome(lambda o: Node.from_json(o, "p.ops[3]", cls), obj) == reference
            checked += 1
    assert fast > 100 and checked > 5 * fast    # both paths exercised


def test_cached_shapes_do_not_admit_bools_or_floats():
    assert decode_attr("exprs", [1, "batch"], "s") == (Expr.const(1), Expr.dim("batch"))
    for bad in ([True, "batch"], [1.0, "batch"]):
        with pytest.raises(GraphError, match=r"^s\[0\]: expected expr, got "):
            decode_attr("exprs", bad, "s")
    decode_attr("expr", 1, "s")
    with pytest.raises(GraphError, match=r"^s: expected expr, got True$"):
        decode_attr("expr", True, "s")
    assert decode_attr("float", 2, "s") == 2.0 and type(decode_attr("float", 2, "s")) is float
    with pytest.raises(GraphError, match=r"^s: expected a number, got True$"):
        decode_attr("float", True, "s")


def test_equal_shapes_share_one_tuple():
    a = Node.from_json({"out": "a", "op": "neg", "args": ["x"], "shape": ["batch", 4]}, "")
    b = Node.from_json({"out": "b", "op": "neg", "args": ["a"], "shape": ["batch", 4]}, "")
    assert a.shape is b.shape


def test_every_odd_value_pair_decodes_like_the_checked_path():
    for kind, value in itertools.product(("int", "float", "bool", "str", "expr", "exprs", "ints", "axes", "peer"),
                                         ODD):
        fast = outcome(lambda v: decode_attr(kind, v, "w"), value)
        reference = outcome(lambda v: _reference_decode(kind, v), value)
        assert fast == reference and type(fast) is type(reference), (kind, value)


def _reference_decode(kind, value):
    """decode_attr with the fast table emptied: the checked ladder alone."""
    from tv_ray.ir import graph
    saved = dict(graph._FAST_DECODE)
    graph._FAST_DECODE.clear()
    try:
        return decode_attr(kind, value, "w")
    finally:
        graph._FAST_DECODE.update(saved)
