"""The ATen-overload -> IR converter table: one traced joint graph in, one concrete `Graph` out.

Each converter turns one FX node into zero or more IR nodes (zero for aliases
such as ``detach``, several for multi-output ops such as ``nll_loss_forward``).
Shapes and shape arguments are concrete ints here; `fit` turns them into
expressions. An ATen op without a converter is a `CaptureError` naming it and
the module that ran it.
"""
from __future__ import annotations

import functools
import operator
from typing import Any, Callable

import torch

from tv_ray.errors import CaptureError
from tv_ray.frontend.trace import Joint
from tv_ray.ir import Expr, Graph, Node, Op, TensorSpec

aten = torch.ops.aten
_DTYPES = {torch.float16: "float", torch.bfloat16: "float", torch.float32: "float", torch.float64: "float",
           torch.int64: "int", torch.int32: "int", torch.bool: "bool"}
_REDUCTION = {0: "none", 1: "mean", 2: "sum"}


def dtype_name(dtype: torch.dtype, where: str) -> str:
    try:
        return _DTYPES[dtype]
    except KeyError:
        raise CaptureError(f"{where}: dtype {dtype} has no IR dtype (float, int, bool)") from None


class Converter:
    """Walks a `Joint` in order; converters call `emit` and `alias`."""

    converters: dict[Any, Callable]       # ATen overload -> its converter (`CONVERTERS`, set below)

    def __init__(self, joint: Joint, int_highs: dict[str, Any] | None = None):
        self.joint = joint
        self.int_highs = int_highs or {}
        self.nodes: list[Node] = []
        self.names: dict[str, str | tuple[str, ...]] = {}   # fx name -> IR name (tuple: multi-output)
        self.empty: dict[str, str] = {}                     # fx name of empty_like -> its template
        self.topk: dict[str, tuple[str, dict]] = {}         # fx name of topk -> (IR input, attrs)
        self.fx: torch.fx.Node | None = None

    # -- used by converters -------------------------------------------------------
    def arg(self, value: Any) -> str:
        """The IR name of an FX argument."""
        if not isinstance(value, torch.fx.Node):
            raise self.error(f"expected a tensor argument, got {value!r}")
        if value.name in self.empty:
            raise self.error(f"reads {value.name}, an uninitialised empty_like that was never filled")
        name = self.names.get(value.name)
        if not isinstance(name, str):
            raise self.error(f"argument {value.name} has no single IR value ({name!r})")
        if name.endswith(".indices") and name[:-len(".indices")] in self.topk:
            raise self.error(f"reads the indices of {name[:-len('.indices')]}: a top-k's indices are supported "
                             f"only scattered as ones into zeros shaped like its input (a routing mask)")
        return name

    def emit(self, op: Op, args: list[str], attrs: dict | None = None, suffix: str = "",
             val: Any = None) -> str:
        """Add an IR node for the current FX node (shape and dtype from its fake value)."""
        node = self.fx
        val = node.meta["val"] if val is None else val
        name = node.name + suffix
        while suffix and name in self._taken:       # a part's name that an FX node has (stack_1's part 1 of stack)
            name += "_"
        self._taken.add(name)
        self.nodes.append(Node.make(name, op, args, attrs or {}, tuple(int(s) for s in val.shape),
                                    dtype_name(val.dtype, name), self._meta(node)))
        if not suffix:
            self.names[node.name] = name
        return name

    @functools.cached_property
    def _taken(self) -> set[str]:
        """The names in use: every FX node's, and each emitted part's."""
        return {node.name for node in self.joint.gm.graph.nodes}

    def _meta(self, node: torch.fx.Node) -> dict:
        """An IR node's provenance: its module path (or its parameter's module) and phase."""
        module, phase = self.joint.provenance.get(node.name, ("", "fwd"))
        return {"module": module or self._param_module(node), "phase": phase}

    def alias(self, target: str | tuple[str, ...]) -> None:
        self.names[self.fx.name] = target

    def rank(self, value: Any) -> int:
        return len(value.meta["val"].shape)

    def error(self, message: str) -> CaptureError:
        node = self.fx
        module = self.joint.provenance.get(node.name, ("", ""))[0] if node is not None else ""
        where = f"node {node.name} ({node.target}) in module {module or '<root>'!r}" if node is not None else ""
        return CaptureError(f"{where}: {message}")

    def _param_module(self, node: torch.fx.Node) -> str:
        for a in node.all_input_nodes:
            if a.name in self.joint.params:
                return self.joint.params[a.name].rpartition(".")[0]
        return ""

    # -- the walk -------------------------------------------------------------------
    def run(self) -> Graph:
        inputs = _module_order(self._walk(), set(self.joint.buffers))
        return Graph(tuple(inputs), tuple(self.nodes), tuple(self._outputs()), name="logical")

    def _walk(self) -> list[TensorSpec]:
        """Convert every node in order; the graph's inputs."""
        inputs = []
        for node in self.joint.gm.graph.nodes:
            self.fx = node
            if node.op == "placeholder":
                inputs.append(self._input(node))
            elif node.op == "call_function":
                convert = self.converters.get(node.target)
                if convert is None:
                    raise self.error(f"unsupported ATen op {node.target}; add a converter to "
                                     f"tv_ray.frontend.aten.CONVERTERS or a decomposition to "
                                     f"tv_ray.frontend.trace.DECOMPOSITIONS")
                convert(self, *node.args, **node.kwargs)
        self.fx = None
        return inputs

    def _outputs(self) -> list[tuple[str, str]]:
        """The loss, then each parameter's gradient."""
        return [("loss", self.names[self.joint.loss])] + \
            [(f"grad/{p}", self.names[n]) for p, n in self.joint.grads.items()]

    def _input(self, node: torch.fx.Node) -> TensorSpec:
        val = node.meta["val"]
        shape = tuple(int(s) for s in val.shape)
        if node.name in self.joint.params:
            name, role = self.joint.params[node.name], "param"
        elif node.name in self.joint.user_inputs:
            name, role = self.joint.user_inputs[node.name], "data"
        else:
            raise self.error("placeholder is neither a parameter, a buffer nor a forward argument")
        self.names[node.name] = name
        dtype = dtype_name(val.dtype, name)
        return TensorSpec(name, tuple(map(_expr, shape)), dtype, role,
                          _expr(self.int_highs[name]) if name in self.int_highs else None)


def _module_order(inputs: list[TensorSpec], buffers: set[str]) -> list[TensorSpec]:
    """Each buffer right after its module's last parameter, as a module's state dict orders them (a joint graph
    puts every buffer after every parameter), so that one layer's inputs stay together for layer extrapolation."""
    out = [s for s in inputs if s.name not in buffers]
    for position, spec in enumerate(inputs):
        if spec.name in buffers:
            module = spec.name.rpartition(".")[0] + "."
            at = max((i + 1 for i, s in enumerate(out) if s.name.startswith(module)),
                     default=sum(s.name not in buffers for s in inputs[:position]))
            out.insert(at, spec)
    return out


def _expr(value) -> Expr:
    return Expr.const(int(value))


# -- helpers shared by converters ------------------------------------------------------
def _dim(cv: Converter, x, dim: int) -> int:
    return dim % cv.rank(x) if cv.rank(x) else 0


def _out_shape(cv: Converter) -> list[int]:
    return [int(s) for s in cv.fx.meta["val"].shape]


def _scalar(value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(value)
    return float(value)


def _binary(op: Op) -> Callable:
    """a (op) b where either side may be a Python scalar (then it is the attribute `other`)."""
    def convert(cv: Converter, a, b, alpha=None):
        attrs = {} if alpha in (None, 1) else {"alpha": float(alpha)}
        if isinstance(b, torch.fx.Node) and isinstance(a, torch.fx.Node):
            return cv.emit(op, [cv.arg(a), cv.arg(b)], attrs)
        if isinstance(a, torch.fx.Node):
            return cv.emit(op, [cv.arg(a)], {**attrs, "other": _scalar(b)})
        raise cv.error(f"scalar left operand {a!r} is not supported for {op}")
    return convert


def _on_bools(op: Op) -> Callable:
    """A bitwise op on bools (a mask's `&`, `|`) as the logical one; on integers it is no logical op: refused."""
    def convert(cv: Converter, a, b):
        if cv.fx.meta["val"].dtype != torch.bool:
            raise cv.error(f"{cv.fx.target} on {cv.fx.meta['val'].dtype} (only on bools, as a logical op)")
        return _binary(op)(cv, a, b)
    return convert


def _unary(op: Op) -> Callable:
    return lambda cv, x: cv.emit(op, [cv.arg(x)])


def _drop(cv: Converter, x, *_, **__) -> None:
    cv.alias(cv.arg(x))


def _reduce(op: Op) -> Callable:
    def convert(cv: Converter, x, dims=None, keepdim=False, dtype=None):
        dims = range(cv.rank(x)) if not dims else dims
        return cv.emit(op, [cv.arg(x)], {"dims": sorted(_dim(cv, x, d) for d in dims), "keepdim": bool(keepdim)})
    return convert


def _with_dim(op: Op) -> Callable:
    """Ops whose only attribute is a dim of their first argument (softmax family, cat, ...)."""
    def convert(cv: Converter, x, dim, *_):
        return cv.emit(op, [cv.arg(x)], {"dim": _dim(cv, x, dim)})
    return convert


def _backward_with_dim(op: Op) -> Callable:
    def convert(cv: Converter, grad, out, dim, _input_dtype):
        return cv.emit(op, [cv.arg(grad), cv.arg(out)], {"dim": _dim(cv, out, dim)})
    return convert


def _reshape(op: Op) -> Callable:
    """view/expand: the size attribute is the result's shape (resolves -1 entries)."""
    return lambda cv, x, *_, **__: cv.emit(op, [cv.arg(x)], {"size": _out_shape(cv)})


def _slice_bounds(size: int, start, end, step) -> tuple[int, int, int]:
    start, end, _ = slice(start, end, step).indices(size)
    return start, max(start, end), step


# -- converters with arguments of their own ------------------------------------------------
def _arange(cv: Converter, start, end=None, step=1, **kwargs):
    if end is None:
        start, end = 0, start
    return cv.emit(Op.ARANGE, [], {"start": int(start), "end": int(end), "step": int(step),
                                   "dtype": dtype_name(cv.fx.meta["val"].dtype, cv.fx.name)})


def _full(cv: Converter, size, value, **kwargs):
    return cv.emit(Op.FULL, [], {"size": list(size), "value": float(value),
                                 "dtype": dtype_name(cv.fx.meta["val"].dtype, cv.fx.name)})


def _full_like(value: float | None) -> Callable:
    def convert(cv: Converter, x, fill=None, **kwargs):
        return cv.emit(Op.FULL_LIKE, [cv.arg(x)], {"value": float(value if value is not None else fill)})
    return convert


def _empty_like(cv: Converter, x, **kwargs):
    cv.empty[cv.fx.name] = cv.arg(x)


def _fill(cv: Converter, x, value):
    """fill(x, v) is a tensor shaped like x holding v; an empty_like target contributes only its shape."""
    template = cv.empty.pop(x.name) if x.name in cv.empty else cv.arg(x)
    return cv.emit(Op.FULL_LIKE, [template], {"value": float(value)})


def _pow_tensor_scalar(cv: Converter, x, exponent):
    return cv.emit(Op.POW, [cv.arg(x)], {"exponent": float(exponent)})


def _pow_scalar(cv: Converter, base, x):
    return cv.emit(Op.POW, [cv.arg(x)], {"base": float(base)})


def _t(cv: Converter, x):
    if cv.rank(x) < 2:
        return cv.alias(cv.arg(x))
    return cv.emit(Op.TRANSPOSE, [cv.arg(x)], {"dim0": 0, "dim1": 1})


def _transpose(cv: Converter, x, dim0, dim1):
    return cv.emit(Op.TRANSPOSE, [cv.arg(x)], {"dim0": _dim(cv, x, dim0), "dim1": _dim(cv, x, dim1)})


def _permute(cv: Converter, x, dims):
    return cv.emit(Op.PERMUTE, [cv.arg(x)], {"dims": [_dim(cv, x, d) for d in dims]})


def _unsqueeze(cv: Converter, x, dim):
    return cv.emit(Op.UNSQUEEZE, [cv.arg(x)], {"dim": dim % (cv.rank(x) + 1)})


def _squeeze(cv: Converter, x, dim):
    return cv.emit(Op.SQUEEZE, [cv.arg(x)], {"dim": _dim(cv, x, dim)})


def _cat(cv: Converter, xs, dim=0):
    return cv.emit(Op.CAT, [cv.arg(x) for x in xs], {"dim": _dim(cv, xs[0], dim)})


def _slice(cv: Converter, x, dim=0, start=None, end=None, step=1):
    dim = _dim(cv, x, dim)
    start, end, step = _slice_bounds(int(x.meta["val"].shape[dim]), start, end, step)
    return cv.emit(Op.SLICE, [cv.arg(x)], {"dim": dim, "start": start, "end": end, "step": step})


def _slice_backward(cv: Converter, grad, input_sizes, dim, start, end, step):
    dim = dim % len(input_sizes)
    start, end, step = _slice_bounds(int(input_sizes[dim]), start, end, step)
    return cv.emit(Op.SLICE_BACKWARD, [cv.arg(grad)], {"input_size": list(input_sizes), "dim": dim,
                                                       "start": start, "end": end, "step": step})


def _split(cv: Converter, x, split_size, dim=0):
    """split -> one slice per chunk (the getitems then pick them)."""
    size = int(x.meta["val"].shape[_dim(cv, x, dim)])
    _split_with_sizes(cv, x, [min(split_size, size - i * split_size) for i in range(len(cv.fx.meta["val"]))], dim)


def _split_with_sizes(cv: Converter, x, sizes, dim=0):
    """split_with_sizes -> one slice per piece (the getitems then pick them)."""
    dim = _dim(cv, x, dim)
    outs, start = [], 0
    for i, (n, val) in enumerate(zip(sizes, cv.fx.meta["val"])):
        outs.append(cv.emit(Op.SLICE, [cv.arg(x)], {"dim": dim, "start": start, "end": start + int(n), "step": 1},
                            suffix=f"_{i}", val=val))
        start += int(n)
    cv.alias(tuple(outs))


def _chunk(cv: Converter, x, chunks, dim=0):
    """chunk: split into pieces of ceil(size / chunks)."""
    size = int(x.meta["val"].shape[_dim(cv, x, dim)])
    return _split(cv, x, -(-size // chunks), dim)


def _rsub(cv: Converter, x, other, alpha=1):
    """other - alpha*x as add(neg(x) [scaled], other)."""
    if alpha != 1:
        raise cv.error(f"rsub with alpha={alpha} is not supported (only 1)")
    negated = cv.emit(Op.NEG, [cv.arg(x)], suffix="_neg")
    return cv.emit(Op.ADD, [negated], {"other": _scalar(other)})


def _triu(cv: Converter, x, diagonal=0):
    return cv.emit(Op.TRIU, [cv.arg(x)], {"diagonal": int(diagonal)})


def _addmm(cv: Converter, bias, a, b, beta=1, alpha=1):
    """bias + a @ b as add(mm(a, b), bias): the parallelizer splits an mm (and its contraction, as a partial
    sum reduced before the bias is added once) where a fused addmm could only run replicated."""
    if beta != 1 or alpha != 1:
        raise cv.error(f"addmm with beta={beta}, alpha={alpha} is not supported (only 1, 1)")
    product = cv.emit(Op.MM, [cv.arg(a), cv.arg(b)], suffix="_mm")
    return cv.emit(Op.ADD, [product, cv.arg(bias)])


def _gelu(cv: Converter, x, approximate="none"):
    return cv.emit(Op.GELU, [cv.arg(x)], {"approximate": approximate})


def _embedding(cv: Converter, weight, indices, padding_idx=-1, scale_grad_by_freq=False, sparse=False):
    if padding_idx != -1 or scale_grad_by_freq or sparse:
        raise cv.error("embedding with padding_idx, scale_grad_by_freq or sparse is not supported")
    return cv.emit(Op.EMBEDDING, [cv.arg(weight), cv.arg(indices)])


def _embedding_backward(cv: Converter, grad, indices, num_weights, padding_idx, scale_grad_by_freq):
    if padding_idx != -1 or scale_grad_by_freq:
        raise cv.error("embedding backward with padding_idx or scale_grad_by_freq is not supported")
    return cv.emit(Op.EMBEDDING_BACKWARD, [cv.arg(grad), cv.arg(indices)], {"num_weights": int(num_weights)})


def _nll_loss_forward(cv: Converter, logp, target, weight, reduction, ignore_index):
    if weight is not None:
        raise cv.error("nll_loss with class weights is not supported")
    loss_val, total_val = cv.fx.meta["val"]
    args = [cv.arg(logp), cv.arg(target)]
    loss = cv.emit(Op.NLL_LOSS, args, {"reduction": _REDUCTION[reduction], "ignore_index": ignore_index},
                   suffix="", val=loss_val)
    total = cv.emit(Op.NLL_LOSS_TOTAL_WEIGHT, [cv.arg(target)], {"ignore_index": ignore_index}, suffix="_total_weight",
                    val=total_val)
    cv.alias((loss, total))


def _nll_loss_backward(cv: Converter, grad, logp, target, weight, reduction, ignore_index, total_weight):
    if weight is not None:
        raise cv.error("nll_loss with class weights is not supported")
    return cv.emit(Op.NLL_LOSS_BACKWARD, [cv.arg(grad), cv.arg(logp), cv.arg(target), cv.arg(total_weight)],
                   {"reduction": _REDUCTION[reduction], "ignore_index": ignore_index})


def _getitem(cv: Converter, x, index):
    outs = cv.names.get(x.name)
    if not isinstance(outs, tuple):
        raise cv.error(f"getitem on {x.name}, which is not a multi-output op")
    cv.alias(outs[index])


def _where(cv: Converter, cond, a, b):
    """where(cond, a, b); a Python scalar side is a tensor of it shaped like the result."""
    def side(x, tag: str) -> str:
        if isinstance(x, torch.fx.Node):
            return cv.arg(x)
        return cv.emit(Op.FULL, [], {"size": _out_shape(cv), "value": _scalar(x),
                                     "dtype": dtype_name(cv.fx.meta["val"].dtype, cv.fx.name)}, suffix=tag)
    return cv.emit(Op.WHERE, [cv.arg(cond), side(a, "_self"), side(b, "_other")])


def _clamp(cv: Converter, x, min=None, max=None):
    bounds = {k: float(v) for k, v in (("min", min), ("max", max)) if v is not None}
    return cv.emit(Op.CLAMP, [cv.arg(x)], bounds)


def _vector_norm(cv: Converter, x, ord=2, dim=None, keepdim=False, dtype=None):
    """The 2-norm as sqrt(sum(x*x)) (gradient clipping's per-tensor norms)."""
    if ord != 2 or dtype is not None:
        raise cv.error(f"linalg_vector_norm with ord={ord}, dtype={dtype} (only the 2-norm)")
    dims = range(cv.rank(x)) if not dim else dim
    square = cv.emit(Op.MUL, [cv.arg(x), cv.arg(x)], suffix="_sq", val=x.meta["val"])
    total = cv.emit(Op.SUM, [square], {"dims": sorted(_dim(cv, x, d) for d in dims), "keepdim": bool(keepdim)},
                    suffix="_sum")
    return cv.emit(Op.SQRT, [total])


def _stack(cv: Converter, xs, dim=0):
    dim = dim % (cv.rank(xs[0]) + 1)
    parts = [cv.emit(Op.UNSQUEEZE, [cv.arg(x)], {"dim": dim}, suffix=f"_{i}",
                     val=_Val(tuple(x.meta["val"].shape[:dim]) + (1,) + tuple(x.meta["val"].shape[dim:]),
                              x.meta["val"].dtype)) for i, x in enumerate(xs)]
    return cv.emit(Op.CAT, parts, {"dim": dim})


def _addc(op: Op) -> Callable:
    """self + value * (t1 op t2): addcmul, addcdiv (an optimizer's update)."""
    def convert(cv: Converter, x, t1, t2, value=1):
        product = cv.emit(op, [cv.arg(t1), cv.arg(t2)], suffix="_t")
        if value != 1:
            product = cv.emit(Op.MUL, [product], {"other": _scalar(value)}, suffix="_scaled")
        return cv.emit(Op.ADD, [cv.arg(x), product])
    return convert


def _lerp(cv: Converter, x, end, weight):
    """x + weight * (end - x) (AdamW's first moment)."""
    step = cv.emit(Op.SUB, [cv.arg(end), cv.arg(x)], suffix="_diff")
    return cv.emit(Op.ADD, [cv.arg(x), cv.emit(Op.MUL, [step], {"other": _scalar(weight)}, suffix="_scaled")])


def _to(cv: Converter, x, *args, **kwargs):
    """A dtype conversion: an alias where the IR dtype stays (float64 to float32 is float to float), else a cast."""
    want = dtype_name(cv.fx.meta["val"].dtype, cv.fx.name)
    if want == dtype_name(x.meta["val"].dtype, cv.fx.name):
        return cv.alias(cv.arg(x))
    return cv.emit(Op.CAST, [cv.arg(x)], {"dtype": want})


def _masked_fill(cv: Converter, x, mask, value):
    """x with `value` where mask holds: where(mask, value, x)."""
    filled = cv.emit(Op.FULL_LIKE, [cv.arg(x)], {"value": float(value)}, suffix="_fill")
    return cv.emit(Op.WHERE, [cv.arg(mask), filled, cv.arg(x)])


def _index_put(cv: Converter, x, indices, values, accumulate=False):
    """x[mask] = values for one boolean mask over x's leading dims (a vocabulary-parallel embedding zeroing the
    rows of tokens outside its shard): where(mask, values, x), both broadcast to x's shape; and
    x[arange(n), cols] = values on an (n, m) x (a vocabulary-parallel loss's gradient): a scatter along dim 1."""
    kinds = [None if i is None else i.meta["val"].dtype for i in indices]
    if not accumulate and kinds == [torch.bool]:
        return _masked_put(cv, x, indices[0], values)
    cols = None if accumulate else _row_columns(cv, x, indices)
    if cols is not None:
        n = x.meta["val"].shape[0]
        rows = cv.emit(Op.EXPAND, [cv.arg(values)], {"size": [n]}, suffix="_values", val=_Val((n,), values.meta["val"].dtype))
        src = cv.emit(Op.UNSQUEEZE, [rows], {"dim": 1}, suffix="_src", val=_Val((n, 1), values.meta["val"].dtype))
        return cv.emit(Op.SCATTER, [cv.arg(x), cols, src], {"dim": 1})
    raise cv.error(f"index_put with indices {[None if k is None else str(k) for k in kinds]}, "
                   f"accumulate={accumulate}: only one boolean mask, or (arange, columns) on a matrix, not "
                   f"accumulated, is supported")


def _max_dim(cv: Converter, x, dim, keepdim=False):
    """max along a dim: its values (amax); its indices have no IR op (an error where they are read)."""
    values = cv.emit(Op.AMAX, [cv.arg(x)], {"dims": [_dim(cv, x, dim)], "keepdim": bool(keepdim)}, suffix="_values",
                     val=cv.fx.meta["val"][0])
    cv.alias((values, None))


def _index(cv: Converter, x, indices):
    """x[arange(n), cols] on an (n, m) x (a vocabulary-parallel loss reading each row's target logit): a gather
    along dim 1."""
    cols = _row_columns(cv, x, indices)
    if cols is not None:
        n = x.meta["val"].shape[0]
        picked = cv.emit(Op.GATHER, [cv.arg(x), cols], {"dim": 1}, suffix="_picked",
                         val=_Val((n, 1), x.meta["val"].dtype))
        return cv.emit(Op.SQUEEZE, [picked], {"dim": 1})
    kinds = [None if i is None else str(i.meta["val"].dtype) for i in indices]
    raise cv.error(f"index with indices {kinds}: only (arange, columns) on a matrix is supported")


def _row_columns(cv: Converter, x, indices) -> str | None:
    """For indices (arange(n), cols) of an (n, m) x — one column per row — cols as an (n, 1) index; else None."""
    if [None if i is None else i.meta["val"].dtype for i in indices] != [torch.int64, torch.int64] or \
            cv.rank(x) != 2 or not _is_arange(indices[0]):
        return None
    n = x.meta["val"].shape[0]
    if tuple(indices[0].meta["val"].shape) != (n,) or tuple(indices[1].meta["val"].shape) != (n,):
        return None
    return cv.emit(Op.UNSQUEEZE, [cv.arg(indices[1])], {"dim": 1}, suffix="_cols", val=_Val((n, 1), torch.int64))


def _is_arange(node) -> bool:
    """Is the FX node arange(n) from 0 by 1 (through aliases)?"""
    while node.target in (aten.detach.default, aten.alias.default):
        node = node.args[0]
    if node.target is aten.arange.default:
        return True
    if node.target in (aten.arange.start, aten.arange.start_step):
        start = node.args[0]
        step = node.args[2] if len(node.args) > 2 else node.kwargs.get("step", 1)
        return start == 0 and step == 1
    return False


def _masked_put(cv: Converter, x, mask, values):
    shape, val = _out_shape(cv), x.meta["val"]
    lead = len(mask.meta["val"].shape)
    name = cv.arg(mask)
    for k in range(lead, len(shape)):
        name = cv.emit(Op.UNSQUEEZE, [name], {"dim": k}, suffix=f"_mask{k}",
                       val=_Val(tuple(shape[:lead]) + (1,) * (k + 1 - lead), torch.bool))
    mask_full = cv.emit(Op.EXPAND, [name], {"size": shape}, suffix="_mask", val=_Val(tuple(shape), torch.bool))
    fill = cv.emit(Op.EXPAND, [cv.arg(values)], {"size": shape}, suffix="_values", val=val)
    return cv.emit(Op.WHERE, [mask_full, fill, cv.arg(x)])


def _topk(cv: Converter, x, k, dim=-1, largest=True, sorted=True):
    """top-k along a dim: its values (an op of their own); its indices only as a routing mask — scattered as
    ones into zeros shaped like x (`_scatter`) — for the IR has no symbolic integer index chosen by real values."""
    if not largest:
        raise cv.error("topk(largest=False) is not supported")
    attrs = {"k": int(k), "dim": _dim(cv, x, dim)}
    read = any(u.target is operator.getitem and u.args[1] == 0 and u.users for u in cv.fx.users)
    values = cv.emit(Op.TOPK_VALUES, [cv.arg(x)], attrs, suffix="_values", val=cv.fx.meta["val"][0]) if read \
        else None
    cv.topk[cv.fx.name] = (cv.arg(x), attrs)
    cv.alias((values, f"{cv.fx.name}.indices"))


def _routing_mask(cv: Converter, x, dim, index, src) -> str | None:
    """scatter(zeros like s, dim, topk(s, k, dim).indices, 1.0) as topk_mask(s, k, dim); else None."""
    made = index.args[0] if index.target is operator.getitem and index.args[1] == 1 else None
    if made is None or made.name not in cv.topk or src != 1 or not isinstance(x, torch.fx.Node):
        return None
    scores, attrs = cv.topk[made.name]
    name = cv.arg(x)
    zeros = next((n for n in reversed(cv.nodes) if n.name == name), None)     # made just before, as a rule
    same = (zeros is not None and zeros.op in (Op.FULL, Op.FULL_LIKE) and zeros.attr["value"] == 0
            and tuple(x.meta["val"].shape) == tuple(made.args[0].meta["val"].shape)
            and _dim(cv, x, dim) == attrs["dim"])
    return cv.emit(Op.TOPK_MASK, [scores], attrs) if same else None


def _gather(cv: Converter, x, dim, index, sparse_grad=False):
    return cv.emit(Op.GATHER, [cv.arg(x), cv.arg(index)], {"dim": _dim(cv, x, dim)})


def _scatter(op: Op) -> Callable:
    """scatter / scatter_add of a source tensor, or scatter of a scalar value (a tensor of it shaped like index)."""
    def convert(cv: Converter, x, dim, index, src):
        if op == Op.SCATTER and (mask := _routing_mask(cv, x, dim, index, src)) is not None:
            return mask
        if not isinstance(src, torch.fx.Node):
            src = cv.emit(Op.FULL, [], {"size": list(index.meta["val"].shape), "value": _scalar(src),
                                        "dtype": dtype_name(x.meta["val"].dtype, cv.fx.name)},
                          suffix="_src", val=_Val(tuple(index.meta["val"].shape), x.meta["val"].dtype))
        else:
            src = cv.arg(src)
        return cv.emit(op, [cv.arg(x), cv.arg(index), src], {"dim": _dim(cv, x, dim)})
    return convert


class _Val:
    """A shape and dtype for an IR node with no FX node of its own."""

    def __init__(self, shape: tuple, dtype):
        self.shape, self.dtype = shape, dtype


def _mm(op: Op) -> Callable:
    return lambda cv, a, b: cv.emit(op, [cv.arg(a), cv.arg(b)])


CONVERTERS: dict[Any, Callable] = {
    # aliases and plumbing
    aten.detach.default: _drop,
    aten.alias.default: _drop,
    aten.lift_fresh_copy.default: _drop,
    aten.conj_physical.default: _drop,          # the identity on a real tensor (the IR has no complex dtype)
    aten.to.dtype: _to,
    aten.to.device: _to,
    aten.to.dtype_layout: _to,
    aten._to_copy.default: _to,
    operator.getitem: _getitem,
    # constants
    aten.arange.default: _arange,
    aten.arange.start: _arange,
    aten.arange.start_step: _arange,
    aten.full.default: _full,
    aten.zeros.default: lambda cv, size, **kwargs: _full(cv, size, 0.0),
    aten.ones.default: lambda cv, size, **kwargs: _full(cv, size, 1.0),
    aten.ones_like.default: _full_like(1.0),
    aten.zeros_like.default: _full_like(0.0),
    aten.full_like.default: _full_like(None),
    aten.empty_like.default: _empty_like,
    aten.fill.Scalar: _fill,
    aten.triu.default: _triu,
    # matrix products
    aten.mm.default: _mm(Op.MM),
    aten.bmm.default: _mm(Op.BMM),
    aten.addmm.default: _addmm,
    # layout
    aten.view.default: _reshape(Op.VIEW),
    aten._unsafe_view.default: _reshape(Op.VIEW),
    aten.reshape.default: _reshape(Op.VIEW),
    aten.view_as.default: _reshape(Op.VIEW),
    aten.flatten.using_ints: _reshape(Op.VIEW),
    aten.expand.default: _reshape(Op.EXPAND),
    aten.t.default: _t,
    aten.transpose.int: _transpose,
    aten.permute.default: _permute,
    aten.unsqueeze.default: _unsqueeze,
    aten.squeeze.dim: _squeeze,
    aten.clone.default: lambda cv, x, **_: cv.emit(Op.CLONE, [cv.arg(x)]),
    aten.slice.Tensor: _slice,
    aten.slice_backward.default: _slice_backward,
    aten.cat.default: _cat,
    aten.stack.default: _stack,
    aten.split.Tensor: _split,
    aten.split_with_sizes.default: _split_with_sizes,
    aten.chunk.default: _chunk,
    # elementwise
    **{target: _unary(op) for target, op in (
        (aten.neg.default, Op.NEG), (aten.rsqrt.default, Op.RSQRT), (aten.sqrt.default, Op.SQRT),
        (aten.reciprocal.default, Op.RECIPROCAL), (aten.exp.default, Op.EXP), (aten.log.default, Op.LOG),
        (aten.sigmoid.default, Op.SIGMOID), (aten.silu.default, Op.SILU), (aten.tanh.default, Op.TANH),
        (aten.cos.default, Op.COS), (aten.sin.default, Op.SIN), (aten.abs.default, Op.ABS))},
    aten.gelu.default: _gelu,
    **{target: _binary(op) for target, op in (
        (aten.add.Tensor, Op.ADD), (aten.add.Scalar, Op.ADD), (aten.sub.Tensor, Op.SUB),
        (aten.sub.Scalar, Op.SUB), (aten.mul.Tensor, Op.MUL), (aten.mul.Scalar, Op.MUL),
        (aten.div.Tensor, Op.DIV), (aten.div.Scalar, Op.DIV), (aten.maximum.default, Op.MAXIMUM),
        (aten.minimum.default, Op.MINIMUM), (aten.eq.Scalar, Op.EQ), (aten.eq.Tensor, Op.EQ),
        (aten.ne.Scalar, Op.NE), (aten.ne.Tensor, Op.NE),
        (aten.lt.Scalar, Op.LT), (aten.ge.Scalar, Op.GE), (aten.lt.Tensor, Op.LT), (aten.ge.Tensor, Op.GE),
        (aten.logical_or.default, Op.LOGICAL_OR), (aten.logical_and.default, Op.LOGICAL_AND))},
    **{target: _on_bools(op) for target, op in (
        (aten.__or__.Tensor, Op.LOGICAL_OR), (aten.bitwise_or.Tensor, Op.LOGICAL_OR),
        (aten.__and__.Tensor, Op.LOGICAL_AND), (aten.bitwise_and.Tensor, Op.LOGICAL_AND))},
    aten.rsub.Scalar: _rsub,
    aten.pow.Tensor_Scalar: _pow_tensor_scalar,
    aten.pow.Scalar: _pow_scalar,
    aten.pow.Tensor_Tensor: _mm(Op.POW),
    aten.where.self: _where,
    aten.where.ScalarOther: _where,
    aten.where.ScalarSelf: _where,
    aten.masked_fill.Scalar: _masked_fill,
    aten.index_put.default: _index_put,
    aten.clamp.default: _clamp,
    aten._assert_tensor_metadata.default: lambda cv, *_, **__: None,     # a check before a cast: no value
    aten.addcmul.default: _addc(Op.MUL),
    aten.addcdiv.default: _addc(Op.DIV),
    aten.lerp.Scalar: _lerp,
    # reductions
    aten.sum.dim_IntList: _reduce(Op.SUM),
    aten.sum.default: _reduce(Op.SUM),
    aten.mean.dim: _reduce(Op.MEAN),
    aten.mean.default: _reduce(Op.MEAN),
    aten.amax.default: _reduce(Op.AMAX),
    aten.max.dim: _max_dim,
    aten.topk.default: _topk,
    aten.index.Tensor: _index,
    aten.linalg_vector_norm.default: _vector_norm,
    # softmax and loss
    aten._softmax.default: _with_dim(Op.SOFTMAX),
    aten._log_softmax.default: _with_dim(Op.LOG_SOFTMAX),
    aten._softmax_backward_data.default: _backward_with_dim(Op.SOFTMAX_BACKWARD),
    aten._log_softmax_backward_data.default: _backward_with_dim(Op.LOG_SOFTMAX_BACKWARD),
    aten.nll_loss_forward.default: _nll_loss_forward,
    aten.nll_loss_backward.default: _nll_loss_backward,
    # indexing
    aten.embedding.default: _embedding,
    aten.gather.default: _gather,
    aten.scatter.value: _scatter(Op.SCATTER),
    aten.scatter.src: _scatter(Op.SCATTER),
    aten.scatter_add.default: _scatter(Op.SCATTER_ADD),
    aten.embedding_dense_backward.default: _embedding_backward,
}

Converter.converters = CONVERTERS
