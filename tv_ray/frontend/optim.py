"""The optimizer step as explicit IR ops appended to a captured graph (SGD, AdamW, global-norm clipping).

The formulas are torch.optim's, written over the reals:

- clipping (torch.nn.utils.clip_grad_norm_): ``norm = sqrt(sum over every
  gradient of sum(g*g))``, ``coef = min(1, max_norm / (norm + 1e-6))``,
  ``g <- g * coef``;
- SGD: ``p - lr*g``;
- AdamW at step t (the input ``step``, torch's ``state["step"]`` after its
  increment, so t >= 1): ``m' = b1*m + (1-b1)*g``, ``v' = b2*v + (1-b2)*g*g``,
  ``p' = p*(1 - lr*wd) - (lr / (1 - b1^t)) * m' / (sqrt(v') / sqrt(1 - b2^t) + eps)``.

The step is a graph input (role ``step``, positive), so a proof holds for every t.
With ``step_before`` it is torch's ``state["step"]`` before the increment (what a
recorded program reads: `tv_ray.frontend.traced`) and the graph adds one.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import torch

from tv_ray.errors import CaptureError
from tv_ray.frontend.capture import capture
from tv_ray.ir import Graph, Node, Op, TensorSpec
from tv_ray.models.spec import ModelSpec

CLIP_EPS = 1e-6     # torch.nn.utils.clip_grad_norm_ adds this to the norm


@dataclass(frozen=True)
class SGD:
    lr: float = 1e-3


@dataclass(frozen=True)
class AdamW:
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 1e-2


class _Appender:
    """Appends optimizer nodes (phase optim) to a graph; builds a new Graph at the end."""

    def __init__(self, graph: Graph):
        self.graph = graph
        self.inputs = list(graph.inputs)
        self.nodes = list(graph.nodes)
        self.outputs = list(graph.outputs)
        self.shapes: dict[str, tuple] = {}

    def shape(self, name: str) -> tuple:
        return self.shapes[name] if name in self.shapes else tuple(self.graph.shape_of(name))

    def add_input(self, name: str, shape: tuple, role: str, positive: bool = False) -> str:
        self.inputs.append(TensorSpec(name, tuple(shape), "float", role, None, positive))
        self.shapes[name] = tuple(shape)
        return name

    def op(self, name: str, op: Op, args: Sequence[str], module: str, shape: tuple | None = None,
           **attrs) -> str:
        shape = self.shape(args[0]) if shape is None else shape
        self.nodes.append(Node.make(name, op, args, attrs, shape, "float", {"module": module, "phase": "optim"}))
        self.shapes[name] = tuple(shape)
        return name

    def build(self) -> Graph:
        return Graph(tuple(self.inputs), tuple(self.nodes), tuple(self.outputs), self.graph.name)


def _params(graph: Graph) -> list[str]:
    outputs = graph.output_map
    params = [s.name for s in graph.inputs if s.role == "param"]
    missing = [p for p in params if f"grad/{p}" not in outputs]
    if missing:
        raise CaptureError(f"optimizer step: parameters without a gradient output: {missing}")
    return params


def _clip(app: _Appender, grads: Mapping[str, str], max_norm: float) -> dict[str, str]:
    """Gradients scaled by min(1, max_norm / (global norm + 1e-6))."""
    total = None
    for p, g in grads.items():
        square = app.op(f"optim.{p}.grad_sq", Op.MUL, [g, g], p)
        rank = len(app.shape(g))
        part = app.op(f"optim.{p}.grad_sq_sum", Op.SUM, [square], p, shape=(), dims=list(range(rank)),
                      keepdim=False)
        total = part if total is None else app.op(f"optim.{p}.norm_sq_acc", Op.ADD, [total, part], "", shape=())
    norm = app.op("optim.grad_norm", Op.SQRT, [total], "")
    padded = app.op("optim.grad_norm_eps", Op.ADD, [norm], "", other=CLIP_EPS)
    inverse = app.op("optim.grad_norm_inv", Op.RECIPROCAL, [padded], "")
    ratio = app.op("optim.clip_ratio", Op.MUL, [inverse], "", other=float(max_norm))
    coef = app.op("optim.clip_coef", Op.CLAMP, [ratio], "", max=1.0)
    return {p: app.op(f"optim.{p}.grad_clipped", Op.MUL, [g, coef], p) for p, g in grads.items()}


def _sgd(app: _Appender, grads: Mapping[str, str], opt: SGD) -> None:
    for p, g in grads.items():
        scaled = app.op(f"optim.{p}.lr_grad", Op.MUL, [g], p, other=opt.lr)
        app.outputs.append((f"new/{p}", app.op(f"optim.{p}.new", Op.SUB, [p, scaled], p)))


def _one_minus_power(app: _Appender, step: str, base: float, tag: str) -> str:
    """1 - base^step (AdamW's bias correction)."""
    power = app.op(f"optim.{tag}_pow", Op.POW, [step], "", base=base)
    negated = app.op(f"optim.{tag}_neg", Op.NEG, [power], "")
    return app.op(f"optim.{tag}", Op.ADD, [negated], "", other=1.0)


def _adamw(app: _Appender, grads: Mapping[str, str], opt: AdamW, step_before: bool = False) -> None:
    beta1, beta2 = opt.betas
    step = app.add_input("step", (), "step", positive=not step_before)
    if step_before:
        step = app.op("optim.step", Op.ADD, [step], "", other=1.0)
    correction1 = _one_minus_power(app, step, beta1, "bias_correction1")
    correction2 = _one_minus_power(app, step, beta2, "bias_correction2")
    step_size = app.op("optim.step_size", Op.MUL, [app.op("optim.bias_correction1_inv", Op.RECIPROCAL,
                                                          [correction1], "")], "", other=opt.lr)
    correction2_sqrt = app.op("optim.bias_correction2_sqrt", Op.SQRT, [correction2], "")
    for p, g in grads.items():
        shape = app.shape(p)
        m = app.add_input(f"exp_avg/{p}", shape, "state")
        v = app.add_input(f"exp_avg_sq/{p}", shape, "state", positive=True)
        name = f"optim.{p}"
        m_new = app.op(f"{name}.exp_avg", Op.ADD, [app.op(f"{name}.exp_avg_decay", Op.MUL, [m], p, other=beta1),
                                                   app.op(f"{name}.exp_avg_grad", Op.MUL, [g], p, other=1 - beta1)], p)
        grad_sq = app.op(f"{name}.grad_sq_adam", Op.MUL, [g, g], p)
        v_new = app.op(f"{name}.exp_avg_sq", Op.ADD, [
            app.op(f"{name}.exp_avg_sq_decay", Op.MUL, [v], p, other=beta2),
            app.op(f"{name}.exp_avg_sq_grad", Op.MUL, [grad_sq], p, other=1 - beta2)], p)
        denom = app.op(f"{name}.denom", Op.ADD, [app.op(f"{name}.denom_unbiased", Op.DIV, [
            app.op(f"{name}.exp_avg_sq_sqrt", Op.SQRT, [v_new], p), correction2_sqrt], p)], p, other=opt.eps)
        update = app.op(f"{name}.update", Op.MUL, [app.op(f"{name}.ratio", Op.DIV, [m_new, denom], p), step_size], p)
        decayed = app.op(f"{name}.decayed", Op.MUL, [p], p, other=1 - opt.lr * opt.weight_decay)
        app.outputs += [(f"new/{p}", app.op(f"{name}.new", Op.SUB, [decayed, update], p)),
                        (f"new/exp_avg/{p}", m_new), (f"new/exp_avg_sq/{p}", v_new)]


_OPTIMIZERS = (SGD, AdamW)
_BY_NAME = {"sgd": SGD, "adamw": AdamW}


def append_optimizer(graph: Graph, optimizer: SGD | AdamW, clip: float | None = None,
                     step_before: bool = False) -> Graph:
    """A new graph: `graph` followed by the (clipped) optimizer step on every parameter (`step_before`: AdamW's
    step input is the count before this step's increment)."""
    if type(optimizer) not in _OPTIMIZERS:
        raise CaptureError(f"unknown optimizer {optimizer!r}; one of {', '.join(t.__name__ for t in _OPTIMIZERS)}")
    app = _Appender(graph)
    outputs = graph.output_map
    grads = {p: outputs[f"grad/{p}"] for p in _params(graph)}
    if clip is not None:
        grads = _clip(app, grads, clip)
    if isinstance(optimizer, AdamW):
        _adamw(app, grads, optimizer, step_before)
    else:
        _sgd(app, grads, optimizer)
    return app.build()


RECIPE = {"optim": "sgd", "clip": None}     # the training recipe when none is given: the API's and the commands'


def capture_step(model: ModelSpec | torch.nn.Module, inputs: Sequence[torch.Tensor] | None = None, *,
                 optim: str | SGD | AdamW = RECIPE["optim"], clip: float | None = RECIPE["clip"],
                 tied: bool | None = None, step_before: bool = False,
                 extrapolate: bool = True, int_highs: Mapping[str, int] | None = None, **hyper) -> Graph:
    """The full training step: forward, loss, backward and the optimizer update.

    Example::

        g = capture_step(tv_ray.models.get("llama3-tiny"), optim="adamw", clip=1.0, lr=1e-4)
        g.output_map["new/norm.weight"], g.output_map["new/exp_avg_sq/norm.weight"]

    `optim` is ``"sgd"`` / ``"adamw"`` (hyper-parameters as keywords: lr,
    betas, eps, weight_decay) or an `SGD` / `AdamW` instance; `clip` is the
    max global gradient norm; `tied` overrides a spec's tied embeddings;
    `extrapolate` is `capture`'s (repeat the layer block of a deep model);
    `step_before`: AdamW's step input counts the steps before this one.
    """
    if isinstance(optim, str):
        if optim not in _BY_NAME:
            raise CaptureError(f"unknown optimizer {optim!r}; one of {', '.join(_BY_NAME)}")
        try:
            optim = _BY_NAME[optim](**hyper)
        except TypeError as err:
            raise CaptureError(f"optimizer {optim!r}: {err}") from None
    elif hyper:
        raise CaptureError(f"hyper-parameters {sorted(hyper)} given with an optimizer instance; set them on it")
    if tied is not None:
        if not isinstance(model, ModelSpec):
            raise CaptureError("tied= applies to a ModelSpec; a module is captured as built")
        model = model.with_dims(tied=tied)
    return append_optimizer(capture(model, inputs, extrapolate=extrapolate, int_highs=int_highs), optim, clip,
                            step_before)
