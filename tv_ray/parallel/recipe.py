"""The built-in recipe: a logical graph and a `ParallelSpec` become a `Plan`.

It decides where every logical input lives (data cut over dp and microbatches,
Megatron tensor-parallel weights, ZeRO-sharded optimizer state and
gradients, sequence-parallel residual stream), lowers the graph to one program
per pipeline stage with the sharding rules, and writes the boundary lineage
from the layouts it used.
"""
from __future__ import annotations

import re
from typing import Mapping

from tv_ray.ir.dims import Expr
from tv_ray.ir.graph import Graph, Node, TensorSpec
from tv_ray.ir.ops import Op
from tv_ray.parallel.layout import Factor, Layout
from tv_ray.parallel.lower import MB, Lowering
from tv_ray.parallel.pipeline import split_stages
from tv_ray.parallel.rules import Env
from tv_ray.parallel.spec import ParallelSpec
from tv_ray.parallel.vocab import vocab_parallel_forms
from tv_ray.plan import FORMAT, Plan, RankMap
from tv_ray.processes import gc_paused
from tv_ray.plan_check import check_plan

# Megatron tensor parallelism: which dim of a parameter tp cuts (torch Linear weights are [out, in]).
TP_RULES: tuple[tuple[str, int], ...] = (
    (r"\.(q_proj|k_proj|v_proj|gate_proj|up_proj|c_fc|q_b_proj|kv_b_proj)\.(weight|bias)$", 0),   # column parallel
    (r"\.(o_proj|down_proj|c_proj)\.weight$", 1),                                 # row parallel
    (r"\.experts\.(w_gate|w_up)$", 1),                      # each routed expert column parallel (expert tp)
    (r"\.experts\.w_down$", 2),                             # and row parallel
    (r"^lm_head\.weight$", 0),                                                    # vocab-split head
    (r"^(embed|wte)\.weight$", 0),                                                # vocab-split embedding
)
MESH_ORDER = ("pp", "dp", "cp", "ep", "tp")


def prepare(graph: Graph) -> Graph:
    """Exact rewrites that make sharding rules simpler: nll_loss(mean) = nll_loss(sum) / total weight."""
    nodes: list[Node] = []
    for node in graph.nodes:
        if node.op == Op.NLL_LOSS and node.attr["reduction"] == "mean":
            attrs = node.attr
            total = Node.make(f"{node.name}.total", Op.NLL_LOSS_TOTAL_WEIGHT, [node.args[1]],
                              {"ignore_index": attrs["ignore_index"]}, (), "float", dict(node.meta))
            summed = Node.make(f"{node.name}.sum", Op.NLL_LOSS, node.args,
                               {"reduction": "sum", "ignore_index": attrs["ignore_index"]}, (), "float",
                               dict(node.meta))
            nodes += [total, summed, Node.make(node.name, Op.DIV, [summed.name, total.name], {}, (), "float",
                                                dict(node.meta))]
        else:
            nodes.append(node)
    return Graph(graph.inputs, tuple(nodes), graph.outputs, graph.name)


def data_dependence(graph: Graph) -> dict[str, bool]:
    dep = {s.name: s.role == "data" for s in graph.inputs}
    for node in graph.nodes:
        dep[node.name] = any(dep[a] for a in node.args)
    return dep


def _cut(shape, cuts: Mapping[int, tuple[str, ...]]) -> Layout:
    return Layout.make([[Factor(Expr.of(size), cuts.get(d, ()))] for d, size in enumerate(shape)])


EXPERTS = r"\.experts\."          # routed experts' stacked weights: dim 0 is the expert


def mesh_sizes(spec: ParallelSpec) -> dict[str, int]:
    """The plan's mesh axes and sizes, in MESH_ORDER; with ep, the axis dp is the expert-data-parallel part."""
    sizes = {"pp": spec.pp, "dp": spec.edp, "cp": spec.cp, "ep": spec.ep, "tp": spec.tp}
    return {a: sizes[a] for a in MESH_ORDER if sizes[a] > 1} or {"dp": 1}


class Recipe:
    """Where each logical input and output lives under a spec.

    With expert parallelism the samples are cut over (dp, mb, ep): rank (d, e)'s microbatch m is block
    (d, m, e) of the batch, so the ep ranks' m-th microbatches are one contiguous block — what an expert
    layer gathers. Routed experts are cut over ep (dim 0); every other weight is replicated over dp × ep.
    With context parallelism the tokens' sequence dim is cut over cp too, and weights are replicated over cp:
    the sharding rules then gather keys and values over cp and reduce gradients over dp × cp
    (docs/context-parallel.md)."""

    def __init__(self, graph: Graph, spec: ParallelSpec):
        self.graph, self.spec = graph, spec
        self.edp = ("dp",) if spec.edp > 1 else ()
        self.ep = ("ep",) if spec.ep > 1 else ()
        self.cp = ("cp",) if spec.cp > 1 else ()
        self.dp = self.edp + self.cp + self.ep      # the data-parallel group of a dense weight
        self.mb = (MB,) if spec.mb > 1 else ()
        self.tp = ("tp",) if spec.tp > 1 else ()

    def tp_dim(self, param: str) -> int | None:
        if not self.tp:
            return None
        for pattern, dim in TP_RULES:
            if re.search(pattern, param):
                return dim
        return None

    def param_layout(self, spec: TensorSpec, zero_cut: bool) -> Layout:
        """tp as TP_RULES says; a routed expert's weight over ep; ZeRO over the ranks that hold copies of it."""
        cuts: dict[int, tuple[str, ...]] = {}
        d = self.tp_dim(spec.name)
        if d is not None:
            cuts[d] = self.tp
        expert = re.search(EXPERTS, spec.name) is not None
        if expert and self.ep:
            cuts[0] = self.ep
        copies = self.edp if expert else self.dp
        if zero_cut and copies:
            cuts[0] = cuts.get(0, ()) + copies
        return _cut(spec.shape, cuts)

    def input_layout(self, spec: TensorSpec) -> Layout:
        if spec.role == "data":         # samples cut over dp and microbatches; a buffer (no batch) whole
            named = Expr.of(spec.shape[0]).free_dims if spec.shape else frozenset()
            batched = spec.shape and (not named or "batch" in named)     # constant shapes: a module's own
            if not batched:
                return Layout.replicated(spec.shape)
            cuts = {0: self.edp + self.mb + self.ep}
            if self.cp and len(spec.shape) > 1 and "seq" in Expr.of(spec.shape[1]).free_dims:
                cuts[1] = self.cp
            return _cut(spec.shape, cuts)
        if spec.role == "param":
            return self.param_layout(spec, self.spec.zero >= 3)
        if spec.role == "state":
            return self.param_layout(self._param_of(spec.name), self.spec.zero >= 1)
        return Layout.replicated(spec.shape)

    def _param_of(self, name: str) -> TensorSpec:
        param = name.split("/", 1)[1]
        return self.graph.value(param)  # type: ignore[return-value]

    def output_layout(self, name: str) -> Layout | None:
        if name == "loss":
            return None      # as computed: a partial sum over dp, or reduced
        kind, _, rest = name.partition("/")
        if kind == "grad":
            return self.param_layout(self.graph.value(rest), self.spec.zero >= 2)  # type: ignore[arg-type]
        if kind == "new":
            return self.input_layout(self.graph.value(rest))  # type: ignore[arg-type]
        return None

    def forced(self, outputs: Mapping[str, str]) -> dict[str, Layout]:
        """Layouts imposed right where a value is made: reduced gradients, the sequence-parallel stream."""
        force = {}
        for name, value in outputs.items():
            if name.startswith("grad/") and value not in {s.name for s in self.graph.inputs}:
                force[value] = self.output_layout(name)
        if self.spec.sp:
            for node in self.graph.nodes:
                if node.op == Op.EMBEDDING and len(node.shape) == 3:
                    force[node.name] = _cut(node.shape, {0: self.edp + self.mb + self.ep, 1: self.cp + self.tp})
        return force


def parallelize(graph: Graph, spec: ParallelSpec | str, dims: Mapping[str, int], model: str = "model",
                layers: int | None = None, schedule: str = "1f1b", check: bool = True) -> Plan:
    """The plan that runs `graph` under `spec`, validated (`check=False`: by the caller, `check_plan`).

    Example::

        plan = parallelize(graph, "dp=2,tp=2", spec.dims, "llama3-tiny")
    """
    if isinstance(spec, str):
        spec = ParallelSpec.parse(spec)
    spec.check_model(dims, layers)
    with gc_paused():       # millions of small immutable objects: the cyclic GC only costs time here
        return _build(graph, spec, dims, model, layers, schedule, check)


def _build(graph: Graph, spec: ParallelSpec, dims: Mapping[str, int], model: str, layers: int | None,
           schedule: str, check: bool) -> Plan:
    logical = graph
    graph = prepare(graph)
    if spec.tp > 1:
        graph = vocab_parallel_forms(graph)
    recipe = Recipe(graph, spec)
    mesh = mesh_sizes(spec)
    sizes = {a: n for a, n in mesh.items() if a != "pp" and n > 1}
    if spec.mb > 1:
        sizes[MB] = spec.mb
    env = Env(sizes, dims, {v.name: v.shape for v in (*graph.inputs, *graph.nodes)}, data_dependence(graph))
    lowering = Lowering(sizes, dims)
    for inp in graph.inputs:
        lowering.input(inp, recipe.input_layout(inp))
    force = recipe.forced(graph.output_map)
    for node in graph.nodes:
        lowering.node(node, env, force.get(node.name))
    for name, value in graph.outputs:
        lowering.output(name, value, recipe.output_layout(name))
    programs, lineage, interior = split_stages(lowering, graph, spec, mesh, layers, logical)
    plan = Plan(format=FORMAT, model=model, dims=dict(dims), mesh=tuple(mesh.items()), microbatches=spec.mb,
                schedule=schedule, logical=logical, programs=programs,
                ranks=RankMap("stage{pp}" if spec.pp > 1 else "main"),
                lineage=tuple(lineage), interior=tuple(interior))
    if check:
        check_plan(plan)
    return plan
