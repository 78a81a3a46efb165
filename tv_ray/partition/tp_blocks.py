"""Tensor-parallel block symmetry: which logical tensors are cut into tp blocks, and a proof that the logical step
commutes with every permutation of those blocks.

Tensor-parallel rank t holds block t of the heads and of the feed-forward
columns where rank 0 holds block 0: the same program on other shards. For
its stages to be rank 0's renamed (one proof serving both, DESIGN.md rule 8),
the logical step must commute with the renaming σ_t that swaps block 0 and
block t of every tensor so cut — the weights the plan splits over tp, and
everything computed from them along the blocks. This module finds those
tensors and proves it, op by op, from the graph alone (`TpBlocks.of`), as
`tv_ray.partition.symmetry.Blocks.of` does for samples.

A tensor's *tp tag* (`TpTag`) says where its blocks lie: element
``idx`` belongs to block ``(idx[dim] // q) % period`` (``period`` = tp). The
modulus covers a dimension that merges another one outside the blocks, as
attention's batched products do: (batch · heads, seq, head_dim) holds, row
``b · heads + h``, head ``h``'s block. Seeds are the plan's own layout: a
logical input that lineage cuts on one dimension over tp alone, one chunk per
rank. From them the tags are derived op by op (`derived_tag`), never from
names or shapes:

- elementwise ops, views, transposes, expands, slices and joins along other
  dims carry a tag to the dim holding the block digit — a reshape keeps it
  where the digit's stride lands on one dim (`_reshaped_tag`);
- an expand that repeats an untagged tensor along a dim (the same element
  everywhere there) takes the tag a reader needs on that dim (`Demand`):
  permuting its blocks leaves it as it is — DeepSeek's rotary key, one for
  every head, joined to each head's own key;
- a matrix product carries its rows' or columns' tag; one that contracts over
  blocks on both sides alike, and a sum over the blocks, is a *contribution
  sum* (`TpBlocks.sums`): untagged, the sum over blocks of each block's share;
- an op that reads along the blocks otherwise (a slice, softmax, top-k or
  join along them, an embedding table cut into blocks, a loss's gather) or
  mixes a tagged value with an untagged one of full extent there cannot be
  shown to commute: the seeds that reached it are dropped and the derivation
  runs again — so a vocabulary-parallel embedding or output layer (whose
  blocks the token data index) stays untagged, and σ_t leaves its atoms alone.

What holds then, by induction over the graph: for every tensor T and every
value of the inputs, T computed from σ-permuted inputs is T's value with its
elements permuted by σ on its tagged dim (untagged: the same value) — an
elementwise op or view moves blocks with their elements, a contraction or
sum over the blocks adds the same terms in another order. A stage of rank t
whose claims are rank 0's moved from block 0 to block t on their tagged dims
is therefore rank 0's stage with its variables renamed by σ_t, valid exactly
when that one is — the renaming these tags are for, not made yet
(docs/templates.md, "Tensor-parallel blocks"). `rename` and `move` are σ_t on
atoms and on claims.

A tp group's partial claim needs more: its tensor must be a *share*
(`TpBlocks.shares`), the sum over t of σ_t of block 0's share — a contribution
sum, or linear in such sums alone (a view, join or negation of shares, the
sum of two, a share times or divided by a tensor σ_t fixes). Then rank t's
part is rank 0's renamed, and block t's share (`share`) is the op on the
arguments' shares, down to a contraction over block t's elements alone.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from tv_ray.errors import Asymmetric
from tv_ray.ir import Graph, Node, Op
from tv_ray.ir.ops import ELEMENTWISE, RANK_DEPENDENT, VIEWS
from tv_ray.partition.symmetry import by_reason, ranks_text, renamed
from tv_ray.plan import Plan
from tv_ray.semantics.shapes import norm_dim
from tv_ray.semantics.table import instantiate_shape
from tv_ray.terms.atom import Atom

TP = "tp"
RESHAPES = frozenset({Op.VIEW, Op.UNSQUEEZE, Op.SQUEEZE})
ALONG = frozenset({Op.SLICE, Op.SLICE_BACKWARD, Op.SELECT, Op.CAT, Op.SOFTMAX, Op.LOG_SOFTMAX,
                   Op.SOFTMAX_BACKWARD, Op.LOG_SOFTMAX_BACKWARD, Op.TOPK_MASK})     # ops reading along `dim`
SUMS = frozenset({Op.SUM, Op.MEAN})
# ops linear in their one argument: each output element one input element, a fixed sum of them, or its negation
LINEAR = VIEWS | frozenset({Op.CLONE, Op.CAST, Op.SLICE_BACKWARD, Op.NEG})


@dataclass(frozen=True)
class TpTag:
    """Element ``idx`` of the tensor lies in tp block ``(idx[dim] // q) % period``."""

    dim: int
    q: int
    period: int


class Spans(NamedTuple):
    """`derived_tag`'s refusal where an untagged argument spans the blocks: which one, the tag it would need there,
    and the reason given when it cannot take that tag."""

    arg: int
    tag: TpTag
    why: str


class Demand(NamedTuple):
    """An expand constant along the blocks (its argument broadcast there) that a reader needs tagged: it may take
    any tag there, so it takes `tag`, grown from `seeds`."""

    name: str
    tag: TpTag
    seeds: frozenset[str]


class Refusal(NamedTuple):
    """The seeds that reached an op that cannot be shown to commute with permuting blocks, and why."""

    seeds: frozenset[str]
    why: str


@dataclass
class TpBlocks:
    """The logical tensors cut into tp blocks (`tags`), proved to commute with permuting blocks (`of`)."""

    tags: dict[str, TpTag]
    count: int                                          # tp: the blocks
    seeds: frozenset[str]                               # the plan's inputs the tags grew from
    sums: set[str] = field(default_factory=set)         # untagged tensors summed over the blocks
    dropped: dict[str, str] = field(default_factory=dict)   # seed -> the op that refused it, and why
    shares: set[str] = field(default_factory=set)       # tensors summed over the blocks of one block's share each

    @staticmethod
    def of(plan: Plan, dims: dict[str, int]) -> "TpBlocks":
        """The tp tags of `plan`'s logical graph at `dims`; Asymmetric when the plan has no tp axis or no
        tensor keeps a tag."""
        count = plan.axis_sizes.get(TP, 1)
        if count < 2:
            raise Asymmetric("no tp axis")
        graph = plan.logical
        shapes = {s.name: tuple(instantiate_shape(s.shape, dims)) for s in graph.inputs}
        shapes |= {n.name: tuple(instantiate_shape(n.shape, dims)) for n in graph.nodes}
        seeds = _seeds(plan, shapes, count)
        dropped: dict[str, str] = {}
        demands: dict[str, Demand] = {}
        while True:
            found = _derived(graph, shapes, seeds, count, demands)
            if isinstance(found, Demand):
                if found.name in demands:       # a demand made is a tag given: its readers cannot ask again
                    raise AssertionError(f"tp blocks: {found.name} asked for twice")
                demands[found.name] = found
                continue
            if isinstance(found, Refusal):
                dropped |= {seed: found.why for seed in found.seeds}
                seeds = {s: t for s, t in seeds.items() if s not in found.seeds}
                demands = {n: d for n, d in demands.items() if not d.seeds & found.seeds}
                continue
            found.dropped = dropped
            found.shares = _shares(graph, found.tags, found.sums)
            if not found.tags:
                raise Asymmetric("no logical tensor keeps a tp block: " +
                                 "; ".join(f"{s}: {why}" for s, why in sorted(dropped.items())[:3]))
            return found

    # -- σ_t: block 0 and block t swapped --------------------------------------------------------------------
    def rename_name(self, name, t: int):
        """The atom `name` of a tagged tensor with its block 0 and block t swapped (σ_t); any other name as it is."""
        tag = self.tags.get(name.base) if isinstance(name, Atom) and name.idx else None
        if tag is None or t == 0:
            return name
        i = name.idx[tag.dim]
        block = (i // tag.q) % tag.period
        by = t * tag.q if block == 0 else -t * tag.q if block == t else 0
        return name._replace(idx=name.idx[:tag.dim] + (i + by,) + name.idx[tag.dim + 1:]) if by else name

    def rename(self, terms, t: int):
        """Terms (an object array or a list) with every atom renamed by σ_t."""
        return terms if t == 0 else renamed(terms, lambda name: self.rename_name(name, t))

    def move(self, claim, t: int):
        """Rank 0's claim as tp rank t's: a slice inside one block 0 of its tensor's tagged dim moved to block t
        there (σ_t of its atoms); a claim of an untagged tensor as it is. Asymmetric for a slice across blocks."""
        tag = self.tags.get(claim.logical)
        if tag is None or t == 0:
            return claim
        lo, n = claim.offsets[tag.dim], claim.shape[tag.dim]
        if (lo // tag.q) % tag.period or lo // tag.q != (lo + n - 1) // tag.q:
            raise Asymmetric(f"{claim.logical}: a slice [{lo}, {lo + n}) of dim {tag.dim} is not inside one tp "
                             f"block 0 (blocks of {tag.q})")
        return claim.shifted(tag.dim, t * tag.q)


@dataclass
class TpMirrors:
    """Tensor-parallel ranks whose stages are their representative's (tp coordinate 0) renamed by σ_t: `rep`
    (rank -> its representative), `block` (rank -> t), and why the others are not (`notes`)."""

    blocks: TpBlocks
    rep: dict[int, int]
    block: dict[int, int]
    notes: list[str]


def tp_mirrors(plan: Plan, blocks: TpBlocks, claims, others: frozenset[int] = frozenset()) -> TpMirrors:
    """Which ranks with tp coordinate t > 0 mirror the rank with the same coordinates and tp = 0: both run one
    program that never reads the tp coordinate, each of the representative's claims moved by σ_t is the rank's
    claim on the same tensor (and the rank has no other), and every partial claim over tp is on a share — so
    each of the rank's stages is the representative's renamed by σ_t. `others`: ranks mirrored otherwise (dp),
    neither representatives nor mirrors here."""
    names, ids = plan.rank_programs()
    table = plan.coord_table()
    at = plan.axes.index(TP)
    stride = plan.stride(TP)
    reads: dict[str, str] = {}
    for name in {names[i] for i in ids}:
        read = next((n for n in plan.programs[name].nodes if n.op in RANK_DEPENDENT and TP in n.attr.get("axes", ())),
                    None)
        reads[name] = "" if read is None else f"it reads its tp coordinate ({read.name} = {read.op})"
    out, why = TpMirrors(blocks, {}, {}, []), {}
    for rank in range(plan.num_ranks):
        t = int(table[rank, at])
        rep = rank - t * stride
        if t == 0 or rank in others or rep in others:
            continue
        program = names[ids[rank]]
        reason = "its program differs from tp rank 0's" if names[ids[rep]] != program else \
            reads[program] or _unmoved(plan.programs[program], blocks, claims, rep, rank, t)
        if reason:
            why[rank] = reason
        else:
            out.rep[rank], out.block[rank] = rep, t
    out.notes = [f"tp: {ranks_text(rs)} not stood in for: {reason}" for reason, rs in by_reason(why).items()]
    return out


def _unmoved(program: Graph, blocks: TpBlocks, claims, rep: int, rank: int, t: int) -> str:
    """Why `rank`'s claims are not `rep`'s moved by σ_t, partial ones over tp on shares ('' when they are)."""
    for name in [s.name for s in program.inputs] + [n.name for n in program.nodes]:
        first, mine = claims.get((rep, name)), claims.get((rank, name))
        if first is None or mine is None:
            if first is not mine:
                return f"{name} is claimed on {'it' if first is None else 'tp rank 0'} alone"
            continue
        if first.partial and TP in first.partial and first.logical not in blocks.shares:
            return f"{name} is claimed partial over tp on {first.logical}, no share"
        try:
            moved = blocks.move(first, t)
        except Asymmetric as error:
            return f"{name}: {error}"
        if moved != mine:
            return f"its claim on {name} is not tp rank 0's moved to block {t}"
    return ""


def _seeds(plan: Plan, shapes: dict[str, tuple[int, ...]], count: int) -> dict[str, TpTag]:
    """The logical float inputs lineage cuts over tp alone on one dim, one chunk per rank, the same wherever it
    does (an input also cut otherwise, or on two dims, is no seed)."""
    inputs = {s.name for s in plan.logical.inputs if s.dtype == "float"}
    found: dict[str, TpTag | None] = {}
    for entry in tuple(plan.lineage) + tuple(plan.interior):
        if entry.logical not in inputs:
            continue
        cuts = [(dim, factors) for dim, factors in entry.slice if TP in factors]
        if not cuts:
            continue
        dim, factors = cuts[0]
        size = shapes[entry.logical][dim]
        tag = TpTag(dim, size // count, count) if len(cuts) == 1 and tuple(factors) == (TP,) and \
            size % count == 0 and not entry.partial else None
        if found.setdefault(entry.logical, tag) != tag:
            found[entry.logical] = None
    return {name: tag for name, tag in found.items() if tag is not None}


def _derived(graph: Graph, shapes, seeds: dict[str, TpTag], count: int, demands: dict[str, Demand]):
    """The tags grown from `seeds` over the graph (a `TpBlocks`) with the expands `demands` tag; or, at the first op
    that needs an expand constant along the blocks tagged, that `Demand`; or, at the first op that cannot be shown
    to commute with permuting blocks, the `Refusal` of the seeds that reached it."""
    tags: dict[str, TpTag] = dict(seeds)
    origin: dict[str, frozenset[str]] = {name: frozenset({name}) for name in seeds}
    sums: set[str] = set()
    uniform: dict[str, frozenset[int]] = {}      # untagged expands -> the dims they broadcast along
    for node in graph.nodes:
        ins = [tags.get(a) for a in node.args]
        if all(t is None for t in ins):
            if node.name in demands:        # an expand of an untagged tensor, still: the same along the blocks
                tags[node.name], origin[node.name] = demands[node.name].tag, demands[node.name].seeds
            elif node.op == Op.EXPAND:
                uniform[node.name] = _broadcast_dims(shapes[node.args[0]], shapes[node.name])
            continue
        reached = frozenset().union(*(origin[a] for a, t in zip(node.args, ins) if t is not None))
        out = derived_tag(node, ins, [shapes[a] for a in node.args], shapes[node.name])
        if isinstance(out, Spans):
            arg = node.args[out.arg]
            if out.tag.dim in uniform.get(arg, ()):
                return Demand(arg, out.tag, reached)
            out = out.why
        if isinstance(out, str):
            return Refusal(reached, f"logical op {node.name} = {node.op}(...): {out}")
        if out is None:
            if node.op in SUMS or node.op in (Op.MM, Op.BMM, Op.ADDMM):
                sums.add(node.name)
            continue
        tags[node.name] = out
        origin[node.name] = reached
    return TpBlocks(tags, count, frozenset(seeds), sums)


def _shares(graph: Graph, tags: dict[str, TpTag], sums: set[str]) -> set[str]:
    """The tensors T that are the sum over the blocks of one block's share each, T = Σ_t T_t with T_t = σ_t(T_0):
    a contribution sum (a contraction or sum over the blocks; restricted to block t's elements it gives T_t), and
    what is linear in those alone — a view, join or negation of shares, a sum of two, a share scaled by, times or
    divided by a tensor that is neither tagged nor a share (σ_t fixes it, so Σ_t σ_t(U·T_0) = U·T). Each block's
    share of such a tensor is then the op on its arguments' shares (`share`)."""
    shares: set[str] = set()
    for node in graph.nodes:
        if node.dtype == "float" and node.name not in tags and \
                (node.name in sums and node.op in SUMS | {Op.MM, Op.BMM} or _linear(node, shares, tags)):
            shares.add(node.name)
    return shares


def _linear(node: Node, shares: set[str], tags: dict[str, TpTag]) -> bool:
    """Is the op linear in its arguments that are shares, every other one fixed by σ_t (untagged, no share)?"""
    shared = [a in shares for a in node.args]
    if not any(shared):
        return False
    op, one = node.op, sum(shared) == 1 and all(s or a not in tags for a, s in zip(node.args, shared))
    if op in LINEAR or op in SUMS or op == Op.CAT:
        return all(shared)
    if op in (Op.ADD, Op.SUB):
        return all(shared) and len(shared) == 2         # (a scalar added to a share would be added tp times)
    if op in (Op.MUL, Op.MM, Op.BMM):
        return one
    return op == Op.DIV and shared[0] and one


def share(blocks: TpBlocks, nodes: dict[str, Node], name: str, t: int, value, evaluate, memo: dict | None = None):
    """Block t's share of `name` (one of `blocks.shares`): a contraction or sum over block t's elements alone (its
    tagged operand zero elsewhere), or the op on its arguments' shares. `value(name)`: a tensor's array (numbers
    or terms); `evaluate(node, args)`: the op on arrays; `memo`: shares made so far, by name."""
    memo = {} if memo is None else memo
    if name in memo:
        return memo[name]
    node = nodes[name]
    if node.op in SUMS | {Op.MM, Op.BMM} and node.name in blocks.sums:
        at = next(i for i, a in enumerate(node.args) if a in blocks.tags)
        args = [_in_block(value(a), blocks.tags[a], t) if i == at else value(a) for i, a in enumerate(node.args)]
    else:
        args = [share(blocks, nodes, a, t, value, evaluate, memo) if a in blocks.shares else value(a)
                for a in node.args]
    out = memo[name] = evaluate(node, args)
    return out


def _in_block(value: np.ndarray, tag: TpTag, t: int) -> np.ndarray:
    """The elements of `value` in block t along its tagged dim; zero elsewhere."""
    idx = np.arange(value.shape[tag.dim])
    inside = ((idx // tag.q) % tag.period == t).reshape([-1 if d == tag.dim else 1 for d in range(value.ndim)])
    return np.where(inside, value, np.zeros((), dtype=value.dtype) if value.dtype != object else 0)


def derived_tag(node: Node, ins: list, arg_shapes: list, out_shape: tuple[int, ...]) -> TpTag | None | str | Spans:
    """The tag of `node`'s output, given its arguments' (`ins`; one at least), under which the op commutes with
    permuting blocks: a TpTag, None (a contribution sum or max over the blocks: the same whatever the order),
    why it may not (str), or `Spans` where an untagged argument spans the blocks (it would need a tag)."""
    op, nd = node.op, len(out_shape)
    if op in ELEMENTWISE or op == Op.EXPAND:
        return _broadcast_tag(ins, arg_shapes, out_shape)
    if op == Op.FULL_LIKE:                  # a constant: every element the same, so any tag holds
        return ins[0]
    if op in RESHAPES:
        return _reshaped_tag(ins[0], arg_shapes[0], out_shape) or "a reshape splits the blocks"
    if op == Op.TRANSPOSE:
        d0, d1 = (norm_dim(node.attr[k], nd, "transpose") for k in ("dim0", "dim1"))
        d = ins[0].dim
        return TpTag(d1 if d == d0 else d0 if d == d1 else d, ins[0].q, ins[0].period)
    if op == Op.PERMUTE:
        order = [norm_dim(d, nd, "permute") for d in node.attr["dims"]]
        return TpTag(order.index(ins[0].dim), ins[0].q, ins[0].period)
    if op in ALONG:
        ndim = len(arg_shapes[0])
        along = norm_dim(node.attr["dim"], ndim, str(op))
        if any(t is not None and t.dim == along for t in ins):
            return f"{op} along the tp blocks"
        tagged = next(t for t in ins if t is not None)
        if any(t not in (None, tagged) for t in ins):
            return f"{op} mixes tensors with tp blocks on different dims"
        if None in ins:
            return Spans(ins.index(None), tagged, f"{op} mixes tensors with and without tp blocks")
        if op == Op.SELECT:
            return TpTag(ins[0].dim - (along < ins[0].dim), ins[0].q, ins[0].period)
        return ins[0]
    if op in SUMS or op == Op.AMAX:
        ndim = len(arg_shapes[0])
        reduced = sorted({norm_dim(d, ndim, str(op)) for d in node.attr.get("dims") or range(ndim)})
        t = ins[0]
        if t.dim in reduced:
            return None
        dim = t.dim if node.attr.get("keepdim") else t.dim - sum(d < t.dim for d in reduced)
        return TpTag(dim, t.q, t.period)
    if op in (Op.MM, Op.BMM):
        return _product_tag(op, ins[0], ins[1])
    if op == Op.ADDMM:
        product = _product_tag(Op.MM, ins[1], ins[2])
        if isinstance(product, str):
            return product
        bias = _broadcast_tag([ins[0], product], [arg_shapes[0], out_shape], out_shape)
        if isinstance(bias, Spans):             # the bias (argument 0) would need a tag, or the product would
            return bias if bias.arg == 0 else bias.why
        return bias if isinstance(bias, str) or bias == product else "addmm adds a bias whose blocks differ"
    return f"{op} is not known to commute with permuting tp blocks"


def _broadcast_tag(ins: list, arg_shapes: list, out_shape: tuple[int, ...]) -> TpTag | None | str | Spans:
    """An elementwise op's (or expand's) tag: every tagged argument's, aligned from the right, the same; every
    untagged argument broadcast along it."""
    found = None
    for t, shape in zip(ins, arg_shapes):
        if t is None:
            continue
        moved = TpTag(t.dim + len(out_shape) - len(shape), t.q, t.period)
        if found not in (None, moved):
            return "arguments hold tp blocks on different dims"
        found = moved
    if found is None:
        return None
    for i, (t, shape) in enumerate(zip(ins, arg_shapes)):
        at = found.dim - (len(out_shape) - len(shape))
        if t is None and at >= 0 and shape[at] != 1:
            return Spans(i, TpTag(at, found.q, found.period), "an argument without tp blocks spans them")
    return found


def _broadcast_dims(src: tuple[int, ...], dst: tuple[int, ...]) -> frozenset[int]:
    """The dims along which an expand of `src` to `dst` repeats its argument (every element there the same)."""
    lead = len(dst) - len(src)
    return frozenset(d for d in range(len(dst)) if dst[d] > 1 and (d < lead or src[d - lead] == 1))


def _reshaped_tag(tag: TpTag, src: tuple[int, ...], dst: tuple[int, ...]) -> TpTag | None:
    """Where a reshape (row-major, the same elements) puts the blocks: in flat terms block ``(f // s) % period``
    with stride ``s = q · (elements inside dim)``; the dim of `dst` whose stride divides s and whose extent holds a
    whole number of periods keeps it (None: the block digit straddles dims)."""
    stride = tag.q * int(np.prod(src[tag.dim + 1:], dtype=np.int64))
    for d in range(len(dst)):
        inner = int(np.prod(dst[d + 1:], dtype=np.int64))
        if inner and stride % inner == 0 and inner <= stride:
            q = stride // inner
            if dst[d] % (q * tag.period) == 0:
                return TpTag(d, q, tag.period)
    return None


def _product_tag(op: Op, x: TpTag | None, y: TpTag | None) -> TpTag | None | str:
    """The blocks of mm(x, y) / bmm(x, y): x's rows', y's columns', a shared batch's, or none (a contraction over
    the blocks on both sides alike: a sum)."""
    lo = 1 if op == Op.BMM else 0
    if op == Op.BMM and (x is not None and x.dim == 0 or y is not None and y.dim == 0):
        return x if x == y else "bmm batches hold tp blocks on one side only"
    if x is not None and y is not None:
        if x.dim == lo + 1 and y.dim == lo and (x.q, x.period) == (y.q, y.period):
            return None
        return f"{op} operands hold tp blocks on dims that do not line up"
    if x is not None:
        return TpTag(x.dim, x.q, x.period) if x.dim == lo else f"{op} contracts over blocks of one operand only"
    return TpTag(lo + 1, y.q, y.period) if y.dim == lo + 1 else f"{op} contracts over blocks of one operand only"


__all__ = ["TpTag", "TpBlocks", "TpMirrors", "tp_mirrors", "derived_tag", "share", "TP"]
