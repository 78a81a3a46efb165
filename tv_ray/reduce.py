"""Shape reduction: the smallest dims table at which a plan is solved, and the side conditions that keep it sound.

DESIGN.md soundness rule 4: every dimension an op reduces over (matmul inner
dims, sum/mean/amax/softmax axes, the nll_loss class dim, every factor a view
merges or splits) stays >= 2, or its full value if that is smaller; every
split factor (lineage slices, local_chunk, reduce_scatter, all_gather,
all_to_all, and every shape expression that divides, such as ``batch*seq/4``)
still divides its dimension; and the plan stays well formed (every shape
expression >= 1, slice bounds keep their order). Layer count, parallel
degrees and microbatch count are not dims, so they are never reduced.

Values made from positions are not data, and a reduced dim keeps only its
first positions: a triu mask keeps enough rows that its diagonal differs
from every other (`_triu`); a float arange's elements are variables, not
its first few positions' values (`tv_ray.semantics.symbolic`), so a constant
changed on it shows whatever position it matters at (docs/reduction.md).

Example::

    plan = tv_ray.parallelize(tv_ray.capture_step("llama3-tiny"), "dp=2,tp=2", model="llama3-tiny")
    reduction = reduce_plan(plan)
    reduction.reduced            # {'batch': 2, 'seq': 2, 'kv_heads': 2, ...}
    reduction.to_json()          # the mapping and side conditions, for the certificate

Each condition is one of two atoms over a shape expression E (a polynomial
with rational coefficients, tv_ray.ir.dims.Expr): "E is an integer" or
"E >= k". The solve is exact: a closed form when the per-dimension minima
already satisfy every condition (the per-dimension problem is a relaxation, so
its componentwise minimum is then optimal), otherwise z3 Optimize minimising
the sum of dims, with divisibility written as E's numerator == denominator * q
for an integer q. Whatever a solver returns is re-checked here with exact
rational arithmetic before it is used; if no smaller table is found, the full
dims are the reduction (always valid).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any, Callable, Iterable, Iterator, Mapping

from tv_ray.errors import ShapeError
from tv_ray.ir.dims import Dims, Expr
from tv_ray.ir.graph import Graph, Node
from tv_ray.ir.ops import Op, registrar
from tv_ray.plan import Fixed, Plan

KINDS = ("reduced", "split", "integer", "positive", "order")
RESTATED = frozenset({"reduced", "split", "order"})     # kinds stated every time (not once per expression)
MAX_SOURCES = 8            # distinct reasons kept per condition; `count` says how many ops gave it in all
Z3_TIMEOUT_MS = 30_000
# a value of a shape expression is never near this; ATen writes "slice to the end" as INT64_MAX
_TO_THE_END = 2 ** 62


# -- atoms and side conditions --------------------------------------------------------------
@dataclass(frozen=True)
class Atom:
    """``expr`` is an integer (kind "integer") or ``expr >= bound`` (kind "at_least")."""

    kind: str
    expr: Expr
    bound: int = 0

    def holds(self, dims: Dims) -> bool:
        value = value_of(self.expr, dims)
        return value.denominator == 1 if self.kind == "integer" else value >= self.bound


def value_of(expr: Expr, dims: Dims) -> Fraction:
    """The exact rational value of `expr` at `dims` (Expr.eval insists on an integer; this does not)."""
    total = Fraction(0)
    for mono, coef in expr.terms:
        value = coef
        for name, exp in mono:
            value *= Fraction(dims[name]) ** exp
        total += value
    return total


@dataclass
class SideCondition:
    """One side condition of the reduction, with the ops / lineage entries that impose it."""

    kind: str                  # reduced | split | integer | positive | order
    atom: Atom
    text: str                  # "head_dim*kv_heads*n_rep/2 >= 2"
    sources: list[dict] = field(default_factory=list)   # first op per reason: path, op, why, module, phase
    count: int = 0

    @property
    def dims(self) -> tuple[str, ...]:
        return tuple(sorted(self.atom.expr.free_dims))

    def to_json(self) -> dict:
        return {"kind": self.kind, "condition": self.text, "dims": list(self.dims),
                "sources": self.sources, "count": self.count}


@dataclass(frozen=True)
class Reduction:
    """The reduced dims table of a plan, the side conditions it keeps, and how it was found."""

    full: dict[str, int]
    reduced: dict[str, int]
    conditions: tuple[SideCondition, ...]
    solver: str                # closed-form | z3 | full
    seconds: float
    note: str = ""

    def failing(self, dims: Dims) -> list[SideCondition]:
        """The side conditions that do not hold at `dims` (none at `reduced`, none at `full`)."""
        return [c for c in self.conditions if not c.atom.holds(dims)]

    def to_json(self) -> dict:
        """JSON for the certificate: both tables, the conditions with their provenance, the solver."""
        return {"full": dict(self.full), "reduced": dict(self.reduced), "solver": self.solver,
                "seconds": round(self.seconds, 6), "note": self.note,
                "conditions": [c.to_json() for c in self.conditions]}


# -- collecting conditions ----------------------------------------------------------------------
Source = tuple[str, Node | None, str]   # (JSON path, node or None for lineage, why)


class _Collector:
    """Side conditions keyed by (kind, atom); each remembers its first few sources and a count."""

    def __init__(self, full: Dims):
        self.full = full
        self.conditions: dict[tuple[str, Atom], SideCondition] = {}
        self.seen: set[tuple[str, Expr]] = set()    # (kind, expr) stated once, as most shapes repeat
        self._at_full: dict[Expr, Fraction] = {}      # Expr is interned: a plan repeats a few hundred
        self.view_blocks: dict[tuple, list[list[Expr]]] = {}
        self.restated: list | None = None     # the conditions the op being collected states again if repeated

    def at_full(self, expr: Expr) -> Fraction:
        value = self._at_full.get(expr)
        if value is None:
            value = self._at_full[expr] = value_of(expr, self.full)
        return value

    def add(self, kind: str, atom: Atom, text: str, source: Source) -> None:
        key = (kind, atom)
        cond = self.conditions.get(key)
        if cond is None:
            cond = self.conditions[key] = SideCondition(kind, atom, text)
        cond.count += 1
        if self.restated is not None and kind in RESTATED:
            self.restated.append(cond)
        path, node, why = source
        # one source per distinct reason: a certificate reader wants every kind of op that asks
        if len(cond.sources) < MAX_SOURCES and all(s["why"] != why for s in cond.sources):
            entry: dict[str, Any] = {"path": path, "why": why}
            if node is not None:
                entry["op"] = node.op.value
                entry["node"] = node.name
                for key_ in ("module", "phase"):
                    if node.get_meta(key_) is not None:
                        entry[key_] = node.get_meta(key_)
            cond.sources.append(entry)

    # the four condition makers every rule uses
    def reduced(self, expr: Expr, source: Source, least: int = 2) -> None:
        if expr.is_const:
            return
        at_full = self.at_full(expr)
        bound = least if at_full >= least else max(1, math.floor(at_full))   # "or its full value if smaller"
        self.add("reduced", Atom("at_least", expr, bound), f"{expr} >= {bound}", source)

    def divides(self, expr: Expr, parts: int, source: Source) -> None:
        if parts > 1 and not (expr.is_const and expr.const_value() % parts == 0):
            self.add("split", Atom("integer", expr / parts), f"{parts} divides {expr}", source)

    def integer(self, expr: Expr, source: Source) -> None:
        if ("integer", expr) in self.seen:
            return
        self.seen.add(("integer", expr))
        if any(coef.denominator != 1 or any(e < 0 for _, e in mono) for mono, coef in expr.terms):
            self.add("integer", Atom("integer", expr), f"{expr} is an integer", source)

    def positive(self, expr: Expr, source: Source) -> None:
        if expr.is_const or ("positive", expr) in self.seen:
            return
        self.seen.add(("positive", expr))
        self.integer(expr, source)
        self.add("positive", Atom("at_least", expr, 1), f"{expr} >= 1", source)

    def keep_order(self, low: Expr, high: Expr, source: Source) -> None:
        """low <= high if it holds at full size, else low >= high: a clamp at full size stays a clamp."""
        diff = high - low
        if diff.is_const:
            return
        if self.at_full(diff) >= 0:
            self.add("order", Atom("at_least", diff, 0), f"{low} <= {high}", source)
        else:
            self.add("order", Atom("at_least", -diff, 0), f"{low} >= {high}", source)


# -- per-op rules --------------------------------------------------------------------------------
OpRule = Callable[[_Collector, Node, list[tuple], Mapping[str, int], str], None]
_RULES: dict[Op, OpRule] = {}
_rule = registrar(_RULES, "reduce: a rule")


def _axis(dim: int, rank: int) -> int:
    return dim + rank if dim < 0 else dim


def _group_size(axes: Iterable[str], axis_sizes: Mapping[str, int]) -> int:
    return math.prod(axis_sizes[a] for a in axes)


@_rule(Op.MM, Op.BMM)
def _matmul(c, node, shapes, axis_sizes, path):
    c.reduced(shapes[0][-1], (path, node, f"{node.op} inner dim (matmul contraction)"))


@_rule(Op.ADDMM)
def _addmm(c, node, shapes, axis_sizes, path):
    c.reduced(shapes[1][-1], (path, node, "addmm inner dim (matmul contraction)"))


@_rule(Op.SUM, Op.MEAN, Op.AMAX)
def _reduction(c, node, shapes, axis_sizes, path):
    shape = shapes[0]
    for d in node.attr["dims"] or range(len(shape)):
        c.reduced(shape[_axis(d, len(shape))], (path, node, f"{node.op} axis {d}"))


@_rule(Op.SOFTMAX, Op.LOG_SOFTMAX, Op.SOFTMAX_BACKWARD, Op.LOG_SOFTMAX_BACKWARD)
def _softmax(c, node, shapes, axis_sizes, path):
    d = node.attr["dim"]
    name = {Op.SOFTMAX: "softmax", Op.LOG_SOFTMAX: "log_softmax", Op.SOFTMAX_BACKWARD: "softmax backward",
            Op.LOG_SOFTMAX_BACKWARD: "log_softmax backward"}[node.op]
    c.reduced(shapes[0][_axis(d, len(shapes[0]))], (path, node, f"{name} axis {d}"))


@_rule(Op.TRIU)
def _triu(c, node, shapes, axis_sizes, path):
    # the mask keeps j - i >= d; on an n x n matrix the diagonals -(n-1) .. n give 2n different masks, so one
    # with n > d (d > 0) or n >= 2 - d differs from every other diagonal's (a causal mask's d = 1: n >= 2)
    d = node.attr["diagonal"]
    for size in shapes[0][-2:]:
        c.reduced(size, (path, node, f"triu mask (diagonal {d})"), d + 1 if d > 0 else 2 - d)


@_rule(Op.NLL_LOSS)
def _nll_loss(c, node, shapes, axis_sizes, path):
    c.reduced(shapes[0][-1], (path, node, "nll_loss class dim"))
    if node.attr["reduction"] != "none":
        for size in shapes[1]:
            c.reduced(size, (path, node, f"nll_loss {node.attr['reduction']} over targets"))


@_rule(Op.NLL_LOSS_TOTAL_WEIGHT)
def _nll_total_weight(c, node, shapes, axis_sizes, path):
    for size in shapes[0]:
        c.reduced(size, (path, node, "nll_loss_total_weight counts targets"))


@_rule(Op.EMBEDDING_BACKWARD)
def _embedding_backward(c, node, shapes, axis_sizes, path):
    for size in shapes[1]:
        c.reduced(size, (path, node, "embedding backward sums over tokens"))


@_rule(Op.INDEX_ADD, Op.SCATTER_ADD)
def _index_add(c, node, shapes, axis_sizes, path):
    index = shapes[1]
    sizes = index if node.op == Op.INDEX_ADD else index[_axis(node.attr["dim"], len(index)):][:1]
    for size in sizes:
        c.reduced(size, (path, node, f"{node.op} sums over the index"))


@_rule(Op.VIEW)
def _view(c, node, shapes, axis_sizes, path):
    key = (shapes[0], node.shape)
    blocks = c.view_blocks.get(key)
    if blocks is None:
        blocks = c.view_blocks[key] = list(_view_blocks(shapes[0], node.shape, c.at_full))
    for block in blocks:
        for size in block:
            c.reduced(size, (path, node, "view merges or splits this factor"))


def _view_blocks(before: tuple, after: tuple, at_full: Callable[[Expr], Fraction]) -> Iterator[list[Expr]]:
    """The groups of dims a view merges or splits (blocks with equal products; ones skipped).

    Block ends are found on the full-size values: both sides are stated
    symbolically and lint has checked their element counts agree.
    """
    a = [d for d in before if not (d.is_const and d.const_value() == 1)]
    b = [d for d in after if not (d.is_const and d.const_value() == 1)]
    i = j = 0
    while i < len(a) and j < len(b):
        block, pa, pb = [a[i], b[j]], at_full(a[i]), at_full(b[j])
        i, j = i + 1, j + 1
        while pa != pb and (i < len(a) or j < len(b)):
            if (pa < pb and i < len(a)) or j >= len(b):
                block.append(a[i])
                pa *= at_full(a[i])
                i += 1
            else:
                block.append(b[j])
                pb *= at_full(b[j])
                j += 1
        if len(block) > 2:
            yield block
    if i < len(a) or j < len(b):     # counts disagree at full size; lint names that, not us
        yield a[i:] + b[j:]


@_rule(Op.LOCAL_CHUNK, Op.REDUCE_SCATTER)
def _chunked(c, node, shapes, axis_sizes, path):
    d = node.attr["dim"]
    parts = _group_size(node.attr["axes"], axis_sizes)
    c.divides(shapes[0][_axis(d, len(shapes[0]))], parts,
              (path, node, f"{node.op} cuts dim {d} into {parts} chunks over {list(node.attr['axes'])}"))


@_rule(Op.ALL_GATHER)
def _all_gather(c, node, shapes, axis_sizes, path):
    d = node.attr["dim"]
    parts = _group_size(node.attr["axes"], axis_sizes)
    c.divides(node.shape[_axis(d, len(node.shape))], parts,
              (path, node, f"all_gather joins {parts} chunks along dim {d} over {list(node.attr['axes'])}"))


@_rule(Op.ALL_TO_ALL)
def _all_to_all(c, node, shapes, axis_sizes, path):
    d = node.attr["split_dim"]
    parts = _group_size(node.attr["axes"], axis_sizes)
    c.divides(shapes[0][_axis(d, len(shapes[0]))], parts,
              (path, node, f"all_to_all splits dim {d} into {parts} chunks"))


def _slice_order(c: _Collector, node: Node, size: Expr, attrs: dict, path: str) -> None:
    start, end = attrs["start"], attrs["end"]
    if start.is_const and start.const_value() < 0:
        start = start + size
    if end.is_const and end.const_value() < 0:
        end = end + size
    if end.is_const and end.const_value() >= _TO_THE_END:
        end = size
    source = (path, node, f"{node.op} bounds along dim {attrs['dim']}")
    c.keep_order(Expr.const(0), start, source)
    c.keep_order(start, end, source)
    c.keep_order(end, size, source)


@_rule(Op.SLICE)
def _slice(c, node, shapes, axis_sizes, path):
    attrs = node.attr
    _slice_order(c, node, shapes[0][_axis(attrs["dim"], len(shapes[0]))], attrs, path)


@_rule(Op.SLICE_BACKWARD)
def _slice_backward(c, node, shapes, axis_sizes, path):
    attrs = node.attr
    size = attrs["input_size"]
    _slice_order(c, node, size[_axis(attrs["dim"], len(size))], attrs, path)


@_rule(Op.SELECT)
def _select(c, node, shapes, axis_sizes, path):
    attrs = node.attr
    size, index = shapes[0][_axis(attrs["dim"], len(shapes[0]))], attrs["index"]
    if index.is_const and index.const_value() < 0:
        index = index + size
    source = (path, node, f"select index along dim {attrs['dim']}")
    c.keep_order(Expr.const(0), index, source)
    c.keep_order(index + 1, size, source)


@_rule(Op.TOPK_VALUES, Op.TOPK_INDICES, Op.TOPK_MASK)
def _topk(c, node, shapes, axis_sizes, path):
    d = node.attr["dim"]
    size = shapes[0][_axis(d, len(shapes[0]))]
    c.keep_order(node.attr["k"], size, (path, node, f"topk k along dim {d}"))
    c.reduced(size, (path, node, f"topk compares along dim {d}"))
    if node.op == Op.TOPK_MASK:     # a routing choice stays a choice: with all k picked, every expert's
        # gates and loads become constants across layers, which the inference of claims by value confuses
        c.keep_order(Expr.of(node.attr["k"]) + 1, size, (path, node, f"topk picks among more than k along dim {d}"))


@_rule(Op.SQUEEZE)
def _squeeze(c, node, shapes, axis_sizes, path):
    # squeeze drops a dim only when it is 1: a symbolic dim must stay on the same side of 1
    if not shapes[0]:
        return
    size = shapes[0][_axis(node.attr["dim"], len(shapes[0]))]
    c.keep_order(size, Expr.const(1), (path, node, "squeeze removes this dim only at size 1"))
    c.keep_order(Expr.const(1), size, (path, node, "squeeze removes this dim only at size 1"))


def _collect_graph(c: _Collector, graph: Graph, path: str, axis_sizes: Mapping[str, int]) -> None:
    """The side conditions of `graph`'s inputs and ops. An op the same as one before — kind, attributes, its own
    and its arguments' shape objects: a microbatch copy — states the very conditions again (its rule reads
    nothing else, and a reason names the op kind, never the op), so it only counts them again."""
    shapes: dict[str, tuple] = {}
    stated: dict[tuple, list] = {}      # (op, attrs, shape and argument shapes by identity) -> conditions counted
    for i, spec in enumerate(graph.inputs):
        shapes[spec.name] = spec.shape
        for d in spec.shape:
            c.positive(d, (f"{path}.inputs[{i}]", None, f"shape of input {spec.name}"))
        if spec.high is not None:
            c.positive(spec.high, (f"{path}.inputs[{i}]", None, f"high bound of input {spec.name}"))
    for i, node in enumerate(graph.nodes):   # iterative: a program may hold 10^5 ops
        same = (node.op, id(node.attrs), id(node.shape), *(id(shapes[a]) for a in node.args))
        counted = stated.get(same)
        if counted is not None:
            for cond in counted:
                cond.count += 1
            shapes[node.name] = node.shape
            continue
        c.restated = []
        where = f"{path}.ops[{i}]"
        for d in node.shape:
            if not d.is_const and ("positive", d) not in c.seen:
                c.positive(d, (where, node, "stated result shape"))
        for key, value in node.attrs:
            if isinstance(value, Expr):
                c.integer(value, (where, node, f"attribute {key}"))
            elif isinstance(value, tuple) and value and isinstance(value[0], Expr):
                for d in value:
                    c.integer(d, (where, node, f"attribute {key}"))
        rule = _RULES.get(node.op)
        if rule is not None:
            rule(c, node, [shapes[a] for a in node.args], axis_sizes, where)
        shapes[node.name] = node.shape
        stated[same], c.restated = c.restated, None


def _collect_lineage(c: _Collector, plan: Plan) -> None:
    outputs = plan.logical.output_map
    sizes = plan.axis_sizes
    for i, entry in enumerate(plan.lineage):
        shape = plan.logical.shape_of(outputs.get(entry.logical, entry.logical))
        for dim, factors in entry.slice:
            parts = math.prod(f.of if isinstance(f, Fixed) else sizes[f] for f in factors)
            names = [f"{f.index}/{f.of}" if isinstance(f, Fixed) else f for f in factors]
            c.divides(shape[dim], parts, (f"lineage[{i}]", None,
                                          f"lineage slice of {entry.logical} dim {dim} by {names}"))


def collect(plan: Plan) -> list[SideCondition]:
    """Every side condition of `plan`: logical graph, each program, each lineage entry."""
    c = _Collector(plan.dims)
    _collect_graph(c, plan.logical, "logical", {})
    for name, program in plan.programs.items():
        _collect_graph(c, program, f"programs.{name}", plan.axis_sizes)
    _collect_lineage(c, plan)
    return list(c.conditions.values())


# -- solving -------------------------------------------------------------------------------------------
def _check_full(conditions: list[SideCondition], full: Dims) -> None:
    for cond in conditions:
        if not cond.atom.holds(full):
            dims = ", ".join(f"{d}={full[d]}" for d in cond.dims) or "no dims"
            where = "; ".join(f"{s['path']}" + (f" {s['op']}" if "op" in s else "") + f" ({s['why']})"
                              for s in cond.sources)
            more = f" and {cond.count - len(cond.sources)} more" if cond.count > len(cond.sources) else ""
            raise ShapeError(f"shape reduction: {cond.text} fails at the full dims ({dims}), so no "
                             f"dims table keeps it; dimension {', '.join(cond.dims) or '?'} is constrained "
                             f"by {where}{more}; fix the dims or the split")


def _per_dim_minimum(conditions: list[SideCondition], full: Dims) -> dict[str, int]:
    """For each dim, the smallest value in [1, full] that satisfies the conditions on it alone."""
    own: dict[str, list[Atom]] = {d: [] for d in full}
    for cond in conditions:
        names = cond.atom.expr.free_dims
        if len(names) == 1:
            own[next(iter(names))].append(cond.atom)
    low = {}
    for d, atoms in own.items():
        value = 1
        while value < full[d] and not all(a.holds({d: value}) for a in atoms):
            value += 1
        low[d] = value
    return low


def _cleared(expr: Expr) -> tuple[Expr, Expr]:
    """(N, D) with expr == N / D, N a polynomial with integer coefficients, D = L * monomial > 0."""
    lcm = math.lcm(*(coef.denominator for _, coef in expr.terms)) if expr.terms else 1
    negative: dict[str, int] = {}
    for mono, _ in expr.terms:
        for name, exp in mono:
            if exp < 0:
                negative[name] = max(negative.get(name, 0), -exp)
    denominator = Expr({tuple(sorted(negative.items())): Fraction(lcm)})
    return expr * denominator, denominator


def _z3_solve(conditions: list[SideCondition], full: Dims, low: Dims) -> tuple[dict[str, int] | None, str]:
    import z3

    # a context of its own: z3's is not thread-safe, and the solver backends check in worker threads on theirs
    ctx = z3.Context()
    dims = {d: z3.Int(d, ctx) for d in full}

    def term(expr: Expr):
        total = z3.IntVal(0, ctx)
        for mono, coef in expr.terms:
            product = z3.IntVal(int(coef), ctx)
            for name, exp in mono:
                for _ in range(exp):
                    product = product * dims[name]
            total = total + product
        return total

    opt = z3.Optimize(ctx=ctx)
    opt.set("timeout", Z3_TIMEOUT_MS)
    for d, var in dims.items():
        opt.add(var >= low[d], var <= full[d])
    for i, cond in enumerate(conditions):
        numerator, denominator = _cleared(cond.atom.expr)
        n, m = term(numerator), term(denominator)
        if cond.atom.kind == "integer":
            opt.add(n == m * z3.Int(f"q{i}", ctx))
        else:
            opt.add(n >= cond.atom.bound * m)
    opt.minimize(z3.Sum(list(dims.values())))
    verdict = opt.check()
    if verdict != z3.sat:
        return None, f"z3 {verdict}: {opt.reason_unknown() if verdict == z3.unknown else 'no model'}"
    model = opt.model()
    return {d: model.eval(var, model_completion=True).as_long() for d, var in dims.items()}, ""


def solve(conditions: list[SideCondition], full: Dims, *,
          use_closed_form: bool = True) -> tuple[dict[str, int], str, str]:
    """(reduced dims, solver, note): the smallest table by sum of dims in [1, full] keeping `conditions`.

    The conditions must hold at `full` (`reduce_plan` checks that first), so
    the full table is always a valid answer when nothing smaller is found.
    """
    full = dict(full)
    low = _per_dim_minimum(conditions, full)
    if use_closed_form and all(c.atom.holds(low) for c in conditions):
        return low, "closed-form", "per-dimension minima satisfy every condition"
    found, note = _z3_solve(conditions, full, low)
    if found is None:
        return full, "full", note
    if not all(c.atom.holds(found) for c in conditions):
        # never trust a model we cannot re-check; the full dims are always valid
        return full, "full", "z3's model failed the exact re-check"
    return found, "z3", "optimal" if not note else note


def reduce_plan(plan: Plan, *, use_closed_form: bool = True) -> Reduction:
    """The smallest dims table (by sum of dims) that keeps every side condition of `plan`.

    Example::

        reduction = reduce_plan(plan)
        tv_ray.simulate(plan, seed=0, dims=reduction.reduced)

    Raises ShapeError naming the dimension and the ops when a condition fails
    even at the plan's full dims. `use_closed_form=False` always asks z3 (tests
    cross-check the two).
    """
    start = time.perf_counter()
    full = dict(plan.dims)
    conditions = collect(plan)
    _check_full(conditions, full)
    reduced, solver, note = solve(conditions, full, use_closed_form=use_closed_form)
    ordered = tuple(sorted(conditions, key=lambda c: (KINDS.index(c.kind), c.text)))
    return Reduction(full, reduced, ordered, solver, time.perf_counter() - start, note)
