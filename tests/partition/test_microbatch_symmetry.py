"""Microbatch symmetry: inside a rank, microbatch k's stages are microbatch 0's renamed — never computed — and
a bug in any microbatch is still found where it is."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from tv_ray.engine.driver import verify_plan
from tv_ray.engine.executor import LocalExecutor
from tv_ray.engine.solve import Budget
from tv_ray.partition.generate import partition
from tv_ray.partition.symmetry import Blocks, Moves, microbatch_moves
from tv_ray.partition.ids import Part, StageId
from tv_ray.terms import var
from tv_ray.terms.atom import Atom

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))
from mutants import _like, edit, with_program  # noqa: E402


@pytest.fixture(scope="module")
def mb4(claimed):
    return claimed("mb=4")


def _verify(plan):
    return verify_plan(plan, budget=Budget(solvers=("z3",)), executor=LocalExecutor(jobs=1), progress=False)


def test_moved_microbatches_give_the_same_stages_as_computing_them(mb4):
    plan, dims, claims = mb4
    full, moved = partition(plan, dims, claims, symmetry=False), partition(plan, dims, claims)
    assert full.moved == full.accumulated == 0 and moved.moved > 1000 and moved.accumulated >= 20
    assert sorted((o.id, o.ranks, o.claim, o.reads, o.mb) for o in full.obligations) == \
        sorted((o.id, o.ranks, o.claim, o.reads, o.mb) for o in moved.every())
    assert moved.copies > len(moved.obligations)          # most moved stages kept as microbatch 0's, renamed
    assert len(moved.formulas) == len(full.formulas)


def test_a_partial_cuts_parts_swap_with_their_own_microbatchs_and_no_other():
    blocks = Blocks({"x": None}, size=1, count=4, small={})
    moves = Moves(blocks)
    mm0, mm1, mm2, mm3 = (StageId.group((0,), f"mm@{k}") for k in range(4))
    assert moves.pair(2, mm0, mm2) and moves.pair(2, mm0, mm2)
    assert not moves.pair(2, mm0, StageId.group((0,), "mm_copy@2"))   # one cut of microbatch 0 pairs with one of 2
    assert not moves.pair(2, StageId.group((0,), "other@0"), mm2)
    assert moves.pair(3, mm0, mm3)                # each microbatch has its own pairs
    terms = np.array([var(Atom(Part(mm0, 0), (0,))), var(Atom(Part(mm2, 1), (0,))), var(Atom(Part(mm1, 0), (0,)))],
                     dtype=object)
    assert [str(t.payload) for t in moves.rename(terms, 2)] == ["r0/mm@2#0[0]", "r0/mm@0#1[0]", "r0/mm@1#0[0]"]
    assert [str(t.payload) for t in moves.rename(terms, 3)] == ["r0/mm@3#0[0]", "r0/mm@2#1[0]", "r0/mm@1#0[0]"]


def _doubled_input(plan, name: str):
    program = plan.programs["main"]
    mm = program.value(name)
    doubled = _like(mm, f"{name}_in", "mul", [mm.args[0]], {"other": 2.0}, shape=program.value(mm.args[0]).shape)
    return [doubled, _like(mm, name, "mm", [f"{name}_in", mm.args[1]])]


def test_a_bug_in_one_microbatch_is_found_in_that_microbatch(mb4):
    plan = mb4[0]
    mutant = with_program(plan, "main", edit(plan.programs["main"], "main", change={"mm_3@2": _doubled_input(plan, "mm_3@2")}))
    outcome = _verify(mutant)
    first = outcome.first_refuted()
    assert outcome.status == "refuted" and outcome.partition.moved > 1000
    assert (str(first.id), first.mb, first.module) == ("r0/mm_3@2", 2, "layers.0.attn.o_proj")


def test_a_bug_in_every_microbatch_is_found_at_microbatch_0_and_in_every_moved_copy(mb4):
    plan = mb4[0]
    change = {f"mm_3@{m}": _doubled_input(plan, f"mm_3@{m}") for m in range(4)}
    mutant = with_program(plan, "main", edit(plan.programs["main"], "main", change=change))
    outcome = _verify(mutant)
    first = outcome.first_refuted()
    assert outcome.status == "refuted" and (str(first.id), first.mb) == ("r0/mm_3@0", 0)
    refuted = {str(o.id) for o in outcome.partition.every() if outcome.verdict_of(o).verdict == "refuted"}
    assert {"r0/mm_3@1", "r0/mm_3@2", "r0/mm_3@3"} <= refuted


def test_a_microbatch_reading_another_microbatchs_activation_is_found(mb4):
    plan = mb4[0]
    program = plan.programs["main"]
    mm = program.value("mm_3@2")
    crossed = _like(mm, "mm_3@2", "mm", ["view_11@0", mm.args[1]])      # microbatch 0's input, not 2's
    outcome = _verify(with_program(plan, "main", edit(program, "main", change={"mm_3@2": crossed})))
    first = outcome.first_refuted()
    assert outcome.status == "refuted" and (str(first.id), first.mb) == ("r0/mm_3@2", 2)


def test_gradient_accumulation_is_proved_as_microbatch_0s_contribution(mb4):
    plan, dims, claims = mb4
    moved = partition(plan, dims, claims)
    stage = next(o for o in moved.obligations if str(o.id) == "r0/t_22~3")      # layers.1.mlp.down_proj's gradient
    lhs, rhs = moved.formulas[stage.key]
    assert moved.accumulated >= 20 and microbatch_moves(plan, dims, None, True).footprint(lhs + rhs) == ({0}, False)


def _accumulation_edited(plan, change):
    program = plan.programs["main"]
    return with_program(plan, "main", edit(program, "main", change={
        name: _like(program.value(name), name, "add", args) for name, args in change.items()}))


def test_an_accumulation_that_adds_one_microbatch_twice_and_drops_the_last_is_refuted(mb4):
    outcome = _verify(_accumulation_edited(mb4[0], {"t_22~3": ["t_22~2", "t_22@2"]}))
    first = outcome.first_refuted()
    assert outcome.status == "refuted" and outcome.partition.accumulated >= 20
    assert (str(first.id), first.module, first.phase) == ("r0/t_22~3", "layers.1.mlp.down_proj", "bwd")


def test_a_wrong_contribution_in_every_microbatch_is_refuted_at_the_accumulated_gradient(mb4):
    plan = mb4[0]
    program = plan.programs["main"]
    change = {}
    for m in range(4):
        t = program.value(f"t_22@{m}")
        change[f"t_22@{m}"] = [_like(t, f"t_22@{m}_", t.op.value, t.args, t.attr),
                               _like(t, f"t_22@{m}", "mul", [f"t_22@{m}_"], {"other": 2.0})]
    outcome = _verify(with_program(plan, "main", edit(program, "main", change=change)))
    first = outcome.first_refuted()
    assert outcome.status == "refuted" and outcome.partition.accumulated >= 20
    assert (str(first.id), first.module) == ("r0/t_22~3", "layers.1.mlp.down_proj")
