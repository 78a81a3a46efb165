"""Every op's concrete rule against the equivalent torch op in float64; shape and dtype rules against the result."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tv_ray.ir.graph import Node
from tv_ray.ir.ops import COLLECTIVES, Op
from tv_ray.semantics import Context, instantiate_attrs, rule_for
from tv_ray.semantics.shapes import known_le
from tv_ray.semantics.table import dtype_name

aten = torch.ops.aten
END = 2 ** 63 - 1  # ATen's "to the end"
NLL_REDUCTION = {"none": 0, "mean": 1, "sum": 2}
CTX = Context(axis_sizes={"dp": 2, "tp": 3}, coords={"dp": 1, "tp": 2})


# Input makers: each takes a numpy Generator and returns an array.
def R(*shape):
    return lambda rng: rng.standard_normal(shape)


def P(*shape):  # positive floats
    return lambda rng: rng.uniform(0.5, 2.0, shape)


def I(high, *shape):  # ints in [0, high)
    return lambda rng: rng.integers(0, high, shape)


def B(*shape):
    return lambda rng: rng.random(shape) < 0.5


def A(values, dtype=np.int64):  # a fixed array
    return lambda rng: np.array(values, dtype=dtype)


# (op, attrs, inputs, torch function of the input tensors)
CASES = [
    (Op.FULL, {"size": [2, 3], "value": 1.5}, [], lambda: torch.full((2, 3), 1.5, dtype=torch.float64)),
    (Op.FULL, {"size": [4], "value": 3, "dtype": "int"}, [], lambda: torch.full((4,), 3)),
    (Op.FULL_LIKE, {"value": 2.0}, [R(2, 3)], lambda x: torch.full_like(x, 2.0)),
    (Op.ARANGE, {"start": 2, "end": 11, "step": 3}, [], lambda: torch.arange(2, 11, 3)),
    (Op.ARANGE, {"start": 0, "end": 5, "step": 1, "dtype": "float"}, [],
     lambda: torch.arange(0, 5, 1, dtype=torch.float64)),
    (Op.TRIU, {"diagonal": 1}, [R(4, 5)], lambda x: torch.triu(x, 1)),
    (Op.TRIU, {"diagonal": -1}, [R(2, 4, 4)], lambda x: torch.triu(x, -1)),
    (Op.MM, {}, [R(3, 4), R(4, 5)], torch.mm),
    (Op.BMM, {}, [R(2, 3, 4), R(2, 4, 5)], torch.bmm),
    (Op.ADDMM, {}, [R(5), R(3, 4), R(4, 5)], torch.addmm),
    (Op.VIEW, {"size": [6, -1]}, [R(2, 3, 4)], lambda x: x.view(6, -1)),
    (Op.PERMUTE, {"dims": [2, 0, 1]}, [R(2, 3, 4)], lambda x: x.permute(2, 0, 1)),
    (Op.PERMUTE, {"dims": [-1, 0, 1]}, [R(2, 3, 4)], lambda x: x.permute(-1, 0, 1)),
    (Op.TRANSPOSE, {"dim0": 0, "dim1": -1}, [R(2, 3, 4)], lambda x: x.transpose(0, -1)),
    (Op.EXPAND, {"size": [2, 3, 4]}, [R(3, 1)], lambda x: x.expand(2, 3, 4)),
    (Op.EXPAND, {"size": [2, -1, 4]}, [R(3, 1)], lambda x: x.expand(2, -1, 4)),
    (Op.UNSQUEEZE, {"dim": -1}, [R(2, 3)], lambda x: x.unsqueeze(-1)),
    (Op.UNSQUEEZE, {"dim": 0}, [R(2, 3)], lambda x: x.unsqueeze(0)),
    (Op.SQUEEZE, {"dim": 1}, [R(2, 1, 3)], lambda x: x.squeeze(1)),
    (Op.SQUEEZE, {"dim": 0}, [R(2, 1, 3)], lambda x: x.squeeze(0)),
    (Op.CLONE, {}, [R(2, 3)], torch.clone),
    (Op.SLICE, {"dim": 1, "start": 1, "end": END, "step": 2}, [R(3, 6)], lambda x: aten.slice(x, 1, 1, END, 2)),
    (Op.SLICE, {"dim": -1, "start": -3, "end": -1, "step": 1}, [R(3, 6)], lambda x: aten.slice(x, -1, -3, -1)),
    (Op.SLICE, {"dim": 0, "start": 5, "end": 9, "step": 1}, [R(3, 6)], lambda x: aten.slice(x, 0, 5, 9)),
    (Op.SLICE_BACKWARD, {"input_size": [2, 5], "dim": 1, "start": 1, "end": 5, "step": 2}, [R(2, 2)],
     lambda g: aten.slice_backward(g, [2, 5], 1, 1, 5, 2)),
    (Op.SELECT, {"dim": 1, "index": -1}, [R(2, 3, 4)], lambda x: x.select(1, -1)),
    (Op.SELECT, {"dim": 0, "index": 2}, [R(4)], lambda x: x.select(0, 2)),
    (Op.CAT, {"dim": 0}, [R(1, 3), R(2, 3), R(3, 3)], lambda *xs: torch.cat(xs, 0)),
    (Op.CAT, {"dim": -1}, [R(2, 1), R(2, 4)], lambda *xs: torch.cat(xs, -1)),
    (Op.NEG, {}, [R(2, 3)], torch.neg),
    (Op.NEG, {}, [I(5, 4)], torch.neg),
    (Op.RSQRT, {}, [P(2, 3)], torch.rsqrt),
    (Op.SQRT, {}, [P(2, 3)], torch.sqrt),
    (Op.RECIPROCAL, {}, [P(2, 3)], torch.reciprocal),
    (Op.EXP, {}, [R(2, 3)], torch.exp),
    (Op.LOG, {}, [P(2, 3)], torch.log),
    (Op.SIGMOID, {}, [R(2, 3)], torch.sigmoid),
    (Op.SILU, {}, [R(2, 3)], F.silu),
    (Op.GELU, {"approximate": "none"}, [R(2, 3)], lambda x: F.gelu(x)),
    (Op.GELU, {"approximate": "tanh"}, [R(2, 3)], lambda x: F.gelu(x, approximate="tanh")),
    (Op.TANH, {}, [R(2, 3)], torch.tanh),
    (Op.COS, {}, [R(2, 3)], torch.cos),
    (Op.SIN, {}, [R(2, 3)], torch.sin),
    (Op.ABS, {}, [R(2, 3)], torch.abs),
    (Op.CAST, {"dtype": "int"}, [A([[-2.7, 3.9], [0.2, -0.5]], np.float64)], lambda x: x.to(torch.int64)),
    (Op.CAST, {"dtype": "float"}, [I(9, 2, 3)], lambda x: x.to(torch.float64)),
    (Op.CAST, {"dtype": "bool"}, [A([0.0, 1.5, -2.0], np.float64)], lambda x: x.to(torch.bool)),
    (Op.ADD, {"alpha": 2.0}, [R(3, 1), R(4)], lambda a, b: torch.add(a, b, alpha=2.0)),
    (Op.ADD, {"other": 3.0}, [R(2, 3)], lambda x: x + 3.0),
    (Op.ADD, {"other": 2}, [I(5, 4)], lambda x: x + 2),
    (Op.SUB, {}, [R(2, 3), R(2, 3)], torch.sub),
    (Op.SUB, {"other": 0.5, "alpha": 3.0}, [R(2, 3)], lambda x: torch.sub(x, 0.5, alpha=3.0)),
    (Op.MUL, {}, [R(2, 1, 3), R(4, 1)], torch.mul),
    (Op.MUL, {"other": 0.125}, [R(2, 3)], lambda x: x * 0.125),
    (Op.DIV, {}, [R(2, 3), P(3)], torch.div),
    (Op.DIV, {}, [I(9, 4), A([1, 2, 3, 4])], torch.div),
    (Op.DIV, {"other": 8.0}, [R(2, 3)], lambda x: x / 8.0),
    (Op.POW, {"exponent": 2.0}, [R(2, 3)], lambda x: torch.pow(x, 2.0)),
    (Op.POW, {"exponent": 0.5}, [P(2, 3)], lambda x: torch.pow(x, 0.5)),
    (Op.POW, {"exponent": 3}, [I(5, 4)], lambda x: torch.pow(x, 3)),
    (Op.POW, {"base": 2.0}, [R(2, 3)], lambda x: torch.pow(2.0, x)),
    (Op.POW, {}, [P(2, 3), R(3)], torch.pow),
    (Op.MAXIMUM, {}, [R(2, 3), R(3)], torch.maximum),
    (Op.MINIMUM, {}, [R(2, 3), R(2, 1)], torch.minimum),
    (Op.CLAMP, {"min": -0.5, "max": 0.5}, [R(3, 4)], lambda x: torch.clamp(x, -0.5, 0.5)),
    (Op.CLAMP, {"min": 0.0}, [R(3, 4)], lambda x: torch.clamp(x, min=0.0)),
    (Op.CLAMP, {"min": 1.0, "max": -1.0}, [R(3, 4)], lambda x: torch.clamp(x, 1.0, -1.0)),
    (Op.EQ, {}, [I(3, 4, 5), I(3, 5)], torch.eq),
    (Op.EQ, {"other": 1}, [I(3, 4, 5)], lambda x: torch.eq(x, 1)),
    (Op.NE, {}, [I(3, 4, 5), I(3, 5)], torch.ne),
    (Op.NE, {"other": 1}, [I(3, 4, 5)], lambda x: torch.ne(x, 1)),
    (Op.LT, {}, [R(4, 5), R(5)], torch.lt),
    (Op.LT, {"other": 0.0}, [R(4, 5)], lambda x: torch.lt(x, 0.0)),
    (Op.GE, {}, [R(4, 5), R(4, 1)], torch.ge),
    (Op.GE, {"other": 2}, [I(5, 6)], lambda x: torch.ge(x, 2)),
    (Op.LOGICAL_AND, {}, [B(3, 4), B(4)], torch.logical_and),
    (Op.LOGICAL_OR, {}, [B(3, 4), B(4)], torch.logical_or),
    (Op.WHERE, {}, [B(3, 1), R(4), R(3, 4)], torch.where),
    (Op.SUM, {"dims": [0, 2], "keepdim": False}, [R(2, 3, 4)], lambda x: torch.sum(x, [0, 2])),
    (Op.SUM, {"dims": [-1], "keepdim": True}, [R(2, 3, 4)], lambda x: torch.sum(x, [-1], keepdim=True)),
    (Op.SUM, {"dims": [], "keepdim": False}, [R(2, 3)], lambda x: aten.sum.dim_IntList(x, [])),
    (Op.SUM, {"dims": [1], "keepdim": False}, [B(2, 3)], lambda x: torch.sum(x, [1])),
    (Op.MEAN, {"dims": [1], "keepdim": True}, [R(2, 3, 4)], lambda x: torch.mean(x, [1], keepdim=True)),
    (Op.MEAN, {"dims": [0, -1], "keepdim": False}, [R(2, 3, 4)], lambda x: torch.mean(x, [0, -1])),
    (Op.AMAX, {"dims": [1], "keepdim": False}, [R(2, 3, 4)], lambda x: torch.amax(x, [1])),
    (Op.AMAX, {"dims": [-1], "keepdim": True}, [I(9, 2, 3)], lambda x: torch.amax(x, [-1], keepdim=True)),
    (Op.SOFTMAX, {"dim": -1}, [R(3, 5)], lambda x: aten._softmax(x, -1, False)),
    (Op.SOFTMAX_BACKWARD, {"dim": 1}, [R(3, 5), R(3, 5)],
     lambda g, y: aten._softmax_backward_data(g, y, 1, torch.float64)),
    (Op.LOG_SOFTMAX, {"dim": 0}, [R(3, 5)], lambda x: aten._log_softmax(x, 0, False)),
    (Op.LOG_SOFTMAX_BACKWARD, {"dim": -1}, [R(3, 5), R(3, 5)],
     lambda g, y: aten._log_softmax_backward_data(g, y, -1, torch.float64)),
    *[(Op.NLL_LOSS, {"reduction": r, "ignore_index": -100}, [R(4, 5), A([1, -100, 4, 0])],
       lambda x, t, r=r: F.nll_loss(x, t, reduction=r, ignore_index=-100)) for r in NLL_REDUCTION],
    (Op.NLL_LOSS, {"reduction": "mean", "ignore_index": 3}, [R(5), A(2)],
     lambda x, t: F.nll_loss(x, t, ignore_index=3)),
    (Op.NLL_LOSS_TOTAL_WEIGHT, {"ignore_index": -100}, [A([1, -100, 4, 0])],
     lambda t: aten.nll_loss_forward(torch.zeros(4, 5), t, None, 1, -100)[1]),
    (Op.NLL_LOSS_TOTAL_WEIGHT, {"ignore_index": 3}, [A(2)],
     lambda t: aten.nll_loss_forward(torch.zeros(5), t, None, 1, 3)[1]),
    *[(Op.NLL_LOSS_BACKWARD, {"reduction": r, "ignore_index": -100},
       [R(4) if r == "none" else R(), R(4, 5), A([1, -100, 4, 0]), A(3.0, np.float64)],
       lambda g, x, t, w, r=r: aten.nll_loss_backward(g, x, t, None, NLL_REDUCTION[r], -100, w))
      for r in NLL_REDUCTION],
    (Op.EMBEDDING, {}, [R(6, 3), I(6, 2, 4)], aten.embedding),
    (Op.EMBEDDING_BACKWARD, {"num_weights": 6}, [R(2, 4, 3), I(6, 2, 4)],
     lambda g, i: aten.embedding_dense_backward(g, i, 6, -1, False)),
    (Op.GATHER, {"dim": 0}, [R(3, 4), I(3, 2, 4)], lambda x, i: torch.gather(x, 0, i)),
    (Op.GATHER, {"dim": -1}, [R(3, 4), I(4, 2, 3)], lambda x, i: torch.gather(x, -1, i)),
    (Op.SCATTER, {"dim": 1}, [R(3, 5), A([[0, 2], [1, 3], [4, 0]]), R(3, 4)],
     lambda x, i, s: torch.scatter(x, 1, i, s)),
    (Op.SCATTER_ADD, {"dim": 0}, [R(3, 4), A([[0, 2, 2, 1], [0, 0, 1, 2]]), R(2, 4)],
     lambda x, i, s: torch.scatter_add(x, 0, i, s)),
    (Op.INDEX_SELECT, {"dim": 0}, [R(4, 3), A([3, 0, 3])], lambda x, i: torch.index_select(x, 0, i)),
    (Op.INDEX_SELECT, {"dim": -1}, [R(4, 3), A([2, 1])], lambda x, i: torch.index_select(x, -1, i)),
    (Op.INDEX_ADD, {"dim": 0}, [R(4, 3), A([0, 2, 0]), R(3, 3)], lambda x, i, s: torch.index_add(x, 0, i, s)),
    (Op.INDEX_ADD, {"dim": 1}, [R(2, 4), A([3, 1]), R(2, 2)], lambda x, i, s: torch.index_add(x, 1, i, s)),
    (Op.TOPK_VALUES, {"k": 2, "dim": -1}, [R(3, 6)], lambda x: torch.topk(x, 2, -1)[0]),
    (Op.TOPK_INDICES, {"k": 3, "dim": 0}, [R(4, 5)], lambda x: torch.topk(x, 3, 0)[1]),
    (Op.TOPK_MASK, {"k": 2, "dim": -1}, [R(3, 6)],
     lambda x: torch.zeros_like(x).scatter(-1, torch.topk(x, 2, -1).indices, 1.0)),
    (Op.AXIS_INDEX, {"axes": ["dp", "tp"]}, [], lambda: torch.tensor(1 * 3 + 2)),
    (Op.AXIS_INDEX, {"axes": ["tp"]}, [], lambda: torch.tensor(2)),
    (Op.LOCAL_CHUNK, {"dim": 1, "axes": ["dp", "tp"]}, [R(2, 12)], lambda x: torch.chunk(x, 6, 1)[5]),
    (Op.LOCAL_CHUNK, {"dim": 0, "axes": ["tp", "dp"]}, [R(12, 2)], lambda x: torch.chunk(x, 6, 0)[2 * 2 + 1]),
]

# (op, attrs, member input shape, group size, torch function: members' inputs -> members' outputs)
GROUP_CASES = [
    (Op.ALL_REDUCE, {"reduce": "sum"}, (2, 3), 3, lambda xs: [torch.stack(xs).sum(0)] * len(xs)),
    (Op.ALL_REDUCE, {"reduce": "avg"}, (2, 3), 4, lambda xs: [torch.stack(xs).mean(0)] * len(xs)),
    (Op.ALL_REDUCE, {"reduce": "max"}, (4,), 2, lambda xs: [torch.stack(xs).amax(0)] * len(xs)),
    (Op.ALL_GATHER, {"dim": 1}, (2, 3), 3, lambda xs: [torch.cat(xs, 1)] * len(xs)),
    (Op.ALL_GATHER, {"dim": 0}, (2, 3), 2, lambda xs: [torch.cat(xs, 0)] * len(xs)),
    (Op.REDUCE_SCATTER, {"dim": 0, "reduce": "sum"}, (4, 3), 4,
     lambda xs: list(torch.chunk(torch.stack(xs).sum(0), len(xs), 0))),
    (Op.REDUCE_SCATTER, {"dim": -1, "reduce": "max"}, (2, 6), 3,
     lambda xs: list(torch.chunk(torch.stack(xs).amax(0), len(xs), -1))),
    (Op.ALL_TO_ALL, {"split_dim": 0, "concat_dim": 1}, (6, 2), 3,
     lambda xs: [torch.cat([x.chunk(len(xs), 0)[j] for x in xs], 1) for j in range(len(xs))]),
    (Op.ALL_TO_ALL, {"split_dim": 1, "concat_dim": 1}, (2, 4), 2,
     lambda xs: [torch.cat([x.chunk(len(xs), 1)[j] for x in xs], 1) for j in range(len(xs))]),
    (Op.BROADCAST, {"root": 2}, (2, 3), 4, lambda xs: [xs[2]] * len(xs)),
]


@pytest.fixture(autouse=True)
def float64_default():
    """torch computes int / int and scalar promotions in float64, as tv_ray does."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(previous)


def _attrs(op: Op, attrs: dict) -> dict:
    """The attributes as the interpreter sees them: normalised by Node.make, then instantiated."""
    return instantiate_attrs(Node.make("n", op, [], attrs), {})


def _case_id(case) -> str:
    return f"{case[0]}-{sorted(case[1].items())}"


def test_every_op_but_send_and_recv_has_a_torch_case():
    covered = {case[0] for case in CASES} | {case[0] for case in GROUP_CASES}
    assert set(Op) - covered == {Op.SEND, Op.RECV}
    assert {case[0] for case in GROUP_CASES} == COLLECTIVES


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_concrete_rule_matches_torch(case):
    op, raw_attrs, makers, torch_fn = case
    rng = np.random.default_rng(0)
    inputs = [make(rng) for make in makers]
    attrs = _attrs(op, raw_attrs)
    rules = rule_for(op, "concrete")
    out = np.asarray(rules.concrete([x.copy() for x in inputs], attrs, CTX))
    expected = torch_fn(*[torch.from_numpy(np.asarray(x)) for x in inputs]).numpy()
    assert out.shape == expected.shape
    assert out.dtype == expected.dtype
    np.testing.assert_allclose(out, expected, rtol=1e-12, atol=1e-12, equal_nan=True)
    # the shape and dtype rules agree with what the concrete rule computed
    assert rules.shape([x.shape for x in inputs], attrs, CTX) == out.shape
    assert rules.dtype([dtype_name(x) for x in inputs], attrs) == dtype_name(out)


@pytest.mark.parametrize("case", GROUP_CASES, ids=_case_id)
def test_group_rule_matches_torch(case):
    op, raw_attrs, shape, size, torch_fn = case
    rng = np.random.default_rng(1)
    inputs = [rng.standard_normal(shape) for _ in range(size)]
    attrs = _attrs(op, {"axes": ["tp"], **raw_attrs})
    rules = rule_for(op, "group")
    outs = rules.group([x.copy() for x in inputs], attrs)
    expected = torch_fn([torch.from_numpy(x) for x in inputs])
    assert len(outs) == size
    stated = rules.shape([shape], attrs, Context(axis_sizes={"tp": size}))
    for out, want in zip(outs, expected):
        np.testing.assert_allclose(out, want.numpy(), rtol=1e-12, atol=1e-12)
        assert out.shape == stated
    assert rules.dtype(["float"], attrs) == "float"


def test_group_rule_outputs_are_independent_copies():
    outs = rule_for(Op.ALL_REDUCE, "group").group([np.ones(2), np.ones(2)], {"axes": ("tp",), "reduce": "sum"})
    outs[0][0] = 99.0
    assert outs[1][0] == 2.0


def test_known_le_decides_only_what_holds_for_every_size():
    from tv_ray.ir.dims import Expr
    seq = Expr.dim("seq")
    assert known_le(0, seq) is True
    assert known_le(seq - 1, seq) is True
    assert known_le(seq, seq / 2) is False
    assert known_le(Expr.dim("batch") / seq, 1) is None  # negative powers are never decided
    assert known_le(seq + 1, seq) is False
    assert known_le(5, seq) is None
