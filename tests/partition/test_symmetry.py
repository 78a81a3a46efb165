"""Data-parallel symmetry: the logical step commutes with permuting samples, and dp ranks are mirrored only
where that and the plan's own structure make it a theorem."""
from __future__ import annotations

import re
import sys
from collections import Counter
from dataclasses import replace
from pathlib import Path

import pytest

from tv_ray.terms.atom import Atom
from tv_ray.engine.driver import verify_plan
from tv_ray.engine.executor import LocalExecutor
from tv_ray.engine.solve import Budget
from tv_ray.ir import Graph, Node
from tv_ray.partition import generate
from tv_ray.partition.derive import Settings, claims_for, derive, derive_claims, unmirrored
from tv_ray.partition.generate import partition
from tv_ray.partition.ids import StageId
from tv_ray.partition.logical import LogicalTerms, atoms
from tv_ray.partition.stages import Mirrored, SymbolicRun
from tv_ray.terms import Kind
from tv_ray.errors import Asymmetric
from tv_ray.partition.symmetry import Blocks, Tag, mirrors

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))
from mutants import _like, _set_attrs, edit, with_program  # noqa: E402


@pytest.fixture(scope="module")
def dp4(claimed):
    return claimed("dp=4")


def test_the_training_step_commutes_with_permuting_samples(step):
    blocks = Blocks.of(step, {"batch": 4, "seq": 2, "kv_heads": 2, "n_rep": 2, "head_dim": 2, "ffn": 4, "vocab": 4}, 2)
    assert blocks.size == 2 and blocks.tags["tokens"] == Tag(0, 1)
    assert blocks.tags["layers.0.attn.q_proj.weight"] is None
    assert any(step.value(name).op.value == "mm" for name in blocks.sums)      # weight gradients: sums over samples
    assert blocks.rename_name(Atom("tokens", (1, 0)), 1) == Atom("tokens", (3, 0))
    assert blocks.rename_name(Atom("tokens", (3, 0)), 1) == Atom("tokens", (1, 0))
    assert blocks.rename_name(Atom("tokens", (0, 1), (2, 4)), 1) == Atom("tokens", (2, 1), (2, 4))
    weight = Atom("layers.0.attn.q_proj.weight", (0, 1))
    assert blocks.rename_name(weight, 1) == weight


def test_an_op_that_reads_samples_by_position_ends_the_symmetry(step):
    clone = next(n for n in step.nodes if n.op.value == "clone")
    sliced = Node.make(clone.name, "slice", clone.args, {"dim": 0, "start": 0, "end": "batch", "step": 1},
                       clone.shape, clone.dtype)
    graph = Graph(step.inputs, tuple(sliced if n.name == clone.name else n for n in step.nodes), step.outputs,
                  step.name)
    with pytest.raises(Asymmetric) as err:
        Blocks.of(graph, {"batch": 4, "seq": 2, "kv_heads": 2, "n_rep": 2, "head_dim": 2, "ffn": 4, "vocab": 4}, 2)
    assert str(err.value) == f"logical op {clone.name} = slice(...): slice along the batch dimension"


GPT2_DIMS = {"batch": 4, "seq": 2, "heads": 2, "head_dim": 2, "ffn": 4, "vocab": 4}


@pytest.fixture(scope="module")
def gpt2_step():
    from tv_ray import api
    return api.capture_step("gpt2-tiny", optim="adamw", clip=1.0)


def _fused(graph, bias_of=None):
    """The graph with its first linear (captured as add(mm(x, w), bias)) fused back into addmm(bias, x, w);
    `bias_of(x)`: nodes making another bias from x, instead of the linear's own."""
    add = next(n for n in graph.nodes if n.op.value == "add" and n.args[0] == f"{n.name}_mm")
    mm = graph.value(add.args[0])
    extra = bias_of(graph.value(mm.args[0])) if bias_of else []
    bias = extra[-1].name if extra else add.args[1]
    addmm = Node.make(add.name, "addmm", [bias, *mm.args], {}, add.shape, "float")
    return edit(graph, graph.name, change={add.name: [*extra, addmm]}, drop=[mm.name]), addmm


def test_addmm_moves_the_rows_of_its_product_and_its_bias_is_shared(gpt2_step):
    graph, addmm = _fused(gpt2_step)
    blocks = Blocks.of(graph, GPT2_DIMS, 2)
    assert blocks.tags[addmm.name] == Tag(0, GPT2_DIMS["seq"]) and blocks.tags[addmm.args[0]] is None


def test_an_addmm_whose_bias_holds_samples_on_other_rows_ends_the_symmetry(gpt2_step):
    def transposed(x):
        return [Node.make("bias_from_x", "transpose", [x.name], {"dim0": 0, "dim1": 1}, (x.shape[1], x.shape[0]),
                          "float")]
    graph, addmm = _fused(gpt2_step, transposed)
    with pytest.raises(Asymmetric) as err:
        Blocks.of(graph, GPT2_DIMS, 2)
    assert str(err.value) == (f"logical op {addmm.name} = addmm(...): the bias bias_from_x is not aligned "
                              f"with the samples of the product")


def test_mirrored_ranks_give_the_same_stages_as_running_every_rank(dp4):
    plan, dims, claims = dp4
    full, mirrored = partition(plan, dims, claims, symmetry=False), partition(plan, dims, claims)
    assert mirrored.symmetry == [] and mirrored.mirrored > 2000
    ranks = mirrored.flat_copies()[0]
    assert mirrored.mirrored == sum(int(r) in mirrored.mirrors.rep for r in ranks) == len(ranks)
    # one row of the instantiation map per representative's cut, standing for its 3 mirrors' stages
    assert mirrored.copy_fan.all() and mirrored.copies == 3 * len(mirrored.copy_of)
    rep = int(mirrored.copy_ranks[0])
    for rank in (None, rep):        # a fan's stage is a mirror's: which one must be named
        with pytest.raises(ValueError) as err:
            mirrored.copy(0, rank)
        assert str(err.value) == f"row 0 of the instantiation map is a fan of rank {rep}'s mirrors " \
                                 f"{list(mirrored.mirrors.of(rep))}, not {rank}"
    everyone = list(mirrored.every())
    assert mirrored.size == len(everyone) == len(full.obligations)
    assert sorted((o.id, o.ranks, o.claim) for o in full.obligations) == \
        sorted((o.id, o.ranks, o.claim) for o in everyone)
    # the same reads, but where a contribution sum is proved as dp block 0's part: block 0's members' reads alone,
    # which the mirrors' (their copies) stand for in the composition (`Partition.representative`) — and for the
    # mean loss, the targets of every block, which its divisor, the whole batch's count, reads
    by_id = {o.id: o for o in everyone}
    fewer = [o for o in full.obligations if set(o.reads) != set(by_id[o.id].reads)]
    assert fewer and all(o.claim.partial == ("dp",) for o in fewer)
    for o in fewer:
        mine = set(by_id[o.id].reads)
        others = {cid for cid in mine if any(mirrored.mirrors.block[r] for r in cid.ranks)}
        assert mine < set(o.reads) and all(cid == StageId.input(cid.ranks[0], "targets") for cid in others)
        assert not others or o.tensor == "nll_loss_forward"
        assert {mirrored.representative(r) for r in o.reads} == {mirrored.representative(r) for r in mine}
    differ = [(a.op, a.claim) for a, b in zip(sorted(full.obligations, key=lambda o: o.id),
                                              sorted(everyone, key=lambda o: o.id)) if a.key != b.key]
    # only the sums over dp differ (the weight gradients, the token count, the loss: its div by the count): each
    # rank's part (and its transposes) is proved as its block's contribution and continues from it, not from a
    # free split of the sum; their all-reduce is the slice's atoms both ways (every block's contribution, or the
    # free parts, summed)
    contribution = LogicalTerms.build(plan.logical, dims, mirrored.mirrors.blocks).contributions
    assert all(claim.logical in contribution and claim.partial == ("dp",) for op, claim in differ)
    assert Counter(op for op, _ in differ) == {"transpose": 30, "mm": 15, "sum": 5, "view": 5,
                                               "embedding_dense_backward": 1, "nll_loss_total_weight": 1, "div": 1}


def test_mirrored_ranks_compute_nothing_past_their_weight_gradients(dp4):
    """A weight gradient's part on a mirrored rank continues as its block's contribution, mirrored: what follows
    (its transposes, the all-reduce of every block's part) is computed by the representative alone."""
    plan, dims, claims = dp4
    found = mirrors(plan, dims)
    computed = Counter()

    class Watched(SymbolicRun):
        def _advance(self, state, node, value):
            if state.rank in found.rep and not isinstance(value, Mirrored):
                computed[str(node.op)] += 1
            super()._advance(state, node, value)

    logical = LogicalTerms.build(plan.logical, dims, found.blocks)
    run = Watched(plan, dims, logical, claims, found)
    run.run()
    assert sorted(found.rep) == [1, 2, 3] and not computed      # (the loss too: its ones_like mirrored)
    # the all-reduce of every block's contribution is the gradient's own atoms, not a sum of dp renamings
    reduced = [ob for ob in run.obligations if ob.op == "all_reduce" and ob.claim.logical in logical.contributions]
    assert len(reduced) == 22
    for lhs, rhs in (run.formulas[ob.key] for ob in reduced):     # (one formula per key: any layer's)
        assert lhs == rhs and all(t.kind in (Kind.VAR, Kind.CONST) for t in lhs)


def test_a_computed_part_among_mirrored_contributions_ends_the_symmetry(dp4):
    plan, dims, claims = dp4
    found = mirrors(plan, dims)
    run = SymbolicRun(plan, dims, LogicalTerms.build(plan.logical, dims, found.blocks), claims, found)
    node = plan.programs["main"].value("mm_15")                 # a weight gradient's part over dp
    shape = claims[0, "mm_15"].shape
    parts = {0: atoms("part", shape), 1: Mirrored(shape), 2: atoms("other", shape), 3: Mirrored(shape)}
    with pytest.raises(Asymmetric) as err:
        for rank, value in parts.items():
            run._cut(run.ranks[rank], node, value, run._claim(rank, "mm_15"))
    assert str(err.value) == ("stage g0,1,2,3/mm_15: a contribution sum across the dp blocks whose parts are not "
                              "block 0's renamed (rank 2: computed)")


def test_a_mirrored_plan_is_proved(dp4):
    plan = dp4[0]
    outcome = verify_plan(plan, budget=Budget(solvers=("z3",)), executor=LocalExecutor(jobs=1), progress=False)
    assert outcome.status == "proved" and outcome.partition.mirrored > 2000


def test_a_rank_with_its_own_program_runs_in_full_and_its_bug_is_found(dp4):
    plan, dims, claims = dp4
    old = plan.programs["main"].value("mul_17")
    graph = edit(plan.programs["main"], "main_r3", change={"mul_17": _set_attrs(old, other=0.5)})
    mutant = with_program(plan, "main_r3", graph, overrides=[3])
    found = mirrors(mutant, dims)
    assert sorted(found.rep) == [1, 2]
    assert found.notes == ["rank 3 runs in full: its program differs from dp rank 0's"]
    outcome = verify_plan(mutant, budget=Budget(solvers=("z3",)), executor=LocalExecutor(jobs=1), progress=False)
    first = outcome.first_refuted()
    assert outcome.status == "refuted" and first.ranks == (3,) and first.tensor == "mul_17"


def test_replicas_whose_outputs_differ_in_a_concrete_run_are_not_mirrored(dp4):
    """A gradient's all-reduce over dp dropped on every rank: the ranks still run one program, but each replica
    updates the weight with its own gradient. Generation with the mirrors stepped the whole program to find that
    (twice, then every rank in full: deepseek-tiny dp=4,ep=2 took 14 s in generation for 2.7 s correct); the
    concrete runs show it first."""
    plan, dims, claims = dp4
    program = plan.programs["main"]
    reduced = next(n for n in program.nodes if n.op.value == "all_reduce" and n.attr["axes"] == ("dp",)
                   and n.get_meta("phase") == "bwd" and len(n.shape) == 2)        # a weight's gradient
    dropped = _like(reduced, reduced.name, "clone", reduced.args)
    mutant = with_program(plan, "main", edit(program, "main", change={reduced.name: dropped}))
    derivation = derive_claims(mutant)
    assert derivation.mirrors is None and derivation.complete
    (note,) = derivation.notes
    assert re.fullmatch(r"symmetry: rank [123] \(dp=[123]\) output \S+ differs from its representative rank 0's "
                        r"by \S+ in a concrete run; every rank run in full", note), note
    assert derive_claims(plan).mirrors is not None


def test_a_program_reading_its_dp_coordinate_is_not_mirrored(dp4):
    plan, dims, claims = dp4
    program = plan.programs["main"]
    chunk = Node.make("chunk_probe", "local_chunk", [program.inputs[0].name], {"dim": 0, "axes": ["dp"]},
                      program.inputs[0].shape, program.inputs[0].dtype)
    graph = replace(program, nodes=(chunk,) + program.nodes)
    with pytest.raises(Asymmetric) as err:
        mirrors(with_program(plan, "main", graph), dims)
    assert str(err.value) == "program main op chunk_probe = local_chunk reads the dp coordinate"


@pytest.fixture(scope="module")
def dp4_unstated(dp4):
    """The dp=4 plan without its intermediate lineage: its interior claims are matched by value."""
    plan, dims, _ = dp4
    plan = replace(plan, interior=())
    return plan, dims, claims_for(plan, dims)[1]


def test_only_the_ranks_that_run_their_own_program_are_matched_by_value(dp4_unstated):
    plan, dims, every = dp4_unstated
    found = mirrors(plan, dims)
    runs, claims = claims_for(plan, dims, 0, unmirrored(plan, found))
    inferred = lambda c: not (c.boundary or c.given)     # noqa: E731
    assert sum(inferred(c) for (rank, _), c in every.items() if rank in found.rep) > 1000
    assert not any(inferred(c) for (rank, _), c in claims.items() if rank in found.rep and not c.partial)
    assert sum(inferred(c) for (rank, _), c in claims.items() if rank == 0) > 300
    assert {k: c for k, c in every.items() if k[0] not in found.rep} == \
        {k: c for k, c in claims.items() if k[0] not in found.rep}


def test_symmetry_failing_mid_run_makes_the_mirrored_ranks_claims_and_runs_every_rank(dp4_unstated, monkeypatch):
    """The mirrored ranks have no claims of their own; when symmetry fails during generation the derivation
    makes them (from the same concrete runs) and every rank runs in full, cut as if unmirrored from the start."""
    plan, dims, every = dp4_unstated
    real = generate._run

    def breaks_symmetry(plan_, dims_, claims, renamings, *rest):
        if renamings.mirrors is not None:
            raise Asymmetric("rank 1 h mixes mirrored and computed values", rank=1, node="h")
        return real(plan_, dims_, claims, renamings, *rest)

    monkeypatch.setattr(generate, "_run", breaks_symmetry)
    derivation = derive(plan, Settings())
    assert derivation.claims == every
    assert "symmetry: rank 1 h mixes mirrored and computed values; every rank run in full" in \
        derivation.partition.symmetry
    full = partition(plan, dims, every, symmetry=False)
    assert sorted((o.id, o.ranks, o.claim, o.reads) for o in derivation.partition.obligations) == \
        sorted((o.id, o.ranks, o.claim, o.reads) for o in full.obligations)
