"""Shape rules over shape expressions: the same rules give symbolic shapes, and raise where sizes decide."""
from __future__ import annotations

import pytest

from tv_ray.errors import ShapeError, UnknownOpError
from tv_ray.ir.dims import Expr, parse
from tv_ray.ir.graph import Node
from tv_ray.ir.ops import Op
from tv_ray.semantics import Context, rule_for
from tv_ray.semantics.table import instantiate, rule

CTX = Context(axis_sizes={"dp": 2, "tp": 4})
DIMS = {"batch": 8, "seq": 8, "d": 6, "ffn": 12, "heads": 2, "head_dim": 4, "vocab": 10}


def E(*texts):
    return tuple(parse(t) if isinstance(t, str) else Expr.const(t) for t in texts)


def derive(op: Op, shapes, attrs=None, ctx=CTX):
    node = Node.make("n", op, [], attrs or {})
    return rule_for(op).shape([tuple(s) for s in shapes], node.attr, ctx)


# (op, attrs, symbolic input shapes, symbolic result)
SYMBOLIC = [
    (Op.MM, {}, [E("batch*seq", "d"), E("d", "ffn")], E("batch*seq", "ffn")),
    (Op.BMM, {}, [E("heads", "seq", "head_dim"), E("heads", "head_dim", "seq")], E("heads", "seq", "seq")),
    (Op.ADDMM, {}, [E("ffn"), E("batch*seq", "d"), E("d", "ffn")], E("batch*seq", "ffn")),
    (Op.VIEW, {"size": ["batch*seq", -1]}, [E("batch", "seq", "heads*head_dim")], E("batch*seq", "heads*head_dim")),
    (Op.VIEW, {"size": ["batch", "seq", "heads", "head_dim"]}, [E("batch*seq", "heads*head_dim")],
     E("batch", "seq", "heads", "head_dim")),
    (Op.PERMUTE, {"dims": [0, 2, 1]}, [E("batch", "seq", "d")], E("batch", "d", "seq")),
    (Op.EXPAND, {"size": ["batch", -1, "seq"]}, [E("heads", 1)], E("batch", "heads", "seq")),
    (Op.SLICE, {"dim": 1, "start": 0, "end": 2 ** 63 - 1, "step": 1}, [E("batch", "seq")], E("batch", "seq")),
    (Op.SLICE, {"dim": 1, "start": "seq/2", "end": "seq", "step": 1}, [E("batch", "seq")], E("batch", "seq/2")),
    (Op.SLICE, {"dim": -1, "start": 0, "end": "head_dim", "step": 2}, [E("head_dim")], E("head_dim/2")),
    (Op.SELECT, {"dim": 0, "index": "batch - 1"}, [E("batch", "seq")], E("seq")),
    (Op.CAT, {"dim": -1}, [E("seq", "head_dim/2"), E("seq", "head_dim/2")], E("seq", "head_dim")),
    (Op.ADD, {}, [E("batch", 1, "seq"), E("seq")], E("batch", 1, "seq")),
    (Op.WHERE, {}, [E("seq", "seq"), E(), E("batch", 1, 1)], E("batch", "seq", "seq")),
    (Op.SUM, {"dims": [-1], "keepdim": True}, [E("batch", "seq", "d")], E("batch", "seq", 1)),
    (Op.ARANGE, {"start": 0, "end": "seq", "step": 1}, [], E("seq")),
    (Op.FULL, {"size": ["seq", "seq"], "value": 0.0}, [], E("seq", "seq")),
    (Op.NLL_LOSS, {"reduction": "none", "ignore_index": -100}, [E("batch*seq", "vocab"), E("batch*seq")],
     E("batch*seq")),
    (Op.EMBEDDING, {}, [E("vocab", "d"), E("batch", "seq")], E("batch", "seq", "d")),
    (Op.EMBEDDING_BACKWARD, {"num_weights": "vocab"}, [E("batch", "seq", "d"), E("batch", "seq")], E("vocab", "d")),
    (Op.TOPK_INDICES, {"k": 2, "dim": -1}, [E("batch*seq", "vocab + 2")], E("batch*seq", 2)),
    (Op.LOCAL_CHUNK, {"dim": 0, "axes": ["dp", "tp"]}, [E("batch", "seq")], E("batch/8", "seq")),
    (Op.ALL_GATHER, {"dim": 0, "axes": ["tp"]}, [E("batch/4", "seq")], E("batch", "seq")),
    (Op.REDUCE_SCATTER, {"dim": 1, "axes": ["dp"], "reduce": "sum"}, [E("batch", "seq")], E("batch", "seq/2")),
    (Op.ALL_TO_ALL, {"split_dim": 0, "concat_dim": 1, "axes": ["tp"]}, [E("heads*4", "seq/4")], E("heads", "seq")),
    (Op.RECV, {"peer": {"pp": -1}, "size": ["batch", "d"], "dtype": "float"}, [], E("batch", "d")),
    (Op.SEND, {"peer": {"pp": 1}}, [E("batch", "d")], E()),
]


@pytest.mark.parametrize("case", SYMBOLIC, ids=lambda c: f"{c[0]}")
def test_symbolic_shape_rule(case):
    op, attrs, shapes, expected = case
    derived = derive(op, shapes, attrs)
    assert len(derived) == len(expected) and all(a == b for a, b in zip(derived, expected)), derived


@pytest.mark.parametrize("case", SYMBOLIC, ids=lambda c: f"{c[0]}")
def test_symbolic_rule_instantiates_to_the_concrete_rule(case):
    op, attrs, shapes, _ = case
    node = Node.make("n", op, [], attrs)
    symbolic = instantiate(tuple(derive(op, shapes, attrs)), DIMS)
    concrete_attrs = {k: instantiate(v, DIMS) for k, v in node.attrs}
    concrete = rule_for(op).shape([instantiate(tuple(s), DIMS) for s in shapes], concrete_attrs, CTX)
    assert tuple(instantiate(tuple(symbolic), DIMS)) == tuple(concrete)


@pytest.mark.parametrize("op, attrs, shapes, message", [
    (Op.MM, {}, [E("batch", "d"), E("ffn", "d")], "mm: inner dims differ: [batch, d] @ [ffn, d]"),
    (Op.VIEW, {"size": ["batch", "d"]}, [E("batch", "seq")],
     "view of [batch, seq] to [batch, d]: the element counts batch*seq and batch*d differ"),
    (Op.ADD, {}, [E("batch"), E("seq")], "add: shapes [batch] and [seq] do not broadcast (dim -1: batch vs seq)"),
    (Op.LOCAL_CHUNK, {"dim": 0, "axes": ["tp"]}, [E(6, "seq")], "local_chunk: dim 0 of [6, seq] into 4 chunks: "
                                                               "6 is not divisible by 4"),
    (Op.REDUCE_SCATTER, {"dim": 0, "axes": ["dp"], "reduce": "sum"}, [E(3)],
     "reduce_scatter: dim 0 of [3] into 2 chunks: 3 is not divisible by 2"),
    (Op.ALL_REDUCE, {"axes": ["cp"], "reduce": "sum"}, [E(3)],
     "mesh axis 'cp' has no size in this context (known axes: dp, tp); run the program with the plan's mesh"),
    (Op.SLICE, {"dim": 0, "start": 0, "end": 5, "step": 1}, [E("seq")],
     "slice: cannot tell whether 5 <= seq for every size of the dims"),
    (Op.TOPK_VALUES, {"k": "seq", "dim": 0}, [E("vocab")], "topk: k=seq may exceed the size vocab of dim 0 of [vocab]"),
    (Op.PERMUTE, {"dims": [0, 0]}, [E("batch", "seq")], "permute[0, 0] is not a permutation of the 2 dims"),
    (Op.TRANSPOSE, {"dim0": 0, "dim1": 2}, [E("batch", "seq")],
     "transpose: dim 2 is out of range for a tensor of rank 2"),
])
def test_shape_rule_errors_name_the_dims(op, attrs, shapes, message):
    with pytest.raises(ShapeError) as err:
        derive(op, shapes, attrs)
    assert str(err.value) == message


def test_registering_an_op_twice_raises():
    with pytest.raises(Exception, match="op mm already has rules registered"):
        rule(Op.MM, shape=lambda shapes, attrs, ctx: ())


def test_missing_rule_kind_names_the_op():
    with pytest.raises(UnknownOpError, match="^no concrete rule for op send$"):
        rule_for(Op.SEND, "concrete")
    with pytest.raises(UnknownOpError, match="^no group rule for op mm$"):
        rule_for(Op.MM, "group")


def test_every_op_has_shape_and_dtype_rules_and_every_collective_a_group_rule():
    from tv_ray.ir.ops import COLLECTIVES, P2P
    for op in Op:
        rule_for(op, "shape")
        rule_for(op, "dtype")
        if op in COLLECTIVES:
            rule_for(op, "group")
        elif op not in P2P:
            rule_for(op, "concrete")
