"""Vocabulary-parallel forms: embedding and cross-entropy rewritten so a vocab-cut weight shards by the generic rules.

Megatron splits the embedding table and the output layer over tp along the
vocabulary. Written as one-hot products — ``embedding(W, ids) = onehot(ids) @ W``,
``log_softmax(x) = (x - max x) - log Σ exp(x - max x)``, ``nll = -Σ onehot(t)·logp`` —
every step is an op whose sharding rule is already exact: the one-hot matrix
is cut locally (each rank compares ids with its own slice of ``arange(V)``,
masking ids outside its range), contractions over the cut vocabulary become
partial sums, and max/sum over it become all-reduces. The rewrites are exact
identities over the reals; the logical graph in the plan stays the captured one.
"""
from __future__ import annotations

from typing import Mapping

from tv_ray.ir.dims import Expr
from tv_ray.ir.graph import Graph, Node
from tv_ray.ir.ops import Op


class _Builder:
    def __init__(self, node: Node):
        self.base, self.meta, self.nodes = node.name, dict(node.meta), []

    def __call__(self, suffix: str, op: Op, args, attrs: Mapping | None = None, shape=(), dtype: str = "float",
                 name: str | None = None) -> str:
        out = name or f"{self.base}.{suffix}"
        self.nodes.append(Node.make(out, op, args, attrs or {}, shape, dtype, self.meta))
        return out

    def onehot(self, ids: str, ids_shape, vocab: Expr) -> str:
        """[*ids_shape, V] float: 1 where the id equals the column (ids outside [0, V) give a zero row)."""
        col = self("cols", Op.ARANGE, [], {"start": 0, "end": vocab, "step": 1, "dtype": "int"}, (vocab,), "int")
        ids1 = self("ids1", Op.UNSQUEEZE, [ids], {"dim": len(ids_shape)}, (*ids_shape, 1), "int")
        hit = self("hit", Op.EQ, [ids1, col], {}, (*ids_shape, vocab), "bool")
        return self("onehot", Op.CAST, [hit], {"dtype": "float"}, (*ids_shape, vocab))


def _rows(shape) -> Expr:
    n = Expr.const(1)
    for d in shape:
        n = n * d
    return n


def _embedding(node: Node, g: Graph) -> list[Node]:
    weight, ids = node.args
    vocab, width = g.shape_of(weight)
    ids_shape = g.shape_of(ids)
    b = _Builder(node)
    onehot = b.onehot(ids, ids_shape, vocab)
    flat = b("flat", Op.VIEW, [onehot], {"size": [_rows(ids_shape), vocab]}, (_rows(ids_shape), vocab))
    rows = b("rows", Op.MM, [flat, weight], {}, (_rows(ids_shape), width))
    b("", Op.VIEW, [rows], {"size": list(node.shape)}, node.shape, name=node.name)
    return b.nodes


def _embedding_backward(node: Node, g: Graph) -> list[Node]:
    grad, ids = node.args
    vocab, width = node.shape
    ids_shape = g.shape_of(ids)
    n = _rows(ids_shape)
    b = _Builder(node)
    onehot = b.onehot(ids, ids_shape, vocab)
    flat = b("flat", Op.VIEW, [onehot], {"size": [n, vocab]}, (n, vocab))
    cols = b("cols_t", Op.TRANSPOSE, [flat], {"dim0": 0, "dim1": 1}, (vocab, n))
    grad2 = b("grad2", Op.VIEW, [grad], {"size": [n, width]}, (n, width))
    b("", Op.MM, [cols, grad2], {}, (vocab, width), name=node.name)
    return b.nodes


def _log_softmax(node: Node, g: Graph) -> list[Node]:
    (x,) = node.args
    dim = node.attr["dim"] % len(node.shape)
    kept = tuple(Expr.const(1) if i == dim else s for i, s in enumerate(node.shape))
    b = _Builder(node)
    top = b("max", Op.AMAX, [x], {"dims": [dim], "keepdim": True}, kept)
    shifted = b("shifted", Op.SUB, [x, top], {}, node.shape)
    exps = b("exp", Op.EXP, [shifted], {}, node.shape)
    total = b("sumexp", Op.SUM, [exps], {"dims": [dim], "keepdim": True}, kept)
    logz = b("logz", Op.LOG, [total], {}, kept)
    b("", Op.SUB, [shifted, logz], {}, node.shape, name=node.name)
    return b.nodes


def _log_softmax_backward(node: Node, g: Graph) -> list[Node]:
    grad, out = node.args
    dim = node.attr["dim"] % len(node.shape)
    kept = tuple(Expr.const(1) if i == dim else s for i, s in enumerate(node.shape))
    b = _Builder(node)
    probs = b("probs", Op.EXP, [out], {}, node.shape)
    total = b("gsum", Op.SUM, [grad], {"dims": [dim], "keepdim": True}, kept)
    scaled = b("scaled", Op.MUL, [probs, total], {}, node.shape)
    b("", Op.SUB, [grad, scaled], {}, node.shape, name=node.name)
    return b.nodes


def _picks_vocab(node: Node, g: Graph) -> bool:
    """The one-hot form equals nll_loss only when ignored targets fall outside [0, V)."""
    logp = node.args[0] if node.op == Op.NLL_LOSS else node.args[1]
    return len(g.shape_of(logp)) == 2 and node.attr["ignore_index"] < 0


def _nll_loss(node: Node, g: Graph) -> list[Node]:
    logp, target = node.args
    n, vocab = g.shape_of(logp)
    b = _Builder(node)
    onehot = b.onehot(target, (n,), vocab)
    picked = b("picked", Op.MUL, [logp, onehot], {}, (n, vocab))
    if node.attr["reduction"] == "none":
        rows = b("rows", Op.SUM, [picked], {"dims": [1], "keepdim": False}, (n,))
        b("", Op.NEG, [rows], {}, (n,), name=node.name)
    else:       # "sum": `prepare` has already written "mean" as sum / total weight
        total = b("total", Op.SUM, [picked], {"dims": [], "keepdim": False}, ())
        b("", Op.NEG, [total], {}, (), name=node.name)
    return b.nodes


def _nll_loss_backward(node: Node, g: Graph) -> list[Node]:
    grad, logp, target, total_weight = node.args
    n, vocab = g.shape_of(logp)
    b = _Builder(node)
    onehot = b.onehot(target, (n,), vocab)
    scale = b("neg", Op.NEG, [grad], {}, g.shape_of(grad))
    if node.attr["reduction"] == "mean":
        scale = b("per_token", Op.DIV, [scale, total_weight], {}, g.shape_of(grad))
    if node.attr["reduction"] == "none":
        scale = b("col", Op.UNSQUEEZE, [scale], {"dim": 1}, (n, 1))
    b("", Op.MUL, [onehot, scale], {}, (n, vocab), name=node.name)
    return b.nodes


REWRITES = {
    Op.EMBEDDING: (_embedding, None),
    Op.EMBEDDING_BACKWARD: (_embedding_backward, None),
    Op.LOG_SOFTMAX: (_log_softmax, None),
    Op.LOG_SOFTMAX_BACKWARD: (_log_softmax_backward, None),
    Op.NLL_LOSS: (_nll_loss, _picks_vocab),
    Op.NLL_LOSS_BACKWARD: (_nll_loss_backward, _picks_vocab),
}


def vocab_parallel_forms(graph: Graph) -> Graph:
    """The same step with embedding and cross-entropy in their vocab-parallel forms."""
    nodes: list[Node] = []
    for node in graph.nodes:
        rewrite, applies = REWRITES.get(node.op, (None, None))
        if rewrite is None or (applies is not None and not applies(node, graph)):
            nodes.append(node)
        else:
            nodes += rewrite(node, graph)
    return Graph(graph.inputs, tuple(nodes), graph.outputs, graph.name)
