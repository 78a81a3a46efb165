"""The exact rewrites the recipe relies on: they compute the same step as the captured graph."""
from __future__ import annotations

import numpy as np
import pytest

import tv_ray
from tv_ray.models import get
from tv_ray.parallel.recipe import prepare
from tv_ray.parallel.vocab import vocab_parallel_forms
from tv_ray.semantics import run_graph
from tv_ray.simulate import draw_inputs


@pytest.mark.parametrize("model", ["llama3-tiny", "gpt2-tiny"])
def test_loss_split_and_vocab_forms_are_exact(model):
    graph = tv_ray.capture_step(model, optim="sgd")
    dims = get(model).dims
    inputs = draw_inputs(graph, dims, np.random.default_rng(0))
    reference = run_graph(graph, dims, inputs)
    rewritten = vocab_parallel_forms(prepare(graph))
    assert {n.op.value for n in rewritten.nodes} >= {"amax", "eq", "mm"}
    assert not {n.op.value for n in rewritten.nodes} & {"embedding", "_log_softmax", "nll_loss_backward"}
    got = run_graph(rewritten, dims, inputs)
    for name, value in reference.items():
        np.testing.assert_allclose(got[name], value, rtol=0, atol=1e-12, err_msg=name)
