"""The captured step run in float64 (tv_ray.semantics) equals torch autograd + torch.optim on the real module."""
import numpy as np
import pytest
import torch

from tv_ray.errors import CaptureError
from tv_ray.frontend import AdamW, SGD, append_optimizer
from tv_ray.semantics import run_graph

from .captures import real_module, symbolic

TOL = 1e-9


@pytest.mark.parametrize("name, tied", [("llama3-tiny", False), ("llama3-tiny", True), ("gpt2-tiny", True),
                                        ("gpt2-tiny", False)])
@pytest.mark.parametrize("optimizer, clip", [(SGD(lr=0.1), None), (AdamW(lr=0.01, weight_decay=0.1), 0.5)],
                         ids=["sgd", "adamw-clip"])
def test_step_matches_torch(name, tied, optimizer, clip):
    spec, logical = symbolic(name, tied)
    graph = append_optimizer(logical, optimizer, clip)
    module, tokens, targets, inputs, gen = real_module(spec)
    if isinstance(optimizer, AdamW):
        opt = torch.optim.AdamW(module.parameters(), lr=optimizer.lr, betas=optimizer.betas, eps=optimizer.eps,
                                weight_decay=optimizer.weight_decay)
        inputs["step"] = np.array(3.0)   # torch increments its step 2 -> 3 before using it
        for n, p in module.named_parameters():
            m, v = torch.randn(p.shape, generator=gen, dtype=torch.float64), torch.rand(p.shape, generator=gen, dtype=torch.float64)
            opt.state[p] = {"step": torch.tensor(2.0, dtype=torch.float64), "exp_avg": m.clone(), "exp_avg_sq": v.clone()}
            inputs[f"exp_avg/{n}"], inputs[f"exp_avg_sq/{n}"] = m.numpy(), v.numpy()
    else:
        opt = torch.optim.SGD(module.parameters(), lr=optimizer.lr)
    loss = module(tokens, targets)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in module.named_parameters()}
    if clip is not None:
        torch.nn.utils.clip_grad_norm_(module.parameters(), clip)
    opt.step()

    out = run_graph(graph, spec.dims, inputs)
    assert abs(float(out["loss"]) - loss.item()) < TOL
    for n, p in module.named_parameters():
        np.testing.assert_allclose(out[f"grad/{n}"], grads[n].numpy(), rtol=0, atol=TOL, err_msg=f"grad/{n}")
        np.testing.assert_allclose(out[f"new/{n}"], p.detach().numpy(), rtol=0, atol=TOL, err_msg=f"new/{n}")
        if isinstance(optimizer, AdamW):
            for state in ("exp_avg", "exp_avg_sq"):
                np.testing.assert_allclose(out[f"new/{state}/{n}"], opt.state[p][state].numpy(), rtol=0, atol=TOL)


def test_adamw_inputs_and_outputs_are_named_as_documented():
    spec, logical = symbolic("llama3-tiny", False)
    graph = append_optimizer(logical, AdamW(), clip=1.0)
    specs = {s.name: s for s in graph.inputs}
    assert specs["step"].role == "step" and specs["step"].positive and specs["step"].shape == ()
    assert specs["exp_avg_sq/norm.weight"].positive and specs["exp_avg/norm.weight"].role == "state"
    outputs = graph.output_map
    assert {"new/norm.weight", "new/exp_avg/norm.weight", "new/exp_avg_sq/norm.weight"} <= set(outputs)
    new = graph.value(outputs["new/layers.0.attn.q_proj.weight"])
    assert new.get_meta("phase") == "optim" and new.get_meta("module") == "layers.0.attn.q_proj.weight"
    assert len(graph.nodes) > len(logical.nodes) and len(logical.nodes) == len(symbolic("llama3-tiny", False)[1].nodes)


def test_unknown_optimizer_is_refused():
    from tv_ray.frontend import capture_step
    import tv_ray.models as models
    with pytest.raises(CaptureError, match=r"^unknown optimizer 'lamb'; one of sgd, adamw$"):
        capture_step(models.get("llama3-tiny"), optim="lamb")


def test_adamw_counting_the_steps_before_this_one_adds_it():
    """``step_before``: the step input is torch's state["step"] before its increment (what a recorded program
    reads), so it is no longer known positive, and the step at t equals the default graph's at t + 1."""
    spec, logical = symbolic("llama3-tiny", False)
    after = append_optimizer(logical, AdamW(), clip=1.0)
    before = append_optimizer(logical, AdamW(), clip=1.0, step_before=True)
    assert not {s.name: s for s in before.inputs}["step"].positive
    _, _, _, inputs, gen = real_module(spec)
    for s in after.inputs:
        if s.role == "state":
            shape = tuple(int(d.eval(spec.dims)) for d in s.shape)
            inputs[s.name] = torch.rand(shape, generator=gen, dtype=torch.float64).numpy()
    ran_after = run_graph(after, spec.dims, {**inputs, "step": np.array(3.0)})
    ran_before = run_graph(before, spec.dims, {**inputs, "step": np.array(2.0)})
    for name, _ in after.outputs:
        np.testing.assert_allclose(ran_before[name], ran_after[name], rtol=0, atol=1e-12, err_msg=name)
