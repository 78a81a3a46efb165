"""The concrete plan simulator: run every rank's program on random float64 inputs and compare with the logical step.

`simulate(plan, seed)` draws the logical inputs, runs the logical graph for the
reference outputs, hands each rank its slice of the inputs (boundary lineage),
runs all ranks together — collectives and send/recv emulated by a round-robin
scheduler — and measures, for every output lineage entry, the largest
``|physical - logical|``. It is a fast refuter, not a proof: agreement at one
random point proves nothing, disagreement is a bug (or a plan error)::

    >>> result = simulate(Plan.load("mlp-tp2.plan.json"), seed=0)
    >>> result.max_abs_dev()
    {'loss': 0.0, 'grad': 4.4e-16, 'param': 0.0, 'state': 0.0}
    >>> result.deviating(tol=1e-9)
    []

The command line is ``tv-ray run plan.json [--seed N] [--tol 1e-9] [--dims k=v,...]``.
"""
from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict, deque
from dataclasses import dataclass, field

import numpy as np

from tv_ray.errors import PlanError, SimulationError, TvRayError
from tv_ray.ir import Graph, TensorSpec
from tv_ray.plan import Plan
from tv_ray.ir import Node, Op
from tv_ray.ir.ops import COLLECTIVES
from tv_ray.semantics import Context, eval_node, rule_for, run_graph
from tv_ray.semantics.interpret import describe as describe_node
from tv_ray.semantics.table import dtype_name, instantiate_shape, numpy_dtype

GROUPS = ("loss", "grad", "param", "state")


@dataclass
class SimResult:
    """Deviations of one simulated step: per logical output, the largest |physical - logical| and where."""

    plan: str
    seed: int
    ranks: int
    dims: dict[str, int]
    deviation: dict[str, float] = field(default_factory=dict)    # logical output -> max |dev|
    worst_rank: dict[str, int] = field(default_factory=dict)     # logical output -> rank of that max
    group_of: dict[str, str] = field(default_factory=dict)       # logical output -> loss/grad/param/state/other

    def max_abs_dev(self) -> dict[str, float | None]:
        """The largest deviation per output group (None for a group the plan has no output in)."""
        out: dict[str, float | None] = {group: None for group in GROUPS}
        for name, dev in self.deviation.items():
            group = self.group_of[name]
            out[group] = dev if out.get(group) is None else max(out[group], dev)
        return out

    def deviating(self, tol: float) -> list[str]:
        """The logical outputs whose deviation exceeds `tol`, sorted."""
        return sorted(name for name, dev in self.deviation.items() if not dev <= tol)

    def ok(self, tol: float) -> bool:
        return not self.deviating(tol)


def output_group(name: str, logical: Graph) -> str:
    """loss, grad, param or state for a logical output name; other for names outside the convention."""
    roles = {spec.name: spec.role for spec in logical.inputs}
    if name == "loss" or name.startswith("loss/"):
        return "loss"
    if name.startswith("grad/"):
        return "grad"
    if name.startswith("new/") and name[4:] in roles:
        return "param" if roles[name[4:]] == "param" else "state"
    return "other"


# -- inputs ---------------------------------------------------------------------------------------
def draw_inputs(logical: Graph, dims: dict[str, int], rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Random logical inputs: normal floats, positive floats in [0.5, 2], ints in [0, high), step in [1, 10]."""
    values = {}
    for spec in logical.inputs:
        shape = tuple(d.eval(dims) for d in spec.shape)
        values[spec.name] = _draw(spec, shape, dims, rng).astype(numpy_dtype(spec.dtype), copy=False)
    return values


def _draw(spec: TensorSpec, shape: tuple[int, ...], dims: dict[str, int], rng: np.random.Generator) -> np.ndarray:
    if spec.dtype == "int":
        if spec.role == "step":
            return rng.integers(1, 11, size=shape)
        return rng.integers(0, spec.high.eval(dims), size=shape)
    if spec.dtype == "bool":
        return rng.integers(0, 2, size=shape).astype(bool)
    if spec.role == "step":
        return rng.uniform(1.0, 10.0, size=shape)
    if spec.positive:
        return rng.uniform(0.5, 2.0, size=shape)
    return rng.standard_normal(size=shape)


def _rank_inputs(plan: Plan, logical_values: dict[str, np.ndarray]) -> list[dict[str, np.ndarray]]:
    """Each rank's program inputs: the logical slice its (unique, validated) input lineage entry names."""
    names, ids = plan.rank_programs()
    inputs: list[dict[str, np.ndarray]] = [{} for _ in range(plan.num_ranks)]
    input_names = {name: {spec.name for spec in plan.programs[name].inputs} for name in names}
    for entry in plan.lineage:
        for rank in np.flatnonzero(plan.selects(entry)):
            if entry.tensor in input_names[names[ids[rank]]]:
                value = logical_values[entry.logical]
                bounds = plan.slice_bounds(entry, int(rank), value.shape)
                inputs[rank][entry.tensor] = value[tuple(slice(a, b) for a, b in bounds)].copy()
    return inputs


# -- comparison --------------------------------------------------------------------------------------
def _deviation(physical: np.ndarray, logical: np.ndarray) -> float:
    """max |physical - logical|, where equal infinities and NaN against NaN count as 0 and NaN against a number as inf."""
    a, b = physical.astype(np.float64), logical.astype(np.float64)
    if a.size == 0:
        return 0.0
    with np.errstate(invalid="ignore"):
        diff = np.where((a == b) | (np.isnan(a) & np.isnan(b)), 0.0, np.abs(a - b))
    return float(np.nan_to_num(diff, nan=np.inf).max())


def _compare(plan: Plan, outputs: list[dict[str, np.ndarray]], reference: dict[str, np.ndarray],
             result: SimResult) -> None:
    names, ids = plan.rank_programs()
    for entry in plan.lineage:
        logical = reference[entry.logical]
        done: set[tuple[int, ...]] = set()
        for rank in (int(r) for r in np.flatnonzero(plan.selects(entry))):
            if entry.tensor not in outputs[rank]:
                continue   # an input on this rank
            members = tuple(plan.group(rank, entry.partial)) if entry.partial else (rank,)
            if members in done:
                continue
            done.add(members)
            physical = outputs[members[0]][entry.tensor]
            for other in members[1:]:
                physical = physical + outputs[other][entry.tensor]
            bounds = plan.slice_bounds(entry, rank, logical.shape)
            expected = logical[tuple(slice(a, b) for a, b in bounds)]
            if physical.shape != expected.shape:
                raise SimulationError(f"{plan.describe(rank)}: output {entry.tensor!r} of {names[ids[rank]]!r} has "
                                      f"shape {physical.shape}, but its slice of {entry.logical!r} has shape "
                                      f"{expected.shape}")
            dev = _deviation(physical, expected)
            if dev > result.deviation.get(entry.logical, -1.0):
                result.deviation[entry.logical] = dev
                result.worst_rank[entry.logical] = rank


# -- running all ranks together ------------------------------------------------------------------------
_TOKEN = np.zeros(0)   # the value of a send: nothing


def _op_text(node: Node) -> str:
    return f"{node.op} {json.dumps(node.to_json().get('attrs', {}), separators=(',', ':'))}"


class _Rank:
    """One rank's execution state: its program, position and live values."""

    def __init__(self, rank: int, name: str, program: Graph, env: dict[str, np.ndarray], ctx: Context):
        self.rank, self.name, self.program, self.env, self.ctx = rank, name, program, env, ctx
        self.pc = 0
        self.issued: dict[tuple, int] = defaultdict(int)   # collectives completed per group

    @property
    def done(self) -> bool:
        return self.pc == len(self.program.nodes)

    def where(self) -> str:
        return f"programs.{self.name}.ops[{self.pc}]"


class Scheduler:
    """Round-robin over ranks: each runs until it blocks at a collective (until every member of the
    group reaches its matching one) or at a recv (until the matching send happened)."""

    def __init__(self, plan: Plan, dims: dict[str, int], rank_inputs: list[dict[str, np.ndarray]]):
        self.plan, self.dims = plan, dims
        names, ids = plan.rank_programs()
        self.frees = {name: _frees(plan.programs[name]) for name in set(names[i] for i in ids)}
        self.ranks = [_Rank(r, names[ids[r]], plan.programs[names[ids[r]]], rank_inputs[r],
                            Context(plan.axis_sizes, plan.coords(r))) for r in range(plan.num_ranks)]
        self.arrived: dict[tuple, dict[int, np.ndarray]] = {}          # (group, k) -> rank -> input
        self.mailbox: dict[tuple, deque] = defaultdict(deque)          # (src, dst, tag) -> values
        self.handlers = {**{op: self._collective for op in COLLECTIVES}, Op.SEND: self._send, Op.RECV: self._recv}
        self.groups: dict[tuple, tuple[int, ...]] = {}

    def run(self) -> list[dict[str, np.ndarray]]:
        """Run every rank to its end; each rank's outputs by output name."""
        while not all(r.done for r in self.ranks):
            progressed = False
            for state in self.ranks:
                while not state.done and self._step(state):
                    progressed = True
            if not progressed:
                raise SimulationError(self._deadlock())
        return [{out: r.env[value] for out, value in r.program.outputs} for r in self.ranks]

    def _step(self, state: _Rank) -> bool:
        node = state.program.nodes[state.pc]
        return self.handlers.get(node.op, self._compute)(state, node)

    def _advance(self, state: _Rank, node: Node, value: np.ndarray) -> None:
        state.env[node.name] = value
        for name in self.frees[state.name][state.pc]:
            del state.env[name]
        state.pc += 1

    def _fail(self, state: _Rank, node: Node, err: Exception) -> SimulationError:
        return SimulationError(f"{self.plan.describe(state.rank)} at {state.where()} ({describe_node(node)}): {err}")

    def _compute(self, state: _Rank, node: Node) -> bool:
        try:
            value = eval_node(node, [state.env[a] for a in node.args], self.dims, state.ctx)
        except (TvRayError, ArithmeticError, ValueError, IndexError, TypeError) as err:
            raise self._fail(state, node, err) from err
        self._advance(state, node, value)
        return True

    def _group(self, state: _Rank, node: Node) -> tuple[tuple, tuple[int, ...]]:
        axes = node.attr["axes"]
        if (state.rank, axes) not in self.groups:
            self.groups[state.rank, axes] = tuple(self.plan.group(state.rank, axes))
        members = self.groups[state.rank, axes]
        return (axes, members), members

    def _collective(self, state: _Rank, node: Node) -> bool:
        group, members = self._group(state, node)
        slot = (group, state.issued[group])
        arrived = self.arrived.setdefault(slot, {})
        if state.rank in arrived:
            return False
        first = self.ranks[next(iter(arrived))] if arrived else None
        if first is not None and (first.program.nodes[first.pc].op, first.program.nodes[first.pc].attrs) != \
                (node.op, node.attrs):
            raise SimulationError(
                f"mismatched collectives on the {'×'.join(group[0])} group {list(members)} (collective "
                f"#{slot[1] + 1} there): {self.plan.describe(first.rank)} runs {first.where()} "
                f"{_op_text(first.program.nodes[first.pc])}, {self.plan.describe(state.rank)} runs "
                f"{state.where()} {_op_text(node)}")
        arrived[state.rank] = state.env[node.args[0]]
        if len(arrived) < len(members):
            return False
        try:
            results = rule_for(node.op, "group").group([arrived[m] for m in members], node.attr)
        except (TvRayError, ValueError) as err:
            raise SimulationError(f"{_op_text(node)} on the group {list(members)} at {state.where()}: {err}") from err
        del self.arrived[slot]
        for member, value in zip(members, results):
            peer = self.ranks[member]
            stated = instantiate_shape(peer.program.nodes[peer.pc].shape, self.dims)
            if value.shape != stated:
                raise SimulationError(f"{self.plan.describe(member)} at {peer.where()}: {_op_text(node)} gives shape "
                                      f"{value.shape} but the op states {stated}")
            peer.issued[group] += 1
            self._advance(peer, peer.program.nodes[peer.pc], value)
        return True

    def _peer(self, state: _Rank, node: Node) -> int:
        coords = state.ctx.coords
        return self.plan.rank_of({a: coords[a] + dict(node.attr["peer"]).get(a, 0) for a in coords})

    def _send(self, state: _Rank, node: Node) -> bool:
        key = (state.rank, self._peer(state, node), node.attr.get("tag", 0))
        self.mailbox[key].append((state.env[node.args[0]], state.where()))
        self._advance(state, node, _TOKEN)
        return True

    def _recv(self, state: _Rank, node: Node) -> bool:
        queue = self.mailbox.get((self._peer(state, node), state.rank, node.attr.get("tag", 0)))
        if not queue:
            return False
        value, sent_at = queue.popleft()
        want = instantiate_shape(node.attr["size"], self.dims)
        if value.shape != want or value.dtype != numpy_dtype(node.attr["dtype"]):
            raise SimulationError(f"{self.plan.describe(state.rank)} at {state.where()} ({describe_node(node)}) "
                                  f"expects {node.attr['dtype']} {want} but {sent_at} sent {dtype_name(value)} "
                                  f"{value.shape}")
        self._advance(state, node, value)
        return True

    def _deadlock(self) -> str:
        waits = []
        for state in self.ranks:
            if state.done:
                continue
            node = state.program.nodes[state.pc]
            if node.op in COLLECTIVES:
                group, members = self._group(state, node)
                arrived = sorted(self.arrived.get((group, state.issued[group]), {}))
                what = (f"{node.name} = {_op_text(node)} on group {list(members)}, collective "
                        f"#{state.issued[group] + 1} there; arrived: {arrived}")
            else:
                what = f"{node.name} = recv from {self.plan.describe(self._peer(state, node))}, tag {node.attr.get('tag', 0)}"
            waits.append(f"{self.plan.describe(state.rank)} waits at {state.where()} ({what})")
        unread = [f"rank {src}→{dst} tag {tag} ×{len(q)}" for (src, dst, tag), q in sorted(self.mailbox.items()) if q]
        return ("deadlock: " + "; ".join(waits) + (f"; sent but never received: {', '.join(unread)}" if unread else ""))


def _frees(program: Graph) -> list[list[str]]:
    """For each op position, the values last read there (program outputs are kept to the end)."""
    last: dict[str, int] = {}
    for position, node in enumerate(program.nodes):
        for arg in node.args:
            last[arg] = position
    for _, value in program.outputs:
        last.pop(value, None)
    frees: list[list[str]] = [[] for _ in program.nodes]
    for name, position in last.items():
        frees[position].append(name)
    return frees


# -- the simulator ---------------------------------------------------------------------------------
def simulate(plan: Plan, seed: int = 0, dims: dict[str, int] | None = None) -> SimResult:
    """Run the plan and the logical graph on the same random inputs; deviations per logical output.

    `dims` overrides some of the plan's dims (run at a smaller size); the plan is
    re-validated there. Raises SimulationError on deadlock or mismatched
    collectives, PlanError if the plan does not hold at `dims`.
    """
    run_dims = _run_dims(plan, dims)
    if run_dims != plan.dims:
        from tv_ray.plan_check import check_plan
        check_plan(plan, run_dims)
    rng = np.random.default_rng(seed)
    logical_inputs = draw_inputs(plan.logical, run_dims, rng)
    reference = dict(logical_inputs)
    reference.update(run_graph(plan.logical, run_dims, logical_inputs))
    rank_inputs = _rank_inputs(plan, logical_inputs)
    del logical_inputs
    outputs = Scheduler(plan, run_dims, rank_inputs).run()
    result = SimResult(plan.model, seed, plan.num_ranks, run_dims,
                       group_of={out: output_group(out, plan.logical) for out, _ in plan.logical.outputs})
    _compare(plan, outputs, reference, result)
    for out, _ in plan.logical.outputs:
        if out not in result.deviation:
            raise SimulationError(f"logical output {out!r}: no rank produced it (check the output lineage)")
    for name in result.deviation:   # output lineage may also name a logical input (a value passed through)
        result.group_of.setdefault(name, output_group(name, plan.logical))
    return result


def _run_dims(plan: Plan, dims: dict[str, int] | None) -> dict[str, int]:
    run = dict(plan.dims)
    for name, value in (dims or {}).items():
        if name not in run:
            raise PlanError(f"dims.{name}: not a dimension of the plan ({', '.join(run)})")
        run[name] = value
    return run


# -- command line --------------------------------------------------------------------------------------
def parse_dims(text: str) -> dict[str, int]:
    """``batch=2,seq=4`` → {"batch": 2, "seq": 4}."""
    dims = {}
    for item in filter(None, text.split(",")):
        name, eq, value = item.partition("=")
        if not eq or not value.strip().isdecimal() or int(value) < 1:
            raise PlanError(f"--dims: expected name=size with size >= 1, got {item!r}")
        dims[name.strip()] = int(value)
    return dims


def add_run_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``tv-ray run`` on a subparsers object; the handler is `cmd_run`."""
    parser = subparsers.add_parser(
        "run", help="simulate a plan on random inputs and compare with the logical step",
        description="Run every rank's program on random float64 inputs (collectives and send/recv emulated) "
                    "and compare each output with the logical step. Prints one JSON line; exit 0 if every "
                    "deviation is within --tol, 1 if not, 2 on an invalid plan or a failed run. "
                    "Example: tv-ray run plan.json --seed 3 --dims batch=2,seq=4")
    parser.add_argument("plan", help="the plan file (tv-ray-plan/1 JSON)")
    parser.add_argument("--seed", type=int, default=0, help="random seed for the inputs (default 0)")
    parser.add_argument("--tol", type=float, default=1e-9, help="largest allowed |physical - logical| (default 1e-9)")
    parser.add_argument("--dims", default="", help="run at other dims: name=size,... (default: the plan's)")
    parser.set_defaults(func=cmd_run)
    return parser


def cmd_run(args: argparse.Namespace) -> int:
    """``tv-ray run``: one JSON line on stdout; deviating outputs on stderr; exit 0 / 1 / 2."""
    try:
        plan = Plan.load(args.plan)
        result = simulate(plan, args.seed, parse_dims(args.dims))
    except TvRayError as err:
        print(f"tv-ray run: {_one_line(err)}", file=sys.stderr)
        return 2
    deviating = result.deviating(args.tol)
    print(json.dumps({"plan": args.plan, "seed": args.seed, "ranks": result.ranks,
                      "max_abs_dev": result.max_abs_dev(), "deviating": deviating, "ok": not deviating}))
    if deviating:
        worst = ", ".join(f"{name} ({result.deviation[name]:.3g} on {plan.describe(result.worst_rank[name])})"
                          for name in deviating)
        print(f"tv-ray run: outputs deviate beyond {args.tol:g}: {worst}", file=sys.stderr)
        return 1
    return 0


def _one_line(err: Exception) -> str:
    return " | ".join(line.strip() for line in str(err).splitlines() if line.strip())
