"""The Python API: capture a model's training step, parallelize it into a plan, simulate the plan.

Example::

    import tv_ray
    graph = tv_ray.capture_step("llama3-tiny", optim="adamw", clip=1.0)
    plan = tv_ray.parallelize(graph, "dp=2,tp=2,pp=2,mb=2", model="llama3-tiny", sp=True)
    plan.save("plan.json")
    print(tv_ray.simulate(plan, seed=0).max_abs_dev())
"""
from __future__ import annotations

from typing import Mapping

from tv_ray.errors import CaptureError, ParallelConfigError
from tv_ray.frontend.capture import capture
from tv_ray.frontend.optim import capture_step as _capture_step
from tv_ray.ir.graph import Graph
from tv_ray.models import ModelSpec, get, list_models
from tv_ray.parallel.recipe import parallelize as _parallelize
from tv_ray.parallel.spec import ParallelSpec
from tv_ray.plan import Plan
from tv_ray.simulate import simulate


def _spec(model: str | ModelSpec, dims: Mapping[str, int] | None, tied: bool | None) -> ModelSpec:
    spec = get(model) if isinstance(model, str) else model
    changes = {"tied": tied} if tied is not None else {}
    if dims:
        return spec.with_dims({**spec.dims, **dims}, **changes)
    return spec.with_dims(**changes) if changes else spec


def capture_step(model, inputs=None, *, optim: str = "sgd", clip: float | None = None, tied: bool | None = None,
                 dims: Mapping[str, int] | None = None, int_highs: Mapping[str, int] | None = None,
                 **hyper) -> Graph:
    """The logical graph of one training step (forward, loss, backward, optimizer update).

    `model` is a built-in name (``tv-ray models``), a `ModelSpec`, or any
    ``torch.nn.Module`` whose ``forward(*inputs)`` returns the scalar loss; for
    a module, `int_highs` gives each integer input's range ``[0, high)``
    (token ids: the vocabulary size), e.g. ``{"tokens": 50257, "targets": 50257}``.
    """
    if isinstance(model, (str, ModelSpec)):
        model = _spec(model, dims, tied)
        tied = None
    graph = _capture_step(model, inputs, optim=optim, clip=clip, tied=tied, int_highs=int_highs, **hyper)
    for spec in graph.inputs:
        if spec.dtype == "int" and spec.high is None:
            raise CaptureError(f"integer input {spec.name!r} needs its range: pass "
                               f"int_highs={{{spec.name!r}: N}} (values lie in [0, N))")
    return graph


def parallelize(graph: Graph, spec: str | ParallelSpec, *, model: str | ModelSpec = "model",
                dims: Mapping[str, int] | None = None, layers: int | None = None, **flags) -> Plan:
    """The plan that runs `graph` under `spec` (``"dp=2,tp=2,pp=2,mb=2"``; flags sp, zero).

    For a built-in model, pass its name as `model`; its dims and layer count
    are taken from it. For another graph pass `dims` (the full value of every
    named dim its shapes use; none for a graph with constant shapes).
    """
    if isinstance(spec, str):
        spec = ParallelSpec.parse(spec, **flags)
    elif flags:
        raise ParallelConfigError(f"flags {sorted(flags)} given with a ParallelSpec; set them on it")
    name = model if isinstance(model, str) else model.name
    if isinstance(model, ModelSpec) or model in list_models():
        model_spec = _spec(model, None, None)
        dims = {**model_spec.dims, **(dims or {})}
        layers = layers or model_spec.config.layers
    return _parallelize(graph, spec, dict(dims or {}), name, layers=layers)


__all__ = ["capture", "capture_step", "parallelize", "simulate", "Plan", "ParallelSpec"]
