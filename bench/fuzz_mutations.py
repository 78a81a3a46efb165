"""Random single mutations of correct plans through the verifier: refuted wherever `tv-ray run` deviates, proved
wherever the mutation is neutral, and never proved where `tv-ray run` deviates (issue 19's "no unsound proof").

    python bench/fuzz_mutations.py [--mutations 1000] [--seed 0] [--out bench/results/fuzz.json]
    python bench/fuzz_mutations.py --merge a.json b.json --out bench/results/fuzz_long.json   # runs side by side

The plans are small correct ones the planner builds (`BASES`: tensor, sequence, data parallelism and ZeRO; a
pipeline; context parallelism; expert parallelism). Each mutation changes one thing in one program (every rank
running it): a collective dropped (its input read instead), applied twice, over another group of the mesh, or with
another reduce op; a constant of an op scaled or shifted; two sends' tags swapped (each recv gets the other's
data); an op of one microbatch reading another microbatch's tensor; a shard taken over another axis of the same
degree (ZeRO's and the sharding rules' `local_chunk` offsets). A mutation the plan checker rejects (a shape or a
collective that no longer matches) is counted as malformed and drawn again. Each well-formed one is run by the
simulator on three seeds (`deviates`: some output off by more than 1e-9) and verified on the local engine.

Outcomes: `refuted` where it deviates (right), `proved` where it does not (right: the mutation is neutral),
`UNSOUND` — proved while the runs deviate —, `missed` (unknown while the runs deviate), and the two a person
looks at: refuted while the runs agree (an effect below the tolerance, or a false alarm) and unknown while they
agree; and ERROR, the verifier crashed (a bug of ours, the row names where). Rows go to `--out` every ten mutations
and at the end, each with the commit it measures (`tree`); the exit code is 1 on any UNSOUND or ERROR row.
"""
from __future__ import annotations

import argparse
import collections
import itertools
import json
import random
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.engine.bugs import changed, correct, inserted_after  # noqa: E402
from tests.engine.mutants import _like, _set_args, _set_attrs  # noqa: E402
from tv_ray import api  # noqa: E402
from tv_ray.errors import TvRayError  # noqa: E402
from tv_ray.ir import Op  # noqa: E402
from tv_ray.plan import Plan  # noqa: E402
from tv_ray.plan_check import check_plan  # noqa: E402
from tv_ray.simulate import simulate  # noqa: E402

BASES = {
    "llama3-tiny dp=2,tp=2,mb=2 sp ZeRO-1 adamw clip": ("llama3-tiny", "dp=2,tp=2,mb=2", "adamw", 1.0,
                                                       {"sp": True, "zero": 1}),
    "gpt2-tiny dp=2,pp=2,mb=2 sgd": ("gpt2-tiny", "dp=2,pp=2,mb=2", "sgd", None, {}),
    "llama3-tiny dp=2,cp=2 ZeRO-2 adamw": ("llama3-tiny", "dp=2,cp=2", "adamw", None, {"zero": 2}),
    "deepseek-tiny dp=4,ep=2 sgd": ("deepseek-tiny", "dp=4,ep=2", "sgd", None, {}),
}
REDUCING = (Op.ALL_REDUCE, Op.REDUCE_SCATTER)
SEEDS = (0, 1, 2)
TIMEOUT = 3.0           # seconds per solver query: tiny plans prove in well under it


class Mutation:
    """A drawn change: `plan` the mutated plan, `what` one line saying what changed where."""

    def __init__(self, plan: Plan, what: str, kind: str):
        self.plan, self.what, self.kind = plan, what, kind


def _program(rng: random.Random, plan: Plan) -> str:
    return rng.choice(sorted(plan.programs))


def dropped(rng, plan, program):
    """A collective that reduces dropped: its readers read its input."""
    node = rng.choice([n for n in plan.programs[program].nodes if n.op == Op.ALL_REDUCE])
    return changed(plan, _like(node, node.name, "clone", node.args), program=program), f"{node.name} dropped"


def twice(rng, plan, program):
    node = rng.choice([n for n in plan.programs[program].nodes if n.op == Op.ALL_REDUCE])
    again = _like(node, f"{node.name}.again", "all_reduce", [node.name], dict(node.attrs))
    return inserted_after(plan, node, again, program), f"{node.name} applied twice"


def regrouped(rng, plan, program):
    node = rng.choice([n for n in plan.programs[program].nodes if n.op in REDUCING + (Op.ALL_GATHER,)])
    axes = [a for a, n in plan.mesh if n > 1]
    groups = [g for size in range(1, len(axes) + 1) for g in itertools.combinations(axes, size)
              if set(g) != set(node.attr["axes"])]
    group = rng.choice(groups)
    return changed(plan, _set_attrs(node, axes=tuple(group)), program=program), \
        f"{node.name} over {'×'.join(group)} instead of {'×'.join(node.attr['axes'])}"


def reduce_op(rng, plan, program):
    node = rng.choice([n for n in plan.programs[program].nodes if n.op in REDUCING])
    other = rng.choice([r for r in ("sum", "avg", "max") if r != node.attr["reduce"]])
    return changed(plan, _set_attrs(node, reduce=other), program=program), \
        f"{node.name} reduces with {other} instead of {node.attr['reduce']}"


def constant(rng, plan, program):
    node = rng.choice([n for n in plan.programs[program].nodes if isinstance(n.attr.get("other"), float)
                       and n.op != Op.FULL_LIKE])
    old = node.attr["other"]
    new = rng.choice([old * 2, old / 2, old + 1e-3, -old if old else 1.0])
    return changed(plan, _set_attrs(node, other=new), program=program), \
        f"{node.name} ({node.op}) other {old:g} -> {new:g}"


def tags_swapped(rng, plan, program):
    sends = [n for n in plan.programs[program].nodes if n.op == Op.SEND]
    pairs = [(a, b) for i, a in enumerate(sends) for b in sends[i + 1:]
             if a.shape == b.shape and dict(a.attr["peer"]) == dict(b.attr["peer"]) and a.attr["tag"] != b.attr["tag"]]
    a, b = rng.choice(pairs)
    return changed(plan, _set_attrs(a, tag=b.attr["tag"]), _set_attrs(b, tag=a.attr["tag"]), program=program), \
        f"sends {a.name} and {b.name} swap tags"


def other_microbatch(rng, plan, program):
    graph = plan.programs[program]
    names = {n.name: n for n in graph.nodes}
    choices = []
    for node in graph.nodes:
        for i, arg in enumerate(node.args):
            stem, _, mb = arg.rpartition("@")
            if stem and mb.isdigit() and arg in names:
                for other in (f"{stem}@{k}" for k in range(plan.microbatches) if str(k) != mb):
                    if other in names and names[other].shape == names[arg].shape and \
                            graph.nodes.index(names[other]) < graph.nodes.index(node):
                        choices.append((node, i, other))
    node, i, other = rng.choice(choices)
    args = list(node.args)
    old, args[i] = args[i], other
    return changed(plan, _set_args(node, *args), program=program), f"{node.name} reads {other} instead of {old}"


def shard_axis(rng, plan, program):
    sizes = dict(plan.mesh)
    chunks = [n for n in plan.programs[program].nodes if n.op == Op.LOCAL_CHUNK and len(n.attr["axes"]) == 1
              and any(a != n.attr["axes"][0] and s == sizes[n.attr["axes"][0]] for a, s in sizes.items())]
    node = rng.choice(chunks)
    (axis,) = node.attr["axes"]
    other = rng.choice([a for a, s in sizes.items() if a != axis and s == sizes[axis]])
    return changed(plan, _set_attrs(node, axes=(other,)), program=program), \
        f"{node.name} takes its {other} shard, not {axis}"


KINDS = {"dropped": dropped, "twice": twice, "group": regrouped, "reduce_op": reduce_op, "constant": constant,
         "tags": tags_swapped, "microbatch": other_microbatch, "shard": shard_axis}


def draw(rng: random.Random, plan: Plan) -> Mutation | None:
    kind = rng.choice(sorted(KINDS))
    program = _program(rng, plan)
    try:
        mutated, what = KINDS[kind](rng, plan, program)
    except (IndexError, ValueError):         # nothing of that kind in the program drawn
        return None
    return Mutation(mutated, f"{program}: {what}", kind)


def _where(err: BaseException) -> str:
    frame = traceback.extract_tb(err.__traceback__)[-1]
    return f"at {Path(frame.filename).name}:{frame.lineno}"


def verdict(deviates: bool, status: str) -> str:
    if status == "ERROR":
        return "ERROR"
    return {(True, "refuted"): "refuted", (False, "proved"): "proved", (True, "proved"): "UNSOUND",
            (True, "unknown"): "missed", (False, "refuted"): "refuted, runs agree",
            (False, "unknown"): "unknown, runs agree"}[deviates, status]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mutations", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "fuzz.json"))
    parser.add_argument("--merge", nargs="+", metavar="FUZZ_JSON",
                        help="no run: the rows of these results (runs with other seeds, side by side) into --out")
    args = parser.parse_args(argv)
    if args.merge:
        parts = [json.loads(Path(path).read_text()) for path in args.merge]
        args.seed = [part["summary"]["seed"] for part in parts]
        malformed = sum((collections.Counter(part["summary"]["malformed_redrawn"]) for part in parts),
                        collections.Counter())
        total = write(args, [row for part in parts for row in part["rows"]], malformed,
                      sum(part["summary"]["seconds"] for part in parts))
        print(json.dumps(total))
        return 0
    rng = random.Random(args.seed)
    tree = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True).stdout.strip() or "unknown"       # the commit the rows measure
    bases = {name: correct(model, spec, optim, clip, **flags) for name, (model, spec, optim, clip, flags)
             in BASES.items()}
    rows, malformed, started = [], collections.Counter(), time.perf_counter()
    while len(rows) < args.mutations:
        base = rng.choice(sorted(bases))
        mutation = draw(rng, bases[base])
        if mutation is None:
            continue
        try:
            check_plan(mutation.plan)
            deviates = any(simulate(mutation.plan, seed=s).deviating(1e-9) for s in SEEDS)
        except TvRayError:
            malformed[mutation.kind] += 1
            continue
        start = time.perf_counter()
        try:
            result = api.verify(mutation.plan, engine="local", progress=False, timeout=TIMEOUT)
            status, headline = result.status, result.report.get("headline", "")
        except Exception as err:      # noqa: BLE001 — a crash is a finding: the row says where
            status, headline = "ERROR", f"{type(err).__name__}: {err}"[:300] + " " + _where(err)
        rows.append({"tree": tree, "base": base, "kind": mutation.kind, "what": mutation.what, "deviates": deviates,
                     "status": status, "verdict": verdict(deviates, status),
                     "seconds": round(time.perf_counter() - start, 2), "headline": headline[:400]})
        print(json.dumps({k: rows[-1][k] for k in ("base", "what", "verdict", "seconds")}), flush=True)
        if len(rows) % 10 == 0 or len(rows) == args.mutations:
            write(args, rows, malformed, time.perf_counter() - started)
    total = write(args, rows, malformed, time.perf_counter() - started)
    print(json.dumps(total))
    return 1 if total["verdicts"].get("UNSOUND") or total["verdicts"].get("ERROR") else 0


def write(args, rows: list[dict], malformed: collections.Counter, seconds: float) -> dict:
    refuted = [r["seconds"] for r in rows if r["status"] == "refuted"]
    total = {"mutations": len(rows), "seed": args.seed, "malformed_redrawn": dict(malformed),
             "trees": dict(collections.Counter(r.get("tree", "unknown") for r in rows)),
             "verdicts": dict(collections.Counter(r["verdict"] for r in rows)),
             "by_kind": {k: dict(collections.Counter(r["verdict"] for r in rows if r["kind"] == k)) for k in KINDS},
             "refutation_s": {"median": statistics.median(refuted), "p90": sorted(refuted)[int(0.9 * len(refuted))],
                              "max": max(refuted)} if refuted else None,
             "seconds": round(seconds, 1)}
    Path(args.out).write_text(json.dumps({"summary": total, "rows": rows}, indent=1) + "\n")
    return total


if __name__ == "__main__":
    sys.exit(main())
