"""The 14 bug classes A1–A14 of the TrainVerify evaluation as mutations of one plan.

The base plan is llama3-tiny, dp=2, tp=2, pp=2, 2 microbatches, AdamW with
gradient clipping at 1.0 (`base_plan()`): ranks 0–3 run ``stage0`` (pp=0), ranks
4–7 run ``stage1`` (pp=1); rank = pp*4 + dp*2 + tp. Each ``aN_*`` function takes
that plan and returns a `Mutant`: the mutated plan, a one-line description, and
what a correct diagnosis must name — the ranks the bug lives on, the physical
ops it changed, the logical module path and phase of the change. Every mutant
is well-formed (`check_plan` passes, collectives match, the simulator runs it)
and numerically wrong (``simulate(mutant.plan).deviating(1e-9)`` is non-empty):
the bug is silent, never a crash. Where the literal mutation would not be
well-formed (A3, A4: a gather changes the shape) the closest well-formed
version is built, and the description says how.

"On one rank" mutations (A7, A12) give that rank a modified copy of its
program through a `RankMap` override; "several ranks" mutations change the
program every rank of a stage runs (A9, A13); the others change a stage's
program too (a collective must change on every member of its group to stay
well-formed). Example::

    plan = base_plan()
    mutant = MUTANTS["A7"](plan)          # mutant.plan, mutant.description, mutant.ranks == (5,)
    outcome = verify_plan(mutant.plan)
    assert not mutant.diagnosis_problems(outcome.first_refuted())
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Iterable, Mapping

from tv_ray.ir import Graph, Node, Op
from tv_ray.ir.ops import COLLECTIVES
from tv_ray.plan import Plan, RankMap

MODEL = "llama3-tiny"
SPEC = "dp=2,tp=2,pp=2,mb=2"
STAGE0 = (0, 1, 2, 3)       # pp=0: (dp, tp) = (0,0) (0,1) (1,0) (1,1)
STAGE1 = (4, 5, 6, 7)       # pp=1


def base_plan() -> Plan:
    """llama3-tiny, dp=2, tp=2, pp=2, mb=2, AdamW + clip 1.0 (takes ~4 s)."""
    from tv_ray import api
    graph = api.capture_step(MODEL, optim="adamw", clip=1.0)
    return api.parallelize(graph, SPEC, model=MODEL)


@dataclass(frozen=True)
class Mutant:
    """A mutated plan and what a correct diagnosis of it must name.

    The change: `ops` (physical ops changed or added, in `program`), run by
    `ranks`, in logical module `module` and phase `phase` (fwd / bwd / optim).
    A correct diagnosis (`diagnosis_problems`) is refuted on a rank running the
    change — that very rank for a one-rank bug — or, for a bug in what is sent
    (A6), on `consumer_ranks`; at a tensor downstream of the change on one of
    its ranks (`downstream`); in the change's phase; and in one of `modules`
    (a module path or any of its sub-modules; "" means the unnamed top level,
    where the loss lives), i.e. in the layer where the bug first shows, not
    wherever its effect first reaches a gradient or parameter output.
    """

    cls: str
    plan: Plan
    description: str
    program: str
    ranks: tuple[int, ...]
    ops: tuple[str, ...]
    module: str
    phase: str
    modules: tuple[str, ...]
    consumer_ranks: tuple[int, ...] = ()

    def downstream(self) -> set[tuple[int, str]]:
        """Every (rank, tensor) whose value depends on a changed op: dataflow within each program, a
        collective to the same op on every member of its group, a send to the peer's matching recv."""
        return downstream(self.plan, [(rank, op) for rank in self.ranks for op in self.ops])

    def diagnosis_problems(self, ob) -> list[str]:
        """What `ob` (an `Obligation`, the first refuted stage) gets wrong about this bug; [] if nothing."""
        problems = []
        if len(self.ranks) == 1:
            if self.ranks[0] not in ob.ranks:
                problems.append(f"ranks {ob.ranks} do not include rank {self.ranks[0]}, the one running the bug")
        elif not set(ob.ranks) & set(self.consumer_ranks or self.ranks):
            problems.append(f"ranks {ob.ranks} are none of {self.consumer_ranks or self.ranks}")
        if not any((rank, ob.tensor) in self.downstream() for rank in ob.ranks):
            problems.append(f"{ob.tensor} on ranks {ob.ranks} is not downstream of {self.ops}")
        if ob.phase != self.phase:
            problems.append(f"phase {ob.phase!r}, the bug is in {self.phase!r}")
        if not any(ob.module == m or (m and ob.module.startswith(m + ".")) for m in self.modules):
            problems.append(f"module {ob.module!r} is not in {self.modules}")
        return problems


def downstream(plan: Plan, sources: Iterable[tuple[int, str]]) -> set[tuple[int, str]]:
    """The (rank, tensor) pairs reachable from `sources` through the plan's dataflow and communication."""
    names, ids = plan.rank_programs()
    users = {name: plan.programs[name].users() for name in set(names[i] for i in ids)}
    program = lambda rank: names[ids[rank]]   # noqa: E731
    seen: set[tuple[int, str]] = set()
    frontier = list(sources)
    while frontier:
        rank, tensor = frontier.pop()
        if (rank, tensor) in seen:
            continue
        seen.add((rank, tensor))
        graph = plan.programs[program(rank)]
        frontier.extend((rank, user) for user in users[program(rank)].get(tensor, []))
        value = graph.value(tensor)
        if not isinstance(value, Node):
            continue
        if value.op in COLLECTIVES:
            frontier.extend((member, tensor) for member in plan.group(rank, value.attr["axes"]))
        elif value.op == Op.SEND:
            offsets = dict(value.attr["peer"])
            coords = plan.coords(rank)
            peer = plan.rank_of({axis: c + offsets.get(axis, 0) for axis, c in coords.items()})
            back = {axis: -o for axis, o in offsets.items()}
            tag = value.attr.get("tag", 0)
            frontier.extend((peer, n.name) for n in plan.programs[program(peer)].nodes
                            if n.op == Op.RECV and dict(n.attr["peer"]) == back and n.attr.get("tag", 0) == tag)
    return seen


# -- editing programs -----------------------------------------------------------------------------
def _set_attrs(node: Node, **changes) -> Node:
    attrs = dict(node.attrs)
    attrs.update(changes)
    return replace(node, attrs=tuple(sorted(attrs.items())))


def _set_args(node: Node, *args: str) -> Node:
    return replace(node, args=tuple(args))


def _like(node: Node, name: str, op: str, args: Iterable[str], attrs: Mapping | None = None,
          shape: Iterable | None = None, **meta) -> Node:
    """A new node with `node`'s meta (module, phase, mb) unless overridden, and its shape unless given."""
    merged = dict(node.meta)
    merged.update(meta)
    return Node.make(name, op, list(args), attrs or {}, node.shape if shape is None else shape,
                     node.dtype, merged)


def edit(graph: Graph, name: str, *, change: Mapping[str, Node | list[Node]] = {},
         after: Mapping[str, list[Node]] = {}, drop: Iterable[str] = (),
         rename_args: Mapping[str, str] = {}, outputs: Mapping[str, str] = {}) -> Graph:
    """A copy of `graph` called `name` with nodes replaced (by one node or a list), new nodes inserted
    after named ones, nodes dropped, every read of a value redirected (`rename_args`: old -> new) and
    outputs re-pointed (`outputs`: output name -> tensor)."""
    drop = set(drop)
    missing = (set(change) | set(after) | drop) - {n.name for n in graph.nodes}
    assert not missing, f"no such nodes in {graph.name}: {sorted(missing)}"
    nodes: list[Node] = []
    for node in graph.nodes:
        if node.name in drop:
            continue
        new = change.get(node.name, node)
        for n in (new if isinstance(new, list) else [new]):
            if rename_args and any(a in rename_args for a in n.args):
                n = replace(n, args=tuple(rename_args.get(a, a) for a in n.args))
            nodes.append(n)
        nodes.extend(after.get(node.name, []))
    outs = tuple((k, outputs.get(k, rename_args.get(v, v))) for k, v in graph.outputs)
    return Graph(graph.inputs, tuple(nodes), outs, name)


def node(plan: Plan, program: str, name: str) -> Node:
    return plan.programs[program].value(name)


def _with_op(plan: Plan, program: str, target: str, op: str, attrs: Mapping | None = None) -> tuple[Node, Graph]:
    """The node `target` of `program` and the program with that node's op (and attributes) replaced."""
    old = node(plan, program, target)
    return old, edit(plan.programs[program], program, change={target: _like(old, target, op, old.args, attrs)})


def with_program(plan: Plan, name: str, graph: Graph, overrides: Iterable[int] = (),
                 restated: Iterable[str] = ()) -> Plan:
    """`plan` with program `name` set to `graph`; ranks in `overrides` run it instead of their template's.

    Intermediate lineage stays as the parallelizer wrote it — the bug is in what runs, not in what the plan
    says each tensor holds — except on ops the mutation removed, and on `restated` tensors (a rewrite that
    changes what they hold, which the verifier must then infer)."""
    programs = dict(plan.programs)
    programs[name] = graph
    ranks = plan.ranks
    if overrides:
        table = dict(ranks.overrides)
        table.update({rank: name for rank in overrides})
        ranks = RankMap(ranks.template, tuple(sorted(table.items())))
    mutated = Plan(plan.format, plan.model, dict(plan.dims), plan.mesh, plan.microbatches, plan.schedule,
                   plan.logical, programs, ranks, plan.lineage)
    names, ids = mutated.rank_programs()
    restated = set(restated)
    kept = tuple(e for e in plan.interior if e.tensor not in restated and
                 all(e.tensor in programs[names[p]] and isinstance(programs[names[p]].value(e.tensor), Node)
                     for p in set(ids[mutated.selects(e)].tolist())))
    return replace(mutated, interior=kept)


def reduced_over(plan: Plan, reduction: Node, axes: list[str], program: str = "main") -> Plan:
    """The plan with `reduction` (an all_reduce, a sum) over `axes` instead: a gradient or a count reduced over
    the wrong group."""
    graph = edit(plan.programs[program], program,
                 change={reduction.name: _like(reduction, reduction.name, "all_reduce", reduction.args,
                                               {"axes": axes, "reduce": "sum"})})
    return with_program(plan, program, graph)


def refuted_at(mutated: Plan, tensor: str, phase: str, module: str) -> str:
    """Verify `mutated`, a well-formed plan wrong in the concrete runs; assert its first refuted stage is `tensor`
    in `phase` under `module` (a path prefix); the diagnosis' headline."""
    from tv_ray.diagnose import diagnose
    from tv_ray.engine.driver import verify_plan
    from tv_ray.plan_check import check_plan
    check_plan(mutated)
    outcome = verify_plan(mutated, progress=False)
    assert outcome.deviations and outcome.status == "refuted", (outcome.counts(), outcome.problems[:3])
    first = outcome.first_refuted()
    assert (first.tensor, first.phase) == (tensor, phase) and first.module.startswith(module), \
        (first.ranks, first.tensor, first.phase, first.module)
    return diagnose(outcome)["headline"]


# -- the 14 classes ------------------------------------------------------------------------------
def a1_allreduce_identity(plan: Plan) -> Mutant:
    """A1: the tp all-reduce after layers.1's attention output projection (forward, microbatch 0) becomes
    an identity (clone): each tp rank continues with its own partial sum."""
    target = "_unsafe_view_18@0~1"
    old, graph = _with_op(plan, "stage1", target, "clone")
    return Mutant("A1", with_program(plan, "stage1", graph),
                  f"stage1 (ranks 4-7): {target} = all_reduce({old.args[0]}, tp) replaced by clone "
                  f"(layers.1.attn.o_proj output, fwd, mb 0)",
                  "stage1", STAGE1, (target,), "layers.1", "fwd",
                  ("layers.1",))


def a2_allreduce_dropped(plan: Plan) -> Mutant:
    """A2: the dp all-reduce of layers.0.mlp.down_proj's weight gradient is removed; its readers (the
    gradient output, the norm and the optimizer) read the local, unreduced sum instead."""
    target, source = "t_50~2", "t_50~1"
    graph = edit(plan.programs["stage0"], "stage0", drop=[target], rename_args={target: source})
    return Mutant("A2", with_program(plan, "stage0", graph),
                  f"stage0 (ranks 0-3): {target} = all_reduce({source}, dp) dropped; readers use {source} "
                  f"(grad of layers.0.mlp.down_proj.weight, bwd)",
                  "stage0", STAGE0, (source,), "layers.0.mlp.down_proj", "bwd",   # its readers changed
                  ("layers.0.mlp.down_proj",))


def a3_allreduce_to_allgather(plan: Plan) -> Mutant:
    """A3: the tp all-reduce of the input gradient of layers.1.mlp.down_proj (backward, microbatch 0)
    becomes an all-gather. Gathering doubles dim 0, so — the closest well-formed version — each rank
    then keeps the first member's chunk (slice 0:batch*seq/4): tp rank 0 its own partial sum, tp rank 1
    rank 0's, instead of the sum of both."""
    target = "view_37@0~1"
    old = node(plan, "stage1", target)
    rows = old.shape[0]
    gathered = _like(old, f"{target}.gathered", "all_gather", old.args, {"axes": ["tp"], "dim": 0},
                     shape=(rows * 2, old.shape[1]))
    first = _like(old, target, "slice", [gathered.name], {"dim": 0, "start": 0, "end": rows, "step": 1})
    graph = edit(plan.programs["stage1"], "stage1", change={target: [gathered, first]})
    return Mutant("A3", with_program(plan, "stage1", graph),
                  f"stage1 (ranks 4-7): {target} = all_reduce({old.args[0]}, tp) replaced by "
                  f"all_gather(dim 0) then slice of member 0's chunk (layers.1.mlp.down_proj, bwd, mb 0)",
                  "stage1", STAGE1, (target, gathered.name), "layers.1.mlp.down_proj", "bwd",
                  ("layers.1.mlp",))


def a4_allgather_to_allreduce(plan: Plan) -> Mutant:
    """A4: the base plan has no all-gather, so the embedding forward is first rewritten the FSDP way —
    gather the vocab-sharded embed.weight over tp (all_gather dim 0), multiply the whole one-hot by the
    whole table, no all-reduce after (a correct plan: `a4_control`) — and then that parameter all-gather
    is replaced by an all-reduce. The sum of the shards has half the rows, so — the closest well-formed
    version — it is tiled twice (cat) to the gathered shape."""
    return _a4(plan, bug=True)


def a4_control(plan: Plan) -> Plan:
    """The correct all-gather rewrite A4 starts from (it must be proved)."""
    return _a4(plan, bug=False).plan


def _a4(plan: Plan, bug: bool) -> Mutant:
    prog = plan.programs["stage0"]
    rows0, rows1 = node(plan, "stage0", "embedding.rows@0"), node(plan, "stage0", "embedding.rows@1")
    weight = prog.value("embed.weight")
    vocab_half, hidden = weight.shape
    full_shape = (vocab_half * 2, hidden)
    meta = {"module": "embed", "phase": "fwd"}
    if bug:
        reduced = Node.make("embed.weight~gathered.sum", "all_reduce", ["embed.weight"],
                            {"axes": ["tp"], "reduce": "sum"}, weight.shape, meta=meta)
        full = Node.make("embed.weight~gathered", "cat", [reduced.name, reduced.name], {"dim": 0},
                         full_shape, meta=meta)
        new_nodes = [reduced, full]
    else:
        full = Node.make("embed.weight~gathered", "all_gather", ["embed.weight"], {"axes": ["tp"], "dim": 0},
                         full_shape, meta=meta)
        new_nodes = [full]
    change: dict[str, Node | list[Node]] = {
        "embedding.rows@0": new_nodes + [_set_args(rows0, "embedding.flat@0", full.name)],
        "embedding.rows@1": _set_args(rows1, "embedding.flat@1", full.name),
    }
    for reduced_name in ("embedding@0~1", "embedding@1~1"):   # the whole table gives whole rows: no all-reduce
        old = prog.value(reduced_name)
        change[reduced_name] = _like(old, reduced_name, "clone", old.args)
    graph = edit(prog, "stage0", change=change, drop=["embedding.flat~1", "embedding.flat~2"])
    ops = tuple(n.name for n in new_nodes)
    rewritten = ("embedding.rows@0", "embedding.rows@1", "embedding@0", "embedding@1")   # whole, not tp partial
    return Mutant("A4", with_program(plan, "stage0", graph, restated=rewritten),
                  "stage0 (ranks 0-3): embedding forward rewritten to gather embed.weight over tp, and that "
                  "all_gather(embed.weight, tp, dim 0) replaced by all_reduce(embed.weight, tp) tiled by cat "
                  "(embed, fwd, both microbatches)",
                  "stage0", STAGE0, ops, "embed", "fwd",
                  ("embed", "layers.0.attn_norm"))


def a5_reduce_scatter_without_reduce(plan: Plan) -> Mutant:
    """A5: the backward fused collective of the embedding gradient (reduce_scatter over tp) loses its
    reduce: each tp rank keeps its own chunk of its own partial gradient (local_chunk)."""
    target = "embedding_dense_backward~3"
    old, graph = _with_op(plan, "stage0", target, "local_chunk", {"axes": ["tp"], "dim": 0})
    return Mutant("A5", with_program(plan, "stage0", graph),
                  f"stage0 (ranks 0-3): {target} = reduce_scatter({old.args[0]}, tp, dim 0) replaced by "
                  f"local_chunk (grad of embed.weight, bwd)",
                  "stage0", STAGE0, (target,), "embed", "bwd",
                  ("embed",))


def a6_send_recv_swapped(plan: Plan) -> Mutant:
    """A6: pipeline stage 0's two forward sends of microbatch 0 swap tags: the residual stream add_6
    goes to the recv stage 1 posts for the normed activation mul_11 and vice versa (same shape)."""
    prog = plan.programs["stage0"]
    a, b = prog.value("add_6@0>1"), prog.value("mul_11@0>1")
    graph = edit(prog, "stage0", change={a.name: _set_attrs(a, tag=b.attr["tag"]),
                                         b.name: _set_attrs(b, tag=a.attr["tag"])})
    return Mutant("A6", with_program(plan, "stage0", graph),
                  f"stage0 (ranks 0-3): sends {a.name} (tag {a.attr['tag']}) and {b.name} (tag {b.attr['tag']}) "
                  f"swap tags, so stage 1's recvs add_6@0<0 and mul_11@0<0 get each other's data (fwd, mb 0)",
                  "stage0", STAGE0, (a.name, b.name), "layers.1.attn_norm", "fwd",
                  ("layers.1",), consumer_ranks=STAGE1)


def a7_constant_one_rank(plan: Plan) -> Mutant:
    """A7: on rank 5 only (pp=1, dp=0, tp=1), layers.1's attention score scale 1/sqrt(8) becomes 0.5
    (forward, microbatch 0)."""
    target, rank = "mul_17@0", 5
    old = node(plan, "stage1", target)
    graph = edit(plan.programs["stage1"], "stage1_r5", change={target: _set_attrs(old, other=0.5)})
    return Mutant("A7", with_program(plan, "stage1_r5", graph, overrides=[rank]),
                  f"rank 5 runs stage1_r5: {target} = mul(view_22@0, other) with other "
                  f"{old.attr['other']:.6g} -> 0.5 (layers.1.attn score scale, fwd, mb 0)",
                  "stage1_r5", (rank,), (target,), "layers.1.attn", "fwd",
                  ("layers.1.attn",))


def a8_pow_exponent(plan: Plan) -> Mutant:
    """A8: the square in the final RMSNorm (norm) forward of microbatch 0 becomes a fourth power."""
    target = "pow_6@0"
    old = node(plan, "stage1", target)
    graph = edit(plan.programs["stage1"], "stage1", change={target: _set_attrs(old, exponent=4.0)})
    return Mutant("A8", with_program(plan, "stage1", graph),
                  f"stage1 (ranks 4-7): {target} = pow(add_13@0) exponent {old.attr['exponent']:g} -> 4 "
                  f"(norm, fwd, mb 0)",
                  "stage1", STAGE1, (target,), "norm", "fwd",
                  ("norm",))


def a9_constant_several_ranks(plan: Plan) -> Mutant:
    """A9: on every rank of pipeline stage 0 (ranks 0-3), the epsilon of layers.0.mlp_norm in microbatch
    1's forward becomes 1e-3 instead of 1e-5."""
    target = "add_5@1"
    old = node(plan, "stage0", target)
    graph = edit(plan.programs["stage0"], "stage0", change={target: _set_attrs(old, other=1e-3)})
    return Mutant("A9", with_program(plan, "stage0", graph),
                  f"stage0 (ranks 0-3): {target} = add(mean_1@1, other) with other {old.attr['other']:g} -> 0.001 "
                  f"(layers.0.mlp_norm eps, fwd, mb 1)",
                  "stage0", STAGE0, (target,), "layers.0.mlp_norm", "fwd",
                  ("layers.0.mlp_norm",))


def a10_backward_wrong_gradient(plan: Plan) -> Mutant:
    """A10: the input-gradient matmul of layers.0.mlp.gate_proj (microbatch 0) reads the gradient at the
    up projection's output (view_63@0) instead of the one at the gate projection's (view_65@0)."""
    target = "mm_36@0"
    old = node(plan, "stage0", target)
    assert old.args[0] == "view_65@0"
    graph = edit(plan.programs["stage0"], "stage0", change={target: _set_args(old, "view_63@0", old.args[1])})
    return Mutant("A10", with_program(plan, "stage0", graph),
                  f"stage0 (ranks 0-3): {target} = mm(view_65@0, t_57) reads view_63@0 (the up_proj output "
                  f"gradient) instead (layers.0.mlp.gate_proj, bwd, mb 0)",
                  "stage0", STAGE0, (target,), "layers.0.mlp.gate_proj", "bwd",
                  ("layers.0.mlp", "layers.0.mlp_norm", ""))


def a11_rope_backward_swapped(plan: Plan) -> Mutant:
    """A11: in the rotary-embedding backward of layers.0's queries (microbatch 1), the cos and sin terms
    are swapped: the gradient is multiplied by cos where it should be by sin and vice versa."""
    prog = plan.programs["stage0"]
    a, b = prog.value("mul_73@1"), prog.value("mul_74@1")
    assert a.args[1] == "sin" and b.args[1] == "cos"
    graph = edit(prog, "stage0", change={a.name: _set_args(a, a.args[0], "cos"),
                                         b.name: _set_args(b, b.args[0], "sin")})
    return Mutant("A11", with_program(plan, "stage0", graph),
                  "stage0 (ranks 0-3): rope backward mul_73@1 = view_75@1*sin and mul_74@1 = view_75@1*cos "
                  "swap sin and cos (layers.0.attn queries, bwd, mb 1)",
                  "stage0", STAGE0, (a.name, b.name), "layers.0.attn", "bwd",
                  ("layers.0.attn",))


def _local_token_count(plan: Plan, program: str) -> Graph:
    target = "nll_loss_backward.per_token"
    old = node(plan, "stage1", target)
    assert old.args[1] == "nll_loss_forward_total_weight~2"
    return edit(plan.programs["stage1"], program,
                change={target: _set_args(old, old.args[0], "nll_loss_forward_total_weight~1")})


def a12_divisor_one_rank(plan: Plan) -> Mutant:
    """A12: on rank 6 only (pp=1, dp=1, tp=0) the loss gradient's divisor is the local token count (the
    sum over its microbatches, before the dp all-reduce) instead of the global one: its gradients come out
    dp× too large."""
    graph = _local_token_count(plan, "stage1_r6")
    return Mutant("A12", with_program(plan, "stage1_r6", graph, overrides=[6]),
                  "rank 6 runs stage1_r6: nll_loss_backward.per_token = div(neg, total_weight) divides by "
                  "nll_loss_forward_total_weight~1 (local count) instead of ~2 (dp all-reduced) (loss, bwd)",
                  "stage1_r6", (6,), ("nll_loss_backward.per_token",), "", "bwd",
                  ("",))


def a13_divisor_several_ranks(plan: Plan) -> Mutant:
    """A13: A12's divisor change on every rank of pipeline stage 1 (ranks 4-7)."""
    graph = _local_token_count(plan, "stage1")
    return Mutant("A13", with_program(plan, "stage1", graph),
                  "stage1 (ranks 4-7): nll_loss_backward.per_token divides by nll_loss_forward_total_weight~1 "
                  "(local count) instead of ~2 (dp all-reduced) (loss, bwd)",
                  "stage1", STAGE1, ("nll_loss_backward.per_token",), "", "bwd",
                  ("",))


def a14_reducer_before_last_microbatch(plan: Plan) -> Mutant:
    """A14: the dp gradient reducer of layers.0.mlp.up_proj.weight is launched as soon as microbatch 0's
    gradient t_54@0 exists; microbatch 1's gradient t_54@1 is added afterwards, unreduced."""
    prog = plan.programs["stage0"]
    acc, reduced = prog.value("t_54~1"), prog.value("t_54~2")
    assert acc.args == ("t_54@0", "t_54@1") and reduced.args == ("t_54~1",)
    early = _like(reduced, "t_54@0~early", "all_reduce", ["t_54@0"], dict(reduced.attrs))
    late = _like(acc, "t_54~2", "add", [early.name, "t_54@1"])
    graph = edit(prog, "stage0", after={"t_54@0": [early]}, drop=["t_54~1"], change={"t_54~2": late})
    return Mutant("A14", with_program(plan, "stage0", graph),
                  "stage0 (ranks 0-3): t_54~2 = all_reduce(t_54@0 + t_54@1, dp) becomes all_reduce(t_54@0, dp) "
                  "issued right after microbatch 0's gradient, + t_54@1 unreduced "
                  "(grad of layers.0.mlp.up_proj.weight, bwd)",
                  "stage0", STAGE0, (early.name, "t_54~2"), "layers.0.mlp.up_proj", "bwd",
                  ("layers.0.mlp.up_proj",))


MUTANTS: dict[str, Callable[[Plan], Mutant]] = {
    "A1": a1_allreduce_identity,
    "A2": a2_allreduce_dropped,
    "A3": a3_allreduce_to_allgather,
    "A4": a4_allgather_to_allreduce,
    "A5": a5_reduce_scatter_without_reduce,
    "A6": a6_send_recv_swapped,
    "A7": a7_constant_one_rank,
    "A8": a8_pow_exponent,
    "A9": a9_constant_several_ranks,
    "A10": a10_backward_wrong_gradient,
    "A11": a11_rope_backward_swapped,
    "A12": a12_divisor_one_rank,
    "A13": a13_divisor_several_ranks,
    "A14": a14_reducer_before_last_microbatch,
}
