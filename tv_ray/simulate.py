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
from dataclasses import dataclass, field

import numpy as np

from tv_ray.errors import PlanError, SimulationError, TvRayError
from tv_ray.execute import Scheduler
from tv_ray.ir import Graph, TensorSpec
from tv_ray.plan import Plan
from tv_ray.semantics import run_graph
from tv_ray.semantics.table import numpy_dtype

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
    for spec in logical.inputs:         # drawn last, so that no other input's values move
        if spec.ignore is not None:
            values[spec.name] = masked(values[spec.name], spec.ignore, rng)
    return values


def masked(values: np.ndarray, ignore: int, rng: np.random.Generator) -> np.ndarray:
    """`values` with elements set to `ignore` at random — targets the loss ignores (padding) —, row (sample) r of
    R with a chance growing as 0.75·r/R, so that samples, and so microbatches, count different numbers of
    tokens."""
    rows = values.shape[:-1]
    chance = np.linspace(0, 0.75, int(np.prod(rows)), endpoint=False).reshape(rows + (1,)) if rows else 0.25
    return np.where(rng.random(values.shape) < chance, ignore, values).astype(values.dtype)


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


def rank_inputs(plan: Plan, logical_values: dict[str, np.ndarray]) -> list[dict[str, np.ndarray]]:
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
def max_abs_deviation(physical: np.ndarray, logical: np.ndarray) -> float:
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
                                      f"{expected.shape}", rank=rank)
            dev = max_abs_deviation(physical, expected)
            if dev > result.deviation.get(entry.logical, -1.0):
                result.deviation[entry.logical] = dev
                result.worst_rank[entry.logical] = rank


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
    inputs = rank_inputs(plan, logical_inputs)
    del logical_inputs
    outputs = Scheduler(plan, run_dims, inputs).run()
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
            raise PlanError(f"dims.{name}: not a dimension of the plan ({', '.join(run)})", path=f"dims.{name}")
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
