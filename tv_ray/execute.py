"""Running every rank's program together: a round-robin scheduler for collectives and send/recv.

The scheduler owns the mesh mechanics — which ranks form a group, when a
collective has every member, which send a recv matches, and what a deadlock
looks like — and leaves the values to a domain: concrete float64 arrays here
(the plan simulator), object arrays of terms in the symbolic interpreter
(`tv_ray.partition`), which overrides `evaluate`, `evaluate_group`,
`dtype_of` and `_advance`.
"""
from __future__ import annotations

import json
from collections import defaultdict, deque
from collections.abc import Mapping
from typing import Callable

import numpy as np

from tv_ray.errors import Asymmetric, CommunicationError, SimulationError, TvRayError
from tv_ray.ir import Graph, Node, Op, describe
from tv_ray.ir.ops import COLLECTIVES, COMMUNICATION, P2P
from tv_ray.plan import Plan
from tv_ray.semantics import Context, eval_node, rule_for
from tv_ray.semantics.batched import batched
from tv_ray.semantics.interpret import Instantiated, instantiated
from tv_ray.semantics.table import dtype_name, instantiate_shape

TOKEN = np.zeros(0)   # the value of a send: nothing


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

    def __init__(self, plan: Plan, dims: dict[str, int], rank_inputs: list[dict[str, np.ndarray]],
                 keep: bool = False):
        """`keep`: every value stays in its rank's `env` and `order` lists (rank, tensor) as each is produced."""
        self.plan, self.dims = plan, dims
        self.order: list[tuple[int, str]] | None = [] if keep else None
        names, ids = plan.rank_programs()
        self.frees = None if keep else PerProgram(plan, _frees)
        self.ranks = [_Rank(r, names[ids[r]], plan.programs[names[ids[r]]], rank_inputs[r],
                            Context(plan.axis_sizes, plan.coords(r))) for r in range(plan.num_ranks)]
        self.active = self.ranks        # the ranks `run` steps (a symbolic run may own a subset)
        self.virtual: frozenset[int] = frozenset()     # ranks never stepped: `stand_in` gives their collectives' inputs
        self.arrived: dict[tuple, dict[int, np.ndarray]] = {}          # (group, k) -> rank -> input
        self.mailbox: dict[tuple, deque] = defaultdict(deque)          # (src, dst, tag) -> values
        self.handlers = {**{op: self._collective for op in COLLECTIVES}, Op.SEND: self._send, Op.RECV: self._recv}
        self.groups: dict[tuple, tuple[int, ...]] = {}
        self._instantiated: dict[int, Instantiated] = {}    # id(node) -> the node at the dims
        self._shapes: dict[tuple, tuple[int, ...]] = {}                      # (id(node), attr) -> a shape

    def run(self) -> list[dict[str, np.ndarray]]:
        """Run every rank to its end; each rank's outputs by output name."""
        while not all(r.done for r in self.active):
            progressed = False
            for state in self.active:
                while not state.done and self._step(state):
                    progressed = True
            if not progressed:
                raise CommunicationError(self._deadlock())
        return [{out: r.env[value] for out, value in r.program.outputs} for r in self.active]

    # -- the value domain: concrete float64 here; the symbolic interpreter overrides these three
    def evaluate(self, state: "_Rank", node: Node, args: list[np.ndarray]) -> np.ndarray:
        return eval_node(node, args, self.dims, state.ctx, self._instance(node))

    def _instance(self, node: Node) -> Instantiated:
        """`node` at the scheduler's dims, cached (nodes live in the plan, as long as the scheduler)."""
        at = self._instantiated.get(id(node))
        if at is None:
            at = self._instantiated[id(node)] = instantiated(node, self.dims)
        return at

    def evaluate_group(self, node: Node, members: tuple[int, ...], values: list[np.ndarray]) -> list[np.ndarray]:
        return rule_for(node.op, "group").group(values, node.attr)

    def stand_in(self, node: Node, members: tuple[int, ...], rank: int, arrived: dict[int, np.ndarray]):
        """The input to a collective of a rank that is never stepped (`virtual`), from the inputs that arrived."""
        raise NotImplementedError(f"rank {rank} is never stepped, and nothing stands in for it")

    def stood_in(self, node: Node, rank: int, value) -> None:
        """A collective's result for a rank that is never stepped (before any stepped member advances)."""

    def send_extra(self, state: "_Rank", node: Node):
        """What travels with a sent value besides the value (nothing here)."""
        return None

    def receive_extra(self, extra) -> None:
        """Called with the matching send's `send_extra` just before a recv completes."""

    def dtype_of(self, value: np.ndarray) -> str | None:
        return dtype_name(value)

    def _step(self, state: _Rank) -> bool:
        node = state.program.nodes[state.pc]
        return self.handlers.get(node.op, self._compute)(state, node)

    def _advance(self, state: _Rank, node: Node, value: np.ndarray) -> None:
        state.env[node.name] = value
        if self.order is not None:
            self.order.append((state.rank, node.name))      # every value kept
        else:
            for name in self.frees[state.name][state.pc]:
                del state.env[name]
        state.pc += 1

    def _fail(self, state: _Rank, node: Node, err: Exception) -> SimulationError:
        return SimulationError(f"{self.plan.describe(state.rank)} at {state.where()} ({describe(node)}): {err}",
                               rank=state.rank, node=node.name)

    def _compute(self, state: _Rank, node: Node) -> bool:
        try:
            value = self.evaluate(state, node, [state.env[a] for a in node.args])
        except Asymmetric:
            raise   # the symbolic domain's control flow (the run is repeated in full), not a failed op
        except (TvRayError, ArithmeticError, ValueError, IndexError, TypeError) as err:
            raise self._fail(state, node, err) from err
        self._advance(state, node, value)
        return True

    def stated(self, node: Node, attr: str | None = None) -> tuple[int, ...]:
        """`node`'s shape (or its shape attribute `attr`) at the scheduler's dims, cached."""
        found = self._shapes.get((id(node), attr))
        if found is None:
            found = self._shapes[id(node), attr] = instantiate_shape(node.attr[attr] if attr else node.shape, self.dims)
        return found

    def members(self, rank: int, axes: tuple[str, ...]) -> tuple[int, ...]:
        """`rank`'s group along `axes` (itself alone for no axes), cached."""
        if not axes:
            return (rank,)
        if (rank, axes) not in self.groups:
            self.groups[rank, axes] = tuple(self.plan.group(rank, axes))
        return self.groups[rank, axes]

    def _group(self, state: _Rank, node: Node) -> tuple[tuple, tuple[int, ...]]:
        axes = node.attr["axes"]
        members = self.members(state.rank, axes)
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
            raise CommunicationError(
                f"mismatched collectives on the {'×'.join(group[0])} group {list(members)} (collective "
                f"#{slot[1] + 1} there): {self.plan.describe(first.rank)} runs {first.where()} "
                f"{_op_text(first.program.nodes[first.pc])}, {self.plan.describe(state.rank)} runs "
                f"{state.where()} {_op_text(node)}", rank=state.rank, node=node.name)
        arrived[state.rank] = state.env[node.args[0]]
        if len(arrived) < len(members) and any(m not in arrived and m not in self.virtual for m in members):
            return False
        try:
            values = [arrived[m] if m in arrived else self.stand_in(node, members, m, arrived) for m in members]
            results = self.evaluate_group(node, members, values)
        except Asymmetric:
            raise   # as in _compute
        except (TvRayError, ValueError) as err:
            raise SimulationError(f"{_op_text(node)} on the group {list(members)} at {state.where()}: {err}",
                                  rank=state.rank, node=node.name) from err
        del self.arrived[slot]
        for member, value in zip(members, results):
            if member in self.virtual:
                self.stood_in(node, member, value)
        for member, value in zip(members, results):
            if member in self.virtual:
                continue
            peer = self.ranks[member]
            stated = self.stated(peer.program.nodes[peer.pc])
            if value.shape != stated:
                raise CommunicationError(f"{self.plan.describe(member)} at {peer.where()}: {_op_text(node)} gives shape "
                                         f"{value.shape} but the op states {stated}",
                                         rank=member, node=peer.program.nodes[peer.pc].name)
            peer.issued[group] += 1
            self._advance(peer, peer.program.nodes[peer.pc], value)
        return True

    def _peer(self, state: _Rank, node: Node) -> int:
        coords = state.ctx.coords
        return self.plan.rank_of({a: coords[a] + dict(node.attr["peer"]).get(a, 0) for a in coords})

    def _send(self, state: _Rank, node: Node) -> bool:
        key = (state.rank, self._peer(state, node), node.attr.get("tag", 0))
        self.mailbox[key].append((state.env[node.args[0]], state.where(), self.send_extra(state, node)))
        self._advance(state, node, TOKEN)
        return True

    def _recv(self, state: _Rank, node: Node) -> bool:
        queue = self.mailbox.get((self._peer(state, node), state.rank, node.attr.get("tag", 0)))
        if not queue:
            return False
        value, sent_at, extra = queue.popleft()
        want = self.stated(node, "size")
        if value.shape != want or self.dtype_of(value) not in (None, node.attr["dtype"]):
            raise CommunicationError(f"{self.plan.describe(state.rank)} at {state.where()} ({describe(node)}) "
                                     f"expects {node.attr['dtype']} {want} but {sent_at} sent "
                                     f"{self.dtype_of(value) or ''} {value.shape}", rank=state.rank, node=node.name)
        self.receive_extra(extra)
        self._advance(state, node, value)
        return True

    def _deadlock(self) -> str:
        waits = []
        for state in self.active:
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


class Stacked(Scheduler):
    """Several concrete runs of one plan's ranks at once, each value every run's stacked along axis 0: an op with
    a stacked form (`tv_ray.semantics.batched`) evaluated once, any other op and every collective run by run.
    `rank_inputs`: each run's inputs of each rank."""

    def __init__(self, plan: Plan, dims: dict[str, int], rank_inputs: list[list[dict[str, np.ndarray]]],
                 keep: bool = False):
        self.count = len(rank_inputs)
        self.token = np.zeros((self.count, 0))
        super().__init__(plan, dims, [{name: np.stack([run[rank][name] for run in rank_inputs])
                                       for name in rank_inputs[0][rank]} for rank in range(plan.num_ranks)], keep)

    def evaluate(self, state: _Rank, node: Node, args: list[np.ndarray]) -> np.ndarray:
        at = self._instance(node)
        out = batched(node, args, at.attrs, at.shape, at.concrete, state.ctx) if node.op not in COMMUNICATION \
            else None
        if out is None:
            return np.stack([eval_node(node, [a[r] for a in args], self.dims, state.ctx, at) for r in range(self.count)])
        if out.shape != (self.count, *at.shape) or out.dtype != at.dtype:
            raise SimulationError(f"{describe(node)}: {self.count} runs stacked give {out.dtype} {out.shape}, not "
                                  f"{node.dtype} {at.shape} each", rank=state.rank, node=node.name)
        return out

    def evaluate_group(self, node: Node, members: tuple[int, ...], values: list[np.ndarray]) -> list[np.ndarray]:
        group = super().evaluate_group
        runs = [group(node, members, [v[r] for v in values]) for r in range(self.count)]
        return [np.stack([results[m] for results in runs]) for m in range(len(members))]

    def stated(self, node: Node, attr: str | None = None) -> tuple[int, ...]:
        return (self.count, *super().stated(node, attr))

    def _advance(self, state: _Rank, node: Node, value: np.ndarray) -> None:
        super()._advance(state, node, self.token if value is TOKEN else value)

    def unstacked(self, run: int) -> list["RunValues"]:
        """Every rank's values in run `run`."""
        return [RunValues(state.env, run) for state in self.ranks]


class RunValues(Mapping):
    """One run's values of a rank, read off the stacked runs' (`Stacked`) when asked."""

    __slots__ = ("env", "run")

    def __init__(self, env: dict[str, np.ndarray], run: int):
        self.env, self.run = env, run

    def __getitem__(self, name: str) -> np.ndarray:
        return self.env[name][self.run, ...]

    def __contains__(self, name) -> bool:
        return name in self.env

    def __iter__(self):
        return iter(self.env)

    def __len__(self) -> int:
        return len(self.env)


class OrderRun(Scheduler):
    """The communication order alone: every rank's sends, recvs and collectives, run with the values left
    out — a value is a zero-strided array of its stated shape and dtype, and the ops between two communications
    are skipped. What it checks is what a concrete run checks of the mesh: every recv is matched by a send of
    its shape and dtype, every collective's members run the same op with inputs of one shape, and the whole
    schedule completes (a CommunicationError names the deadlock otherwise).

    Programs are straight-line and a recv or collective blocks until it can complete, so whether the schedule
    completes does not depend on the order ranks are stepped in (the furthest each rank can get is unique):
    ranks run from a worklist, woken by the send or the collective they wait for. And it needs only one slice
    of the mesh: along an axis where every rank runs its neighbour's program and no send or recv crosses, the
    mesh is the same from every coordinate, so is the furthest each rank gets; the ranks at coordinate 0 of
    every such axis (`symmetric`) are stepped, and the others' inputs to a collective are their images' there.
    A 8,192-rank plan whose dp and tp ranks share programs costs its pp ranks' communications."""

    def __init__(self, plan: Plan, dims: dict[str, int], sliced: bool = True):
        """`sliced`: step one slice of the mesh (False: every rank)."""
        self.layouts = PerProgram(plan, lambda program: _Layout(program, dims))
        names, ids = plan.rank_programs()
        super().__init__(plan, dims, [self.layouts[names[ids[r]]] for r in range(plan.num_ranks)])
        self.symmetric = symmetric_axes(plan) if sliced else ()
        table = plan.coord_table()
        sliced = np.all(table[:, [plan.axes.index(a) for a in self.symmetric]] == 0, axis=1)
        self.active = [state for state in self.ranks if sliced[state.rank]]
        self.virtual = frozenset(np.flatnonzero(~sliced).tolist())
        self.blocked: set[int] = set()
        self.waiting: dict[tuple, _Rank] = {}     # (src, dst, tag) -> the rank blocked at that recv
        for state in self.ranks:
            state.pc = state.env.next[0]

    def run(self) -> None:
        ready = self.ready = deque(self.active)
        while ready:
            state = ready.popleft()
            while not state.done and self._step(state):
                pass
            if not state.done:
                self.blocked.add(state.rank)
                node = state.program.nodes[state.pc]
                if node.op == Op.RECV:
                    self.waiting[self._peer(state, node), state.rank, node.attr.get("tag", 0)] = state
        if not all(r.done for r in self.active):
            raise CommunicationError(self._deadlock())

    def stand_in(self, node: Node, members: tuple[int, ...], rank: int, arrived: dict[int, np.ndarray]):
        coords = self.ranks[rank].ctx.coords
        return arrived[self.plan.rank_of({a: 0 if a in self.symmetric else c for a, c in coords.items()})]

    def evaluate_group(self, node: Node, members: tuple[int, ...], values: list[np.ndarray]) -> list[np.ndarray]:
        if len({v.shape for v in values}) > 1:
            raise ValueError(f"the members' inputs have shapes {[v.shape for v in values]}")
        return [None if m in self.virtual else self.ranks[m].env[self.ranks[m].program.nodes[self.ranks[m].pc].name]
                for m in members]

    def _send(self, state: _Rank, node: Node) -> bool:
        super()._send(state, node)
        woken = self.waiting.pop((state.rank, self._peer(state, node), node.attr.get("tag", 0)), None)
        if woken is not None:
            self._wake(woken)
        return True

    def _advance(self, state: _Rank, node: Node, value: np.ndarray) -> None:
        state.pc = state.env.next[state.pc + 1]
        if state.rank in self.blocked:
            self._wake(state)

    def _wake(self, state: _Rank) -> None:
        self.blocked.discard(state.rank)
        self.ready.append(state)


def symmetric_axes(plan: Plan) -> tuple[str, ...]:
    """The mesh axes along which every rank runs its neighbour's program and no send or recv crosses."""
    names, ids = plan.rank_programs()
    crossed = {axis for name in set(names[i] for i in ids) for node in plan.programs[name].nodes
               if node.op in P2P for axis, step in node.attr["peer"] if step}
    grid = np.asarray(ids).reshape([size for _, size in plan.mesh])
    return tuple(axis for position, axis in enumerate(plan.axes) if axis not in crossed
                 and (grid == np.take(grid, [0], axis=position)).all())


class _Layout(dict):
    """One program for `OrderRun`: each value as a zero-strided array of its shape and dtype (made when first read),
    and from each op position the position of the next communication (`next`)."""

    _DTYPES = {"float": np.float64, "int": np.int64, "bool": np.bool_, "token": np.float64}

    def __init__(self, program: Graph, dims: dict[str, int]):
        super().__init__()
        self.program, self.dims = program, dims
        self.next = [len(program.nodes)] * (len(program.nodes) + 1)
        for position in range(len(program.nodes) - 1, -1, -1):
            self.next[position] = position if program.nodes[position].op in COMMUNICATION \
                else self.next[position + 1]

    def __missing__(self, name: str) -> np.ndarray:
        made = self.program.value(name)
        found = self[name] = np.broadcast_to(np.zeros((), self._DTYPES[made.dtype]),
                                             instantiate_shape(made.shape, self.dims))
        return found


def check_order(plan: Plan, dims: dict[str, int], sliced: bool = True) -> None:
    """Raise CommunicationError unless every rank's communication can complete (`OrderRun`) at `dims`."""
    OrderRun(plan, dims, sliced).run()


class PerProgram(dict):
    """Program name -> `made(program)`, made when first asked (a run stepping some ranks asks for their programs'
    alone: a pipeline shard's of a frontier plan, one of its four 165k-op programs)."""

    def __init__(self, plan: Plan, made: Callable[[Graph], object]):
        super().__init__()
        self.plan, self.made = plan, made

    def __missing__(self, name: str):
        found = self[name] = self.made(self.plan.programs[name])
        return found


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
