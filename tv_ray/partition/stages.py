"""Stages and obligations: the plan run once symbolically, cut at every claimed tensor.

Every logical tensor gets one variable per element (its *atoms*); its
definition is its op applied to its inputs' atoms. Every rank's program then
runs on terms (`tv_ray.semantics.symbolic`) through the same scheduler as the
simulator. Where a rank produces a claimed tensor, the computed terms and the
claim become one obligation — a stage: the physical ops since the last cut,
realising one logical op or one hop of communication — and the run continues
from the claim instead of the computed terms:

- a whole or sliced claim continues as the logical atoms of the slice;
- a claim that is a partial sum over a group continues, on group member p of
  g, as fresh atoms for p < g−1 and as the slice minus the others' atoms for
  the last member — every split of the logical value into g summands, so a
  proof over these atoms holds for the actual split;
- an obligation for a partial claim compares the group's sum with the slice.

Program inputs continue from their boundary lineage (assumed); program
outputs carry the claims their output lineage requires. Each obligation
records the claims it read (the stage DAG), its ranks, the physical op and the
logical op it realises, with module path and phase for reports.

An op without a symbolic rule gives fresh atoms for its result (a sound
over-approximation: any proof through it holds for every value) and a note;
every note is a composition problem, so such a run ends unknown (exit 2),
never proved, while its refutations elsewhere still locate bugs.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import networkx as nx
import numpy as np

from tv_ray.errors import TvRayError
from tv_ray.execute import Scheduler
from tv_ray.ir import Graph, Node, Op
from tv_ray.partition.claims import Claim
from tv_ray.partition.keys import formula_key
from tv_ray.plan import Plan
from tv_ray.semantics.symbolic import INF, NEG_INF, STRUCTURAL, as_dtype, choice, eval_symbolic, group_rule
from tv_ray.semantics.table import instantiate_shape
from tv_ray.terms import Kind, Term, postorder, substitute, sum_, var

EXPAND_ROUNDS = 24
EXPAND_GROWTH, EXPAND_SLACK = 3, 1000      # stop unfolding past 3x the formula's size + 1000 nodes
SHAPE_ONLY = frozenset({Op.FULL_LIKE})      # reads only its input's shape
INFINITE = frozenset({INF, NEG_INF})
DERIVE_DEPTH = 24
DERIVE_COMPUTE = 4


def atom_name(tensor: str, idx: tuple[int, ...]) -> str:
    return f"{tensor}[{','.join(map(str, idx))}]"


def atoms(tensor: str, shape: tuple[int, ...]) -> np.ndarray:
    out = np.empty(shape, dtype=object)
    for idx in np.ndindex(shape):
        out[idx] = var(atom_name(tensor, idx))
    return out


@dataclass
class LogicalTerms:
    """The logical graph symbolically: each tensor's atoms (or its value, for constants and ints) and definition."""

    graph: Graph
    dims: dict[str, int]
    value: dict[str, np.ndarray] = field(default_factory=dict)
    definition: dict[str, np.ndarray] = field(default_factory=dict)
    order: dict[str, int] = field(default_factory=dict)
    atom_of: dict[Term, tuple[str, tuple[int, ...]]] = field(default_factory=dict)
    nodes: dict[str, Node] = field(default_factory=dict)

    @staticmethod
    def build(graph: Graph, dims: dict[str, int]) -> "LogicalTerms":
        lt = LogicalTerms(graph, dims, nodes={n.name: n for n in graph.nodes})
        varying: set[str] = set()     # floats computed from float inputs: these get atoms
        for i, spec in enumerate(graph.inputs):
            shape = instantiate_shape(spec.shape, dims)
            lt.order[spec.name] = i
            if spec.dtype == "float":
                varying.add(spec.name)
            if spec.dtype == "float":
                lt.value[spec.name] = lt._atoms(spec.name, shape)
            else:
                high = spec.high.eval(dims) if hasattr(spec.high, "eval") else int(spec.high or 2)
                arr = np.empty(shape, dtype=object)
                for idx in np.ndindex(shape):
                    arr[idx] = choice(atom_name(spec.name, idx), high)
                lt.value[spec.name] = arr
            lt.definition[spec.name] = lt.value[spec.name]
        for node in graph.nodes:
            lt.order[node.name] = len(lt.order)
            d = eval_symbolic(node, [lt.value[a] for a in node.args], dims)
            lt.definition[node.name] = d
            if node.dtype == "float" and node.op not in SHAPE_ONLY and any(a in varying for a in node.args):
                varying.add(node.name)
                lt.value[node.name] = lt._atoms(node.name, d.shape, d)
            else:
                lt.value[node.name] = d
        return lt

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

    def _atoms(self, name: str, shape, definition: np.ndarray | None = None) -> np.ndarray:
        """Atoms for a tensor's elements; an element whose definition is a constant (a masked attention
        weight is exactly 0) keeps the constant, so structural zeros stay visible downstream."""
        arr = atoms(name, shape)
        for idx in np.ndindex(shape):
            if definition is not None and (definition[idx].kind is Kind.CONST or definition[idx] in INFINITE):
                arr[idx] = definition[idx]
            else:
                self.atom_of[arr[idx]] = (name, idx)
        return arr


@dataclass
class Obligation:
    """One stage at one slot: the computed terms of a claimed tensor must equal its claim."""

    id: str
    ranks: tuple[int, ...]
    program: str
    tensor: str
    claim: Claim
    key: str                        # of the formula computed terms == claim (`Partition.formulas[key]`)
    reads: tuple[str, ...]          # ids of the claims this stage read (obligations or boundary inputs)
    op: str = ""
    module: str = ""
    phase: str = ""
    realises: str = ""
    mb: int | None = None
    position: int = 0               # execution order of the cut, for "first failing"
    notes: tuple[str, ...] = ()


@dataclass
class Partition:
    """All obligations of a plan, its boundary input claims, the stage DAG, and one formula per unique key.

    Only the first formula of each key is kept (`formulas[key] = (lhs, rhs)`): the terms of every other
    obligation with that key are dropped as soon as it is keyed, so memory follows the unique keys, not
    the obligations (every data-parallel slot of a stage shares one)."""

    obligations: list[Obligation]
    boundary: dict[str, Claim]
    dag: nx.DiGraph
    notes: list[str]
    formulas: dict[str, tuple[list[Term], list[Term]]] = field(default_factory=dict)


def boundary_id(rank: int, tensor: str) -> str:
    return f"in:r{rank}/{tensor}"


def claim_id(members: tuple[int, ...], tensor: str) -> str:
    return f"r{members[0]}/{tensor}" if len(members) == 1 else f"g{','.join(map(str, members))}/{tensor}"


class SymbolicRun(Scheduler):
    """The scheduler on object arrays of terms, cutting at claims and recording obligations."""

    def __init__(self, plan: Plan, dims: dict[str, int], logical: LogicalTerms,
                 claims: dict[tuple[int, str], Claim]):
        self.logical, self.claims = logical, claims
        self.sources: dict[tuple[int, str], frozenset[str]] = {}
        self.pending: dict[str, dict[int, np.ndarray]] = {}
        self.obligations: list[Obligation] = []
        self.formulas: dict[str, tuple[list[Term], list[Term]]] = {}
        self.notes: list[str] = []
        self.opaque: dict[tuple[int, str], str] = {}
        self._group_sources: frozenset[str] = frozenset()
        self._received: frozenset[str] = frozenset()
        self.boundary: dict[str, Claim] = {}
        rank_inputs = self._inputs(plan)
        super().__init__(plan, dims, rank_inputs, keep=False)
        self._nodes = {name: {n.name: n for n in g.nodes} for name, g in plan.programs.items()}

    # -- program inputs from boundary lineage --------------------------------------------------
    def _inputs(self, plan: Plan) -> list[dict[str, np.ndarray]]:
        inputs: list[dict[str, np.ndarray]] = [{} for _ in range(plan.num_ranks)]
        for (rank, tensor), claim in self.claims.items():
            program = plan.programs[plan.program_of(rank)]
            if tensor in {s.name for s in program.inputs}:
                inputs[rank][tensor] = self.logical.value[claim.logical][claim.slices()]
                cid = boundary_id(rank, tensor)
                self.sources[rank, tensor] = frozenset({cid})
                self.boundary[cid] = claim
        return inputs

    # -- the value domain --------------------------------------------------------------------
    def evaluate(self, state, node: Node, args):
        try:
            return eval_symbolic(node, args, self.dims, state.ctx)
        except TvRayError as err:
            shape = instantiate_shape(node.shape, self.dims)
            tag = f"opaque:r{state.rank}/{node.name}"
            self.opaque[state.rank, node.name] = str(err)
            # Either way the run cannot end proved: every note is a composition problem (see engine.driver).
            if node.dtype == "float":
                self.notes.append(f"rank {state.rank} {node.name} = {node.op}(...): {err}; its value is left "
                                  f"unconstrained")
                return atoms(tag, shape)
            self.notes.append(f"rank {state.rank} {node.name} = {node.op}(...): {err}; integer values cannot be "
                              f"left unconstrained, so nothing after it is proved")
            return np.full(shape, 0, dtype=object)

    def evaluate_group(self, node: Node, members, values):
        self._group_sources = frozenset().union(
            *(self.sources.get((m, self.ranks[m].program.nodes[self.ranks[m].pc].args[0]), frozenset())
              for m in members))
        return group_rule(node.op, values, node.attr)

    def dtype_of(self, value):
        return None

    def send_extra(self, state, node):
        return self.sources.get((state.rank, node.args[0]), frozenset())

    def receive_extra(self, extra):
        self._received = extra

    # -- cuts -----------------------------------------------------------------------------------
    def _advance(self, state, node: Node, value) -> None:
        key = (state.rank, node.name)
        if node.op in (Op.ALL_REDUCE, Op.ALL_GATHER, Op.REDUCE_SCATTER, Op.ALL_TO_ALL, Op.BROADCAST):
            reads = self._group_sources
        elif node.op == Op.RECV:
            reads = self._received
        else:
            reads = frozenset().union(*(self.sources.get((state.rank, a), frozenset()) for a in node.args))
        if key in self.opaque:
            reads = reads | {f"opaque:r{state.rank}/{node.name}"}
        claim = self.claims.get(key)
        if claim is not None and node.dtype == "float" and node.op != Op.SEND:
            value = self._cut(state, node, value, claim, reads)
        else:
            self.sources[key] = reads
        super()._advance(state, node, value)

    def _cut(self, state, node: Node, value: np.ndarray, claim: Claim, reads: frozenset[str]) -> np.ndarray:
        rank = state.rank
        members = tuple(self.plan.group(rank, claim.partial)) if claim.partial else (rank,)
        cid = claim_id(members, node.name)
        self.sources[rank, node.name] = frozenset({cid})
        target = self.logical.value[claim.logical][claim.slices()]
        if not claim.partial:
            self._record(cid, members, state, node, claim, [value], reads)
            return target
        parts = self.pending.setdefault(cid, {})
        parts[rank] = (value, reads)
        position = members.index(rank)
        free = [atoms(f"{cid}#{p}", claim.shape) for p in range(len(members) - 1)]
        if len(parts) == len(members):
            del self.pending[cid]
            self._record(cid, members, state, node, claim, [parts[m][0] for m in members],
                         frozenset().union(*(parts[m][1] for m in members)))
        if position < len(members) - 1:
            return free[position]
        out = np.empty(claim.shape, dtype=object)
        for idx in np.ndindex(claim.shape):
            out[idx] = target[idx] - sum_([f[idx] for f in free])
        return out

    def _record(self, cid, members, state, node: Node, claim: Claim, values, reads) -> None:
        defined = self.logical.definition[claim.logical][claim.slices()]
        lhs, rhs = [], []
        for idx in np.ndindex(claim.shape):
            lhs.append(sum_([as_dtype(v, "float")[idx] for v in values]))
            rhs.append(defined[idx])
        lhs, rhs = expand(lhs, rhs, self.logical)
        key = formula_key(lhs, rhs, self.logical.order)
        self.formulas.setdefault(key, (lhs, rhs))
        self.obligations.append(Obligation(
            id=cid, ranks=members, program=state.name, tensor=node.name, claim=claim, key=key,
            reads=tuple(sorted(reads)), op=str(node.op), module=node.get_meta("module", "") or "",
            phase=node.get_meta("phase", "") or "", realises=node.get_meta("realises", "") or "",
            mb=node.get_meta("mb"), position=len(self.obligations)))


def _logical_atoms(terms: list[Term], logical: LogicalTerms) -> set[str]:
    out = set()
    for node in postorder(*terms):
        if node.kind is Kind.VAR and node in logical.atom_of:
            out.add(logical.atom_of[node][0])
    return out


def _size(terms: list[Term]) -> int:
    return len(postorder(*terms))


def expand(lhs: list[Term], rhs: list[Term], logical: LogicalTerms) -> tuple[list[Term], list[Term]]:
    """Unfold logical atoms of a tensor that is computed from another tensor the formula also mentions.

    The physical side may skip a logical intermediate (a fused op, a view the
    plan never made, a value left unclaimed): then one side reads U and the
    other reads W = f(U), and as free variables they would look unrelated.
    Replacing W's atoms by W's definition is the logical graph's own equation,
    so the obligation stays equivalent to the claim; latest tensor first.
    """
    if all(a is b for a, b in zip(lhs, rhs)):
        return lhs, rhs          # the same term (a view, a copy, a received value): nothing to unfold
    left, right = _logical_atoms(lhs, logical), _logical_atoms(rhs, logical)
    if left == right:
        return lhs, rhs          # the common case: both sides read the same tensors
    budget = EXPAND_GROWTH * _size(lhs + rhs) + EXPAND_SLACK
    for round_ in range(EXPAND_ROUNDS):
        if round_:
            if _size(lhs + rhs) > budget:
                break    # unfolding further would not close it: a real difference (a bug) or a gap
            left, right = _logical_atoms(lhs, logical), _logical_atoms(rhs, logical)
        present, differ = left | right, left ^ right
        if not differ:
            break
        derived = [t for t in present if (t in differ and logical.derives_from(t, present - {t}))
                   or logical.derives_from(t, differ - {t})] or list(differ)   # else: the other side inlines it
        tensor = max(derived, key=lambda t: logical.order[t])
        definition = logical.definition[tensor]
        values = logical.value[tensor]
        mapping = {values[idx]: definition[idx] for idx in np.ndindex(values.shape)}
        memo: dict = {}
        lhs = [substitute(t, mapping, memo) for t in lhs]
        rhs = [substitute(t, mapping, memo) for t in rhs]
    return lhs, rhs


def partition(plan: Plan, dims: dict[str, int], claims: dict[tuple[int, str], Claim]) -> Partition:
    """Run the plan symbolically with cuts at `claims`; the obligations and the stage DAG."""
    logical = LogicalTerms.build(plan.logical, dims)
    run = SymbolicRun(plan, dims, logical, claims)
    run.run()
    for cid, parts in run.pending.items():
        run.notes.append(f"{cid}: partial claim produced on ranks {sorted(parts)} only")
    dag = nx.DiGraph()
    for cid in run.boundary:
        dag.add_node(cid, kind="boundary")
    for ob in run.obligations:
        dag.add_node(ob.id, kind="obligation")
        for src in ob.reads:
            dag.add_edge(src, ob.id)
    return Partition(run.obligations, run.boundary, dag, run.notes, run.formulas)


__all__ = ["Obligation", "Partition", "LogicalTerms", "SymbolicRun", "partition", "expand", "atoms",
           "atom_name", "boundary_id", "claim_id"]
