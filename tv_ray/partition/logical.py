"""The logical graph symbolically: each tensor's atoms (its value) and its definition over its inputs' atoms.

Every logical tensor gets one variable per element (its *atoms*); its
definition is its op applied to its inputs' atoms. Ints and constants are
their definitions.

With `Blocks` (a proof that the step commutes with permuting batch samples,
`tv_ray.partition.symmetry`), only the first block of samples is built: a
tensor with a batch dimension holds block 0's elements, and any slice
(`value_at`, `definition_at`) renames block 0 to the blocks it covers. A
tensor without samples computed from tensors with samples (a weight
gradient, the loss) is built over the whole batch — its definition only when
asked, for a contribution sum, whose block-0 part is `contribution`. A view
or copy of a contribution sum (a weight gradient transposed) moves each
element of the sum, so it is the sum over blocks of the view of each block's
part: it has a `contribution` too. Block-0 parts are built when a formula
asks for one (llama3-405b at 16 layers: 18 of 407 ever are).

A value is its atoms except where the definition is a constant, so an op
that gives no constant on variables (`NEVER_CONSTANT`, `SUMS`, on tensors
that are their atoms throughout) gets its atoms without its definition being built;
that is built when a formula asks for it (`_define`). Most of the optimizer's
tensors are such, and most formulas are never built (stage templates). Nor
are such a tensor's atoms made up front — a float input's, or a tensor's
whose definition was built and holds no constant: a slice asked for (a
claim's continuation) is made alone, and the whole tensor only where
something reads it whole (`full`).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from tv_ray.ir import Graph, Node, Op
from tv_ray.ir.ops import VIEWS
from tv_ray.partition.symmetry import Blocks
from tv_ray.semantics.symbolic import INF, NEG_INF, STRUCTURAL, choice, eval_symbolic, nll_rows, nll_total_weight
from tv_ray.semantics.table import instantiate_shape
from tv_ray.terms import Kind, Term, const, mul, sum_
from tv_ray.terms.term import grid_vars
from tv_ray.terms.atom import Atom

SHAPE_ONLY = frozenset({Op.FULL_LIKE})      # reads only its input's shape
# ops whose result on variables (and nonzero scalars) is never a constant: the term constructors fold constants
# and drop neutral elements but never cancel variables (`tv_ray.terms.term`), and apply no rule to a variable;
# a product of matrices of variables is a sum of products of variables over a nonempty inner dimension
NEVER_CONSTANT = frozenset({Op.ADD, Op.SUB, Op.MUL, Op.DIV, Op.NEG, Op.SQRT, Op.RSQRT, Op.MM, Op.BMM})
# likewise a sum (or a mean: a sum times 1/n) of distinct variables over a nonempty region
SUMS = frozenset({Op.SUM, Op.MEAN})
SCALARS = ("other", "alpha")
MOVES_ELEMENTS = VIEWS | {Op.CLONE}         # each output element is one input element
INFINITE = frozenset({INF, NEG_INF})
DERIVE_DEPTH = 24
DERIVE_COMPUTE = 4


def atoms(base, shape: tuple[int, ...], offsets: tuple[int, ...] | None = None) -> np.ndarray:
    """One variable per element of a tensor of `shape`, named `Atom(base, idx)` (base: a logical tensor's name,
    a `Part`, an opaque op's `StageId`); `offsets`: those of that region of a larger tensor."""
    out = np.empty(shape, dtype=object)
    out.reshape(-1)[:] = grid_vars(base, shape, offsets)
    return out


def own_atom(x, tensor: str, idx: tuple[int, ...]) -> bool:
    """Is `x`, element `idx` of `tensor`'s value, that tensor's own atom there (renamed with the tensor)?"""
    return isinstance(x, Term) and x.kind is Kind.VAR and isinstance(x.payload, Atom) and x.payload.base == tensor \
        and x.payload.onehot is None and x.payload.idx == idx


@dataclass
class LogicalTerms:
    """The logical graph symbolically: each tensor's atoms (or its value, for constants and ints) and definition."""

    graph: Graph
    dims: dict[str, int]
    value: dict[str, np.ndarray] = field(default_factory=dict)
    definition: dict[str, np.ndarray] = field(default_factory=dict)
    order: dict[str, int] = field(default_factory=dict)
    nodes: dict[str, Node] = field(default_factory=dict)
    blocks: Blocks | None = None
    contributions: set[str] = field(default_factory=set)    # the contribution sums (a `contribution` each)
    _parts: dict[str, np.ndarray] = field(default_factory=dict)         # block-0 parts built so far
    _varying: set[str] = field(default_factory=set)
    _atomic: set[str] = field(default_factory=set)       # tensors whose every element is its own atom
    _later: set[str] = field(default_factory=set)        # definitions built when asked (`_deferrable`)
    _unmade: dict[str, tuple[int, ...]] = field(default_factory=dict)   # atoms made when asked: the shape
    _regions: dict[tuple, np.ndarray] = field(default_factory=dict)   # slices of tensors not made, by slice
    _summed: dict[tuple, np.ndarray] = field(default_factory=dict)    # blocks [0, width)'s, by slice

    @staticmethod
    def build(graph: Graph, dims: dict[str, int], blocks: Blocks | None = None, eager: bool = False) -> "LogicalTerms":
        """`eager`: every value made now, and every definition but a contribution sum's — what those made when
        asked must equal (the tests' reference); else a tensor that is its atoms throughout (most weights, most of
        the optimizer's) has its atoms made when asked (`full`, `value_at`), and a float input's or a deferrable
        op's definition is built when asked too (`_define`)."""
        lt = LogicalTerms(graph, dims, nodes={n.name: n for n in graph.nodes}, blocks=blocks)
        small = blocks.small if blocks else dims
        varying = lt._varying     # floats computed from float inputs: these get atoms
        for i, spec in enumerate(graph.inputs):
            shape = instantiate_shape(spec.shape, small)
            lt.order[spec.name] = i
            if spec.dtype == "float":
                varying.add(spec.name)
                lt._of_atoms(spec.name, tuple(shape), eager)
                if eager:
                    lt.definition[spec.name] = lt.value[spec.name]
                else:
                    lt._later.add(spec.name)
                continue
            high = spec.high.eval(dims) if hasattr(spec.high, "eval") else int(spec.high or 2)
            arr = np.empty(shape, dtype=object)
            for idx in np.ndindex(shape):
                arr[idx] = choice(Atom(spec.name, idx), high, spec.ignore)
            lt.value[spec.name] = lt.definition[spec.name] = arr
        for node in graph.nodes:
            lt.order[node.name] = len(lt.order)
            varies = node.dtype == "float" and node.op not in SHAPE_ONLY and any(a in varying for a in node.args)
            if varies:
                varying.add(node.name)
            gathers = lt._gathers(node)  # no samples, from tensors with samples: over the whole batch
            summed = node.name in blocks.sums if gathers else \
                node.op in MOVES_ELEMENTS and node.args[0] in lt.contributions      # a view of one
            if summed:
                lt.contributions.add(node.name)
            if gathers:
                if node.name in blocks.sums and varies:     # its definition built when asked (`_whole_definition`)
                    lt._of_atoms(node.name, tuple(instantiate_shape(node.shape, dims)), eager)
                    continue
                d = eval_symbolic(node, [lt.whole(a) for a in node.args], dims)
            elif varies and not eager and lt._deferrable(node):
                lt._of_atoms(node.name, tuple(instantiate_shape(node.shape, lt._dims_of(node.name))), eager)
                lt._later.add(node.name)
                continue
            else:
                d = eval_symbolic(node, [lt.full(a) for a in node.args], lt._dims_of(node.name))
            lt.definition[node.name] = d
            kept = _atoms_but_constants(node.name, d) if varies else d
            if kept is not None:
                lt.value[node.name] = kept
            else:
                lt._of_atoms(node.name, d.shape, eager)
        return lt

    def _of_atoms(self, name: str, shape: tuple[int, ...], eager: bool) -> None:
        """A tensor that is its atoms throughout: made now (`eager`) or when asked (`full`, `value_at`)."""
        self._atomic.add(name)
        if eager:
            self.value[name] = atoms(name, shape)
        else:
            self._unmade[name] = shape

    def _dims_of(self, name: str) -> dict[str, int]:
        """The dims a tensor is built at: one block's, for a tensor with samples."""
        return self.blocks.small if self._has_samples(name) else self.dims

    def _deferrable(self, node: Node) -> bool:
        """Is the definition of `node` no constant anywhere, so its value is its atoms without building it? On
        tensors that are their atoms throughout, no samples gathered: an op that moves elements (a view, a
        copy: each element is an atom), an op of `NEVER_CONSTANT` with nonzero scalars, or one of `SUMS`. Built
        when asked (`_define`). (Were it wrong, atoms for a constant would only weaken what follows: a proof for
        every value of an atom holds for the constant.)"""
        if not node.args or not all(a in self._atomic for a in node.args):
            return False
        if node.op in MOVES_ELEMENTS:
            return True
        if node.op in SUMS:
            return set(node.attr) <= {"dims", "keepdim"} and _summed_shape(self.shape_of(node.args[0]), node.attr) == \
                tuple(instantiate_shape(node.shape, self._dims_of(node.name)))
        if node.op not in NEVER_CONSTANT or \
                any(isinstance(v, bool) or not isinstance(v, (int, float)) or v == 0
                    for k, v in node.attr.items() if k in SCALARS) or set(node.attr) - set(SCALARS):
            return False
        return _result_shape(node.op, [self.shape_of(a) for a in node.args]) == \
            tuple(instantiate_shape(node.shape, self._dims_of(node.name)))

    def atomic(self, name: str) -> bool:
        """Is every element of the tensor's value its own atom (no constant kept anywhere)?"""
        return name in self._atomic

    def shape_of(self, name: str) -> tuple[int, ...]:
        """The shape a tensor is built at (one block's, for a tensor with samples)."""
        unmade = self._unmade.get(name)
        return unmade if unmade is not None else self.value[name].shape

    def full(self, name: str) -> np.ndarray:
        """A tensor's whole value as built (its atoms made now, if they were left for later)."""
        shape = self._unmade.pop(name, None)
        if shape is not None:
            self.value[name] = atoms(name, shape)
        return self.value[name]

    def _define(self, name: str) -> None:
        if name in self._later:
            node = self.nodes.get(name)
            self.definition[name] = self.full(name) if node is None else \
                eval_symbolic(node, [self.full(a) for a in node.args], self._dims_of(name))     # an input: its atoms
            self._later.discard(name)

    def _has_samples(self, name: str) -> bool:
        return self.blocks is not None and self.blocks.tags.get(name) is not None

    def _gathers(self, node: Node) -> bool:
        return (self.blocks is not None and not self._has_samples(node.name)
                and any(self._has_samples(a) for a in node.args))

    # -- slices over every block ---------------------------------------------------------------------
    def whole(self, name: str, kind: str = "value") -> np.ndarray:
        """A tensor's value (or definition) over the whole batch."""
        shape = instantiate_shape((self.graph.value(name)).shape, self.dims)
        return self._at(name, kind, tuple(slice(0, n) for n in shape))

    def value_at(self, name: str, slices: tuple) -> np.ndarray:
        return self._at(name, "value", slices)

    def claimed(self, claim) -> np.ndarray:
        """What a (whole, sliced or summed) claim says its tensor is: its slice's atoms, times its scale."""
        return scaled(self.value_at(claim.logical, claim.slices()), claim.scale)

    def definition_at(self, name: str, slices: tuple) -> np.ndarray:
        return self._at(name, "definition", slices)

    def _at(self, name: str, kind: str, slices: tuple) -> np.ndarray:
        if kind == "definition" and name not in self.definition:
            self._define(name)
        if kind == "definition" and name not in self.definition:
            self.definition[name] = self._whole_definition(name)
        unmade = self._unmade.get(name) if kind == "value" else None
        if unmade is None:
            held = (self.value if kind == "value" else self.definition)[name]
            take = held.__getitem__ if held.ndim else lambda at: held    # (a 0-d array indexed by () is its element)
        else:               # the slice's atoms alone, made once (a weight's slice is read by every microbatch)
            def take(at: tuple) -> np.ndarray:
                key = (name, _hashable(at))
                found = self._regions.get(key)
                if found is None:
                    found = self._regions[key] = _region_atoms(name, unmade, at)
                return found
        if not self._has_samples(name):
            return take(slices)
        tag = self.blocks.tags[name]
        width = self.blocks.size * tag.q
        sl = slices[tag.dim]
        lo, hi = sl.start or 0, sl.stop
        parts = []
        for b in range(lo // width, (hi - 1) // width + 1 if hi > lo else lo // width):
            local = list(slices)
            local[tag.dim] = slice(max(lo, b * width) - b * width, min(hi, (b + 1) * width) - b * width)
            parts.append(self.blocks.rename(take(tuple(local)), b))
        if not parts:
            local = list(slices)
            local[tag.dim] = slice(0, 0)
            return take(tuple(local))
        return parts[0] if len(parts) == 1 else np.concatenate(parts, axis=tag.dim)

    def contribution_of(self, name: str, slices: tuple, width: int) -> np.ndarray:
        """The part of a contribution sum that blocks [0, width) make: block 0's, plus its renamings (built once
        per slice: a group's parts and its stage read the same)."""
        at = (name, _hashable(slices), width)
        found = self._summed.get(at)
        if found is None:
            found = self._summed[at] = self._contribution_of(name, slices, width)
        return found

    def contribution_sources(self, name: str) -> list[str]:
        """The tensors a contribution sum's block-0 part (`contribution`) is built from: the views down to the
        gathering op, then that op's arguments (their block-0 values)."""
        chain = [name]
        node = self.nodes[name]
        while node.args[0] in self.contributions and not self._gathers(node):    # a view of a contribution sum
            chain.append(node.args[0])
            node = self.nodes[node.args[0]]
        return chain + list(node.args)

    def contribution(self, name: str) -> np.ndarray:
        """Block 0's part of a contribution sum, built when first asked (most are never: a stage keyed by its
        template builds no formula): the gathering op on its arguments' block-0 values (a mean nll_loss: block 0's
        summed losses over the whole batch's count), or a view of a contribution sum applied to that sum's part."""
        found = self._parts.get(name)
        if found is None:
            node = self.nodes[name]
            if node.op is Op.NLL_LOSS and node.attr["reduction"] == "mean":
                # each block's losses over the whole batch's count (`Blocks.sums`)
                ignore = node.attr["ignore_index"]
                found = np.asarray(sum_(nll_rows(self.full(node.args[0]), self.full(node.args[1]), ignore)) /
                                   nll_total_weight(self.whole(node.args[1]), ignore), dtype=object)
            elif self._gathers(node):
                found = eval_symbolic(node, [self.full(a) for a in node.args], self.blocks.small)
            else:
                found = eval_symbolic(node, [self.contribution(node.args[0])], self.dims)
            self._parts[name] = found
        return found

    def _contribution_of(self, name: str, slices: tuple, width: int) -> np.ndarray:
        part = self.contribution(name)[slices]
        out = np.empty(part.shape, dtype=object)
        renamed = [part] + [self.blocks.rename(part, b) for b in range(1, width)]
        for idx in np.ndindex(part.shape):
            out[idx] = sum_([r[idx] for r in renamed]) if width > 1 else part[idx]
        return out

    def _whole_definition(self, name: str) -> np.ndarray:
        node = self.nodes[name]
        return eval_symbolic(node, [self.whole(a) for a in node.args], self.dims)

    def tensor_of(self, atom: Term) -> str | None:
        """The logical tensor an atom is an element of (None for other variables): an atom is named by its
        tensor and index (`atoms`; in any block, renamed), and only tensors computed from float inputs have
        atoms — every other variable is named otherwise (an int input's choice, a free part, an opaque op)."""
        if atom.kind is not Kind.VAR:
            return None
        name = atom.payload
        return name.base if isinstance(name, Atom) and name.onehot is None and name.base in self._varying else None

    def unfolding(self, name: str, present: list[Term]) -> dict[Term, Term]:
        """Atom → definition for the atoms of `name` in `present` (all of them for a tensor without samples)."""
        self._define(name)
        if not self._has_samples(name) and name in self.definition:
            values, definition = self.full(name), self.definition[name]
            return {values[idx]: definition[idx] for idx in np.ndindex(values.shape)}
        return {atom: self.element_definition(name, atom.payload.idx) for atom in present}

    def element_definition(self, name: str, idx: tuple[int, ...]) -> Term:
        """The definition of one element (any block)."""
        return self._at(name, "definition", tuple(slice(i, i + 1) for i in idx)).reshape(-1)[0]

    def derives_from(self, tensor: str, others: set[str]) -> bool:
        """Is `tensor` computed from one of `others` by rearrangements (views, copies, slices, cat) and at most
        `DERIVE_COMPUTE` other ops? (A long chain relates everything in a training step; a short one is a
        logical intermediate the plan skipped or holds under another name.)"""
        frontier, seen = [(tensor, 0)], {tensor}
        for _ in range(DERIVE_DEPTH):
            nxt = []
            for name, cost in frontier:
                node = self.nodes.get(name)
                if node is None:
                    continue
                step = cost + (node.op not in STRUCTURAL)
                if step > DERIVE_COMPUTE:
                    continue
                for a in node.args:
                    if a in others:
                        return True
                    if a not in seen:
                        seen.add(a)
                        nxt.append((a, step))
            frontier = nxt
            if not frontier:
                break
        return False

    def views_of_others(self, tensors: set[str]) -> set[str]:
        """The tensors among `tensors` that are another one's elements moved (a chain of views and copies): a
        formula whose two sides read the same tensors may still read one's element on one side and the view's
        on the other (a physical view of a slice the logical view's slices cannot state), which a solver sees as
        unrelated variables."""
        found = set()
        for tensor in tensors:
            node = self.nodes.get(tensor)
            for _ in range(DERIVE_DEPTH):
                if node is None or node.op not in MOVES_ELEMENTS:
                    break
                if node.args[0] in tensors:
                    found.add(tensor)
                    break
                node = self.nodes.get(node.args[0])
        return found


def _atoms_but_constants(name: str, definition: np.ndarray) -> np.ndarray | None:
    """Atoms for a tensor's elements where its definition holds a constant (a closed term, ±∞) somewhere, each such
    element keeping its constant (a masked attention weight is exactly 0, and downstream sees it); None where it
    holds none (the tensor is its atoms throughout)."""
    constants = [(i, t) for i, t in enumerate(definition.reshape(-1)) if t.kind is Kind.CONST or t in INFINITE]
    if not constants:
        return None
    arr = atoms(name, definition.shape)
    flat = arr.reshape(-1)
    for i, t in constants:
        flat[i] = t
    return arr


def _hashable(slices: tuple) -> tuple:
    return tuple((s.start, s.stop, s.step) if isinstance(s, slice) else s for s in slices)


def _region_atoms(name: str, shape: tuple[int, ...], slices: tuple) -> np.ndarray:
    """`atoms(name, shape)[slices]` without the other atoms (basic slices of step 1 and an `Ellipsis`; any other
    index takes the whole tensor's)."""
    items = list(slices)
    if Ellipsis in items:
        at = items.index(Ellipsis)
        items[at:at + 1] = [slice(None)] * (len(shape) - len(items) + 1)
    items += [slice(None)] * (len(shape) - len(items))
    if len(items) != len(shape) or not all(isinstance(s, slice) and s.step in (None, 1) for s in items):
        return atoms(name, shape)[slices]
    bounds = [s.indices(n)[:2] for s, n in zip(items, shape)]
    return atoms(name, tuple(max(0, b - a) for a, b in bounds), tuple(a for a, _ in bounds))


def _result_shape(op: Op, shapes: list[tuple[int, ...]]) -> tuple[int, ...] | None:
    """The shape an op of `NEVER_CONSTANT` gives on arguments of `shapes` (None: not a product over a nonempty
    inner dimension, or shapes that do not fit)."""
    try:
        if op in (Op.MM, Op.BMM):
            (*outer, rows, inner), (*batch, inner2, cols) = shapes
            return tuple(outer) + (rows, cols) if inner == inner2 >= 1 and outer == batch else None
        return np.broadcast_shapes(*shapes)
    except ValueError:
        return None


def _summed_shape(shape: tuple[int, ...], attr: dict) -> tuple[int, ...] | None:
    """The shape a sum over `attr["dims"]` (every dim where none) gives, or None where a summed dim is empty (a
    sum of nothing is the constant 0) or out of range."""
    dims = attr.get("dims") or range(len(shape))
    summed = {d + len(shape) if d < 0 else d for d in dims}
    if not all(0 <= d < len(shape) and shape[d] >= 1 for d in summed):
        return None
    keep = attr.get("keepdim")
    return tuple(1 if d in summed else n for d, n in enumerate(shape) if keep or d not in summed)


def scaled(values: np.ndarray, scale) -> np.ndarray:
    """`scale` times each term (the values themselves for 1)."""
    if scale == 1:
        return values
    factor = const(scale)
    out = np.empty(values.shape, dtype=object)
    for idx in np.ndindex(values.shape):
        out[idx] = mul(factor, values[idx])
    return out


__all__ = ["LogicalTerms", "atoms", "own_atom", "scaled"]
