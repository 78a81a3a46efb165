"""capture: ATen joint graphs -> logical graphs with symbolic shapes, checked against torch."""
import numpy as np
import pytest
import torch

import tv_ray.models as models
from tv_ray.errors import CaptureError
from tv_ray.frontend import capture, instantiate
from tv_ray.frontend.capture import capture_spec_at
from tv_ray.ir import Expr, Op
from tv_ray.semantics.interpret import run_graph

from .captures import symbolic

CASES = [("llama3-tiny", False), ("llama3-tiny", True), ("gpt2-tiny", True), ("gpt2-tiny", False)]
FOURTH = {"llama3-tiny": {"batch": 4, "seq": 6, "kv_heads": 3, "n_rep": 5, "head_dim": 10, "ffn": 14, "vocab": 22},
          "gpt2-tiny": {"batch": 4, "seq": 6, "heads": 3, "head_dim": 10, "ffn": 14, "vocab": 22}}


@pytest.fixture(scope="module", params=CASES, ids=[f"{n}-{'tied' if t else 'untied'}" for n, t in CASES])
def captured(request):
    return symbolic(*request.param)


def test_ops_inputs_and_outputs_are_named_as_documented(captured):
    spec, graph = captured
    assert all(isinstance(node.op, Op) for node in graph.nodes)
    params = [n for n, _ in spec.build().named_parameters()]
    by_name = {s.name: s for s in graph.inputs}
    assert [s.name for s in graph.inputs if s.role == "data"] == ["tokens", "targets"]
    assert [s.name for s in graph.inputs if s.role == "param"] == params
    for data in ("tokens", "targets"):
        assert by_name[data].dtype == "int" and by_name[data].high == Expr.dim("vocab")
        assert by_name[data].shape == (Expr.dim("batch"), Expr.dim("seq"))
    assert [out for out, _ in graph.outputs] == ["loss"] + [f"grad/{p}" for p in params]
    assert graph.shape_of(graph.output_map["loss"]) == ()
    assert {node.get_meta("phase") for node in graph.nodes} == {"fwd", "bwd"}


def test_shapes_are_symbolic(captured):
    spec, graph = captured
    first_mm = next(n for n in graph.nodes if n.op in (Op.MM, Op.ADDMM))
    assert {"batch", "seq"} <= first_mm.shape[0].free_dims
    assert first_mm.get_meta("module") in ("layers.0.attn.q_proj", "layers.0.attn.c_attn")


def test_attention_scale_is_a_recorded_form():
    _, graph = symbolic("llama3-tiny", False)
    scales = [n for n in graph.nodes if n.get_meta("dims_float") == "other=1*head_dim^(-1/2)"]
    assert len(scales) == 4      # two layers, forward and backward
    assert scales[0].attr["other"] == pytest.approx(8 ** -0.5)
    assert scales[0].get_meta("module") == "layers.0.attn"


@pytest.mark.parametrize("name", ["llama3-tiny", "gpt2-tiny"])
def test_fitted_graph_at_a_fourth_table_equals_a_fresh_capture(name):
    spec, graph = symbolic(name, name == "gpt2-tiny")
    dims = FOURTH[name]
    fitted, fresh = instantiate(graph, dims), capture_spec_at(spec, dims)
    assert fitted.inputs == fresh.inputs and fitted.outputs == fresh.outputs
    assert len(fitted.nodes) == len(fresh.nodes)
    for a, b in zip(fitted.nodes, fresh.nodes):
        assert (a.name, a.op, a.args, a.shape, a.dtype) == (b.name, b.op, b.args, b.shape, b.dtype)
        assert a.attr.keys() == b.attr.keys()
        for key, value in a.attrs:
            assert value == pytest.approx(b.attr[key], rel=1e-12) if isinstance(value, float) else value == b.attr[key], \
                (a.name, key)


class _Erf(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)
        self.inner = _ErfInner()

    def forward(self, x):
        return self.inner(self.proj(x)).sum()


class _ErfInner(torch.nn.Module):
    def forward(self, x):
        return torch.erf(x)


def test_unsupported_op_names_the_op_and_module():
    with pytest.raises(CaptureError) as err:
        capture(_Erf(), (torch.randn(3, 4),))
    assert str(err.value) == (
        "node erf (aten.erf.default) in module 'inner': unsupported ATen op aten.erf.default; add a converter "
        "to tv_ray.frontend.aten.CONVERTERS or a decomposition to tv_ray.frontend.trace.DECOMPOSITIONS")


class _IntegerAnd(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Linear(4, 4, bias=False)

    def forward(self, x, ids, other):
        return (self.w(x) * ((ids & other) == 1)).sum()


def test_a_bitwise_op_on_integers_is_refused_not_read_as_a_logical_one():
    with pytest.raises(CaptureError, match=r"^node bitwise_and\w* \(aten.bitwise_and.Tensor\) in module '<root>': "
                                           r"aten.bitwise_and.Tensor on torch.int64 \(only on bools, as a logical op\)"):
        capture(_IntegerAnd(), (torch.randn(2, 4), torch.arange(4), torch.arange(4)),
                int_highs={"ids": 4, "other": 4})


def test_safe_softmax_over_a_row_masked_whole_is_refused():
    """SDPA's `_safe_softmax` is recorded as softmax; they differ only on a row that is -inf throughout."""
    from tv_ray.frontend.trace import DECOMPOSITIONS
    safe = DECOMPOSITIONS[torch.ops.aten._safe_softmax.default]
    masked = torch.tensor([[0.0, float("-inf")], [float("-inf"), float("-inf")]])
    assert torch.equal(safe(masked[:1], -1), torch.tensor([[1.0, 0.0]]))
    with pytest.raises(CaptureError, match=r"^_safe_softmax over a row masked whole \(every entry -inf\)"):
        safe(masked, -1)


class _Unused(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.used = torch.nn.Linear(4, 4, bias=False)
        self.unused = torch.nn.Linear(4, 4, bias=False)

    def forward(self, x):
        return self.used(x).sum()


class _Buffered(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Linear(4, 4, bias=False)
        self.register_buffer("shift", torch.ones(4))

    def forward(self, x):
        return (self.w(x) + self.shift).sum()


def test_a_parameter_without_a_gradient_is_named():
    with pytest.raises(CaptureError) as err:
        capture(_Unused(), (torch.randn(2, 4),))
    assert str(err.value) == "parameter unused.weight receives no gradient from the loss"


def test_a_buffer_is_a_data_input_named_by_its_path():
    """A buffer the step leaves alone is an input of any value: the graph computes with the one it is given."""
    module = _Buffered().double()
    x = torch.randn(2, 4, dtype=torch.float64)
    graph = capture(module, (x,))
    assert [(s.name, s.role) for s in graph.inputs] == [("w.weight", "param"), ("shift", "data"), ("x", "data")]
    shift = np.arange(4.0)
    got = run_graph(graph, {}, {"w.weight": module.w.weight.detach().numpy(), "shift": shift, "x": x.numpy()})
    assert np.isclose(got["loss"], float((x @ module.w.weight.detach().t()).sum()) + 2 * shift.sum())


def test_a_buffer_the_step_changes_is_refused():
    norm = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))    # running statistics updated
    with pytest.raises(CaptureError, match=r"expected the loss and a gradient for each \(a forward that mutates an "
                                           r"input\?\)"):
        capture(_MSE(norm), (torch.randn(5, 4), torch.randn(5, 4)))


class _Router(torch.nn.Module):
    """Top-2 of 4 experts per token; `capacity`: each expert keeps its first token only (a count over the choices)."""

    def __init__(self, capacity: bool = False):
        super().__init__()
        self.gate = torch.nn.Linear(3, 4, bias=False)
        self.capacity = capacity

    def forward(self, x):
        scores = self.gate(x).sigmoid()
        chosen = torch.topk(scores.detach(), 2, dim=-1).indices
        mask = torch.zeros_like(scores).scatter(-1, chosen, 1.0)
        if self.capacity:
            load = torch.nn.functional.one_hot(chosen, 4).sum(1).cumsum(0)
            mask = mask * (load <= 1)
        return (scores * mask).sum()


def test_a_routing_mask_is_one_topk_mask_op_with_torchs_values():
    module = _Router().double()
    x = torch.randn(5, 3, dtype=torch.float64)
    graph = capture(module, (x,))
    masks = [n for n in graph.nodes if n.op == Op.TOPK_MASK]
    assert len(masks) == 1 and masks[0].attr["k"] == 2 and masks[0].attr["dim"] == 1
    assert not [n for n in graph.nodes if n.op in (Op.TOPK_INDICES, Op.TOPK_VALUES, Op.SCATTER)]
    got = run_graph(graph, {}, {"gate.weight": module.gate.weight.detach().numpy(), "x": x.numpy()})
    assert np.isclose(got["loss"], float(module(x)))


def test_capacity_limited_routing_is_refused_at_the_read_of_the_indices():
    with pytest.raises(CaptureError, match=r"reads the indices of topk: a top-k's indices are supported only "
                                           r"scattered as ones into zeros shaped like its input \(a routing mask\)"):
        capture(_Router(capacity=True).double(), (torch.randn(5, 3, dtype=torch.float64),))


class _SizeBranch(torch.nn.Module):
    """Adds an op only when seq is large: not shape-polymorphic."""

    def __init__(self, cfg):
        super().__init__()
        self.embed = torch.nn.Embedding(cfg.vocab, cfg.d_model)

    def forward(self, tokens, targets):
        x = self.embed(tokens)
        if tokens.shape[1] > 10:
            x = x * 2.0
        logits = x @ self.embed.weight.t()
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def test_a_model_whose_structure_depends_on_size_is_refused():
    spec = models.ModelSpec("branchy", models.get("llama3-tiny").config, _SizeBranch)
    with pytest.raises(CaptureError, match=r"^model is not shape-polymorphic: the probe captures have \[\d+, \d+, \d+\] ops"):
        capture(spec)


def test_a_plain_module_captures_with_constant_shapes():
    lin = torch.nn.Sequential(torch.nn.Linear(4, 3))
    graph = capture(_MSE(lin), (torch.randn(5, 4), torch.randn(5, 3)))
    assert [s.name for s in graph.inputs if s.role == "data"] == ["x", "y"]
    assert all(d.is_const for n in graph.nodes for d in n.shape)
    assert [o for o, _ in graph.outputs] == ["loss", "grad/inner.0.weight", "grad/inner.0.bias"]


class _MSE(torch.nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x, y):
        return ((self.inner(x) - y) ** 2).mean()


class _Tied(torch.nn.Module):
    """An output layer tied to the input embedding: one parameter under two paths."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(6, 4)
        self.head = torch.nn.Linear(4, 6, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens, targets):
        return torch.nn.functional.cross_entropy(self.head(torch.tanh(self.embed(tokens))), targets)


def test_a_tied_parameter_is_one_input_whose_gradient_sums_its_uses():
    """Traced as two inputs each with its own uses' gradient, a tied weight's step would be two copies drifting
    apart (B21 proved by accident): it is one input, its gradient the sum."""
    module = _Tied().double()
    tokens, targets = torch.randint(0, 6, (5,)), torch.randint(0, 6, (5,))
    graph = capture(module, (tokens, targets), int_highs={"tokens": 6, "targets": 6})
    assert [s.name for s in graph.inputs if s.role == "param"] == ["embed.weight"]
    assert [o for o, _ in graph.outputs] == ["loss", "grad/embed.weight"]
    module(tokens, targets).backward()
    got = run_graph(graph, {}, {"embed.weight": module.embed.weight.detach().numpy(), "tokens": tokens.numpy(),
                                "targets": targets.numpy()})
    assert np.allclose(got["grad/embed.weight"], module.embed.weight.grad.numpy(), rtol=0, atol=1e-12)


class _CausalAttention(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = torch.nn.Linear(4, 12, bias=False)

    def forward(self, x):
        q, k, v = self.qkv(x).view(1, 3, 3, 4).transpose(1, 2).split(1, dim=2)
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):    # the decomposable one
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).sum()


def test_sdpa_causal_mask_is_a_triu_whose_diagonal_reduction_keeps():
    """torch decomposes SDPA's causal mask through tril, which compares aranges; recorded as a triu instead, the
    mask is an op shape reduction keeps visible (docs/reduction.md), and the step still computes SDPA's loss."""
    model, x = _CausalAttention(), torch.randn(1, 3, 4, dtype=torch.float64)
    graph = capture(model.double(), (x,))
    (triu,) = [n for n in graph.nodes if n.op is Op.TRIU]
    assert triu.attr["diagonal"] == 1 and not any(n.op is Op.ARANGE for n in graph.nodes)
    values = {"qkv.weight": model.qkv.weight.detach().numpy()}
    values |= {s.name: x.numpy() for s in graph.inputs if s.name not in values}
    got = run_graph(graph, {}, values)
    assert np.isclose(got["loss"], float(model(x)))
