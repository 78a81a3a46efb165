"""Tracing one training step of a torch module into an ATen joint (forward + backward) FX graph.

PyTorch's own autograd derives the backward (`aot_export_module` with
``trace_joint=True``); tv_ray never writes a gradient formula. Sizes come from
fake tensors, so frontier-size modules trace without allocating memory.

Provenance: `aot_export_module` re-traces its internal joint graph and drops
node metadata on the way. We annotate each submodule call (forward hooks +
`torch.fx.traceback.annotate`), and read the module path and the phase
(``partitioner_tag``) back from that internal graph, which each final node
names in its ``stack_trace`` line (``<name> = torch.ops.aten...``).
"""
from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass

import torch
import torch.fx.traceback as fx_traceback
from torch._decomp import get_decompositions
from torch._functorch import aot_autograd
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from tv_ray.errors import CaptureError

aten = torch.ops.aten



def _var_mean(x, dim=None, *, correction=None, keepdim=False):
    """Population variance and mean as two means (torch's own decomposition ends in prims.var)."""
    if correction not in (None, 0):
        raise CaptureError(f"var_mean with correction={correction} is not supported (only the population "
                           f"variance, as layer norm uses)")
    dims = list(range(x.dim())) if dim is None else list(dim)
    mean = aten.mean.dim(x, dims, True)
    centered = aten.sub.Tensor(x, mean)
    var = aten.mean.dim(aten.mul.Tensor(centered, centered), dims, keepdim)
    return var, (mean if keepdim else aten.squeeze.dims(mean, dims))


# ATen ops outside our closed op set that PyTorch can rewrite into ops inside it.
DECOMPOSITIONS = {
    **get_decompositions([
        aten.native_layer_norm, aten.native_layer_norm_backward, aten.gelu_backward, aten.tanh_backward,
        aten.silu_backward, aten.sigmoid_backward,
    ]),
    aten.var_mean.correction: _var_mean,
}


@dataclass(frozen=True)
class Joint:
    """The traced joint graph and what its placeholders and outputs mean."""

    gm: torch.fx.GraphModule
    params: dict[str, str]           # placeholder -> parameter path
    user_inputs: dict[str, str]      # placeholder -> forward argument name
    loss: str                        # node holding the loss
    grads: dict[str, str]            # parameter path -> node holding its gradient
    provenance: dict[str, tuple[str, str]]  # node -> (module path, "fwd" | "bwd")


class _LossTuple(torch.nn.Module):
    """aot_export_module wants tuple outputs; parameter paths get the prefix ``model.``."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, *args):
        return (self.model(*args),)


@contextlib.contextmanager
def _annotate_modules(model: torch.nn.Module):
    """Tag every op traced inside a submodule's forward with that submodule's path."""
    open_annotations: list = []
    handles = []

    def enter(path):
        def hook(_module, _args):
            annotation = fx_traceback.annotate({"module": path})
            annotation.__enter__()
            open_annotations.append(annotation)
        return hook

    def leave(_module, _args, _out):
        open_annotations.pop().__exit__(None, None, None)

    for path, sub in model.named_modules():
        if path:
            handles.append(sub.register_forward_pre_hook(enter(path)))
            handles.append(sub.register_forward_hook(leave))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


@contextlib.contextmanager
def _keep_internal_joint(found: list):
    """Remember the internal joint graph that aot_export_module re-traces (it holds the metadata)."""
    original = aot_autograd.make_fx

    def make_fx(fn, *args, **kwargs):
        for cell in getattr(fn, "__closure__", None) or ():
            if isinstance(cell.cell_contents, torch.fx.GraphModule):
                found.append(cell.cell_contents)
        return original(fn, *args, **kwargs)

    aot_autograd.make_fx = make_fx
    try:
        yield
    finally:
        aot_autograd.make_fx = original


_DEFINED = re.compile(r"^\s*(\w+) = ")


def _provenance(gm: torch.fx.GraphModule, internal: torch.fx.GraphModule) -> dict[str, tuple[str, str]]:
    inner = {n.name: n for n in internal.graph.nodes}
    out = {}
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        lines = (node.meta.get("stack_trace") or "").strip().splitlines()
        match = _DEFINED.match(lines[-1]) if lines else None
        source = inner.get(match.group(1)) if match else None
        if source is None:
            continue  # pytree plumbing added by the re-trace (getitem of outputs); no provenance
        module = (source.meta.get("custom") or {}).get("module", "")
        phase = {"is_forward": "fwd", "is_backward": "bwd"}.get(source.meta.get("partitioner_tag"), "fwd")
        out[node.name] = (module, phase)
    return out


def fake_inputs(mode: FakeTensorMode, tensors) -> tuple[FakeTensor, ...]:
    return tuple(mode.from_tensor(t) for t in tensors)


def trace_joint(model: torch.nn.Module, inputs: tuple, mode: FakeTensorMode | None = None) -> Joint:
    """Trace forward + backward of ``loss = model(*inputs)`` (under `mode` if the module is fake)."""
    arg_names = _forward_arg_names(model, len(inputs))
    wrapper = _LossTuple(model)
    internal: list = []
    try:
        with contextlib.ExitStack() as stack:
            if mode is not None:
                stack.enter_context(mode)
            stack.enter_context(_annotate_modules(model))
            stack.enter_context(_keep_internal_joint(internal))
            stack.enter_context(fx_traceback.preserve_node_meta())
            gm, sig = aot_autograd.aot_export_module(wrapper, inputs, trace_joint=True, output_loss_index=0,
                                                     decompositions=DECOMPOSITIONS)
    except CaptureError:
        raise
    except Exception as err:
        raise CaptureError(f"torch could not trace {type(model).__name__}: {type(err).__name__}: {err}") from err
    if len(internal) != 1:
        raise CaptureError(f"torch {torch.__version__}: found {len(internal)} internal joint graphs in "
                           f"aot_export_module (expected 1); module provenance cannot be recovered — "
                           f"update tv_ray.frontend.trace._keep_internal_joint for this torch version")

    def strip(path: str) -> str:
        return path[len("model."):]

    return Joint(
        gm=gm,
        params={ph: strip(p) for ph, p in sig.inputs_to_parameters.items()},
        user_inputs=dict(zip(sig.user_inputs, arg_names)),
        loss=sig.backward_signature.loss_output,
        grads={strip(p): node for node, p in sig.backward_signature.gradients_to_parameters.items()},
        provenance=_provenance(gm, internal[0]),
    )


def _forward_arg_names(model: torch.nn.Module, count: int) -> list[str]:
    import inspect
    params = [p.name for p in inspect.signature(model.forward).parameters.values()
              if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(params) < count:
        return [f"input{i}" for i in range(count)]
    return params[:count]
