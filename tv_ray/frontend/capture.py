"""capture: a torch model's training step (forward, loss, backward) as a logical `Graph`.

A built-in model (`ModelSpec`) is captured at its three probe dims tables and
fitted into one graph whose shapes are expressions over the named dims (see
`fit`); a plain module with fixed inputs is captured once, with constant
shapes. Names follow docs/plan-format.md: inputs ``tokens``, ``targets`` (data)
and parameters by module path; outputs ``loss`` and ``grad/<param>``.
"""
from __future__ import annotations

from typing import Mapping, Sequence

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from tv_ray.errors import CaptureError
from tv_ray.frontend.aten import Converter
from tv_ray.frontend.fit import fit_graphs
from tv_ray.frontend.trace import fake_inputs, trace_joint
from tv_ray.ir import Graph
from tv_ray.models.spec import ModelSpec


def capture_concrete(module: torch.nn.Module, inputs: Sequence[torch.Tensor], *,
                     int_highs: Mapping[str, int] | None = None,
                     mode: FakeTensorMode | None = None) -> Graph:
    """The training step of ``loss = module(*inputs)`` with constant shapes."""
    return Converter(trace_joint(module, tuple(inputs), mode), dict(int_highs or {})).run()


def capture_spec_at(spec: ModelSpec, dims: Mapping[str, int]) -> Graph:
    """A built-in model's step at one dims table, on fake tensors (no memory for the weights)."""
    mode = FakeTensorMode()
    with mode:
        module = spec.build(dims=dims, device="cpu")
    tokens, targets = spec.example_inputs(dims=dims)
    return capture_concrete(module, fake_inputs(mode, (tokens, targets)),
                            int_highs={"tokens": dims["vocab"], "targets": dims["vocab"]}, mode=mode)


def capture(model: ModelSpec | torch.nn.Module, inputs: Sequence[torch.Tensor] | None = None, *,
            int_highs: Mapping[str, int] | None = None) -> Graph:
    """The logical graph of one training step (no optimizer; see `capture_step`).

    Example::

        graph = capture(tv_ray.models.get("llama3-8b"))        # symbolic shapes
        graph.shape_of("tokens")                                # (batch, seq)
        graph = capture(my_module, (tokens, targets))           # constant shapes

    A `ModelSpec` is captured at its probe dims and fitted; dims-dependent
    float constants are evaluated at the spec's dims. A module needs `inputs`
    and its forward must return the scalar loss.
    """
    if isinstance(model, ModelSpec):
        if inputs is not None:
            raise CaptureError(f"capture({model.name}): a ModelSpec makes its own inputs; pass "
                               f"spec.build(...) and inputs to capture a module at fixed inputs")
        tables = model.probe_dims()
        return fit_graphs([capture_spec_at(model, t) for t in tables], tables, at=model.dims)
    if isinstance(model, torch.nn.Module):
        if inputs is None:
            raise CaptureError(f"capture({type(model).__name__}): a plain module needs its inputs, "
                               f"e.g. capture(module, (tokens, targets))")
        return capture_concrete(model, inputs, int_highs=int_highs)
    raise CaptureError(f"capture: expected a ModelSpec or a torch.nn.Module, got {type(model).__name__}")
