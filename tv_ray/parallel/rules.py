"""Sharding rules: for each logical op, the layouts its inputs must have and the layout it produces.

A rule sees the layouts its inputs arrive in and returns a `Decision`: the
layout each input is converted to (by communication the lowering inserts) and
the layout of the result. Every rule is exact: a local op applied to inputs in
the required layouts yields the logical result in the output layout. Ops
without a sharding rule run fully replicated (correct, only slower); an op
missing from both tables is an error naming it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping

from tv_ray.errors import ParallelConfigError
from tv_ray.ir.dims import Expr
from tv_ray.ir.graph import Node
from tv_ray.ir.ops import BINARY, UNARY, Op, registrar
from tv_ray.parallel.layout import ONE, Dim, Factor, Layout, canonical, view_layout

BATCH_AXES = frozenset({"dp", "mb", "cp"})   # on a conflict these stay on the data, not the weights


@dataclass
class Env:
    """What a rule may consult: axis sizes, full dims, logical shapes, which values depend on data."""

    sizes: Mapping[str, int]
    dims: Mapping[str, int]
    shapes: Mapping[str, tuple[Expr, ...]]
    data_dependent: Mapping[str, bool]


@dataclass
class Decision:
    inputs: list[Layout]
    out: Layout
    divide_by: int = 1          # mean over a cut dimension: the local mean is divided by the cut


Rule = Callable[[Node, list[Layout], Env], Decision]
RULES: dict[Op, Rule] = {}
register = registrar(RULES, "sharding rule")


def _uncut(dim: Dim) -> Dim:
    size = ONE
    for f in dim:
        size = size * f.size
    return canonical([Factor(size)])


def _dim_axes(dim: Dim) -> set[str]:
    return {a for f in dim for a in f.axes}


def _no_partial(layouts: list[Layout]) -> list[Layout]:
    return [l.without_partial() for l in layouts]


def _sums_only(layout: Layout) -> Layout:
    """Linear ops (sums, products with a weight) keep partial sums; a partial max must be reduced first."""
    if all(kind == "sum" for _, kind in layout.partial):
        return layout
    return layout.without_partial()


def _common_partial(layouts: list[Layout]) -> tuple | None:
    parts = {l.partial for l in layouts}
    return parts.pop() if len(parts) == 1 else None


# -- elementwise ------------------------------------------------------------------
def _align(node: Node, ins: list[Layout], keep_partial: bool) -> Decision:
    """Broadcasting elementwise: every operand takes the most-cut layout seen on each output dim."""
    rank = len(node.shape)
    target: list[Dim] = []
    used: set[str] = set()
    for d in range(rank):
        choice: Dim | None = None
        for lay in ins:
            k = d - (rank - lay.rank)
            if k < 0 or lay.logical_shape()[k] != node.shape[d]:
                continue
            dim = lay.dims[k]
            axes = _dim_axes(dim)
            if axes and not axes & used and (choice is None or not _dim_axes(choice)):
                choice = dim
        choice = choice or canonical([Factor(node.shape[d])])
        used |= _dim_axes(choice)
        target.append(choice)
    partial = _common_partial(ins) if keep_partial else ()
    # only partial sums pass through linear ops; a partial max does not survive negation or addition
    if partial is None or any(a in used or kind != "sum" for a, kind in partial):
        partial = ()
    reqs = []
    for lay in ins:
        offset = rank - lay.rank
        dims = []
        for k in range(lay.rank):
            size = lay.logical_shape()[k]
            dims.append(target[k + offset] if size == node.shape[k + offset] else canonical([Factor(size)]))
        reqs.append(Layout(tuple(dims), partial))
    return Decision(reqs, Layout(tuple(target), partial))


LINEAR_UNARY = frozenset({Op.NEG, Op.CLONE})


@register(*UNARY)
def _unary(node, ins, env):
    return _align(node, ins, keep_partial=node.op in LINEAR_UNARY)


@register(*BINARY, Op.WHERE, Op.CLAMP)
def _binary(node, ins, env):
    op, scalar = node.op, len(ins) == 1
    if op in (Op.ADD, Op.SUB) and not scalar:
        return _align(node, ins, keep_partial=True)          # sum of partial sums
    if op in (Op.MUL, Op.DIV) and scalar:
        return _align(node, ins, keep_partial=True)          # scaling a partial sum
    if op in (Op.MUL, Op.DIV) and not scalar and ins[0].partial:
        # linear in the first operand: keep its partial sum, reduce the other
        part = ins[0].partial
        dec = _align(node, [l.without_partial() for l in ins], keep_partial=False)
        if not any(a in dec.out.axes() for a, _ in part) and all(k == "sum" for _, k in part):
            dec.inputs[0] = dec.inputs[0].with_partial(dict(part))
            dec.out = dec.out.with_partial(dict(part))
        return dec
    return _align(node, ins, keep_partial=False)


# -- matrix products ------------------------------------------------------------------
def _resolve(a_dim: Dim, b_dim: Dim, axis_taken: set[str]) -> tuple[Dim, Dim]:
    """Two dims that must agree (a contraction or bmm's batch): take the more cut one."""
    for cand in (a_dim, b_dim) if len(_dim_axes(a_dim)) >= len(_dim_axes(b_dim)) else (b_dim, a_dim):
        if not _dim_axes(cand) & axis_taken:
            return cand, cand
    return _uncut(a_dim), _uncut(b_dim)


def _without(dim: Dim, axes: set[str]) -> Dim:
    """`dim` no longer cut by `axes`: each dropped where it is its factor's innermost axis (one all_gather of
    it: an expert layer gathering its ep peers' tokens keeps their dp and microbatch cut), else the dim whole."""
    factors = []
    for f in dim:
        kept = f.axes
        while kept and kept[-1] in axes:
            kept = kept[:-1]
        factors.append(Factor(f.size, kept))
    out = canonical(factors)
    return _uncut(dim) if _dim_axes(out) & axes else out


def _drop_conflicts(m: Dim, n: Dim, a_data: bool, b_data: bool, blocked: set[str]) -> tuple[Dim, Dim]:
    """An axis may cut only one of M, N (and not the contraction): batch axes stay on data, model axes on weights."""
    for axis in sorted(_dim_axes(m) & _dim_axes(n)):
        keep_on_a = a_data if axis in BATCH_AXES else not a_data
        m, n = (m, _uncut(n)) if keep_on_a else (_uncut(m), n)
    return _without(m, blocked), _without(n, blocked)


def _matmul(node: Node, a: Layout, b: Layout, env: Env, batch: bool) -> Decision:
    a_data = env.data_dependent.get(node.args[0], True)
    b_data = env.data_dependent.get(node.args[1], True)
    off = 1 if batch else 0
    partial = {}
    a, b = _sums_only(a), _sums_only(b)
    if a.partial and b.partial:
        a, b = a.without_partial(), b.without_partial()
    # a partial sum over an axis that cuts the other operand: reduce it rather than gather the other
    if {x for x, _ in a.partial} & b.axes():
        a = a.without_partial()
    if {x for x, _ in b.partial} & a.axes():
        b = b.without_partial()
    partial.update(dict(a.partial or b.partial))
    taken = set(partial)
    # batch axes stay on data here too: a weight cut along the contraction (or bmm's batch dim: the experts)
    # by an axis that cuts the data's samples — a ZeRO-3 shard — is gathered, not matched there; that would
    # gather the samples instead, every microbatch's at once, and make each backward wait for the last forward
    on_data = _dim_axes(a.dims[off]) if a_data and not b_data else \
        _dim_axes(b.dims[off + 1]) if b_data and not a_data else set()
    samples = on_data & BATCH_AXES
    bdim: tuple[Dim, Dim] | tuple = ()
    if batch:
        bdim = _resolve(a.dims[0], b.dims[0], taken | samples)
        taken |= _dim_axes(bdim[0])
    k_a, k_b = _resolve(a.dims[off + 1], b.dims[off], taken | samples)
    taken |= _dim_axes(k_a)
    m, n = _drop_conflicts(a.dims[off], b.dims[off + 1], a_data, b_data, taken)
    for axis in _dim_axes(k_a):
        partial[axis] = "sum"
    lead_a, lead_b = (bdim[0],) if batch else (), (bdim[1],) if batch else ()
    req_a = Layout(lead_a + (m, k_a), a.partial)
    req_b = Layout(lead_b + (k_b, n), b.partial)
    return Decision([req_a, req_b], Layout.make(lead_a + (m, n), partial))


@register(Op.MM)
def _mm(node, ins, env):
    return _matmul(node, ins[0], ins[1], env, batch=False)


@register(Op.BMM)
def _bmm(node, ins, env):
    return _matmul(node, ins[0], ins[1], env, batch=True)


# -- reductions -----------------------------------------------------------------------
@register(Op.SUM, Op.MEAN, Op.AMAX)
def _reduce(node, ins, env):
    (x,) = ins
    x = x.without_partial() if node.op == Op.AMAX else _sums_only(x)
    reduced = {d % x.rank for d in node.attr["dims"]} if node.attr["dims"] else set(range(x.rank))
    kind = "max" if node.op == Op.AMAX else "sum"
    partial = dict(x.partial)
    divide = 1
    out_dims = []
    for d in range(x.rank):
        if d in reduced:
            for axis in _dim_axes(x.dims[d]):
                partial[axis] = kind
                divide *= env.sizes[axis]
            if node.attr["keepdim"]:
                out_dims.append((Factor(ONE),))
        else:
            out_dims.append(x.dims[d])
    return Decision([x], Layout.make(out_dims, partial), divide if node.op == Op.MEAN else 1)


# -- layout ops -------------------------------------------------------------------------
@register(Op.VIEW)
def _view(node, ins, env):
    return Decision(ins, view_layout(ins[0], node.shape, env.sizes, env.dims, f"view {node.name}"))


@register(Op.PERMUTE, Op.TRANSPOSE)
def _permute(node, ins, env):
    (x,) = ins
    if node.op == Op.PERMUTE:
        order = [d % x.rank for d in node.attr["dims"]]
    else:
        order = list(range(x.rank))
        i, j = node.attr["dim0"] % x.rank, node.attr["dim1"] % x.rank
        order[i], order[j] = order[j], order[i]
    return Decision([x], Layout(tuple(x.dims[d] for d in order), x.partial))


@register(Op.UNSQUEEZE)
def _unsqueeze(node, ins, env):
    (x,) = ins
    d = node.attr["dim"] % (x.rank + 1)
    dims = list(x.dims)
    dims.insert(d, (Factor(ONE),))
    return Decision([x], Layout(tuple(dims), x.partial))


@register(Op.SQUEEZE)
def _squeeze(node, ins, env):
    (x,) = ins
    d = node.attr["dim"] % x.rank
    if x.logical_shape()[d] != ONE:
        return Decision([x], x)
    return Decision([x], Layout(x.dims[:d] + x.dims[d + 1:], x.partial))


@register(Op.EXPAND)
def _expand(node, ins, env):
    (x,) = ins
    size = node.attr["size"]
    offset = len(size) - x.rank
    dims = []
    for d, s in enumerate(size):
        k = d - offset
        if k >= 0 and x.logical_shape()[k] == Expr.of(s) or (k >= 0 and s == -1):
            dims.append(x.dims[k])
        else:
            dims.append(canonical([Factor(node.shape[d])]))
    return Decision([x], Layout.make(dims, x.partial))


def _whole_dims(x: Layout, dims: set[int], keep_partial: bool = True) -> Layout:
    out = Layout(tuple(_uncut(x.dims[d]) if d in dims else x.dims[d] for d in range(x.rank)), x.partial)
    return out if keep_partial else out.without_partial()


@register(Op.SLICE)
def _slice(node, ins, env):
    x = _whole_dims(ins[0], {node.attr["dim"] % ins[0].rank})
    d = node.attr["dim"] % x.rank
    return Decision([x], x.with_dim(d, [Factor(node.shape[d])]))


@register(Op.SELECT)
def _select(node, ins, env):
    d = node.attr["dim"] % ins[0].rank
    x = _whole_dims(ins[0], {d})
    return Decision([x], Layout(x.dims[:d] + x.dims[d + 1:], x.partial))


@register(Op.SLICE_BACKWARD)
def _slice_backward(node, ins, env):
    d = node.attr["dim"] % ins[0].rank
    x = _whole_dims(ins[0], {d})
    return Decision([x], x.with_dim(d, [Factor(node.shape[d])]))


@register(Op.CAT)
def _cat(node, ins, env):
    d = node.attr["dim"] % len(node.shape)
    whole = [_whole_dims(l, {d}) for l in ins]
    partial = _common_partial(whole)
    # every input takes the first input's layout on the other dims
    ref = whole[0] if partial is not None else whole[0].without_partial()
    reqs = [ref.with_dim(d, l.dims[d]) for l in whole]
    return Decision(reqs, ref.with_dim(d, [Factor(node.shape[d])]))


@register(Op.TRIU)
def _triu(node, ins, env):
    x = _whole_dims(ins[0], {ins[0].rank - 1, ins[0].rank - 2}, keep_partial=False)
    return Decision([x], x)


# -- creation ------------------------------------------------------------------------
@register(Op.FULL, Op.ARANGE)
def _create(node, ins, env):
    return Decision([], Layout.replicated(node.shape))


@register(Op.FULL_LIKE)
def _full_like(node, ins, env):
    return Decision(ins, ins[0].without_partial())


# -- softmax and loss -------------------------------------------------------------------
@register(Op.SOFTMAX, Op.LOG_SOFTMAX)
def _softmax(node, ins, env):
    x = _whole_dims(ins[0], {node.attr["dim"] % ins[0].rank}, keep_partial=False)
    return Decision([x], x)


@register(Op.TOPK_MASK)
def _topk_mask(node, ins, env):
    """Each line along dim picks its own top k: the line whole, every other dim as it comes."""
    x = _whole_dims(ins[0], {node.attr["dim"] % ins[0].rank}, keep_partial=False)
    return Decision([x], x)


@register(Op.SOFTMAX_BACKWARD, Op.LOG_SOFTMAX_BACKWARD)
def _softmax_backward(node, ins, env):
    d = node.attr["dim"] % ins[0].rank
    dec = _align(node, [_whole_dims(l, {d}, keep_partial=False) for l in ins], keep_partial=False)
    return dec


def _rows(logp: Layout, target: Layout, node: Node) -> tuple[Layout, Layout]:
    """nll_loss: the class dim whole, the rows of logp laid out as the target's."""
    classes = logp.rank - 1
    logp = _whole_dims(logp, {classes}, keep_partial=False)
    target = target.without_partial()
    if logp.rank == 2:
        row = target.dims[0] if _dim_axes(target.dims[0]) else logp.dims[0]
        logp = logp.with_dim(0, row)
        target = target.with_dim(0, row)
    return logp, target


@register(Op.NLL_LOSS)
def _nll_loss(node, ins, env):
    logp, target = _rows(ins[0], ins[1], node)
    if node.attr["reduction"] == "none":
        return Decision([logp, target], Layout(target.dims))
    if node.attr["reduction"] == "mean" and target.axes():
        raise ParallelConfigError(f"{node.name}: nll_loss(mean) over rows cut by {sorted(target.axes())} "
                                  f"must be split into sum / total weight first (tv_ray.parallel.prepare)")
    return Decision([logp, target], Layout((), tuple(sorted((a, "sum") for a in target.axes()))))


@register(Op.NLL_LOSS_TOTAL_WEIGHT)
def _nll_total_weight(node, ins, env):
    target = ins[0].without_partial()
    return Decision([target], Layout((), tuple(sorted((a, "sum") for a in target.axes()))))


@register(Op.NLL_LOSS_BACKWARD)
def _nll_loss_backward(node, ins, env):
    grad, logp, target, total = ins
    logp, target = _rows(logp, target, node)
    return Decision([grad.without_partial(), logp, target, total.without_partial()], logp)


# -- embedding -----------------------------------------------------------------------------
@register(Op.EMBEDDING)
def _embedding(node, ins, env):
    weight, idx = ins
    idx = idx.without_partial()
    weight = _whole_dims(_sums_only(weight), {0})
    col = weight.dims[1]
    if _dim_axes(col) & idx.axes():
        col = _uncut(col)
    weight = weight.with_dim(1, col)
    return Decision([weight, idx], Layout(idx.dims + (col,), weight.partial))


@register(Op.EMBEDDING_BACKWARD)
def _embedding_backward(node, ins, env):
    grad, idx = ins
    grad, idx = _sums_only(grad), idx.without_partial()
    grad_lead = Layout(grad.dims[:-1])
    lead = grad_lead.dims if len(grad_lead.axes()) > len(idx.axes()) else idx.dims   # cutting the ids is free
    col = grad.dims[-1]
    lead_axes = Layout(lead).axes()
    if _dim_axes(col) & lead_axes:
        col = _uncut(col)
    partial = dict(grad.partial)
    for a in lead_axes:
        partial[a] = "sum"
    req_grad = Layout(lead + (col,), grad.partial)
    return Decision([req_grad, Layout(lead)], Layout.make([[Factor(node.shape[0])], col], partial))


# -- everything else runs replicated ---------------------------------------------------------
REPLICATED = frozenset({Op.GATHER, Op.SCATTER, Op.SCATTER_ADD, Op.INDEX_SELECT, Op.INDEX_ADD,
                        Op.TOPK_VALUES, Op.TOPK_INDICES, Op.ADDMM})


@register(*REPLICATED)
def _replicated(node, ins, env):
    return Decision([Layout.replicated(l.logical_shape()) for l in ins], Layout.replicated(node.shape))


def decide(node: Node, ins: list[Layout], env: Env) -> Decision:
    try:
        rule = RULES[node.op]
    except KeyError:
        raise ParallelConfigError(f"node {node.name}: op {node.op} has no sharding rule "
                                  f"(communication ops cannot appear in a logical graph)") from None
    return rule(node, ins, env)
