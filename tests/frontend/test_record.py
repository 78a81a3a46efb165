"""The recorder: one process's ATen ops as a program that computes what torch computed, or an error saying why not."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from tv_ray.errors import CaptureError
from tv_ray.frontend.record import RankConverter, Recorder
from tv_ray.semantics.interpret import run_graph


def recorded(step, inputs: dict[str, torch.Tensor], roles: dict[str, str] | None = None):
    """Run `step(**inputs)` under a recorder; its program and torch's outputs (name -> tensor)."""
    known = {id(t): (t, name, (roles or {}).get(name, "data")) for name, t in inputs.items()}
    recorder = Recorder(known, lambda group: None)
    with recorder:
        outputs = step(recorder, **inputs)
    program = RankConverter(recorder.recording(list(outputs.items()))).run()
    return program, outputs


def run(program, inputs: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    return run_graph(program, {}, {name: t.detach().numpy() for name, t in inputs.items()})


def test_in_place_ops_become_the_values_they_leave():
    x, w = torch.randn(3, 4, dtype=torch.float64), torch.randn(4, 4, dtype=torch.float64)

    def step(recorder, x, w):
        y = x @ w
        y.mul_(2.0).add_(1.0)               # in place: later reads see the new value
        torch._foreach_mul_([w], 0.5)       # a foreach op, element by element
        z = torch.addcmul(y, y, y, value=0.25).lerp(x, 0.3)
        return {"y": y, "z": z, "w": w}
    inputs = {"x": x.clone(), "w": w.clone()}
    program, outputs = recorded(step, inputs)
    got = run(program, {"x": x, "w": w})
    for name, value in outputs.items():
        assert np.allclose(got[name], value.numpy(), rtol=0, atol=1e-12), name


def test_a_gradient_marked_before_it_is_clipped():
    w, x = torch.randn(4, 4, dtype=torch.float64, requires_grad=True), torch.randn(3, 4, dtype=torch.float64)

    def step(recorder, w, x):
        (x @ w).pow(2).sum().backward()
        recorder.mark("grad/w", w.grad)
        w.grad.mul_(0.1)
        return {"clipped": w.grad}
    program, outputs = recorded(step, {"w": w, "x": x}, {"w": "param"})
    got = run(program, {"w": w, "x": x})
    assert np.allclose(got["grad/w"] * 0.1, outputs["clipped"].numpy(), rtol=0, atol=1e-12)
    assert {s.name: s.role for s in program.inputs} == {"w": "param", "x": "data"}
    assert {n.get_meta("phase") for n in program.nodes} >= {"fwd", "bwd"}


def test_a_tensor_from_outside_the_step_is_named():
    stray = torch.ones(2, 3)
    with pytest.raises(CaptureError) as err:
        recorded(lambda recorder, x: {"y": x + stray}, {"x": torch.ones(2, 3)})
    assert str(err.value) == ("the step: aten.add.Tensor reads a tensor of shape (2, 3) and dtype torch.float32 that no "
                              "recorded op made and that is no parameter, optimizer state or batch tensor of the step")


def test_a_value_read_into_python_is_refused():
    with pytest.raises(CaptureError) as err:
        recorded(lambda recorder, x: {"y": x * float(x.sum())}, {"x": torch.ones(2)})
    assert str(err.value) == ("the step: the step reads a tensor's value into Python (aten._local_scalar_dense.default: "
                              ".item(), a Python branch or an optimizer's step count read as a float); the program "
                              "would hold it as a constant")


def test_a_view_read_after_its_base_changed_reads_the_new_value_or_is_refused():
    """A view that is its base's memory with the dims permuted (a transpose) reads the base's new value, as torch's
    does; one that is no such view (every other column) is refused."""
    x = torch.randn(2, 3, dtype=torch.float64)

    def step(recorder, x):
        view = x.t()
        x.add_(1.0)
        return {"y": view * 2}
    program, outputs = recorded(step, {"x": x.clone()})
    assert np.allclose(run(program, {"x": x})["y"], outputs["y"].numpy(), rtol=0, atol=1e-12)

    def strided(recorder, x):
        view = x[:, ::2]
        x.add_(1.0)
        return {"y": view * 2}
    with pytest.raises(CaptureError) as err:
        recorded(strided, {"x": torch.ones(2, 3)})
    assert str(err.value) == ("the step: aten.mul.Tensor reads a tensor (2, 2) after aten.add_.Tensor changed memory it "
                              "shares; a program cannot hold that aliasing")


def test_an_uninitialised_tensor_read_is_refused():
    with pytest.raises(CaptureError) as err:
        recorded(lambda recorder, x: {"y": torch.empty(2) + x}, {"x": torch.ones(2)})
    assert str(err.value) == ("the step: aten.add.Tensor reads a tensor of shape (2,) and dtype torch.float32 made by "
                              "aten.empty.memory_format that no op wrote whole")


def test_memory_written_through_views_reads_back():
    """FSDP2's and megatron-core's patterns: a buffer written whole through a view of it reads as that view's value;
    windows of one buffer (`as_strided`) changed one by one leave the others readable, and the buffer reads as its
    windows' values where they were written, its own elsewhere; a transposed window is read so, a strided one
    refused."""
    x = torch.randn(2, 4, dtype=torch.float64)

    def step(recorder, x):
        buffer = torch.empty(8, dtype=x.dtype)
        buffer.view(2, 4).copy_(x)                 # written whole through a view
        flat = buffer * 1.0                        # reads as x, flattened
        first, second = torch.as_strided(buffer, (4,), (1,), 0), torch.as_strided(buffer, (4,), (1,), 4)
        first.mul_(2.0)                            # the second window is another part of the buffer
        return {"flat": flat, "first": first, "second": second + 0.0}
    program, outputs = recorded(step, {"x": x.clone()})
    got = run(program, {"x": x})
    assert np.allclose(got["flat"], x.reshape(-1).numpy(), rtol=0, atol=0)
    assert np.allclose(got["first"], 2 * x[0].numpy(), rtol=0, atol=0)
    assert np.allclose(got["second"], x[1].numpy(), rtol=0, atol=0)

    def rebuilt(recorder, x):
        buffer = torch.empty(8, dtype=x.dtype)
        buffer.view(2, 4).copy_(x)
        torch.as_strided(buffer, (4,), (1,), 0).mul_(2.0)       # the buffer: the window's new value, then x[1]
        return {"flat": buffer * 1.0}
    program, _ = recorded(rebuilt, {"x": x.clone()})
    assert np.array_equal(run(program, {"x": x})["flat"], np.concatenate([2 * x[0].numpy(), x[1].numpy()]))
    program, _ = recorded(lambda recorder, x: {"y": torch.as_strided(x, (2, 2), (1, 2)) * 1.0}, {"x": x.clone()})
    assert np.array_equal(run(program, {"x": x})["y"], x.reshape(-1)[:4].reshape(2, 2).t().numpy())   # transposed
    with pytest.raises(CaptureError) as err:
        recorded(lambda recorder, x: {"y": torch.as_strided(x, (2, 2), (4, 2)) * 1.0}, {"x": x.clone()})
    assert str(err.value) == ("the step: aten.as_strided.default with strides (4, 2) (only a window of contiguous "
                              "memory, or one with its dims permuted, is recorded)")


def test_sends_and_receives_are_recorded_with_their_peer_along_the_mesh_axis():
    """Point-to-point (a pipeline's activations and gradients): a send of the value as issued, a receive that writes
    its buffer whole, the peer a step along the axis the process group spans; the fake process group (one process)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore
    dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
    try:
        x = torch.randn(3, dtype=torch.float64)
        recorder = Recorder({id(x): (x, "x", "data")}, lambda group: ("pp",))
        with recorder:
            dist.send(x * 2, dst=1, tag=3)
            buffer = torch.empty(3, dtype=torch.float64)
            dist.recv(buffer, src=1)
            out = buffer + 1
        program = RankConverter(recorder.recording([("out", out)])).run()
    finally:
        dist.destroy_process_group()
    ops = [(n.op.value, n.args, dict(n.attr)) for n in program.nodes]
    assert ops[1] == ("send", ("mul_tensor",), {"peer": (("pp", 1),), "tag": 3})
    assert ops[2][0] == "recv" and ops[2][2]["peer"] == (("pp", 1),) and ops[2][2]["tag"] == 0
    assert ops[3] == ("add", (program.nodes[2].name,), {"other": 1.0})


def test_a_transposed_tensor_is_read_off_the_memory_it_lies_on():
    """A permuted view of memory a tensor holds (a transposed weight autograd saved, read after FSDP2 wrote its
    storage again) reads as that tensor permuted back; staleness is by storage, not address (memory freed and
    reused shares nothing)."""
    w = torch.randn(2, 3, dtype=torch.float64)

    def step(recorder, w):
        buffer = torch.empty(6, dtype=w.dtype)
        view = buffer.view(2, 3)
        transposed = view.t()
        view.copy_(w)                  # written whole after the transposed view was made: the view is stale
        return {"y": transposed * 1.0}
    program, outputs = recorded(step, {"w": w.clone()})
    assert np.array_equal(run(program, {"w": w})["y"], w.numpy().T)
