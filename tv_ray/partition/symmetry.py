"""Batch symmetry: which logical tensors carry batch samples, and a proof that the logical step commutes with
every permutation of samples.

A logical tensor's *batch dimension* is the one whose size is ``batch · q``
(found from its shape at two batch sizes); element ``idx`` then belongs to
sample ``idx[d] // q`` (its `Tag`). Permuting samples moves those elements and
fixes every tensor without a batch dimension (weights, gradients, optimizer
state, the loss).

`Blocks.of` proves, op by op, that each logical op commutes with every such
permutation ρ — ``definition[T][π(idx)] ≡ ρ(definition[T][idx])`` — by the
op's index structure alone: elementwise ops and views move samples with their
elements, reductions and contractions over the batch dimension are sums (or
max, mean) over all samples, which a permutation only reorders. An op it
cannot show this for (an `arange` over the batch, a slice of it, a gather
along it) ends the check with the op named; then nothing uses the symmetry.

Two things rest on it:

- The logical graph is built for the first block of samples only
  (`tv_ray.partition.logical.LogicalTerms`); any other block's terms are the
  first block's with the sample numbers renamed (`Blocks.rename`).
- Data-parallel ranks are mirrored (`mirrors`, read off the plan's lineage
  entries): a rank with dp coordinate k > 0 whose program and claims are its
  dp-0 representative's, moved from block 0 to block k, has every stage equal
  to the representative's with variables renamed — and a renaming of
  variables keeps validity, so one proof (one key) serves both. How the run
  uses it: `tv_ray.partition.stages.SymbolicRun`.

A logical op whose output has no batch dimension but whose inputs do is a
*contribution sum* when it adds up one term per sample (mm and bmm over the
batch, sum over it, embedding backward, nll total weight, nll_loss summed or
averaged): its value is the sum over blocks of the op applied to each block
(`Blocks.sums`) — for a mean nll_loss, of each block's summed losses divided by
the whole batch's count (Σ_b S_b / T = (Σ_b S_b) / T, and T, a sum over every
sample, is fixed by every permutation of samples), the divisor every
data-parallel rank must use.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from tv_ray.errors import Asymmetric
from tv_ray.ir import Graph, Node, Op
from tv_ray.ir.ops import ELEMENTWISE, RANK_DEPENDENT
from tv_ray.partition.claims import Claim
from tv_ray.partition.ids import Part, StageId
from tv_ray.plan import Plan
from tv_ray.semantics.shapes import norm_dim
from tv_ray.semantics.table import instantiate_attrs, instantiate_shape
from tv_ray.terms import Kind, Term, postorder, substitute, var
from tv_ray.terms.atom import Atom

BATCH, DP = "batch", "dp"
SHAPE_ATTRS = frozenset({"size", "input_size"})     # attrs that may name the batch in a batch-carrying op


@dataclass(frozen=True)
class Tag:
    """Element ``idx`` of the tensor belongs to batch sample ``idx[dim] // q``."""

    dim: int
    q: int


def tags_of(graph: Graph, dims: dict[str, int], small: dict[str, int]) -> dict[str, Tag | None]:
    """Each logical tensor's batch dimension, from its shape at `dims` and at `small` (fewer samples)."""
    batch, few = dims[BATCH], small[BATCH]
    out: dict[str, Tag | None] = {}
    for name, shape in [(s.name, s.shape) for s in graph.inputs] + [(n.name, n.shape) for n in graph.nodes]:
        big_shape, small_shape = instantiate_shape(shape, dims), instantiate_shape(shape, small)
        found = []
        for d, (n, m) in enumerate(zip(big_shape, small_shape)):
            if n == m:
                continue
            if n % batch or m != few * (n // batch):
                raise Asymmetric(f"{name} dim {d} has {n} elements at batch {batch} and {m} at batch {few}: "
                                 f"not a multiple of the batch")
            found.append(Tag(d, n // batch))
        if len(found) > 1:
            raise Asymmetric(f"{name} has two batch dimensions ({found[0].dim} and {found[1].dim})")
        out[name] = found[0] if found else None
    return out


def _aligned(out_ndim: int, arg_shape: tuple[int, ...], out_dim: int) -> int | None:
    """The dim of a broadcast argument aligned with output dim `out_dim` (None when broadcast there)."""
    a = out_dim - (out_ndim - len(arg_shape))
    return a if a >= 0 and arg_shape[a] != 1 else None


def _moved(tag: Tag | None, dim: int) -> Tag | None:
    return None if tag is None else Tag(dim, tag.q)


def _view_tag(tag: Tag, src: tuple[int, ...], dst: tuple[int, ...]) -> Tag | None:
    """Where a reshape (row-major, same elements) puts the samples of a tensor tagged `tag`."""
    prefix = int(np.prod(src[:tag.dim]))
    per_sample = tag.q * int(np.prod(src[tag.dim + 1:]))
    for d in range(len(dst)):
        if int(np.prod(dst[:d])) == prefix and dst[d] > 1:
            inner = int(np.prod(dst[d + 1:]))
            return Tag(d, per_sample // inner) if per_sample % inner == 0 and inner else None
    return None


def expected_tag(node: Node, tags: dict[str, Tag | None], shapes: dict[str, tuple[int, ...]]) -> Tag | None | str:
    """The output tag under which `node` commutes with every permutation of samples, or why it may not.

    Returns a Tag, None (the output holds no sample: fixed by every permutation), or a reason (str)."""
    ins = [tags[a] for a in node.args]
    out_shape = shapes[node.name]
    op, a = node.op, node.attr
    if all(t is None for t in ins) and op not in (Op.EXPAND, Op.FULL, Op.FULL_LIKE):
        return None if tags[node.name] is None else f"{op} makes a batch dimension from no sample"
    if op in (Op.FULL, Op.FULL_LIKE):
        return tags[node.name]                  # a constant: every element the same, so any tag holds
    if op in ELEMENTWISE:
        out = tags[node.name]
        if out is None:
            return "an elementwise op drops a batch dimension"
        for arg, t in zip(node.args, ins):
            at = _aligned(len(out_shape), shapes[arg], out.dim)
            if (at is None and t is not None) or (at is not None and t != Tag(at, out.q)):
                return f"argument {arg} is not aligned with the samples of the result"
        return out
    if op in (Op.VIEW, Op.UNSQUEEZE, Op.SQUEEZE):
        return _view_tag(ins[0], shapes[node.args[0]], out_shape) or "a reshape splits the samples"
    if op == Op.EXPAND:
        out = tags[node.name]
        if ins[0] is None:
            if out is not None and _aligned(len(out_shape), shapes[node.args[0]], out.dim) is not None:
                return "an expand reads a full-size batch dimension of a tensor without samples"
            return out
        at = ins[0].dim + len(out_shape) - len(shapes[node.args[0]])
        return Tag(at, ins[0].q)
    if op == Op.PERMUTE:
        order = [norm_dim(d, len(out_shape), "permute") for d in a["dims"]]
        return _moved(ins[0], order.index(ins[0].dim))
    if op == Op.TRANSPOSE:
        d0, d1 = (norm_dim(a[k], len(out_shape), "transpose") for k in ("dim0", "dim1"))
        d = ins[0].dim
        return _moved(ins[0], d1 if d == d0 else d0 if d == d1 else d)
    if op in (Op.SLICE, Op.SLICE_BACKWARD, Op.SELECT, Op.TRIU):
        nd = len(shapes[node.args[0]])
        cut = (nd - 2, nd - 1) if op == Op.TRIU else (norm_dim(a["dim"], len(out_shape) if op == Op.SLICE_BACKWARD
                                                           else nd, str(op)),)
        if ins[0].dim in cut:
            return f"{op} along the batch dimension"
        shift = 1 if op == Op.SELECT and a["dim"] % nd < ins[0].dim else 0
        return _moved(ins[0], ins[0].dim - shift)
    if op == Op.CAT:
        dim = norm_dim(a["dim"], len(out_shape), "cat")
        if any(t != ins[0] for t in ins) or ins[0].dim == dim:
            return "a cat mixes tensors with and without samples, or runs along the batch"
        return ins[0]
    if op in (Op.SUM, Op.MEAN, Op.AMAX):
        nd = len(shapes[node.args[0]])
        reduced = sorted({norm_dim(d, nd, str(op)) for d in a.get("dims") or range(nd)})
        if ins[0].dim in reduced:
            return None
        return _moved(ins[0], ins[0].dim if a.get("keepdim") else ins[0].dim - sum(d < ins[0].dim for d in reduced))
    if op in (Op.SOFTMAX, Op.LOG_SOFTMAX):
        return ins[0]
    if op == Op.TOPK_MASK:          # each line picks its own: one sample's line, or a choice among samples
        along = ins[0].dim == norm_dim(a["dim"], len(out_shape), "topk_mask")
        return "a top-k along the batch picks among samples" if along else ins[0]
    if op in (Op.SOFTMAX_BACKWARD, Op.LOG_SOFTMAX_BACKWARD):
        return ins[0] if ins[0] == ins[1] else "a softmax backward mixes samples"
    if op in (Op.MM, Op.BMM):
        return _product_tag(op, *ins)
    if op == Op.ADDMM:                                   # bias + x @ w
        out = _product_tag(Op.MM, ins[1], ins[2])
        if not isinstance(out, Tag):
            return out if isinstance(out, str) else "addmm adds a bias to a sum over the samples"
        at = _aligned(len(out_shape), shapes[node.args[0]], out.dim)
        if (at is None and ins[0] is not None) or (at is not None and ins[0] != Tag(at, out.q)):
            return f"the bias {node.args[0]} is not aligned with the samples of the product"
        return out
    if op == Op.EMBEDDING:
        return ins[1] if ins[0] is None else "an embedding table holds samples"
    if op == Op.EMBEDDING_BACKWARD:
        return None if ins[0] == ins[1] and not a.get("scale_grad_by_freq") else "an embedding backward mixes samples"
    if op == Op.NLL_LOSS:
        if ins[0] != Tag(0, ins[0].q if ins[0] else 0) or ins[1] != ins[0]:
            return "nll_loss rows and targets do not line up"
        return None if a["reduction"] in ("mean", "sum") else ins[0]
    if op == Op.NLL_LOSS_TOTAL_WEIGHT:
        return None
    if op == Op.NLL_LOSS_BACKWARD:
        grad, logp, target, total = ins
        if logp is None or logp.dim != 0 or target != logp or total is not None or \
                (grad is not None and grad != logp):
            return "nll_loss_backward rows and targets do not line up"
        return logp
    return f"{op} is not known to commute with a permutation of samples"


def _product_tag(op: Op, x: Tag | None, y: Tag | None) -> Tag | None | str:
    """The samples of mm(x, y) / bmm(x, y): the rows of x, the columns of y, or none (a sum over them)."""
    lo = 1 if op == Op.BMM else 0
    if op == Op.BMM and x is not None and x.dim == 0:
        return x if y == x else "bmm batches differ"
    if x is not None and x.dim == lo and y is None:
        return x                                     # rows of the left operand
    if x is None and y is not None and y.dim == lo + 1:
        return y                                     # columns of the right operand
    if x is not None and y is not None and x.dim == lo + 1 and y.dim == lo and x.q == y.q:
        return None                                  # the contraction runs over the samples: a sum
    return f"{op} operands hold samples on dims that do not line up"


CONTRIBUTION_SUMS = frozenset({Op.MM, Op.BMM, Op.SUM, Op.EMBEDDING_BACKWARD, Op.NLL_LOSS_TOTAL_WEIGHT, Op.NLL_LOSS})


@dataclass
class Blocks:
    """The batch cut into `count` blocks of `size` samples, with the proof that the logical graph commutes
    with permuting samples: the logical graph is built for block 0; block k is block 0 renamed."""

    tags: dict[str, Tag | None]
    size: int                                   # samples per block
    count: int
    small: dict[str, int]                       # the dims of one block
    sums: set[str] = field(default_factory=set)   # logical tensors that are contribution sums over samples

    @staticmethod
    def of(graph: Graph, dims: dict[str, int], count: int) -> "Blocks":
        """Cut `dims[batch]` samples into `count` blocks; raises Asymmetric naming the first op in the way."""
        if BATCH not in dims or count < 2 or dims[BATCH] % count:
            raise Asymmetric(f"batch {dims.get(BATCH)} does not split into {count} blocks")
        small = {**dims, BATCH: dims[BATCH] // count}
        tags = tags_of(graph, dims, small)
        shapes = {s.name: instantiate_shape(s.shape, dims) for s in graph.inputs}
        blocks = Blocks(tags, small[BATCH], count, small)
        for node in graph.nodes:
            shapes[node.name] = instantiate_shape(node.shape, dims)
            want = expected_tag(node, tags, shapes)
            if isinstance(want, str) or want != tags[node.name]:
                why = want if isinstance(want, str) else f"its samples sit on {want}, its shape says {tags[node.name]}"
                raise Asymmetric(f"logical op {node.name} = {node.op}(...): {why}")
            if tags[node.name] is not None or any(tags[x] is not None for x in node.args):
                full, few = instantiate_attrs(node, dims), instantiate_attrs(node, small)
                changed = {k for k in full if full[k] != few[k]}
                if changed - (SHAPE_ATTRS if tags[node.name] is not None else set()):
                    raise Asymmetric(f"logical op {node.name} = {node.op}(...): attribute "
                                     f"{sorted(changed)[0]} depends on the batch size")
            if tags[node.name] is None and any(tags[x] is not None for x in node.args) and node.op in CONTRIBUTION_SUMS:
                blocks.sums.add(node.name)
        return blocks

    # -- renaming block 0 to block k ---------------------------------------------------------------
    def rename_name(self, name, k: int, width: int = 1):
        """The variable of blocks [k·width, (k+1)·width) corresponding to `name` (an `Atom`) of blocks [0, width)
        (and back: the two runs of blocks swap; other names stay)."""
        tag = self.tags.get(name.base) if isinstance(name, Atom) and name.idx else None
        if tag is None:
            return name
        idx = list(name.idx)
        span = self.size * tag.q * width
        run = idx[tag.dim] // span
        if run == 0:
            idx[tag.dim] += k * span
        elif run == k:
            idx[tag.dim] -= k * span
        else:
            return name
        return name._replace(idx=tuple(idx))

    def move(self, claim, k: int, width: int = 1):
        """A claim on blocks [0, width) as blocks [k·width, (k+1)·width)'s (a claim without samples: itself)."""
        tag = self.tags.get(claim.logical)
        return claim if tag is None or k == 0 else claim.shifted(tag.dim, k * width * self.size * tag.q)

    def moves_to(self, claim, k: int, other) -> bool:
        """Is `other` the claim `claim` moved to block k (`move(claim, k) == other`, without making that claim: a
        renamed microbatch's every cut asks)?"""
        tag = self.tags.get(claim.logical)
        if tag is None or k == 0:
            return claim == other
        d, (o, o0) = tag.dim, (other.offsets, claim.offsets)
        return o[d] == o0[d] + k * self.size * tag.q and o[:d] == o0[:d] and o[d + 1:] == o0[d + 1:] and \
            other.logical == claim.logical and other.shape == claim.shape and other.partial == claim.partial and \
            other.boundary == claim.boundary and other.given == claim.given and other.scale == claim.scale

    def spanned(self, claim) -> frozenset[int]:
        """The blocks (of one microbatch) whose samples a claim's slice holds: none for a tensor without samples."""
        tag = self.tags.get(claim.logical)
        if tag is None or not claim.shape[tag.dim]:
            return frozenset()
        width, lo = self.size * tag.q, claim.offsets[tag.dim]
        return frozenset(range(lo // width, (lo + claim.shape[tag.dim] - 1) // width + 1))

    def block_of(self, name) -> int | None:
        """The block (of one microbatch) a variable's sample lies in; None for a variable without samples."""
        tag = self.tags.get(name.base) if isinstance(name, Atom) and name.idx else None
        if tag is None:
            return None
        return name.idx[tag.dim] // (self.size * tag.q)

    def rename(self, terms, k: int, extra=None, width: int = 1):
        """Terms (an object array or a list) with the variables of blocks [0, width) renamed to those of
        blocks [k·width, (k+1)·width) (and `extra`, a name → name function, applied after). Choices are
        renamed by their data element."""
        if k == 0 and extra is None:
            return terms
        return renamed(terms, lambda name: self.rename_name(name, k, width), extra)


def renamed(terms, rename, extra=None):
    """Terms (an object array or a list) with each variable's name x renamed to `rename(x)` (then to `extra` of
    that); a data choice's by `rename` of its data element."""
    from tv_ray.semantics.symbolic import Choice
    flat = list(np.asarray(terms, dtype=object).reshape(-1)) if isinstance(terms, np.ndarray) else list(terms)
    roots = [t for t in flat if isinstance(t, Term)]
    mapping: dict[Term, Term] = {}
    for node in postorder(*roots):
        if node.kind is Kind.VAR:
            new = rename(node.payload)
            new = extra(new) if extra else new
            if new != node.payload:
                mapping[node] = var(new)
    memo: dict = {}
    out = []
    for t in flat:
        if isinstance(t, Term):
            out.append(substitute(t, mapping, memo) if mapping else t)
        elif isinstance(t, Choice):
            out.append(Choice(rename(t.base), t.table))
        else:
            out.append(t)
    if isinstance(terms, np.ndarray):
        arr = np.empty(len(out), dtype=object)
        arr[:] = out
        return arr.reshape(terms.shape)
    return out


@dataclass
class Mirrors:
    """Data-parallel ranks whose stages are their representative's (dp coordinate 0) with block 0 renamed."""

    blocks: Blocks                 # one block per microbatch of one dp rank
    rep: dict[int, int]            # mirrored rank -> its representative
    block: dict[int, int]          # every rank -> its dp coordinate k: it reads blocks [k·width, (k+1)·width)
    width: int = 1                 # blocks per dp rank (its microbatches)
    notes: list[str] = field(default_factory=list)
    image: dict[int, dict[int, int]] = field(default_factory=dict)   # block k -> the rank swap of dp 0 and k
    _of: dict[int, tuple[int, ...]] | None = field(default=None, repr=False, compare=False)
    _groups: dict = field(default_factory=dict, repr=False, compare=False)   # (group's ranks, k) -> dp k's

    def of(self, rep: int) -> tuple[int, ...]:
        """The mirrors of representative `rep`, in rank order (none for any other rank)."""
        if self._of is None:
            of: dict[int, list[int]] = {}
            for rank in sorted(self.rep):
                of.setdefault(self.rep[rank], []).append(rank)
            self._of = {r: tuple(ranks) for r, ranks in of.items()}
        return self._of.get(rep, ())

    def rank_name(self, name, k: int):
        """A free or opaque variable of dp 0's slots renamed to dp k's (the ranks of its stage swapped)."""
        if not isinstance(name, Atom):
            return name
        base = name.base
        cid = base.cid if isinstance(base, Part) else base if isinstance(base, StageId) else None
        if cid is None:
            return name
        if len({self.block[r] for r in cid.ranks if self.block[r] in (0, k)}) > 1:
            raise Asymmetric(f"{name} belongs to a group across dp ranks 0 and {k}: its part is not a renaming")
        moved = cid.with_ranks(tuple(self.image[k].get(r, r) for r in cid.ranks))
        return name._replace(base=base._replace(cid=moved) if isinstance(base, Part) else moved)

    def rename_id(self, cid: StageId, k: int) -> StageId:
        """A stage or claim id of dp 0's slots as dp k's (a group across dp ranks 0 and k is the same group)."""
        ranks = cid.ranks
        if len(ranks) == 1:     # most ids: one rank's (made as a tuple is: a weight gradient's reads, each mirror)
            moved = self.image[k].get(ranks[0])
            return cid if moved is None else cid.with_ranks((moved,))
        moved = self._groups.get((ranks, k))
        if moved is None:
            image = self.image[k]
            same = len({self.block[r] for r in ranks if self.block[r] in (0, k)}) > 1
            moved = self._groups[ranks, k] = ranks if same else tuple(image.get(r, r) for r in ranks)
        return cid if moved == ranks else cid.with_ranks(moved)

    def rename_ids(self, ids, k: int) -> frozenset[StageId]:
        """`rename_id` of each id: a mirror's reads (a weight gradient's, accumulated over the microbatches, ~70 ids
        for each of dp=16's 15 mirrors)."""
        rename = self.rename_id
        return frozenset([rename(cid, k) for cid in ids])

    def reads(self, terms) -> tuple[bool, bool]:
        """(Do the terms name a rank's or a group's own variables — free parts, opaque values —, could a block
        renaming change them — a variable of a sample, or anything but a term: data choices)."""
        roots = [t for t in terms if isinstance(t, Term)]
        named, samples = False, len(roots) < len(terms)
        for n in postorder(*roots):
            if n.kind is Kind.VAR and isinstance(n.payload, Atom):
                named = named or isinstance(n.payload.base, (Part, StageId))
                samples = samples or self.blocks.block_of(n.payload) is not None
        return named, samples

    def rename(self, terms, k: int):
        """Terms of dp 0's slots as dp k's: block 0 renamed to block k, rank prefixes swapped."""
        return self.blocks.rename(terms, k, lambda name: self.rank_name(name, k), self.width)

    def move(self, claim: Claim, k: int) -> Claim:
        """dp 0's claim as dp k's: its samples moved by k runs of `width` blocks."""
        return self.blocks.move(claim, k, self.width)


def mirrors(plan: Plan, dims: dict[str, int]) -> Mirrors:
    """The data-parallel mirror map of a plan, or Asymmetric saying why none holds.

    Rank r with dp coordinate k > 0 mirrors rank r0 (the same coordinates, dp = 0) when they run the same
    program, no op of it reads the dp coordinate, and every lineage entry (boundary or intermediate) that
    gives r a claim gives r0 the same claim with its samples in block 0, moved to block k for r. This is
    read off each entry's split factors, never per rank: the dp factor may only cut the batch dimension of a
    tensor with samples, outermost, one block per dp rank. A rank that fails runs in full; the logical
    graph's symmetry must hold for any rank to mirror."""
    sizes = plan.axis_sizes
    count = sizes.get(DP, 1)
    if count < 2:
        raise Asymmetric("no dp axis")
    width = max(1, plan.microbatches)
    blocks = Blocks.of(plan.logical, dims, count * width)
    names, ids = plan.rank_programs()
    for name in sorted({names[i] for i in ids}):
        for node in plan.programs[name].nodes:
            if node.op in RANK_DEPENDENT and DP in node.attr.get("axes", ()):
                raise Asymmetric(f"program {name} op {node.name} = {node.op} reads the dp coordinate")
    table, axes = plan.coord_table(), plan.axes
    dp = table[:, axes.index(DP)]
    stride = plan.stride(DP)
    base = np.arange(plan.num_ranks) - dp * stride             # the same coordinates with dp = 0
    why: dict[int, str] = {}
    for rank in np.flatnonzero((dp > 0) & (np.asarray(ids) != np.asarray(ids)[base])):
        why[int(rank)] = "its program differs from dp rank 0's"
    shapes = {s.name: instantiate_shape(s.shape, dims) for s in plan.logical.inputs}
    shapes |= {n.name: instantiate_shape(n.shape, dims) for n in plan.logical.nodes}
    # what `_entry_problem` reads of entries it found nothing wrong with (a slice by identity: a loaded plan holds each
    # distinct one once)
    fine: set[tuple] = set()
    for entry in plan.lineage + tuple(plan.interior):
        read = (entry.where, id(entry.slice), blocks.tags.get(entry.logical), shapes.get(entry.logical))
        if read in fine:
            continue
        problem = _entry_problem(plan, blocks, width, entry, shapes)
        if not problem:
            fine.add(read)
        else:
            for rank in np.flatnonzero(plan.selects(entry) & (dp > 0)):
                why.setdefault(int(rank), problem)
    out = Mirrors(blocks, {}, {int(r): int(dp[r]) for r in range(plan.num_ranks)}, width=width)
    for rank in np.flatnonzero(dp > 0):
        if int(rank) not in why:
            out.rep[int(rank)] = int(base[rank])
    out.notes = [f"{ranks_text(rs)} {'runs' if len(rs) == 1 else 'run'} in full: {reason}"
                 for reason, rs in by_reason(why).items()]
    for k in range(1, count):
        out.image[k] = {int(r): int(r + (k if dp[r] == 0 else -k) * stride)
                        for r in range(plan.num_ranks) if dp[r] in (0, k)}
    return out


def find_mirrors(plan: Plan, dims: dict[str, int], symmetry: bool = True) -> tuple[Mirrors | None, list[str]]:
    """The plan's data-parallel mirrors (None, with the reason, when there are none or `symmetry` is off)."""
    if not symmetry or plan.axis_sizes.get(DP, 1) < 2:
        return None, []
    try:
        return mirrors(plan, dims), []
    except Asymmetric as why:
        return None, [f"symmetry: {why}"]


def _entry_problem(plan: Plan, blocks: Blocks, width: int, entry, shapes) -> str:
    """Why an entry's claims on dp rank k are not dp rank 0's moved by k blocks ('' when they are)."""
    if any(axis == DP for axis, _ in entry.where):
        return f"lineage for {entry.tensor} selects ranks by their dp coordinate"
    tag = blocks.tags.get(entry.logical)
    cuts = [(dim, factors) for dim, factors in entry.slice if DP in factors]
    if tag is None:
        return f"{entry.tensor} holds a dp shard of {entry.logical}, which has no samples" if cuts else ""
    if len(cuts) != 1 or cuts[0][0] != tag.dim or cuts[0][1][0] != DP:
        return f"{entry.tensor}'s samples of {entry.logical} are not cut by dp, outermost, on the batch dimension"
    dim, factors = cuts[0]
    chunk = shapes[entry.logical][dim] // plan.chunks(factors)
    if plan.chunks(factors[1:]) * chunk != width * blocks.size * tag.q:
        return f"{entry.tensor}'s dp cut of {entry.logical} is not one block of samples per dp rank"
    return ""


def by_reason(why: dict[int, str]) -> dict[str, list[int]]:
    """The ranks of each reason, in rank order (reasons in order of their first rank)."""
    out: dict[str, list[int]] = {}
    for rank, reason in sorted(why.items()):
        out.setdefault(reason, []).append(rank)
    return out


def ranks_text(ranks: list[int]) -> str:
    """How notes name ranks: ``rank 3``, ``ranks 1, 2``, or past eight the first eight and ``… (12 in all)``."""
    shown = ", ".join(map(str, ranks[:8])) + (f", … ({len(ranks)} in all)" if len(ranks) > 8 else "")
    return f"rank {shown}" if len(ranks) == 1 else f"ranks {shown}"


__all__ = ["Tag", "Blocks", "Mirrors", "mirrors", "find_mirrors", "tags_of", "expected_tag", "CONTRIBUTION_SUMS",
           "renamed", "by_reason", "ranks_text"]


class Moves:
    """Microbatch symmetry inside one rank: a value of microbatch k as microbatch 0's, renamed.

    Renaming variables keeps every identity, so an op on arguments that are
    microbatch 0's arguments renamed (or left alone by the renaming) gives
    microbatch 0's result renamed, and a stage whose computed terms and claim
    are microbatch 0's renamed is valid exactly when microbatch 0's is: one
    proof, one key (`tv_ray.partition.stages.SymbolicRun` keeps the values as
    `Moved` and never computes them).

    The renaming for k is a bijection on variables: samples of block 0 and
    block k swap (`Blocks.rename`, one block per microbatch), and the free
    parts of a partial claim cut at microbatch 0 swap with those of the cut
    at microbatch k that `pair` matched with it — each cut keeps parts of its
    own, so no two splits of a value are ever assumed equal."""

    def __init__(self, blocks: Blocks):
        self.blocks = blocks
        self.pairs: dict[int, dict[StageId, StageId]] = {}        # k -> cut id <-> cut id (both directions)

    def pair(self, k: int, first: StageId, other: StageId) -> bool:
        """Match the partial cut `other` (microbatch k) with `first` (microbatch 0); False if either is taken."""
        pairs = self.pairs.setdefault(k, {})
        if pairs.get(first, other) != other or pairs.get(other, first) != first:
            return False
        pairs[first], pairs[other] = other, first
        return True

    def rename(self, terms, k: int):
        """Terms of microbatch 0 as microbatch k's."""
        return self.blocks.rename(terms, k, lambda name: self._part(name, k))

    def _part(self, name, k: int):
        base = name.base if isinstance(name, Atom) else None
        swap = self.pairs.get(k, {}).get(base.cid) if isinstance(base, Part) else None
        return name if swap is None else name._replace(base=base._replace(cid=swap))

    def footprint(self, terms) -> tuple[frozenset[int], bool]:
        """The blocks whose samples the terms read, and whether they read a partial claim's free part."""
        from tv_ray.semantics.symbolic import Choice
        flat = list(np.asarray(terms, dtype=object).reshape(-1))
        blocks, parts = set(), False
        for node in postorder(*[t for t in flat if isinstance(t, Term)]):
            if node.kind is Kind.VAR:
                b = self.blocks.block_of(node.payload)
                if b is not None:
                    blocks.add(b)
                parts = parts or (isinstance(node.payload, Atom) and isinstance(node.payload.base, Part))
        for t in flat:
            if isinstance(t, Choice):
                b = self.blocks.block_of(t.base)
                if b is not None:
                    blocks.add(b)
        return frozenset(blocks), parts

    def split(self, claim: Claim) -> tuple[int, Claim] | None:
        """(k, microbatch 0's claim) for a claim inside block k ≥ 1 (one microbatch); else None."""
        tag = self.blocks.tags.get(claim.logical)
        if tag is None:
            return None
        span = self.blocks.size * tag.q
        lo, n = claim.offsets[tag.dim], claim.shape[tag.dim]
        k = lo // span
        if k == 0 or (lo + n - 1) // span != k:
            return None
        return k, claim.shifted(tag.dim, -k * span)

    def first(self, claim: Claim) -> bool:
        """Does the claim lie in block 0 (or hold no samples)?"""
        tag = self.blocks.tags.get(claim.logical)
        if tag is None:
            return True
        span = self.blocks.size * tag.q
        return claim.offsets[tag.dim] + claim.shape[tag.dim] <= span


def microbatch_moves(plan: Plan, dims: dict[str, int], mirrored: Mirrors | None, symmetry: bool) -> Moves | None:
    """The microbatch symmetry of a plan with more than one microbatch (None when off or not shown)."""
    if not symmetry or plan.microbatches < 2:
        return None
    if mirrored is not None:
        return Moves(mirrored.blocks)
    if plan.axis_sizes.get(DP, 1) > 1:
        return None                 # dp ranks unmirrored: each reads its own run of blocks
    try:
        return Moves(Blocks.of(plan.logical, dims, plan.microbatches))
    except Asymmetric:
        return None
