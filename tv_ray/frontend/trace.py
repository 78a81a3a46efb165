"""Tracing one training step of a torch module into an ATen joint (forward + backward) FX graph.

PyTorch's own autograd derives the backward (`aot_export_module` with
``trace_joint=True``); tv_ray never writes a gradient formula. Sizes come from
fake tensors, so frontier-size modules trace without allocating memory.

The joint graph taken is `aot_export_module`'s internal one, before the
export re-traces it only to drop the pytree of its inputs (primals, tangents)
and outputs (forward outputs, every input's gradient) — most of the time of
a capture went to that re-trace (llama3 probes: 13.9 → 7.4 s for nine), and
it dropped the node metadata on the way. Here the placeholders and outputs
are read by position, as the export's signature reads them (parameters, then
buffers, then the forward's arguments; the loss, then each input's
gradient); the converted graph is the one the re-traced graph gave, node for
node. A buffer the step does not change (a rotary cache) is a data input
named by its path: the proof holds whatever value it has; one the step
changes (batch-norm statistics) leaves the joint graph an output more,
refused. Provenance: each submodule call is annotated (forward hooks +
`torch.fx.traceback.annotate`); each node of the joint graph holds that
module path and its phase (``partitioner_tag``).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.fx.traceback as fx_traceback
from torch._decomp import get_decompositions
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from tv_ray.errors import CaptureError, JointTaken

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


def _var_mean_unbiased(x, dim=None, unbiased=True, keepdim=False):
    """`var_mean.dim` (layer norm's decomposition run eagerly calls it so): `_var_mean` with its correction."""
    return _var_mean(x, dim, correction=int(unbiased), keepdim=keepdim)


def _tril(x, diagonal=0):
    """The lower triangle (SDPA's causal mask) as a select where the upper triangle past it is not: a triu, whose
    diagonal shape reduction keeps visible (docs/reduction.md; torch's own decomposition compares aranges)."""
    above = aten.triu.default(aten.ones_like.default(x), diagonal + 1)
    return aten.where.self(aten.eq.Scalar(above, 0), x, aten.zeros_like.default(x))


def _masked_whole(x: torch.Tensor, dim: int) -> bool:
    """Whether some row of `x` along `dim` is -inf throughout; looked at outside any mode (no op recorded)."""
    with torch.utils._python_dispatch._disable_current_modes():
        return bool(torch.eq(x, float("-inf")).all(dim).any())


def _safe_softmax(x, dim, dtype=None):
    """SDPA's softmax, which gives 0 on a row masked whole (every entry -inf) where softmax gives NaN: recorded as
    softmax, so a row masked whole is refused where values are known (a rank's recording; the logical capture runs
    on fake tensors and the same mask)."""
    if dtype is not None:
        x = aten._to_copy.default(x, dtype=dtype)
    if not isinstance(x, torch._subclasses.FakeTensor) and _masked_whole(x, dim):
        raise CaptureError("_safe_softmax over a row masked whole (every entry -inf), whose 0 a softmax does not give")
    return aten._softmax.default(x, dim, False)


# ATen ops outside our closed op set that PyTorch can rewrite into ops inside it.
DECOMPOSITIONS = {
    **get_decompositions([
        aten.native_layer_norm, aten.native_layer_norm_backward, aten.gelu_backward, aten.tanh_backward,
        aten.silu_backward, aten.sigmoid_backward,
    ]),
    aten.var_mean.correction: _var_mean,
    aten.var_mean.dim: _var_mean_unbiased,
    aten.tril.default: _tril,
    aten._safe_softmax.default: _safe_softmax,
    aten.logical_not.default: lambda x: aten.eq.Scalar(x, 0),
    aten.scalar_tensor.default: lambda value, dtype=None, **_: aten.full.default(
        [], value, dtype=dtype or torch.get_default_dtype()),
}


@dataclass(frozen=True)
class Joint:
    """The traced joint graph and what its placeholders and outputs mean."""

    gm: torch.fx.GraphModule
    params: dict[str, str]           # placeholder -> parameter path
    user_inputs: dict[str, str]      # placeholder -> forward argument name, or a buffer's path (a data input)
    loss: str                        # node holding the loss
    grads: dict[str, str]            # parameter path -> node holding its gradient
    provenance: dict[str, tuple[str, str]]  # node -> (module path, "fwd" | "bwd")
    buffers: tuple[str, ...] = ()    # the buffers' paths (data inputs)


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
def _take_joint():
    """Stop `aot_export_module` where it would re-trace its joint graph (`make_fx` of a function closing over it),
    raising `JointTaken` with that graph."""
    from torch._functorch import aot_autograd       # here, not at import: a traced rank never needs it (1.7 s)
    original = aot_autograd.make_fx

    def make_fx(fn, *args, **kwargs):
        for cell in getattr(fn, "__closure__", None) or ():
            if isinstance(cell.cell_contents, torch.fx.GraphModule):
                raise JointTaken(cell.cell_contents)
        return original(fn, *args, **kwargs)

    aot_autograd.make_fx = make_fx
    try:
        yield
    finally:
        aot_autograd.make_fx = original


def _provenance(graph: torch.fx.GraphModule) -> dict[str, tuple[str, str]]:
    """Each op's (module path, phase) from its annotation and partitioner tag."""
    return {node.name: ((node.meta.get("custom") or {}).get("module", ""),
                        {"is_forward": "fwd", "is_backward": "bwd"}.get(node.meta.get("partitioner_tag"), "fwd"))
            for node in graph.graph.nodes if node.op == "call_function"}


def _joint(graph: torch.fx.GraphModule, wrapper: torch.nn.Module, arg_names: list[str]) -> Joint:
    """What the joint graph's placeholders and outputs are, by position: (parameters, buffers, forward arguments,
    then the loss's tangents, which a joint graph of a loss never reads: dropped) and (the loss, then each
    placeholder's gradient but the tangents')."""
    params = [(path[len("model."):], param) for path, param in wrapper.named_parameters(remove_duplicate=False)]
    held_buffers = list(wrapper.named_buffers(remove_duplicate=False))
    buffers = [path[len("model."):] for path, _ in held_buffers]
    if len({id(b) for _, b in held_buffers}) != len(buffers):
        raise CaptureError(f"a buffer is held under two paths ({', '.join(buffers)}): not supported")
    held = len(params) + len(buffers)
    placeholders = [node for node in graph.graph.nodes if node.op == "placeholder"]
    args = placeholders[held:held + len(arg_names)]
    for node in placeholders[held + len(arg_names):]:
        if node.users:
            raise CaptureError(f"the joint graph reads {node.name}, a tangent of the loss (torch {torch.__version__})")
        graph.graph.erase_node(node)
    outputs = next(node for node in graph.graph.nodes if node.op == "output").args[0]
    if len(args) != len(arg_names) or len(outputs) != 1 + held + len(arg_names):
        raise CaptureError(f"torch {torch.__version__}: the joint graph has {len(placeholders)} inputs and "
                           f"{len(outputs)} outputs for {held} parameters and buffers and {len(arg_names)} forward "
                           f"arguments; expected the loss and a gradient for each (a forward that mutates an input?)")
    grads = {}
    for (path, param), grad in zip(params, outputs[1:]):
        if param.requires_grad:
            if grad is None:
                raise CaptureError(f"parameter {path} receives no gradient from the loss")
            grads[path] = grad
    tied = _untie(graph, placeholders, params, grads)
    return Joint(gm=graph, params={node.name: path for node, (path, _) in zip(placeholders, params)
                                   if path not in tied},
                 user_inputs={node.name: name for node, name in zip(placeholders[len(params):held] + args,
                                                                    buffers + arg_names)}, loss=outputs[0].name,
                 grads={path: grad.name for path, grad in grads.items() if path not in tied},
                 provenance=_provenance(graph), buffers=tuple(buffers))


def _untie(graph: torch.fx.GraphModule, placeholders, params, grads: dict) -> set[str]:
    """A parameter held under several paths (tied: the output layer's weight the input embedding's) traced as one
    input per path, each path's gradient only its own uses' — the step of untied copies. Every later path's
    placeholder is replaced by the first's and its gradient added into the first's (one parameter, one gradient:
    the sum over its uses). Returns the later paths, which name no input or gradient from then on."""
    first: dict[int, str] = {}
    nodes = {path: node for node, (path, _) in zip(placeholders, params)}
    later = set()
    output = next(node for node in graph.graph.nodes if node.op == "output")
    for path, param in params:
        origin = first.setdefault(id(param), path)
        if origin == path:
            continue
        later.add(path)
        nodes[path].replace_all_uses_with(nodes[origin])
        graph.graph.erase_node(nodes[path])
        if path in grads:
            with graph.graph.inserting_before(output):
                total = graph.graph.call_function(torch.ops.aten.add.Tensor, (grads[origin], grads[path]))
            total.meta["val"] = grads[origin].meta["val"]
            total.meta["partitioner_tag"] = "is_backward"
            total.meta["custom"] = {"module": origin.rpartition(".")[0]}
            grads[origin] = total
    return later


def fake_inputs(mode: FakeTensorMode, tensors) -> tuple[FakeTensor, ...]:
    return tuple(mode.from_tensor(t) for t in tensors)


def trace_joint(model: torch.nn.Module, inputs: tuple, mode: FakeTensorMode | None = None) -> Joint:
    """Trace forward + backward of ``loss = model(*inputs)`` (under `mode` if the module is fake)."""
    from torch._functorch import aot_autograd
    wrapper = _LossTuple(model)
    try:
        with contextlib.ExitStack() as stack:
            if mode is not None:
                stack.enter_context(mode)
            stack.enter_context(_annotate_modules(model))
            stack.enter_context(_take_joint())
            stack.enter_context(fx_traceback.preserve_node_meta())
            aot_autograd.aot_export_module(wrapper, inputs, trace_joint=True, output_loss_index=0,
                                           decompositions=DECOMPOSITIONS)
    except JointTaken as taken:
        return _joint(taken.graph, wrapper, _forward_arg_names(model, len(inputs)))
    except CaptureError:
        raise
    except Exception as err:
        raise CaptureError(f"torch could not trace {type(model).__name__}: {type(err).__name__}: {err}") from err
    raise CaptureError(f"torch {torch.__version__}: aot_export_module made no joint graph to re-trace; update "
                       f"tv_ray.frontend.trace._take_joint for this torch version")


def _forward_arg_names(model: torch.nn.Module, count: int) -> list[str]:
    import inspect
    params = [p.name for p in inspect.signature(model.forward).parameters.values()
              if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(params) < count:
        return [f"input{i}" for i in range(count)]
    return params[:count]
