"""Concrete runs stacked (`tv_ray.execute.Stacked`): the claims' runs stepped once for all their points give every
rank's every value exactly as running each point alone does, over the parallelisms the planner writes."""
from __future__ import annotations

import numpy as np
import pytest

from tv_ray import api
from tv_ray.errors import SimulationError
from tv_ray.execute import Stacked
from tv_ray.ir import Op
from tv_ray.partition.claims import run_concrete, run_points, runs_for
from tv_ray.reduce import reduce_plan
from tv_ray.semantics import batched
from tv_ray.simulate import rank_inputs

PLANS = [("llama3-tiny", "dp=2,tp=2,pp=2,mb=4", {}), ("gpt2-tiny", "dp=2,tp=2,mb=2", {"sp": True}),
         ("llama3-tiny", "dp=2,tp=2,mb=2", {"zero": 3}), ("llama3-tiny", "dp=2,cp=2", {"zero": 1}),
         ("deepseek-tiny", "dp=2,ep=2,tp=2,pp=2,mb=2", {"sp": True, "zero": 1})]


def _points(plan):
    dims = reduce_plan(plan).reduced
    return dims, [run.logical for run in runs_for(plan, dims)[0]]


@pytest.mark.parametrize("model, spec, flags", PLANS, ids=[f"{m}-{s}-{f}" for m, s, f in PLANS])
def test_stacked_runs_are_the_runs_one_by_one(model, spec, flags):
    plan = api.parallelize(api.capture_step(model, optim="adamw", clip=1.0), spec, model=model, **flags)
    dims, points = _points(plan)
    assert len(points) >= 4                    # the random run, the digit runs, the clipping run
    stacked = Stacked(plan, dims, [rank_inputs(plan, p) for p in points], keep=True)
    stacked.run()                               # no op falls back to running the points one by one
    for run, point in enumerate(points):
        alone = run_concrete(plan, dims, logical=point)[0]
        assert stacked.order == alone.order
        for mine, theirs in zip(stacked.unstacked(run), alone.ranks):
            assert mine.keys() == theirs.keys()
            for name, value in theirs.items():
                got = mine[name]
                assert got.shape == value.shape and got.dtype == value.dtype, name
                assert np.array_equal(got, value, equal_nan=True), name


def test_a_stacked_form_that_mixes_the_runs_is_caught_and_the_runs_are_made_one_by_one(monkeypatch):
    """A reduction over every dim without its dims counted from the end would sum the runs together: the
    stacked result's shape gives it away, and `run_points` runs each point alone instead."""
    plan = api.parallelize(api.capture_step("llama3-tiny", optim="adamw", clip=1.0), "dp=2,tp=2", model="llama3-tiny")
    dims, points = _points(plan)
    monkeypatch.setitem(batched.LIFTED, Op.SUM, lambda a, ndim, runs: a)
    stacked = Stacked(plan, dims, [rank_inputs(plan, p) for p in points], keep=True)
    with pytest.raises(SimulationError, match=r"^rank 0 \(dp=0, tp=0\) at programs\.main\.ops\[\d+\] \(_log_softmax\.sumexp "
                       r"= sum\(_log_softmax\.exp\)\): .*: 4 runs stacked give float64 \(4, 1, 2\), not float \(4, 1\) each$"):
        stacked.run()
    runs = run_points(plan, dims, points)
    alone = run_concrete(plan, dims, logical=points[-1])[0]
    assert all(np.array_equal(runs[-1].ranks[r][n], v, equal_nan=True)
               for r, values in enumerate(alone.ranks) for n, v in values.items())


NODES = [   # (op, attributes, argument shapes, result shape): each stacked form against the runs one by one
    ("expand", {"size": [2, 3, 4]}, [(3, 1)], (2, 3, 4)),
    ("expand", {"size": [-1, 4]}, [(3, 1)], (3, 4)),
    ("addmm", {}, [(4,), (3, 2), (2, 4)], (3, 4)),
    ("add", {}, [(3, 4), (4,)], (3, 4)),
    ("where", {}, [(3, 1), (4,), (3, 4)], (3, 4)),
    ("unsqueeze", {"dim": 1}, [(3, 4)], (3, 1, 4)),
    ("unsqueeze", {"dim": 2}, [(3, 4)], (3, 4, 1)),
    ("sum", {"dims": [], "keepdim": False}, [(3, 4)], ()),
    ("sum", {"dims": [0], "keepdim": True}, [(3, 4)], (1, 4)),
    ("mean", {"dims": [1, 0], "keepdim": False}, [(3, 4)], ()),
    ("amax", {"dims": [0], "keepdim": False}, [(3, 4)], (4,)),
    ("transpose", {"dim0": 0, "dim1": 1}, [(3, 4)], (4, 3)),
    ("view", {"size": [-1]}, [(3, 4)], (12,)),
    ("slice", {"dim": 0, "start": 1, "end": 3, "step": 1}, [(3, 4)], (2, 4)),
    ("slice_backward", {"input_size": [5, 4], "dim": 0, "start": 1, "end": 4, "step": 1}, [(3, 4)], (5, 4)),
    ("squeeze", {"dim": 0}, [(1, 4)], (4,)),
    ("cat", {"dim": 0}, [(3, 4), (2, 4)], (5, 4)),
    ("_softmax", {"dim": 0}, [(3, 4)], (3, 4)),
    ("mm", {}, [(3, 2), (2, 4)], (3, 4)),
    ("bmm", {}, [(2, 3, 2), (2, 2, 4)], (2, 3, 4)),
]


@pytest.mark.parametrize("op, attrs, shapes, shape", NODES, ids=[f"{n[0]}-{n[1]}" for n in NODES])
def test_each_stacked_form_is_the_op_run_by_run(op, attrs, shapes, shape):
    from tv_ray.ir import Node
    from tv_ray.semantics import Context, eval_node
    from tv_ray.semantics.interpret import instantiated
    node = Node.make("y", op, [f"x{i}" for i in range(len(shapes))], attrs, shape=list(shape))
    at = instantiated(node, {})
    runs = np.random.default_rng(0).normal(size=(3, len(shapes), 5 * 3 * 4))
    args = [np.stack([run[i][:int(np.prod(s))].reshape(s) for run in runs]) for i, s in enumerate(shapes)]
    got = batched.batched(node, args, at.attrs, at.shape, at.concrete, Context())
    assert got is not None
    alone = np.stack([eval_node(node, [a[r] for a in args], {}, Context(), at) for r in range(3)])
    assert got.shape == alone.shape == (3, *shape) and np.array_equal(got, alone)
