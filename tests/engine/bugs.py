"""The bug corpus: every class of docs/bugs.md as a faulty plan, its correct twin, and where a report must locate it.

`CORPUS` maps a class id (A1–A14, B1–B27, C1–C10) to a `Bug`: how the class is built, and either `build()` — which
returns a `Case`, the faulty plan with its twin and the place the report must name — or `missing`, the capability
tv_ray lacks to express it. Three ways of building:

- a mutation of a correct plan the planner builds (the smallest model and config the class needs): a collective
  over the wrong group, a reduce op or constant changed, a communication left out or added, a microbatch dropped;
  the twin is the plan unmutated. A1–A14 are tests/engine/mutants.py's, on its base plan.
- a traced script of tests/frontend/scripts (a framework's own code, gloo on CPU) with its BUG switched on: the
  framework's faulty behaviour; the twin is the same script without it.

A case is located when the first refuted stage is in the phase and under the module where the fault enters, at the
tensor named (for mutations: the op changed, or the first op reading a value the change added), and the report's
headline says what `says` lists: the factor, the communication and its group, the output as the model names it.
tests/engine/test_bugs.py pins every mutation case; tests/frontend/test_traced.py the traced ones; bench/bugs.py
runs them all and writes the table of README "Bug classes".
"""
from __future__ import annotations

import functools
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from tests.engine.mutants import MUTANTS, Mutant, _like, _set_args, _set_attrs, base_plan, edit, reduced_over, \
    with_program
from tests.frontend.buggy import SCRIPTS, with_bug
from tv_ray import api
from tv_ray.ir import Node, Op
from tv_ray.plan import Plan

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs" / "bugs.md"


@dataclass(frozen=True)
class Case:
    """A faulty plan, its correct twin, and where the report on the faulty one must point."""

    faulty: Plan
    twin: Plan
    phase: str
    module: str                         # the first refuted stage's module is this path or under it ("" = any)
    tensor: str | None = None           # its tensor (None for a traced plan: the names are torch's)
    says: tuple[str, ...] = ()          # phrases the report's headline holds
    mutant: Mutant | None = None        # A1–A14: located as `Mutant.diagnosis_problems` says
    timeout: float = 10.0               # the solvers' limit per query

    def location_problems(self, result) -> list[str]:
        """What the report of `result` (a refuted `api.Result` of `faulty`) gets wrong about where the fault is."""
        first = result.outcome.first_refuted()
        if first is None:
            return [f"nothing refuted: {result.status}"]
        if self.mutant is not None:
            problems = self.mutant.diagnosis_problems(first)
        else:
            problems = [f"{name} {got!r}, expected {want!r}" for name, got, want in
                        (("phase", first.phase, self.phase), ("tensor", first.tensor, self.tensor or first.tensor))
                        if got != want]
            if not (first.module == self.module or first.module.startswith(self.module + ".") or not self.module):
                problems.append(f"module {first.module!r}, expected {self.module!r} or under it")
        headline = result.report.get("headline", "")
        return problems + [f"the headline does not say {phrase!r}" for phrase in self.says if phrase not in headline]


@dataclass(frozen=True)
class Bug:
    cls: str
    how: str                                        # how the faulty plan is built (a line of the README table)
    build: Callable[[], Case] | None = field(default=None, compare=False)
    missing: str = ""                               # for a class tv_ray cannot express: what it lacks

    @property
    def expressible(self) -> bool:
        return self.build is not None

    @property
    def traced(self) -> bool:
        return self.how.startswith("traced")


@functools.lru_cache(maxsize=None)
def correct(model: str, spec: str, optim: str = "sgd", clip: float | None = None, masked: bool = False,
            **flags) -> Plan:
    """The correct plan the planner builds for `model` at `spec` (captures take seconds: built once); `masked`:
    targets may be ignored (`capture_step(masked=True)`)."""
    return api.parallelize(api.capture_step(model, optim=optim, clip=clip, masked=masked), spec, model=model, **flags)


def _nodes(plan: Plan, where: Callable[[Node], bool], program: str = "main") -> list[Node]:
    return [n for n in plan.programs[program].nodes if where(n)]


def _one(plan: Plan, where: Callable[[Node], bool], program: str = "main") -> Node:
    (found,) = _nodes(plan, where, program)
    return found


def inserted_after(plan: Plan, target: Node, new: Node, program: str = "main") -> Plan:
    """`plan` with `new` (reading `target`) inserted after `target`, every other reader of `target` reading `new`."""
    graph = edit(plan.programs[program], program, after={target.name: [new]}, rename_args={target.name: new.name})
    graph = edit(graph, program, change={new.name: new})          # `new` itself still reads `target`
    return with_program(plan, program, graph)


def changed(plan: Plan, *nodes: Node, program: str = "main") -> Plan:
    """`plan` with `nodes` in place of the nodes of `program` they are named as."""
    return with_program(plan, program, edit(plan.programs[program], program, change={n.name: n for n in nodes}))


# -- A: TrainVerify's mutations --------------------------------------------------------------------
def _trainverify(cls: str) -> Callable[[], Case]:
    def build() -> Case:
        twin = _base()
        mutant = MUTANTS[cls](twin)
        return Case(mutant.plan, twin, mutant.phase, mutant.module, mutant=mutant)
    return build


@functools.lru_cache(maxsize=None)
def _base() -> Plan:
    return base_plan()


# -- sequence parallelism: llama3-tiny dp=2,tp=2 with sp -----------------------------------------
def _sp() -> Plan:
    return correct("llama3-tiny", "dp=2,tp=2", "adamw", 1.0, sp=True)


def _final_norm_gradient(plan: Plan) -> Node:
    """The final norm's weight gradient, summed over dp × tp (each tp rank's sequence chunk)."""
    return _one(plan, lambda n: n.op == Op.ALL_REDUCE and n.get_meta("module") == "norm"
                and n.get_meta("phase") == "bwd")


def b2_sp_norm_gradient_averaged() -> Case:
    twin = _sp()
    reduced = _final_norm_gradient(twin)
    faulty = changed(twin, _set_attrs(reduced, reduce="avg"))
    return Case(faulty, twin, "bwd", "norm", reduced.name, ("physical = 0.25 × logical",))


def b9_sp_gradient_scaled_by_sp() -> Case:
    twin = _sp()
    reduced = _final_norm_gradient(twin)
    scaled = _like(reduced, f"{reduced.name}.times_sp", "mul", [reduced.name], {"other": 2.0})
    return Case(inserted_after(twin, reduced, scaled), twin, "bwd", "norm", scaled.name, ("physical = 2 × logical",))


def _norm_sum(plan: Plan, weight: str, reduced: bool) -> Node:
    name = f"optim.{weight}.grad_sq_sum" + ("~1" if reduced else "")
    return plan.programs["main"].value(name)


def c2_replicated_weight_counted_tp_times() -> Case:
    """A tp-replicated weight's squared gradient sum all-reduced over tp as the sharded weights' are."""
    twin = _sp()
    local = _norm_sum(twin, "layers.0.attn_norm.weight", reduced=False)
    summed = _like(local, f"{local.name}~tp", "all_reduce", [local.name], {"axes": ["tp"], "reduce": "sum"})
    return Case(inserted_after(twin, local, summed), twin, "optim", "", "optim.layers.0.attn_norm.weight.norm_sq_acc",
                (f"{summed.name} sums {local.name} over tp", "the reduction over tp is one too many"))


def c10_clip_norm_from_partial_sums() -> Case:
    """The global norm accumulates a tp-sharded weight's squared sum before its pending sum over tp."""
    twin = _sp()
    acc = twin.programs["main"].value("optim.layers.0.attn.q_proj.weight.norm_sq_acc")
    local = _norm_sum(twin, "layers.0.attn.q_proj.weight", reduced=False)
    faulty = changed(twin, _set_args(acc, acc.args[0], local.name))
    return Case(faulty, twin, "optim", "", "optim.layers.0.attn.q_proj.weight.norm_sq_acc",
                (f"it reads {local.name} on ranks 0, 1, a partial sum over tp never reduced",))


def c8_shard_norm_over_the_whole_group() -> Case:
    """ZeRO-2 on dp × tp: a norm weight's gradient is sharded over dp and replicated over tp; its squared sum
    all-reduced over dp × tp instead of the shard group dp counts it tp times (HSDP's replicas)."""
    twin = correct("llama3-tiny", "dp=2,tp=2", "adamw", 1.0, zero=2)
    reduced = _norm_sum(twin, "layers.0.attn_norm.weight", reduced=True)
    return Case(reduced_over(twin, reduced, ["dp", "tp"]), twin, "optim", "", reduced.name,
                ("physical = 2 × logical", "the reduction over tp is one too many"))


# -- loss, accumulation and ZeRO: llama3-tiny dp=2,mb=2 --------------------------------------------
def _mb(**flags) -> Plan:
    return correct("llama3-tiny", "dp=2,mb=2", **flags)


def _per_microbatch_counts(plan: Plan, times: float) -> Plan:
    """Each microbatch's loss gradient divided by its own token count (summed over dp) × `times`."""
    graph = plan.programs["main"]
    change: dict = {}
    for backward in _nodes(plan, lambda n: n.op.value == "nll_loss_backward"):
        mb = backward.get_meta("mb")
        local = graph.value(f"nll_loss_forward_total_weight@{mb}")
        count = _like(local, f"{local.name}~dp", "all_reduce", [local.name], {"axes": ["dp"], "reduce": "sum"},
                      phase="bwd")
        scaled = _like(count, f"{local.name}~scaled", "mul", [count.name], {"other": times}, phase="bwd")
        change[backward.name] = [count, scaled, _set_args(backward, *backward.args[:3], scaled.name)]
    return with_program(plan, "main", edit(graph, "main", change=change))


def b10_loss_normalised_per_microbatch() -> Case:
    """Each microbatch's loss gradient divided by its own token count (summed over dp) × mb: the global count only
    where every microbatch counts as many tokens — targets the loss ignores (padding) make them differ, so the
    plan's targets are masked (without, every microbatch counts as many and the change is no bug: proved)."""
    twin = correct("llama3-tiny", "dp=2,mb=2", masked=True)
    return Case(_per_microbatch_counts(twin, 2.0), twin, "bwd", "", "nll_loss_backward@0", ())


def b11_accumulated_gradient_wiped() -> Case:
    """The pipeline's re-initialisation zeroes the gradient accumulated over the first microbatch."""
    twin = _base()
    accumulated = twin.programs["stage0"].value("t_54~1")
    kept = _like(accumulated, accumulated.name, "clone", [accumulated.args[-1]])
    return Case(changed(twin, kept, program="stage0"), twin, "bwd", "layers.0.mlp.up_proj", "t_54~1", ())


def b12_zero2_keeps_the_last_microbatch() -> Case:
    twin = _mb(zero=2)
    accumulated = twin.programs["main"].value("t_54~1")
    kept = _like(accumulated, accumulated.name, "clone", [accumulated.args[-1]])
    return Case(changed(twin, kept), twin, "bwd", "layers.0.mlp.up_proj", "t_54~1", ())


def b13_zero_loss_of_the_last_microbatch() -> Case:
    """Under ZeRO with accumulation the loss reported is the last microbatch's, scaled as if it were the mean."""
    twin = _mb(zero=2)
    graph = twin.programs["main"]
    summed = graph.value(dict(graph.outputs)["loss"])
    last = _like(summed, summed.name, "mul", [summed.args[-1]], {"other": 2.0})
    return Case(changed(twin, last), twin, "", "", summed.name, ())


def _averaged(plan: Plan, bug: bool) -> Plan:
    """The up projection's gradient all-reduced with AVG over dp and multiplied by dp (a correct rewrite); with
    `bug`, the backend's AVG sums."""
    reduced = plan.programs["main"].value("t_54~2")
    mean = _set_attrs(reduced, reduce="sum" if bug else "avg")
    times = _like(reduced, f"{reduced.name}.times_dp", "mul", [reduced.name], {"other": 2.0})
    return inserted_after(changed(plan, mean), mean, times)


def b14_avg_reduction_sums() -> Case:
    base = _mb()
    return Case(_averaged(base, bug=True), _averaged(base, bug=False), "bwd", "layers.0.mlp.up_proj",
                "t_54~2.times_dp", ("physical = 2 × logical",))


def b17_scalar_read_before_its_reduction() -> Case:
    """The loss divides by the token count read on this rank, before its pending sum over dp."""
    twin = _mb()
    graph = twin.programs["main"]
    losses = _nodes(twin, lambda n: n.name.startswith("nll_loss_forward@"))
    local = graph.value(graph.value(losses[0].args[1]).args[0])
    faulty = changed(twin, *[_set_args(n, n.args[0], local.name) for n in losses])
    return Case(faulty, twin, "", "", dict(graph.outputs)["loss"], ("physical = 2 × logical",))


# -- context parallelism: llama3-tiny dp=2,cp=2 ----------------------------------------------------
def _cp() -> Plan:
    return correct("llama3-tiny", "dp=2,cp=2")


def _token_count(plan: Plan, phase: str) -> Node:
    return _one(plan, lambda n: n.op == Op.ALL_REDUCE and n.get_meta("phase") == phase and "total" in n.name
                and n.name.startswith("nll_loss_forward"))


def b4_loss_scaled_by_cp() -> Case:
    """The loss's token count summed over dp only in the forward: the loss cp × too large, the gradients right.
    The count has no claim of its own (the plan states the loss's lineage), so the loss is refuted."""
    twin = _cp()
    return Case(reduced_over(twin, _token_count(twin, "fwd"), ["dp"]), twin, "fwd", "", "nll_loss_forward",
                ("physical = 2 × logical",))


def b5_gradient_scaled_by_cp() -> Case:
    """The backward divides by the tokens of this cp chunk's dp group only: every gradient cp × too large."""
    twin = _cp()
    count = _token_count(twin, "bwd")
    return Case(reduced_over(twin, count, ["dp"]), twin, "bwd", "", count.name, ("physical = 0.5 × logical",))


def b7_token_count_undercounted_by_cp() -> Case:
    """Both counts summed over dp only: the count the backward reads needs no forward value, so it comes first."""
    twin = _cp()
    faulty = reduced_over(reduced_over(twin, _token_count(twin, "fwd"), ["dp"]), _token_count(twin, "bwd"), ["dp"])
    return Case(faulty, twin, "bwd", "", _token_count(twin, "bwd").name, ("physical = 0.5 × logical",))


def c4_correction_factor_without_cp() -> Case:
    """The backward's divisor corrected by the dp size where dp × cp was meant: the count times dp / (dp·cp)."""
    twin = _cp()
    count = _token_count(twin, "bwd")
    scaled = _like(count, f"{count.name}.dp_only", "mul", [count.name], {"other": 0.5})
    return Case(inserted_after(twin, count, scaled), twin, "bwd", "", "view_33", ("physical = 2 × logical",))


def b18_all_reduce_over_cp_inserted() -> Case:
    """A sum over cp of the gathered keys, which every cp rank already holds whole."""
    twin = _cp()
    gathered = _nodes(twin, lambda n: n.op == Op.ALL_GATHER and n.get_meta("phase") == "fwd")[0]
    summed = _like(gathered, f"{gathered.name}~cp", "all_reduce", [gathered.name], {"axes": ["cp"], "reduce": "sum"})
    reader = _nodes(twin, lambda n: gathered.name in n.args)[0]
    return Case(inserted_after(twin, gathered, summed), twin, "fwd", gathered.get_meta("module"), reader.name,
                ("physical = 2 × logical", "the reduction over cp is one too many"))


def b6_aux_loss_gradient_divided_by_cp() -> Case:
    """The balance loss's backward reads the experts' load (summed over the cp chunks) divided by cp once more:
    refuted at the first op that reads the scaled load (it has no logical tensor of its own)."""
    twin = correct("deepseek-tiny", "dp=2,cp=2")
    load = _one(twin, lambda n: n.op == Op.ALL_REDUCE and n.get_meta("phase") == "bwd"
                and n.get_meta("module") == "layers.1.mlp" and n.attr["axes"] == ("cp",))
    (reader,) = _nodes(twin, lambda n: load.name in n.args)
    scaled = _like(load, f"{load.name}.over_cp", "mul", [load.name], {"other": 0.5})
    return Case(inserted_after(twin, load, scaled), twin, "bwd", "layers.1.mlp", reader.name,
                ("physical = 0.5 × logical",))


# -- expert parallelism: deepseek-tiny dp=4,ep=2 (mesh dp=2 × ep=2) ------------------------------
def _ep() -> Plan:
    return correct("deepseek-tiny", "dp=4,ep=2")


def gradient_of(plan: Plan, weight: str) -> Node:
    """The op making `weight`'s gradient output (its reduction)."""
    graph = plan.programs["main"]
    return graph.value(dict(graph.outputs)[f"grad/{weight}"])


def b22_expert_gradient_ep_times_too_large() -> Case:
    twin = _ep()
    reduced = gradient_of(twin, "layers.1.mlp.experts.w_gate")
    scaled = _like(reduced, f"{reduced.name}.scaled", "mul", [reduced.name], {"other": 2.0})
    return Case(inserted_after(twin, reduced, scaled), twin, "bwd", "layers.1.mlp.experts", scaled.name,
                ("physical = 2 × logical",))


def b23_expert_input_gradient_left_partial() -> Case:
    """The sum over the ep ranks' experts of the tokens' input gradient skipped."""
    twin = _ep()
    reduced = _one(twin, lambda n: n.op == Op.ALL_REDUCE and tuple(n.attr["axes"]) == ("ep",)
                   and not n.get_meta("module") and n.get_meta("phase") == "bwd")
    faulty = changed(twin, _like(reduced, reduced.name, "clone", reduced.args))
    return Case(faulty, twin, "bwd", "", reduced.name, ("partial sum over ep",))


def b24_router_gradient_not_reduced_over_ep() -> Case:
    twin = _ep()
    reduced = gradient_of(twin, "layers.1.mlp.gate.weight")
    return Case(reduced_over(twin, reduced, ["dp"]), twin, "bwd", "layers.1.mlp.gate", reduced.name,
                ("partial sum over ep",))


def c5_router_partial_gradients_never_summed() -> Case:
    """The router's score gradient through the gate normalisation: each ep rank keeps its own experts' partial sum
    (the reduce-scatter over ep becomes a local chunk)."""
    twin = _ep()
    scattered = _one(twin, lambda n: n.op == Op.REDUCE_SCATTER and tuple(n.attr["axes"]) == ("ep",)
                     and n.get_meta("phase") == "bwd")
    local = _like(scattered, scattered.name, "local_chunk", scattered.args,
                  {"axes": ["ep"], "dim": scattered.attr["dim"]})
    return Case(changed(twin, local), twin, "bwd", "", scattered.name, ())


def c6_aux_loss_gradient_dropped() -> Case:
    """The balance loss's gradient seed (the loss coefficient) discarded: the router learns from the loss alone."""
    twin = _ep()
    seed = _one(twin, lambda n: n.op.value == "mul" and n.args == ("ones_like",) and n.get_meta("phase") == "bwd"
                and n.get_meta("module") == "layers.1.mlp")
    return Case(changed(twin, _set_attrs(seed, other=0.0)), twin, "bwd", "layers.1.mlp", seed.name, ())


def b26_global_norm_without_other_ep_shards() -> Case:
    """With ep and tp, the experts' squared gradient sums reduced over tp only, as the dense ones are: the norm
    leaves out the experts the other ep rank holds. Located at the first of those sums: a partial sum over ep."""
    twin = correct("deepseek-tiny", "dp=2,ep=2,tp=2", "adamw", 1.0)
    faulty = twin
    for reduced in _nodes(twin, lambda n: n.op == Op.ALL_REDUCE and ".mlp.experts.w_" in n.name
                          and "grad_sq_sum" in n.name):
        faulty = reduced_over(faulty, reduced, ["tp"])
    return Case(faulty, twin, "optim", "", "optim.layers.1.mlp.experts.w_gate.grad_sq_sum~1",
                ("partial sum over ep", "a reduction (all-reduce / reduce-scatter) over ep is missing"))


def c1_rotary_key_gradient_not_summed_over_tp() -> Case:
    """MLA at tp=2: the rotary key (kv_a_proj's last qk_rope outputs) is expanded to each rank's heads; its rows of
    kv_a_proj's weight gradient are left out of the sum over tp (the latent rows summed)."""
    twin = correct("deepseek-tiny", "tp=2")
    reduced = gradient_of(twin, "layers.0.attn.kv_a_proj.weight")
    rows, cols = reduced.shape
    latent_rows = twin.programs["main"].value("split_with_sizes_1_0").shape[-1]     # kv_a_proj's latent outputs
    latent = _like(reduced, f"{reduced.name}.latent", "slice", reduced.args,
                   {"dim": 0, "start": 0, "end": latent_rows, "step": 1}, shape=(latent_rows, cols))
    summed = _like(latent, f"{latent.name}~1", "all_reduce", [latent.name], {"axes": ["tp"], "reduce": "sum"})
    key = _like(reduced, f"{reduced.name}.rope", "slice", reduced.args,
                {"dim": 0, "start": latent_rows, "end": rows, "step": 1}, shape=(rows - latent_rows, cols))
    whole = _like(reduced, reduced.name, "cat", [summed.name, key.name], {"dim": 0})
    faulty = with_program(twin, "main", edit(twin.programs["main"], "main",
                                             change={reduced.name: [latent, summed, key, whole]}))
    return Case(faulty, twin, "bwd", "layers.0.attn.kv_a_proj", reduced.name, ("partial sum over tp",))


# -- traced framework code -------------------------------------------------------------------------
def _traced(script: str, bug: str, phase: str, module: str, says: tuple[str, ...], twin: Path | None = None,
            timeout: float = 10.0) -> Callable[[], Case]:
    def build() -> Case:
        from tv_ray.frontend.traced import trace
        with tempfile.TemporaryDirectory() as directory:
            faulty = trace(with_bug(Path(directory), script, bug))
        return Case(faulty, trace(twin or SCRIPTS / f"{script}.py"), phase, module, None, says, timeout=timeout)
    return build


def _bug(cls: str, how: str, build: Callable[[], Case] | None = None, missing: str = "") -> tuple[str, Bug]:
    return cls, Bug(cls, how, build, missing)


_A = "mutation of llama3-tiny dp=2,tp=2,pp=2,mb=2 (AdamW, clip 1.0), tests/engine/mutants.py"
CORPUS: dict[str, Bug] = dict([
    *[_bug(cls, _A, _trainverify(cls)) for cls in MUTANTS],
    _bug("B1", "traced megatron-core linears under sp, a norm without megatron's sequence_parallel mark",
         _traced("megatron_sp", "norm_unmarked", "optim", "", ("grad/norm.weight",
                                                               "physical is one rank's partial sum over tp"))),
    _bug("B2", "mutation of llama3-tiny dp=2,tp=2 sp: the final norm's gradient all-reduced with AVG",
         b2_sp_norm_gradient_averaged),
    _bug("B3", "traced megatron-core q_layernorm, its tp sum left to the sp mark (sp off)",
         _traced("megatron_qknorm", "sp_only", "optim", "", ("(grad/q_layernorm.weight)",
                                                            "physical is one rank's partial sum over tp"))),
    _bug("B4", "mutation of llama3-tiny dp=2,cp=2: the forward token count summed over dp only", b4_loss_scaled_by_cp),
    _bug("B5", "mutation of llama3-tiny dp=2,cp=2: the backward token count summed over dp only",
         b5_gradient_scaled_by_cp),
    _bug("B6", "mutation of deepseek-tiny dp=2,cp=2: the experts' load divided by cp in the balance loss backward",
         b6_aux_loss_gradient_divided_by_cp),
    _bug("B7", "mutation of llama3-tiny dp=2,cp=2: both token counts summed over dp only",
         b7_token_count_undercounted_by_cp),
    _bug("B8", "traced FSDP2 (fully_shard) dividing the gradients twice",
         _traced("fsdp_mlp", "divide_twice", "bwd", "", ("physical = 0.5 × logical", "grad/"))),
    _bug("B9", "mutation of llama3-tiny dp=2,tp=2 sp: the sp-reduced norm gradient multiplied by sp (Megatron sp; "
               "tv_ray has no Ulysses all-to-all)", b9_sp_gradient_scaled_by_sp),
    _bug("B10", "mutation of llama3-tiny dp=2,mb=2 with masked targets: each microbatch's loss gradient divided by "
                "its own token count × mb", b10_loss_normalised_per_microbatch),
    _bug("B11", "mutation of llama3-tiny dp=2,tp=2,pp=2,mb=2: the first microbatch's accumulated gradient wiped",
         b11_accumulated_gradient_wiped),
    _bug("B12", "mutation of llama3-tiny dp=2,mb=2 ZeRO-2: the reduce-scatter reads the last microbatch only",
         b12_zero2_keeps_the_last_microbatch),
    _bug("B13", "mutation of llama3-tiny dp=2,mb=2 ZeRO-2: the loss reported is the last microbatch's × mb",
         b13_zero_loss_of_the_last_microbatch),
    _bug("B14", "mutation of llama3-tiny dp=2,mb=2: a gradient all-reduced with AVG (then × dp), AVG summing",
         b14_avg_reduction_sums),
    _bug("B15", "", missing="DTensor sharding propagation is not modelled: a trace records the collectives torch "
                            "ran, so the class needs a torch that still has the bug (PyTorch #179502)"),
    _bug("B16", "", missing="uneven shards: the planner refuses a dim its degree does not divide, and a trace of "
                            "uneven DTensor shards is refused at capture"),
    _bug("B17", "mutation of llama3-tiny dp=2,mb=2: the loss divides by the rank's own token count, before its sum "
                "over dp", b17_scalar_read_before_its_reduction),
    _bug("B18", "mutation of llama3-tiny dp=2,cp=2: an all-reduce over cp of the gathered keys",
         b18_all_reduce_over_cp_inserted),
    _bug("B19", "traced megatron-core vocab-parallel layers, the output layer gathering the logits",
         _traced("megatron_vocab", "gathered_logits", "fwd", "", ("(loss) — physical = logical + 0.693147 (= log 2)",),
                 twin=ROOT / "docs" / "examples" / "megatron_lm.py", timeout=0.5)),
    _bug("B20", "", missing="ring attention (send/recv of key/value blocks, online softmax) is not built: context "
                            "parallelism gathers the keys and values (docs/context-parallel.md)"),
    _bug("B21", "traced torch.distributed.pipelining 1F1B, the tied embedding's all-reduce over pp skipped",
         _traced("pipeline_tied", "tie_unsynced", "bwd", "", ("(grad/tok_embeddings.weight)",
                                                               "physical is one rank's partial sum over pp"))),
    _bug("B22", "mutation of deepseek-tiny dp=4,ep=2: the experts' gradient × ep after its reduction",
         b22_expert_gradient_ep_times_too_large),
    _bug("B23", "mutation of deepseek-tiny dp=4,ep=2: the tokens' input gradient not summed over ep",
         b23_expert_input_gradient_left_partial),
    _bug("B24", "mutation of deepseek-tiny dp=4,ep=2: the router's gradient reduced over dp only",
         b24_router_gradient_not_reduced_over_ep),
    _bug("B25", "", missing="no adapters (LoRA) and no expert tensor parallelism (experts are whole on their ep "
                            "rank)"),
    _bug("B26", "mutation of deepseek-tiny dp=2,ep=2,tp=2 (AdamW, clip 1.0): the experts' squared sums reduced "
                "over tp only", b26_global_norm_without_other_ep_shards),
    _bug("B27", "traced DTensor MLP with clipping, one gradient left out of the global norm",
         _traced("dtensor_mlp_clip", "norm_drops_one", "optim", "up", ("new/up.weight",))),
    _bug("C1", "mutation of deepseek-tiny tp=2: the rotary key's rows of kv_a_proj's gradient not summed over tp",
         c1_rotary_key_gradient_not_summed_over_tp),
    _bug("C2", "mutation of llama3-tiny dp=2,tp=2 sp (AdamW, clip 1.0): a replicated norm weight's squared sum "
               "all-reduced over tp", c2_replicated_weight_counted_tp_times),
    _bug("C3", "", missing="labels are an input of the step: shifting them before the cp split is the data "
                           "loader's, outside the plan (its loss-scale half is B4)"),
    _bug("C4", "mutation of llama3-tiny dp=2,cp=2: the backward's token count scaled by dp / (dp·cp)",
         c4_correction_factor_without_cp),
    _bug("C5", "mutation of deepseek-tiny dp=4,ep=2: the router's normalisation gradient kept per ep rank (no "
               "reduce-scatter)", c5_router_partial_gradients_never_summed),
    _bug("C6", "mutation of deepseek-tiny dp=4,ep=2: the balance loss's gradient dropped",
         c6_aux_loss_gradient_dropped),
    _bug("C7", "traced torch.distributed.pipelining 1F1B with the schedule's division by microbatches off",
         _traced("pipeline_tied", "unscaled", "bwd", "", ("physical = 2 × logical: a sum where a mean was meant",))),
    _bug("C8", "mutation of llama3-tiny dp=2,tp=2 ZeRO-2 (AdamW, clip 1.0): a dp-sharded, tp-replicated norm "
               "weight's squared sum all-reduced over dp × tp (HSDP meshes are not built)",
         c8_shard_norm_over_the_whole_group),
    _bug("C9", "", missing="the built-in models clamp no activation (clipping's clamp reads a reduced norm), and "
                           "a clamp added to the physical side alone is a plain A7-style change"),
    _bug("C10", "mutation of llama3-tiny dp=2,tp=2 sp (AdamW, clip 1.0): the clipping norm accumulates a tp "
                "shard's squared sum before its sum over tp", c10_clip_norm_from_partial_sums),
])
