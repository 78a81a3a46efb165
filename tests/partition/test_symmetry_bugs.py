"""Bugs shared by every data-parallel rank are found through the mirrored stages: the representative's
stage is refuted — for a weight gradient, the block-0 contribution it is proved against."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tv_ray import api
from tv_ray.diagnose import diagnose
from tv_ray.engine.driver import verify_plan
from tv_ray.engine.executor import LocalExecutor
from tv_ray.engine.solve import Budget

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))
from mutants import _like, edit, with_program  # noqa: E402


@pytest.fixture(scope="module")
def dp4():
    return api.parallelize(api.capture_step("llama3-tiny", optim="adamw", clip=1.0), "dp=4", model="llama3-tiny")


def _verify(plan):
    return verify_plan(plan, budget=Budget(solvers=("z3",)), executor=LocalExecutor(jobs=1), progress=False)


def test_a_doubled_weight_gradient_is_refuted_against_block_0s_contribution(dp4):
    program = dp4.programs["main"]
    mm = program.value("mm_15")                         # a weight gradient, claimed as a partial sum over dp
    doubled = _like(mm, "mm_15_in", "mul", [mm.args[0]], {"other": 2.0}, shape=program.value(mm.args[0]).shape)
    mutant = with_program(dp4, "main", edit(program, "main", change={
        "mm_15": [doubled, _like(mm, "mm_15", "mm", ["mm_15_in", mm.args[1]])]}))
    outcome = _verify(mutant)
    first = outcome.first_refuted()
    assert outcome.status == "refuted" and outcome.partition.mirrored > 2000
    assert (str(first.id), first.ranks) == ("g0,1,2,3/mm_15", (0, 1, 2, 3))
    assert mutant.logical.value("mm_15").op.value == "mm"
    assert diagnose(outcome)["stage"]["factor"].startswith("physical = 2 × logical")


def test_a_doubled_loss_on_every_dp_rank_is_refuted(dp4):
    program = dp4.programs["main"]
    loss = program.value("nll_loss_forward")           # the loss, a partial sum over dp (not a contribution sum)
    doubled = _like(loss, "loss_x2", "mul", ["nll_loss_forward"], {"other": 2.0})
    mutant = with_program(dp4, "main", edit(program, "main", after={"nll_loss_forward": [doubled]},
                                            rename_args={"nll_loss_forward": "loss_x2"}))
    outcome = _verify(mutant)
    first = outcome.first_refuted()
    assert outcome.status == "refuted" and outcome.partition.mirrored > 2000
    assert (str(first.id), first.ranks) == ("g0,1,2,3/loss_x2", (0, 1, 2, 3))
    assert diagnose(outcome)["stage"]["factor"].startswith("physical = 2 × logical")
