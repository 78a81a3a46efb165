"""Layer extrapolation: a deep model's graph from 2/3/4-layer captures equals its full capture, and runs like torch."""
import sys
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import tv_ray.models as models
from tv_ray.errors import CaptureError
from tv_ray.frontend import capture, capture_step, layers
from tv_ray.frontend.capture import capture_spec_at, probe_capture
from tv_ray.frontend.layers import LayerPattern, find_pattern
from tv_ray.ir import Graph, Node, TensorSpec
from tv_ray.semantics import check_graph
from tv_ray.semantics import run_graph

from .captures import deep, real_module

TOL = 1e-9


def canonical(graph: Graph) -> Graph:
    """The graph with every node named by its position: equal canonical forms = equal up to node names."""
    names = {s.name: s.name for s in graph.inputs}
    nodes = []
    for i, node in enumerate(graph.nodes):
        names[node.name] = f"%{i}"
        nodes.append(Node(f"%{i}", node.op, tuple(names[a] for a in node.args), node.attrs, node.shape,
                          node.dtype, node.meta))
    return Graph(graph.inputs, tuple(nodes), tuple((o, names[v]) for o, v in graph.outputs), graph.name)


def assert_same_up_to_names(made: Graph, real: Graph) -> None:
    a, b = canonical(made), canonical(real)
    assert a.inputs == b.inputs
    for x, y in zip(a.nodes, b.nodes):
        assert x == y, (x, y)
    assert len(a.nodes) == len(b.nodes) and a.outputs == b.outputs
    assert a == b


def test_extrapolated_llama_equals_its_full_capture():
    spec, made = deep("llama3-tiny", 5)
    _, real = deep("llama3-tiny", 5, extrapolate=False)
    assert_same_up_to_names(made, real)
    assert [s.name for s in made.inputs if s.role == "param"] == [n for n, _ in spec.build().named_parameters()]
    assert len({n.name for n in made.nodes}) == len(made.nodes)
    check_graph(made, allow_comm=False)


def at_one_table(name: str, depth: int) -> Graph:
    """The capture at the model's first probe table: one trace instead of three (kept for the process)."""
    spec = models.get(name).with_dims(layers=depth)
    return probe_capture(spec, spec.probe_dims()[0])


def test_extrapolated_gpt2_equals_its_full_capture_at_a_probe_table():
    """Constant shapes keep the test fast (one trace of 5 layers, not three); the layer logic is the same."""
    made = layers.extrapolate({k: at_one_table("gpt2-tiny", k) for k in (2, 3, 4)}, 5, "gpt2-tiny")
    spec = models.get("gpt2-tiny").with_dims(layers=5)
    assert_same_up_to_names(made, capture_spec_at(spec, spec.probe_dims()[0]))


@pytest.mark.parametrize("name", ["llama3-tiny", "gpt2-tiny"])
def test_the_pattern_rebuilds_the_three_layer_capture_exactly(name):
    two, three = (deep(name, k)[1] if name == "llama3-tiny" else at_one_table(name, k) for k in (2, 3))
    pattern = find_pattern(two, three)
    assert pattern.container == "layers"
    assert [run.reversed for run in pattern.runs] == [False, True]     # forward block, then backward block
    assert pattern.graph(3) == three and pattern.graph(2) is two
    new = pattern.graph(5)
    assert new.value(new.output_map["grad/layers.4.attn.c_proj.weight" if name == "gpt2-tiny"
                                     else "grad/layers.4.attn.q_proj.weight"]).get_meta("module").startswith("layers.4.")


def test_shallow_models_are_captured_as_they_are():
    spec, graph = deep("llama3-tiny", 4)
    assert graph == deep("llama3-tiny", 4, extrapolate=False)[1]


def test_extrapolated_llama_runs_like_torch_autograd():
    spec, graph = deep("llama3-tiny", 5)
    module, tokens, targets, inputs, _ = real_module(spec)
    loss = module(tokens, targets)
    loss.backward()
    out = run_graph(graph, spec.dims, inputs)
    assert abs(float(out["loss"]) - loss.item()) < TOL
    for n, p in module.named_parameters():
        np.testing.assert_allclose(out[f"grad/{n}"], p.grad.numpy(), rtol=0, atol=TOL, err_msg=f"grad/{n}")


def test_capture_step_extrapolates():
    spec, graph = deep("llama3-tiny", 5)
    step = capture_step(spec, optim="adamw", clip=1.0)
    assert step.nodes[:len(graph.nodes)] == graph.nodes
    assert "new/exp_avg_sq/layers.4.mlp.down_proj.weight" in step.output_map


def test_a_wrong_layer_index_in_the_block_is_refused(monkeypatch):
    """Mutant: copies for layer 3 keep layer 2's module path; the check names the first such node."""
    spec = models.get("llama3-tiny").with_dims(layers=5)
    deep("llama3-tiny", 5)                                  # the probes are cached
    copy = LayerPattern._copy

    def stale(self, node, layer, newest):
        made = copy(self, node, layer, newest)
        return made.with_meta(module=node.get_meta("module")) if layer == 3 else made

    monkeypatch.setattr(LayerPattern, "_copy", stale)
    two, three, four = (deep("llama3-tiny", k)[1] for k in (2, 3, 4))
    pattern = find_pattern(two, three)
    at = pattern.runs[0].stop                               # layer 3's forward follows layer 2's
    made, real = pattern.graph(4).nodes[at], four.nodes[at]
    assert made.get_meta("module") == "layers.2.attn_norm" and real.get_meta("module") == "layers.3.attn_norm"
    with pytest.raises(CaptureError) as err:
        capture(spec)
    made_args, real_args = ", ".join(made.args), ", ".join(real.args)
    assert str(err.value) == (
        f"capture(llama3-tiny, layers=5): layer extrapolation refused — the layer block of the 2- and 3-layer "
        f"captures, repeated to 4 layers, differs from the 4-layer capture at node {at}: "
        f"{made.name} = pow({made_args}) in the extrapolation, {real.name} = pow({real_args}) in the capture "
        f"(provenance: {made.meta} vs {real.meta}); the layers of llama3-tiny do not repeat exactly; capture it "
        f"layer by layer with capture(spec, extrapolate=False) (slower: every layer is traced)")


# -- a model whose layers do not repeat ----------------------------------------------------------------
@dataclass(frozen=True)
class _ToyConfig:
    DIMS: ClassVar[tuple[str, ...]] = ("batch", "seq", "d_model", "vocab")
    layers: int
    batch: int = 2
    seq: int = 3
    d_model: int = 4
    vocab: int = 5
    odd_layer: int = -1        # this layer uses sigmoid, the others tanh: the layers are not all alike


class _Toy(torch.nn.Module):
    def __init__(self, cfg: _ToyConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = torch.nn.Embedding(cfg.vocab, cfg.d_model)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(cfg.d_model, cfg.d_model) for _ in range(cfg.layers))

    def forward(self, tokens, targets):
        x = self.embed(tokens)
        for i, layer in enumerate(self.layers):
            x = x + (torch.sigmoid if i == self.cfg.odd_layer else torch.tanh)(layer(x))
        logits = x @ self.embed.weight.t()
        return F.cross_entropy(logits.reshape(-1, self.cfg.vocab), targets.reshape(-1))


def test_a_model_whose_fourth_layer_differs_is_refused():
    spec = models.ModelSpec("toy-odd", _ToyConfig(layers=6, odd_layer=3), _Toy)
    with pytest.raises(CaptureError, match=r"^capture\(toy-odd, layers=6\): layer extrapolation refused — the layer "
                                           r"block of the 2- and 3-layer captures, repeated to 4 layers, differs from "
                                           r"the 4-layer capture at node \d+: tanh_\w+ = tanh\(\w+\) in the extrapolation, "
                                           r"sigmoid\w* = sigmoid\(\w+\) in the capture \(op: tanh vs sigmoid\); the layers of toy-odd do "
                                           r"not repeat exactly; capture it layer by layer with capture\(spec, "
                                           r"extrapolate=False\) \(slower: every layer is traced\)$"):
        capture(spec)


def test_a_graph_without_a_layer_container_is_refused():
    two = Graph((TensorSpec("x", ()),), (), (("loss", "x"),))
    three = Graph((TensorSpec("x", ()), TensorSpec("w", ())), (), (("loss", "x"), ("grad/w", "w")))
    with pytest.raises(CaptureError, match=r"^layer block: the 3-layer capture's new inputs \['w'\] are not the "
                                           r"parameters <container>\.2\.\* of one layer container$"):
        layers.find_pattern(two, three)


def test_probes_traced_in_forked_processes_are_those_traced_here(monkeypatch):
    """A deep model's probe captures are traced one per core in forked processes (`_prefetch`): each equals the
    same probe traced in this process, and is kept for the process."""
    module = sys.modules["tv_ray.frontend.capture"]      # the package exports a function of that name
    monkeypatch.setattr(module, "_PROBES", {})
    monkeypatch.setattr(module.os, "cpu_count", lambda: 2)
    spec = models.get("gpt2-tiny").with_dims(layers=2)
    tables = spec.probe_dims()
    module._prefetch([(spec, table) for table in tables])
    assert len(module._PROBES) == len(tables)
    for table in tables:
        held = module._PROBES[module._probe_key(spec, table)]
        assert held == capture_spec_at(spec, table)
        assert probe_capture(spec, table) is held
