"""Stage generation at scale, today's generator against one without a renaming, side by side in one run.

    python bench/scale.py [--configs "llama3-8b:32:dp=4,tp=8,pp=4,mb=8:512;..." | --sweep layers|tp|pp|dp|mb|frontier|moe]
                          [--out bench/results/scale.json]
                          [--modes templates,baseline|stepped|evaluated|before|workers2|costs]
                          [--before DIR] [--plot bench/results/scale.png]

A config is MODEL:LAYERS:SPEC:BATCH[:ZERO] (LAYERS overrides the model's depth: the sweeps over 4, 8, 16, 32
layers; ZERO the ZeRO stage, 0 by default).
Each (config, mode) runs in its own child process (their peaks do not add up; the cyclic collector off, as in the
`tv-ray` command): capture and plan, the claims, then the stages (`partition`, one process, whole: `--shards
off`), AdamW and clipping on. Per row: wall seconds
per phase, peak RSS, stages (obligations), stages keyed by template without being built, unique keys, and
a digest of the stages (id, ranks, reads, claim, key) that must be the same in every mode, and one without the
keys (`stages_digest`: the same stages, whatever formula each was keyed by). `templates` is today's
generator (stage templates, mirrored dp ranks stood in for); `baseline` is `templates=False`: every stage's
formula built, as before templates; `stepped` steps every mirrored rank (`virtual=False`), as before stand-ins;
`evaluated` evaluates every op of microbatches k > 0 (`renamed=False`: none taken as its microbatch 0
counterpart's renamed, `tv_ray.partition.microbatches`); `before` runs today's settings on the tv_ray of an
earlier checkout (`--before DIR`: the same stages, the keys may differ where a formula changed); `workers2` runs
the stages as pipeline shards in two worker processes (`partition(shards=True)`, the local executor): 1 against 2
workers, the same stages and keys; `costs` is today's generator with every op it computes timed (`op_costs`: what
each kind of op costs — microbatch 0 or k, a pipeline stage's first layer, a later one or none, taken as its
counterpart's renamed or stepped —, the timer's own cost included, so its seconds are not compared).
The first mode is compared with each other one (`side_by_side`).
"""
from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import re
import resource
import subprocess
import sys
import time
from pathlib import Path

BASE = {"dp": 4, "tp": 8, "pp": 4, "mb": 8}       # the sweeps' centre: llama3-8b, 8 layers, batch 32
SWEEPS = {"layers": (4, 8, 16, 32), "tp": (1, 2, 4, 8), "pp": (1, 2, 4), "dp": (1, 2, 4, 8), "mb": (1, 2, 4, 8)}


# TrainVerify's configurations (AdamW, clip 1.0): the targets of issue 16
FRONTIER = ("llama3-8b:32:dp=512:512;llama3-8b:32:dp=16,tp=8,pp=4,mb=32:512;"
            "llama3-70b:80:dp=16,tp=8,pp=4,mb=32:512;llama3-405b:126:dp=64,tp=8,pp=16,mb=16:2048")


# TrainVerify's DeepSeek configurations (issue 18): 16B and 236B as TrainVerify ran them, 671B with ep = 8
MOE = ("deepseek-v2-lite-16b:27:dp=16,tp=4,pp=2,mb=16:256;deepseek-v2-236b:60:dp=16,tp=8,pp=4,mb=16:256;"
       "deepseek-v3-671b:61:dp=32,tp=8,pp=8,mb=16,ep=8:512")


def sweep(name: str) -> str:
    """The configs of one sweep around `BASE` (every other degree held), `FRONTIER` or `MOE`."""
    if name == "frontier":
        return FRONTIER
    if name == "moe":
        return MOE
    def config(layers: int, degrees: dict) -> str:
        spec = ",".join(f"{k}={v}" for k, v in degrees.items())
        return f"llama3-8b:{layers}:{spec}:{degrees['dp'] * degrees['mb']}"   # a sample per microbatch and dp rank
    if name == "layers":
        return ";".join(config(n, BASE) for n in SWEEPS["layers"])
    return ";".join(config(8, {**BASE, name: n}) for n in SWEEPS[name])


DEFAULT = sweep("layers")


MODES = {"templates": {"templates": True, "virtual": True}, "baseline": {"templates": False, "virtual": True},
         "stepped": {"templates": True, "virtual": False}, "workers2": {"templates": True, "virtual": True},
         "evaluated": {"templates": True, "virtual": True, "renamed": False},
         "costs": {"templates": True, "virtual": True}}
WORKERS = {"workers2": 2}      # modes whose stages run as pipeline shards in that many worker processes


def measure(model: str, layers: int, spec: str, batch: int, mode: str, zero: int = 0) -> dict:
    import tv_ray
    from tv_ray.models import get
    from tv_ray.engine.executor import LocalExecutor
    from tv_ray.partition import derive
    from tv_ray.partition.generate import ops_of, partition
    from tv_ray.partition.symmetry import find_mirrors
    from tv_ray.reduce import reduce_plan
    started = time.perf_counter()
    base = get(model)
    model_spec = base.with_dims({**base.dims, "batch": batch}, layers=layers)
    plan = tv_ray.parallelize(tv_ray.capture_step(model_spec, optim="adamw", clip=1.0), spec, model=model_spec,
                              zero=zero)
    planned = time.perf_counter()
    dims = reduce_plan(plan).reduced
    found, notes = find_mirrors(plan, dims, True)
    if hasattr(derive, "derived_claims"):
        claims = derive.derived_claims(plan, dims, found)[1]
    else:           # a tree before microbatch k's claims were offered microbatch 0's
        claims = derive.claims_for(plan, dims, 0, derive.unmirrored(plan, found))[1]
    claimed = time.perf_counter()
    workers = WORKERS.get(mode)
    pool = LocalExecutor(workers) if workers else None
    costs = op_costs(plan) if mode == "costs" else None
    part = partition(plan, dims, claims, found or not notes, shards=bool(workers), **MODES[mode],
                     generate=pool.map if pool else None, groups=workers or 1)
    done = time.perf_counter()
    if pool:
        pool.close()
    return {"model": model, "layers": layers, "parallel": spec, "batch": batch, "zero": zero, "ranks": plan.num_ranks,
            "templates": MODES[mode]["templates"], "mode": mode, "ops": ops_of(plan, range(plan.num_ranks)),
            "stages": part.size, "recorded": len(part.obligations), "templated": part.templated,
            "stood_in": part.stood_in, "unique": len(part.formulas),
            "seconds": {"plan": round(planned - started, 1), "claims": round(claimed - planned, 1),
                        "stages": round(done - claimed, 1)},
            "peak_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20, 2),
            "worker_peak_rss_gib": round(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2 ** 20, 2),
            "workers": workers or 1, "shards": part.shards,
            **({"op_costs": costs()} if costs else {}), **digests(part)}


def op_costs(plan):
    """Time every op the symbolic run computes (`SymbolicRun._compute`: all but communication), by kind — its
    microbatch (0, or k > 0), where it lies (its pipeline stage's first layer, a later layer, outside the layers),
    how it went (`renamed`: taken as its microbatch 0 counterpart's renamed, `in segments`: so, with the ops after
    it in its run segment at once — `Renamed._renamed_run`; else stepped) — and return what
    gives the table: per kind, ops, seconds, microseconds an op and share of the timed seconds."""
    from tv_ray.partition import microbatches, stages
    in_layer = re.compile(r"^layers\.(\d+)(\.|$)")     # a layer's own ops (`layers.N`: its residual adds) too

    def layer(node) -> int | None:
        found = in_layer.match(node.get_meta("module") or "")
        return int(found.group(1)) if found else None
    places = {}         # (program, op) -> its microbatch and where it lies
    for name, program in plan.programs.items():
        first = min((n for n in map(layer, program.nodes) if n is not None), default=None)
        for node in program.nodes:
            at = layer(node)
            places[name, node.name] = (f"microbatch {'0' if node.get_meta('mb') in (0, None) else 'k'}",
                                       "outside layers" if at is None else
                                       "first layer" if at == first else "later layers")
    seconds, ops, renamed, segment = {}, {}, [False], [0]
    compute, take = stages.SymbolicRun._compute, microbatches.Renamed._renamed
    take_segment = microbatches.Renamed._take_segment

    def taken(self, state, node):
        renamed[0] = take(self, state, node)
        return renamed[0]

    def segmented(self, state, run, *rest):
        segment[0] = len(run.nodes)
        return take_segment(self, state, run, *rest)

    def timed(self, state, node):
        renamed[0], segment[0] = False, 0
        start = time.perf_counter()
        done = compute(self, state, node)
        spent = time.perf_counter() - start
        kind = places[state.name, node.name] + ("in segments" if segment[0] else
                                                "renamed" if renamed[0] else "stepped",)
        seconds[kind] = seconds.get(kind, 0.0) + spent
        ops[kind] = ops.get(kind, 0) + (segment[0] or 1)
        return done
    stages.SymbolicRun._compute, microbatches.Renamed._renamed = timed, taken
    microbatches.Renamed._take_segment = segmented

    def table() -> list[dict]:
        total = sum(seconds.values())
        return [{"kind": " / ".join(kind), "ops": ops[kind], "seconds": round(spent, 2),
                 "us_per_op": round(1e6 * spent / ops[kind], 1), "share": round(spent / total, 3)}
                for kind, spent in sorted(seconds.items(), key=lambda kv: -kv[1])]
    return table


EXPAND_LIMIT = 2_000_000      # stages from which the digests hash the recorded stages and the instantiation map


def digests(part) -> dict:
    """`digest` (stages with keys), `stages_digest` (without them) and `copies_digest`. Up to `EXPAND_LIMIT`
    stages, the first two cover every stage expanded (id, ranks, reads as a set, claim), so a mode that steps the mirrored
    ranks or runs pipeline shards compares equal, and there is no third; past it, they cover the recorded stages
    (sorted by id) and the count of the others, and `copies_digest` those as (rank, its stage's place in that
    order, microbatch: the instantiation map) — expanding tens of millions of them in Python would take longer
    than generating them. That map is one generation order's: a mirrored stage of a group spanning dp blocks is the
    same stage from either block, so pipeline shards may point it elsewhere; it is compared between whole runs."""
    keyed, bare = hashlib.sha256(), hashlib.sha256()
    compact = part.size > EXPAND_LIMIT
    stages = list(part.obligations if compact else part.every())
    order = sorted(range(len(stages)), key=lambda i: str(stages[i].id))
    for o in (stages[i] for i in order):
        line = f"{o.id}|{o.ranks}|{sorted(str(r) for r in o.reads)}|{o.claim}"
        bare.update(f"{line}\n".encode())
        keyed.update(f"{line}|{o.key}\n".encode())
    out = {}
    if compact:
        import numpy as np
        place = np.empty(len(stages), dtype=np.int64)
        place[order] = np.arange(len(stages))
        # every stage of the map, whichever way a tree holds it (before /7: no fans; before /5: no microbatches)
        ranks, of, mbs = part.flat_copies() if hasattr(part, "flat_copies") else \
            (part.copy_ranks, part.copy_of, getattr(part, "copy_mb", np.zeros(len(part.copy_of), dtype=np.int64)))
        ranks, of, mbs = ranks.astype(np.int64), place[of], mbs.astype(np.int64)
        order = np.lexsort((mbs, ranks, of))
        out["copies_digest"] = hashlib.sha256(np.stack([ranks[order], of[order], mbs[order]]).tobytes()).hexdigest()
        for h in (keyed, bare):
            h.update(f"copies {len(of)}\n".encode())
    return {"digest": keyed.hexdigest(), "stages_digest": bare.hexdigest(), **out}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--configs", default=DEFAULT)
    parser.add_argument("--sweep", choices=sorted(SWEEPS) + ["frontier", "moe"],
                        help="the configs of one sweep, or TrainVerify's (instead of --configs)")
    parser.add_argument("--modes", default="templates,baseline")
    parser.add_argument("--out", default="bench/results/scale.json")
    parser.add_argument("--plot", default="")
    parser.add_argument("--before", default="", help="a checkout of an earlier tree: mode `before` runs today's "
                                                     "settings on its tv_ray")
    parser.add_argument("--child", nargs=6, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        # the collector off, as the `tv-ray` command runs (`tv_ray.cli.entry`): `partition` pauses it, and turned
        # back on its first pass walked everything generation made (1.5 of 16.3 s at llama3-8b 32 layers) — a
        # pass the command never makes, which the stages' seconds held
        gc.disable()
        model, layers, spec, batch, mode, zero = args.child
        print(json.dumps(measure(model, int(layers), spec, int(batch), mode, int(zero))), flush=True)
        return 0
    out = Path(args.out)
    rows = json.loads(out.read_text())["rows"] if out.exists() else []
    ok = True
    for config in (sweep(args.sweep) if args.sweep else args.configs).split(";"):
        model, layers, spec, batch, *zero = config.split(":")
        got = {}
        for mode in args.modes.split(","):
            env = {**os.environ, "PYTHONPATH": args.before} if mode == "before" else None
            child = subprocess.run([sys.executable, __file__, "--child", model, layers, spec, batch,
                                    "templates" if mode == "before" else mode, zero[0] if zero else "0"],
                                   capture_output=True, text=True, env=env)
            if child.returncode:
                print(child.stderr[-3000:], file=sys.stderr)
                ok = False
                continue
            got[mode] = {**json.loads(child.stdout.strip().splitlines()[-1]), "mode": mode}
            print(json.dumps(got[mode]), flush=True)
        first, *others = args.modes.split(",")
        for other in others:
            if first in got and other in got:
                t, b = got[first], got[other]
                same = t.get("stages_digest", t["digest"]) == b.get("stages_digest", b["digest"]) and \
                    bool(t.get("shards") or b.get("shards") or t.get("copies_digest") == b.get("copies_digest"))
                ok = ok and same and (other == "before" or t["digest"] == b["digest"])
                t.setdefault("side_by_side", {})[other] = {
                    "stages_s": b["seconds"]["stages"], "same_stages": same, "same_keys": t["digest"] == b["digest"],
                    "speedup": round(b["seconds"]["stages"] / max(t["seconds"]["stages"], 1e-9), 2),
                    "unique": b["unique"], "peak_rss_gib": b["peak_rss_gib"]}
        for row in got.values():
            rows = [r for r in rows if _config(r) != _config(row)] + [row]
        out.write_text(json.dumps({"rows": rows}, indent=1) + "\n")
    if args.plot:
        plot(rows, args.plot)
    return 0 if ok else 1


def _config(row: dict) -> tuple:
    mode = row.get("mode", "templates" if row["templates"] else "baseline")
    return row["model"], row["layers"], row["parallel"], row["batch"], mode, row.get("zero", 0)


def plot(rows: list[dict], path: str) -> None:
    """Stage generation against layers (templates vs baseline) and against dp (stand-ins vs stepped)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (by_layers, by_dp) = plt.subplots(1, 2, figsize=(11, 4))
    labels = {"templates": "today", "baseline": "every stage built", "stepped": "mirrored ranks stepped"}
    for mode in ("templates", "baseline"):
        pts = sorted((r["layers"], r["seconds"]["stages"]) for r in rows
                     if _config(r)[4:] == (mode, 0) and r["parallel"] == "dp=4,tp=8,pp=4,mb=8")
        if pts:
            by_layers.plot(*zip(*pts), marker="o", label=labels[mode])
    for mode in ("templates", "stepped"):
        pts = sorted((int(r["parallel"].split(",")[0][3:]), r["seconds"]["stages"]) for r in rows
                     if _config(r)[4:] == (mode, 0) and r["layers"] == 4 and r["parallel"].endswith(",tp=8,pp=4,mb=8"))
        if pts:
            by_dp.plot(*zip(*pts), marker="o", label=labels[mode])
    by_layers.set_xlabel("layers (llama3-8b, dp=4,tp=8,pp=4,mb=8)")
    by_dp.set_xlabel("dp (llama3-8b, 4 layers, tp=8,pp=4,mb=8, a sample per dp rank and microbatch)")
    for ax in (by_layers, by_dp):
        ax.set_ylabel("stage generation (s)")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
