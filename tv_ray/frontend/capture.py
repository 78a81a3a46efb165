"""capture: a torch model's training step (forward, loss, backward) as a logical `Graph`.

A built-in model (`ModelSpec`) is captured at its three probe dims tables and
fitted into one graph whose shapes are expressions over the named dims (see
`fit`); a plain module with fixed inputs is captured once, with constant
shapes. Names follow docs/plan-format.md: inputs ``tokens``, ``targets`` (data)
and parameters by module path; outputs ``loss`` and ``grad/<param>``.

A model deeper than 4 layers is captured at 2, 3 and 4 layers and its layer
block repeated (`layers`); its nine probe captures are traced in forked
processes, one per core. Probe captures are kept for the process, keyed by
the module factory and the config at the probe dims, so models that differ
only in their full dims or depth (llama3-8b / 70b / 405b) share them.
"""
from __future__ import annotations

import dataclasses
import multiprocessing
import os
from typing import Mapping, Sequence

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from tv_ray.errors import CaptureError
from tv_ray.frontend.aten import Converter
from tv_ray.frontend.fit import fit_graphs
from tv_ray.frontend.layers import extrapolate as extrapolate_layers, probe_layers
from tv_ray.frontend.trace import fake_inputs, trace_joint
from tv_ray.ir import Graph, Op
from tv_ray.ir.ops import VIEWS
from tv_ray.models.spec import ModelSpec
from tv_ray.processes import in_processes


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


_TARGET_ARG = {Op.NLL_LOSS: 1, Op.NLL_LOSS_TOTAL_WEIGHT: 0, Op.NLL_LOSS_BACKWARD: 2}


def masked_targets(graph: Graph) -> Graph:
    """`graph` with each int input that a loss reads as its targets (through views) allowed the loss's
    ignore_index too (`capture_step(..., masked=True)`): targets padded out of the loss are in the verified
    domain, as in training with padding (a built-in model's cross entropy ignores -100, as torch's does)."""
    made = {n.name: n for n in graph.nodes}
    ignored: dict[str, int] = {}
    for node in graph.nodes:
        if node.op in _TARGET_ARG:
            target = node.args[_TARGET_ARG[node.op]]
            while target in made and made[target].op in VIEWS:
                target = made[target].args[0]
            ignored[target] = node.attr["ignore_index"]
    inputs = tuple(dataclasses.replace(s, ignore=ignored[s.name]) if s.name in ignored and s.dtype == "int" else s
                   for s in graph.inputs)
    return Graph(inputs, graph.nodes, graph.outputs, graph.name)


_PROBES: dict[tuple, Graph] = {}      # (module factory, config, dims table) -> its capture, for the process


def _probe_key(spec: ModelSpec, table: Mapping[str, int]) -> tuple | None:
    """What a probe capture depends on: the module factory and the config at the table (None: unhashable, a
    mutable config — traced afresh)."""
    key = (spec.make_module, dataclasses.replace(spec.config, **table), tuple(sorted(table.items())))
    try:
        hash(key)
    except TypeError:
        return None
    return key


def _capture_probe(make_module, config, table: tuple[tuple[str, int], ...]) -> Graph:
    return capture_spec_at(ModelSpec("probe", config, make_module), dict(table))


def probe_capture(spec: ModelSpec, table: Mapping[str, int]) -> Graph:
    """`capture_spec_at`, kept for the process: the graph depends only on the module factory and the config."""
    key = _probe_key(spec, table)
    if key is None:
        return capture_spec_at(spec, table)
    got = _PROBES.get(key)
    if got is None:
        got = _PROBES[key] = _capture_probe(*key)
    return got


def _prefetch(probes: list[tuple[ModelSpec, Mapping[str, int]]]) -> None:
    """The probe captures not held yet, traced in forked processes, one per core (a deep model's nine: 7.4 s on
    one core). Only where this process may have children; a probe that fails there is traced again here, in
    order, by `probe_capture`, which raises its error. The first is traced here, before forking, so that torch's
    set-up on a first trace (seconds) is made once."""
    keys = list(dict.fromkeys(k for spec, table in probes
                              if (k := _probe_key(spec, table)) is not None and k not in _PROBES))
    workers = min(len(keys), os.cpu_count() or 1)
    if workers < 2 or multiprocessing.current_process().daemon:
        return
    _PROBES[keys[0]] = _capture_probe(*keys[0])      # here first: the processes inherit torch's first-trace set-up
    rest = keys[1:]
    try:
        for i, graph in in_processes(workers)(_capture_probe, rest):
            _PROBES[rest[i]] = graph
    except Exception:       # noqa: BLE001 — an optimisation only: the captures in order raise what failed
        return


def capture_symbolic(spec: ModelSpec) -> Graph:
    """A built-in model's step traced at its probe dims, every layer, and fitted over the named dims."""
    tables = spec.probe_dims()
    return fit_graphs([probe_capture(spec, t) for t in tables], tables, at=spec.dims)


def capture(model: ModelSpec | torch.nn.Module, inputs: Sequence[torch.Tensor] | None = None, *,
            int_highs: Mapping[str, int] | None = None, extrapolate: bool = True) -> Graph:
    """The logical graph of one training step (no optimizer; see `capture_step`).

    Example::

        graph = capture(tv_ray.models.get("llama3-8b"))        # symbolic shapes
        graph.shape_of("tokens")                                # (batch, seq)
        graph = capture(my_module, (tokens, targets))           # constant shapes

    A `ModelSpec` is captured at its probe dims and fitted; dims-dependent
    float constants are evaluated at the spec's dims. With more than 4
    layers it is captured at 2, 3 and 4 layers and its layer block repeated,
    after checking that the block repeated to 4 layers is the 4-layer capture
    (a CaptureError if not); ``extrapolate=False`` traces every layer. A
    module needs `inputs` and its forward must return the scalar loss.
    """
    if isinstance(model, ModelSpec):
        if inputs is not None:
            raise CaptureError(f"capture({model.name}): a ModelSpec makes its own inputs; pass "
                               f"spec.build(...) and inputs to capture a module at fixed inputs")
        layers = getattr(model.config, "layers", None)
        probes_at = probe_layers(getattr(model.config, "repeats_from", 2))
        if extrapolate and isinstance(layers, int) and layers > max(probes_at):
            depths = [model.with_dims(layers=k) for k in probes_at]
            _prefetch([(spec, table) for spec in depths for table in spec.probe_dims()])
            probes = {k: capture_symbolic(spec) for k, spec in zip(probes_at, depths)}
            return extrapolate_layers(probes, layers, model.name)
        return capture_symbolic(model)
    if isinstance(model, torch.nn.Module):
        if inputs is None:
            raise CaptureError(f"capture({type(model).__name__}): a plain module needs its inputs, "
                               f"e.g. capture(module, (tokens, targets))")
        return capture_concrete(model, inputs, int_highs=int_highs)
    raise CaptureError(f"capture: expected a ModelSpec or a torch.nn.Module, got {type(model).__name__}")
