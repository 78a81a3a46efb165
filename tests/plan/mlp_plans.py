"""Small hand-built plans for a 2-layer MLP step (tp, dp, dp×tp with ZeRO-style reduce_scatter, pp).

The logical step: ``y = tanh(x·w1)·w2``, ``loss = sum(y²)`` (or the mean),
backward by hand, then SGD on w1, w2 and a momentum buffer for w1. Each
builder returns a plan as a JSON object (so tests can mutate it as text would
be) and takes switches that plant the bugs the tests look for.
"""
from __future__ import annotations

import copy
from typing import Any

DIMS = {"batch": 4, "d": 4, "ffn": 8}
LR, MOMENTUM = 0.1, 0.9


class Builder:
    """Appends inputs and ops to one SSA graph in plan JSON form."""

    def __init__(self):
        self.inputs: list[dict] = []
        self.ops: list[dict] = []
        self.outputs: dict[str, str] = {}

    def input(self, name: str, shape: list, role: str = "activation", **extra: Any) -> str:
        self.inputs.append({"name": name, "shape": shape, "dtype": "float", "role": role, **extra})
        return name

    def op(self, out: str, op: str, args: list[str], shape: list, **attrs: Any) -> str:
        entry: dict[str, Any] = {"out": out, "op": op, "args": args, "shape": shape}
        if "dtype" in attrs and op != "recv":
            entry["dtype"] = attrs.pop("dtype")
        if attrs:
            entry["attrs"] = attrs
        self.ops.append(entry)
        return out

    def json(self) -> dict:
        return {"inputs": self.inputs, "ops": self.ops, "outputs": self.outputs}


def forward_backward(g: Builder, x: str, w1: str, w2: str, batch: str, ffn: str, *, sfx: str = "",
                     reduce_y: list[str] | None = None, loss: str = "sum", dy_scale: float = 2.0) -> dict:
    """Forward, loss and backward of one (micro)batch; returns the names of loss, dw1, dw2."""
    h = g.op(f"h{sfx}", "mm", [x, w1], [batch, ffn])
    a = g.op(f"a{sfx}", "tanh", [h], [batch, ffn])
    y = g.op(f"p{sfx}", "mm", [a, w2], [batch, "d"])
    if reduce_y:
        y = g.op(f"y{sfx}", "all_reduce", [y], [batch, "d"], axes=reduce_y, reduce="sum")
    sq = g.op(f"sq{sfx}", "mul", [y, y], [batch, "d"])
    out = g.op(f"loss{sfx}", loss, [sq], [], dims=[0, 1], keepdim=False)
    dy = g.op(f"dy{sfx}", "mul", [y], [batch, "d"], other=dy_scale)
    da, dw2 = backward_second(g, a, w2, dy, batch, ffn, sfx)
    dw1 = backward_first(g, x, a, da, batch, ffn, sfx)
    return {"loss": out, "dw1": dw1, "dw2": dw2}


def backward_second(g: Builder, a: str, w2: str, dy: str, batch: str, ffn: str, sfx: str) -> tuple[str, str]:
    w2t = g.op(f"w2t{sfx}", "transpose", [w2], ["d", ffn], dim0=0, dim1=1)
    da = g.op(f"da{sfx}", "mm", [dy, w2t], [batch, ffn])
    at = g.op(f"at{sfx}", "transpose", [a], [ffn, batch], dim0=0, dim1=1)
    return da, g.op(f"dw2{sfx}", "mm", [at, dy], [ffn, "d"])


def backward_first(g: Builder, x: str, a: str, da: str, batch: str, ffn: str, sfx: str) -> str:
    a2 = g.op(f"a2{sfx}", "mul", [a, a], [batch, ffn])
    dtanh = g.op(f"dtanh{sfx}", "neg", [g.op(f"a2m1{sfx}", "sub", [a2], [batch, ffn], other=1.0)], [batch, ffn])
    dh = g.op(f"dh{sfx}", "mul", [da, dtanh], [batch, ffn])
    xt = g.op(f"xt{sfx}", "transpose", [x], ["d", batch], dim0=0, dim1=1)
    return g.op(f"dw1{sfx}", "mm", [xt, dh], ["d", ffn])


def sgd(g: Builder, param: str, grad: str, shape: list, out_prefix: str = "") -> None:
    g.outputs[f"grad/{param}"] = grad
    g.outputs[f"new/{param}"] = g.op(f"new_{param}", "sub", [param if not out_prefix else out_prefix + param, grad],
                                     shape, alpha=LR)


def momentum(g: Builder, state: str, grad: str, shape: list) -> None:
    scaled = g.op("m_scaled", "mul", [state], shape, other=MOMENTUM)
    g.outputs[f"new/{state}"] = g.op("new_m", "add", [scaled, grad], shape)


def logical(loss: str = "sum") -> dict:
    """The single-device step."""
    g = Builder()
    x = g.input("x", ["batch", "d"], "data")
    g.input("w1", ["d", "ffn"], "param")
    g.input("w2", ["ffn", "d"], "param")
    g.input("exp_avg/w1", ["d", "ffn"], "state")
    scale = 2.0 if loss == "sum" else 2.0 / (DIMS["batch"] * DIMS["d"])
    names = forward_backward(g, x, "w1", "w2", "batch", "ffn", loss=loss, dy_scale=scale)
    g.outputs["loss"] = names["loss"]
    sgd(g, "w1", names["dw1"], ["d", "ffn"])
    sgd(g, "w2", names["dw2"], ["ffn", "d"])
    momentum(g, "exp_avg/w1", names["dw1"], ["d", "ffn"])
    return g.json()


def entry(tensor: str, logical_name: str | None = None, where: dict | None = None, slice_: list | None = None,
          partial: list | None = None) -> dict:
    out: dict[str, Any] = {"where": where or {}, "tensor": tensor, "logical": logical_name or tensor}
    if slice_:
        out["slice"] = [{"dim": dim, "split": split} for dim, split in slice_]
    if partial:
        out["partial"] = partial
    return out


def plan(mesh: dict, programs: dict, lineage: list, *, ranks: Any = None, loss: str = "sum",
         microbatches: int = 1) -> dict:
    return {"format": "tv-ray-plan/1", "model": "mlp2", "dims": dict(DIMS), "mesh": mesh,
            "microbatches": microbatches, "schedule": "1f1b" if microbatches > 1 else "none",
            "logical": logical(loss), "programs": programs,
            "ranks": ranks if isinstance(ranks, dict) else {"program": ranks or next(iter(programs))},
            "lineage": lineage}


OUTPUTS = ("loss", "grad/w1", "grad/w2", "new/w1", "new/w2", "new/exp_avg/w1")


def tp_plan(all_reduce: bool = True) -> dict:
    """Megatron tp=2: w1 split by columns, w2 by rows, one all_reduce of the second matmul."""
    g = Builder()
    x = g.input("x", ["batch", "d"], "data")
    g.input("w1", ["d", "ffn/2"], "param")
    g.input("w2", ["ffn/2", "d"], "param")
    g.input("exp_avg/w1", ["d", "ffn/2"], "state")
    names = forward_backward(g, x, "w1", "w2", "batch", "ffn/2", reduce_y=["tp"] if all_reduce else None)
    g.outputs["loss"] = names["loss"]
    sgd(g, "w1", names["dw1"], ["d", "ffn/2"])
    sgd(g, "w2", names["dw2"], ["ffn/2", "d"])
    momentum(g, "exp_avg/w1", names["dw1"], ["d", "ffn/2"])
    cols, rows = [(1, ["tp"])], [(0, ["tp"])]
    lineage = [entry("x"), entry("w1", slice_=cols), entry("w2", slice_=rows), entry("exp_avg/w1", slice_=cols),
               entry("loss"), entry("grad/w1", slice_=cols), entry("new/w1", slice_=cols),
               entry("new/exp_avg/w1", slice_=cols), entry("grad/w2", slice_=rows), entry("new/w2", slice_=rows)]
    return plan({"tp": 2}, {"tp": g.json()}, lineage)


def dp_program(loss: str = "sum", divisor_batch: str = "batch/2", reduce: str = "sum") -> dict:
    """A dp rank: the whole model on its batch half; gradients all-reduced over dp."""
    g = Builder()
    x = g.input("x", ["batch/2", "d"], "data")
    g.input("w1", ["d", "ffn"], "param")
    g.input("w2", ["ffn", "d"], "param")
    g.input("exp_avg/w1", ["d", "ffn"], "state")
    local_batch = {"batch/2": DIMS["batch"] // 2, "batch": DIMS["batch"]}[divisor_batch]
    scale = 2.0 if loss == "sum" else 2.0 / (local_batch * DIMS["d"])
    names = forward_backward(g, x, "w1", "w2", "batch/2", "ffn", loss=loss, dy_scale=scale)
    grads = {k: g.op(f"{k}_red", "all_reduce", [names[k]], shape, axes=["dp"], reduce=reduce)
             for k, shape in (("dw1", ["d", "ffn"]), ("dw2", ["ffn", "d"]))}
    g.outputs["loss"] = names["loss"] if loss == "sum" else \
        g.op("loss_avg", "all_reduce", [names["loss"]], [], axes=["dp"], reduce="avg")
    sgd(g, "w1", grads["dw1"], ["d", "ffn"])
    sgd(g, "w2", grads["dw2"], ["ffn", "d"])
    momentum(g, "exp_avg/w1", grads["dw1"], ["d", "ffn"])
    return g.json()


def dp_plan(loss: str = "sum", overrides: dict | None = None) -> dict:
    """dp=2. With loss = sum the loss stays a partial sum over dp (lineage `partial`); with mean it is averaged.

    `overrides` maps ranks to other programs: a name ending in ``_bug`` gets the mean's divisor wrong.
    """
    reduce = "sum" if loss == "sum" else "avg"
    programs = {"dp": dp_program(loss, reduce=reduce)}
    for name in set((overrides or {}).values()) - {"dp"}:   # "*_bug" programs divide by the wrong batch size
        programs[name] = dp_program(loss, divisor_batch="batch" if name.endswith("_bug") else "batch/2",
                                    reduce=reduce)
    lineage = [entry("x", slice_=[(0, ["dp"])]), entry("w1"), entry("w2"), entry("exp_avg/w1"),
               entry("loss", partial=["dp"] if loss == "sum" else None)]
    lineage += [entry(name) for name in OUTPUTS[1:]]
    return plan({"dp": 2}, programs, lineage, loss=loss,
                ranks={"program": "dp", "overrides": overrides} if overrides else "dp")


def zero_plan(rs_axes: tuple[str, ...] = ("dp",)) -> dict:
    """dp=2 × tp=2 Megatron; gradients reduce-scattered over dp (dim 0) and each dp rank updates its shard."""
    g = Builder()
    x = g.input("x", ["batch/2", "d"], "data")
    g.input("w1", ["d", "ffn/2"], "param")
    g.input("w2", ["ffn/2", "d"], "param")
    g.input("shard/w1", ["d/2", "ffn/2"], "param")
    g.input("shard/w2", ["ffn/4", "d"], "param")
    g.input("exp_avg/w1", ["d/2", "ffn/2"], "state")
    names = forward_backward(g, x, "w1", "w2", "batch/2", "ffn/2", reduce_y=["tp"])
    dw1 = g.op("dw1_rs", "reduce_scatter", [names["dw1"]], ["d/2", "ffn/2"], axes=list(rs_axes), dim=0,
               reduce="sum")
    dw2 = g.op("dw2_rs", "reduce_scatter", [names["dw2"]], ["ffn/4", "d"], axes=["dp"], dim=0, reduce="sum")
    g.outputs["loss"] = names["loss"]
    sgd(g, "w1", dw1, ["d/2", "ffn/2"], out_prefix="shard/")
    sgd(g, "w2", dw2, ["ffn/4", "d"], out_prefix="shard/")
    momentum(g, "exp_avg/w1", dw1, ["d/2", "ffn/2"])
    w1_shard, w2_shard = [(0, ["dp"]), (1, ["tp"])], [(0, ["tp", "dp"])]
    lineage = [entry("x", slice_=[(0, ["dp"])]), entry("w1", slice_=[(1, ["tp"])]),
               entry("w2", slice_=[(0, ["tp"])]), entry("shard/w1", "w1", slice_=w1_shard),
               entry("shard/w2", "w2", slice_=w2_shard), entry("exp_avg/w1", slice_=w1_shard),
               entry("loss", partial=["dp"])]
    lineage += [entry(name, slice_=w1_shard) for name in ("grad/w1", "new/w1", "new/exp_avg/w1")]
    lineage += [entry(name, slice_=w2_shard) for name in ("grad/w2", "new/w2")]
    return plan({"dp": 2, "tp": 2}, {"zero": g.json()}, lineage)


def pp_stage0(recv_first: bool = False, peer: dict | None = None) -> dict:
    """Pipeline stage 0 of 2 with two microbatches: first layer; sends activations, receives their gradients."""
    peer = peer or {"pp": 1}
    g = Builder()
    xs = [g.input(f"x.mb{mb}", ["batch/2", "d"], "data") for mb in range(2)]
    g.input("w1", ["d", "ffn"], "param")
    g.input("exp_avg/w1", ["d", "ffn"], "state")
    acts = []
    for mb, x in enumerate(xs):
        if recv_first and mb == 0:   # the bug: waits for a gradient before sending anything
            g.op("da.mb0", "recv", [], ["batch/2", "ffn"], peer=peer, size=["batch/2", "ffn"], dtype="float", tag=0)
        h = g.op(f"h.mb{mb}", "mm", [x, "w1"], ["batch/2", "ffn"])
        acts.append(g.op(f"a.mb{mb}", "tanh", [h], ["batch/2", "ffn"]))
        g.op(f"sent_a.mb{mb}", "send", [acts[-1]], [], peer=peer, tag=mb, dtype="token")
    dws = []
    for mb, (x, a) in enumerate(zip(xs, acts)):
        if not (recv_first and mb == 0):
            g.op(f"da.mb{mb}", "recv", [], ["batch/2", "ffn"], peer=peer, size=["batch/2", "ffn"], dtype="float",
                 tag=mb)
        dws.append(backward_first(g, x, a, f"da.mb{mb}", "batch/2", "ffn", f".mb{mb}"))
    dw1 = g.op("dw1", "add", dws, ["d", "ffn"])
    sgd(g, "w1", dw1, ["d", "ffn"])
    momentum(g, "exp_avg/w1", dw1, ["d", "ffn"])
    return g.json()


def pp_stage1(swap_tags: bool = False) -> dict:
    """Pipeline stage 1 of 2: second layer, loss and its backward; sends activation gradients back."""
    g = Builder()
    g.input("w2", ["ffn", "d"], "param")
    losses, dws = [], []
    for mb in range(2):
        tag = 1 - mb if swap_tags else mb
        a = g.op(f"a.mb{mb}", "recv", [], ["batch/2", "ffn"], peer={"pp": -1}, size=["batch/2", "ffn"],
                 dtype="float", tag=tag)
        y = g.op(f"p.mb{mb}", "mm", [a, "w2"], ["batch/2", "d"])
        sq = g.op(f"sq.mb{mb}", "mul", [y, y], ["batch/2", "d"])
        losses.append(g.op(f"loss.mb{mb}", "sum", [sq], [], dims=[0, 1], keepdim=False))
        dy = g.op(f"dy.mb{mb}", "mul", [y], ["batch/2", "d"], other=2.0)
        da, dw2 = backward_second(g, a, "w2", dy, "batch/2", "ffn", f".mb{mb}")
        g.op(f"sent_da.mb{mb}", "send", [da], [], peer={"pp": -1}, tag=mb, dtype="token")
        dws.append(dw2)
    g.outputs["loss"] = g.op("loss", "add", losses, [])
    sgd(g, "w2", g.op("dw2", "add", dws, ["ffn", "d"]), ["ffn", "d"])
    return g.json()


def pp_plan(recv_first: bool = False, swap_tags: bool = False) -> dict:
    """pp=2 with 2 microbatches; send/recv tagged by microbatch."""
    programs = {"stage0": pp_stage0(recv_first), "stage1": pp_stage1(swap_tags)}
    first, last = {"pp": 0}, {"pp": 1}
    lineage = [entry(f"x.mb{mb}", "x", first, [(0, [{"index": mb, "of": 2}])]) for mb in range(2)]
    lineage += [entry("w1", where=first), entry("exp_avg/w1", where=first), entry("w2", where=last)]
    lineage += [entry(name, where=first) for name in ("grad/w1", "new/w1", "new/exp_avg/w1")]
    lineage += [entry(name, where=last) for name in ("loss", "grad/w2", "new/w2")]
    return plan({"pp": 2}, programs, lineage, ranks="stage{pp}", microbatches=2)


def mutated(obj: dict) -> dict:
    """A deep copy to mutate."""
    return copy.deepcopy(obj)
