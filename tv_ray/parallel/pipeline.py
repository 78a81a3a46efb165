"""Pipeline stages: cut one lowered program into per-stage programs joined by send/recv, in 1F1B order.

Stages are assigned on the lowered program by dataflow: parameters of
``layers.i`` are pinned to stage ``i * pp // layers``; a forward op runs on
the latest stage among its inputs, a backward op on the earliest (gradients
flow back), an optimizer op where its parameter's gradient is. Ops that
depend on no pinned value (constants, data-only work such as token counts,
unpinned parameters) float: every stage that needs them computes them. A value
used on another stage is sent once per destination (tagged, so order does not
matter); an updated parameter is sent to every stage that holds the parameter,
which is what keeps tied embeddings on the first and last stage in sync.
"""
from __future__ import annotations

import heapq
import re
from typing import Mapping

from tv_ray.errors import ParallelConfigError
from tv_ray.ir.graph import Graph, Node
from tv_ray.ir.ops import Op
from tv_ray.parallel.lineage import interior_entries, lineage_entry
from tv_ray.parallel.lower import Lowering
from tv_ray.parallel.spec import ParallelSpec
from tv_ray.plan import Lineage

LAYER = re.compile(r"^layers\.(\d+)\.")


def _lineage(lowering: Lowering, graph: Graph, where: Mapping[str, int], inputs: set[str],
             outputs: set[str]) -> list[Lineage]:
    entries = []
    micro = lowering.microbatches
    for spec in graph.inputs:
        local = lowering.values[spec.name]
        for m, name in enumerate(local.names):
            if name in inputs:
                entries.append(lineage_entry(name, spec.name, local.layout, where,
                                             m if len(local.names) > 1 else None, micro))
    for name, layout in lowering.output_layouts.items():
        if name in outputs:
            entries.append(lineage_entry(name, name, layout, where, None, micro))
    return entries


def _prune(program: Graph) -> Graph:
    used = {a for n in program.nodes for a in n.args} | set(program.output_map.values())
    return Graph(tuple(s for s in program.inputs if s.name in used), program.nodes, program.outputs, program.name)


def split_stages(lowering: Lowering, graph: Graph, spec: ParallelSpec, mesh: Mapping[str, int],
                 layers: int | None = None, reference: Graph | None = None):
    """The programs by name, the boundary lineage and the intermediate lineage of a lowered step.

    `graph` is the graph that was lowered; intermediate lineage names only tensors of `reference` (the
    plan's logical graph, which the lowered one rewrote exactly: a rewritten node keeps its name)."""
    reference = reference or graph
    program = lowering.graph("main")
    if spec.pp == 1:
        program = _prune(program)
        return ({"main": program},
                _lineage(lowering, graph, {}, {s.name for s in program.inputs}, set(program.output_map)),
                interior_entries(lowering, reference, program, {}))
    return Stager(program, graph, spec, layers).build(lowering, reference)


class Stager:
    def __init__(self, program: Graph, logical: Graph, spec: ParallelSpec, layers: int | None):
        self.program, self.logical, self.pp, self.mb = program, logical, spec.pp, spec.mb
        found = [int(m.group(1)) for s in logical.inputs if (m := LAYER.match(s.name))]
        self.layers = layers or (max(found) + 1 if found else 0)
        if self.layers < self.pp:
            raise ParallelConfigError(f"pp = {self.pp} is more than the model's {self.layers} layers")
        self.phase, seeds = self.phases()
        self.program = self._constant_seeds(seeds)

    def pin(self, name: str) -> int | None:
        m = LAYER.match(name)
        return int(m.group(1)) * self.pp // self.layers if m else None

    def phases(self) -> tuple[dict[str, str], set[str]]:
        """fwd / bwd / optim for each op (bwd = downstream of the loss seed, a full_like of the loss), and the
        seed."""
        loss = self.program.output_map.get("loss")
        phase: dict[str, str] = {s.name: "input" for s in self.program.inputs}
        seeds = set()
        for node in self.program.nodes:
            if node.get_meta("phase") == "optim":
                phase[node.name] = "optim"
            elif loss is not None and not seeds and node.op == Op.FULL_LIKE and not node.shape \
                    and node.attr["value"] == 1.0:       # the loss seed ones_like(loss) of the joint graph
                seeds.add(node.name)
                phase[node.name] = "bwd"
            elif any(phase.get(a) == "bwd" for a in node.args):
                phase[node.name] = "bwd"
            else:
                phase[node.name] = "fwd"
        return phase, seeds

    def _constant_seeds(self, seeds: set[str]) -> Graph:
        """The program with the loss seed made a constant of the loss's shape: a full_like reads its argument
        for the shape alone, and the argument can be the loss summed over every microbatch (it is when the loss
        is all-reduced over tp after that sum), which would make every backward wait for the last forward
        and break 1F1B — a deadlock against the stage before, which sends its next forward only once a
        backward came back."""
        nodes = tuple(Node.make(node.name, Op.FULL, [], {"size": node.shape, "value": node.attr["value"],
                                                          "dtype": node.dtype}, node.shape, node.dtype, dict(node.meta))
                      if node.name in seeds else node for node in self.program.nodes)
        return Graph(self.program.inputs, nodes, self.program.outputs, self.program.name)

    def assign(self) -> tuple[dict[str, int | None], dict[str, str]]:
        phase = self.phase
        stage: dict[str, int | None] = {s.name: self.pin(s.name) for s in self.program.inputs}
        grad_home: dict[str, int | None] = {}
        grad_of = {value: out[5:] for out, value in self.program.outputs if out.startswith("grad/")}
        for node in self.program.nodes:
            placed = [stage[a] for a in node.args if stage[a] is not None]
            kind = phase[node.name]
            param = node.get_meta("module")
            if kind == "optim" and param in grad_home and grad_home[param] is not None:
                stage[node.name] = grad_home[param]
            elif not placed:
                stage[node.name] = None
            else:
                stage[node.name] = max(placed) if kind == "fwd" else min(placed)
            if node.name in grad_of:
                grad_home[grad_of[node.name]] = stage[node.name]
        return stage, phase

    def build(self, lowering: Lowering, reference: Graph):
        stage, phase = self.assign()
        producers = {n.name: n for n in self.program.nodes}
        members = self._members(stage, producers)
        out_stages = self._output_stages(stage, members, producers)
        # one tagged message per (value, destination stage); program inputs come from lineage, never sent
        tags: dict[tuple[str, int], int] = {}
        for s in range(self.pp):
            for name in members[s]:
                for a in producers[name].args:
                    if a in producers and stage[a] not in (None, s):
                        tags.setdefault((a, s), len(tags))
            for out, value in self.program.outputs:
                if s in out_stages[out] and value in producers and stage[value] not in (None, s):
                    tags.setdefault((value, s), len(tags))
        programs, lineage, interior = {}, [], []
        for s in range(self.pp):
            program = self._program(s, stage, phase, members[s], out_stages, producers, tags)
            programs[program.name] = program
            lineage += _lineage(lowering, self.logical, {"pp": s}, {i.name for i in program.inputs},
                                set(program.output_map))
            interior += interior_entries(lowering, reference, program, {"pp": s})
        return programs, lineage, interior

    def _members(self, stage, producers) -> dict[int, list[str]]:
        """The ops each stage runs: its own, plus the floating ops they (transitively) read."""
        members = {}
        own: dict[int | None, list[str]] = {}       # each stage's own ops
        for n, st in stage.items():
            if n in producers:
                own.setdefault(st, []).append(n)
        for s in range(self.pp):
            todo = own.get(s, []) + [v for out, v in self.program.outputs if self._home(out, v, stage) == s]
            closure: set[str] = set()
            while todo:
                v = todo.pop()
                if v in closure or v not in producers:
                    continue
                closure.add(v)
                todo += [a for a in producers[v].args if stage.get(a) in (None, s)]
            members[s] = [n.name for n in self.program.nodes if n.name in closure]
        return members

    def _home(self, out: str, value: str, stage) -> int:
        home = stage.get(value)
        if home is None:
            return self.pp - 1 if out == "loss" else 0
        return home

    def _output_stages(self, stage, members, producers) -> dict[str, list[int]]:
        """Each output on its producer's stage; an updated parameter also on every stage that reads it."""
        reads = {s: {a for n in members[s] for a in producers[n].args if a not in producers} for s in range(self.pp)}
        inputs = {spec.name for spec in self.program.inputs}
        out_stages = {}
        for out, value in self.program.outputs:
            stages = {self._home(out, value, stage)}
            if out.startswith("new/") and out[4:] in inputs:
                stages |= {s for s in range(self.pp) if out[4:] in reads[s]}
            out_stages[out] = sorted(stages)
        return out_stages

    def _program(self, s, stage, phase, members, out_stages, producers, tags) -> Graph:
        """Stage `s`'s ops in 1F1B order, a recv before a remote value's first use, a send after each value made."""
        nodes: list[Node] = []
        recvd: dict[str, str] = {}
        sends: dict[str, list[int]] = {}
        for value, dst in tags:
            if stage[value] == s:
                sends.setdefault(value, []).append(dst)

        def local(value: str) -> str:
            src = stage[value] if value in producers else None      # inputs are on every stage that reads them
            if src in (None, s):
                return value
            if value not in recvd:
                recvd[value] = f"{value}<{src}"
                p = producers[value]
                nodes.append(Node.make(recvd[value], Op.RECV, [], {"peer": {"pp": src - s}, "size": p.shape,
                                                                   "dtype": p.dtype, "tag": tags[(value, s)]},
                                       p.shape, p.dtype, dict(p.meta)))
            return recvd[value]

        for name in self._order(s, members, phase, producers):
            node = producers[name]
            args = tuple(local(a) for a in node.args)
            nodes.append(node if args == node.args else node.renamed(node.name, args, node.meta))
            for dst in sends.get(name, []):
                nodes.append(Node.make(f"{name}>{dst}", Op.SEND, [name], {"peer": {"pp": dst - s},
                                                                          "tag": tags[(name, dst)]},
                                       (), "token", dict(node.meta)))
        outs = {out: local(value) for out, value in self.program.outputs if s in out_stages[out]}
        used = {a for n in nodes for a in n.args} | set(outs.values())
        inputs = tuple(spec for spec in self.program.inputs if spec.name in used)
        return Graph(inputs, tuple(nodes), tuple(outs.items()), f"stage{s}")

    def _order(self, s: int, names: list[str], phase, producers) -> list[str]:
        """1F1B: warm-up forwards, then one forward one backward, then cool-down backwards."""
        warm = min(self.pp - s - 1, self.mb)
        units: list[tuple[str, int]] = [("fwd", m) for m in range(warm)]
        for i in range(self.mb - warm):
            units += [("fwd", warm + i), ("bwd", i)]
        units += [("bwd", m) for m in range(self.mb - warm, self.mb)]
        rank = {u: i + 1 for i, u in enumerate(units)}
        index = {n: i for i, n in enumerate(names)}
        prio: dict[str, int] = {}
        data = {spec.name for spec in self.program.inputs if spec.role == "data"}
        last = len(units) + 1
        for n in names:
            node = producers[n]
            if data.issuperset(node.args):
                data.add(n)
                prio[n] = 0     # data-only work (token counts for the global loss scale) first: no unit waits on it
                continue
            kind = phase[n]
            if kind == "optim":
                prio[n] = last
                continue
            base = max([prio[a] for a in node.args if a in prio], default=0)
            unit = rank.get((kind, node.get_meta("mb")))
            prio[n] = base if unit is None or unit < base else unit
        # ready ops lowest (priority, position) first, each as one integer: priority · len(names) + position
        width = len(names)
        waiting = [0] * width
        users: list[list[int]] = [[] for _ in names]
        for i, n in enumerate(names):
            for a in producers[n].args:
                j = index.get(a)
                if j is not None:
                    users[j].append(i)
                    waiting[i] += 1
        key = [prio[n] * width + i for i, n in enumerate(names)]
        ready = [key[i] for i in range(width) if not waiting[i]]
        heapq.heapify(ready)
        out = []
        while ready:
            i = heapq.heappop(ready) % width
            out.append(names[i])
            for u in users[i]:
                waiting[u] -= 1
                if not waiting[u]:
                    heapq.heappush(ready, key[u])
        return out

