"""Random correct configs through the verifier: every plan the planner accepts must be proved, degrees that are
not powers of two included (issue 19's "no false alarms").

    python bench/fuzz_configs.py [--examples 30] [--seed 0] [--out bench/results/fuzz_configs.json]

hypothesis draws the model (llama3-tiny, gpt2-tiny), dp, tp and mb in 1..4, cp in 1..3, pp in 1..2 (the tiny models
have two layers), sequence parallelism, the ZeRO stage, the optimizer and clipping. The dims are the model's,
made to fit the draw (`fitted_dims`): heads (kv_heads) a multiple of tp, every weight dim a multiple of
tp·dp·cp (ZeRO cuts them over dp × cp as well), batch of dp·mb, seq of cp·tp. Each accepted plan is verified
on the local engine; a config the planner still refuses is a row with its message (it is not a proof's
business). Rows go to `--out`; the exit code is 1 where an accepted plan is not proved.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time

from hypothesis import HealthCheck, Phase, given, seed, settings, strategies as st

import tv_ray
import tv_ray.models
from tv_ray.errors import TvRayError


def _multiple(unit: int, at_least: int) -> int:
    """The least multiple of `unit` that is at least `at_least`."""
    return unit * max(1, -(-at_least // unit))


def fitted_dims(model: str, dp: int, tp: int, mb: int, cp: int) -> dict[str, int]:
    """The model's dims, grown just enough that every cut of the draw divides."""
    dims = dict(tv_ray.models.get(model).dims)
    unit = tp * dp * cp
    heads_key = "kv_heads" if "kv_heads" in dims else "heads"
    dims[heads_key] = _multiple(tp, dims[heads_key]) if dims[heads_key] % tp else dims[heads_key]
    heads = dims[heads_key] * dims.get("n_rep", 1)
    dims["head_dim"] = dims["head_dim"] * (unit // math.gcd(unit, heads * dims["head_dim"]))
    dims["ffn"] = _multiple(unit, dims["ffn"])
    dims["vocab"] = _multiple(unit, dims["vocab"])
    dims["batch"] = _multiple(dp * mb, dims["batch"])
    dims["seq"] = _multiple(cp * tp, dims["seq"])
    return dims


CONFIGS = st.fixed_dictionaries({
    "model": st.sampled_from(["llama3-tiny", "gpt2-tiny"]),
    "dp": st.integers(1, 4), "tp": st.integers(1, 4), "pp": st.integers(1, 2), "mb": st.integers(1, 4),
    "cp": st.integers(1, 3), "sp": st.booleans(), "zero": st.integers(0, 3),
    "optim": st.sampled_from(["sgd", "adamw"]), "clip": st.sampled_from([None, 1.0]),
})


def spec_of(c: dict) -> str:
    return ",".join(f"{axis}={c[axis]}" for axis in ("dp", "tp", "pp", "mb", "cp") if c[axis] > 1) or "dp=1"


def run(c: dict) -> dict:
    """One drawn config: planned, verified; a row."""
    dims = fitted_dims(c["model"], c["dp"], c["tp"], c["mb"], c["cp"])
    sp = c["sp"] and c["tp"] > 1
    row = {"model": c["model"], "parallel": spec_of(c), "sp": sp, "zero": c["zero"], "optim": c["optim"],
           "clip": c["clip"], "dims": dims}
    start = time.perf_counter()
    try:
        graph = tv_ray.capture_step(c["model"], optim=c["optim"], clip=c["clip"], dims=dims)
        plan = tv_ray.parallelize(graph, row["parallel"], model=c["model"], dims=dims, sp=sp, zero=c["zero"])
    except TvRayError as err:
        return {**row, "status": "refused", "message": str(err)}
    result = tv_ray.verify(plan, engine="local", progress=False)
    row.update(status=result.status, **result.outcome.counts(), seconds=round(time.perf_counter() - start, 2))
    if not result.proved:
        row["headline"] = result.report.get("headline")
    return row


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--examples", type=int, default=30)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="bench/results/fuzz_configs.json")
    args = parser.parse_args()
    rows: list[dict] = []
    seen: set[str] = set()
    start = time.perf_counter()

    def write() -> dict:
        """The rows so far and their summary to `--out` (after every example: a run stopped early keeps them)."""
        summary = {"examples": len(rows), "proved": sum(r["status"] == "proved" for r in rows),
                   "refused": sum(r["status"] == "refused" for r in rows),
                   "false_alarms": sum(r["status"] not in ("proved", "refused") for r in rows),
                   "seed": args.seed, "seconds": round(time.perf_counter() - start, 1)}
        with open(args.out, "w") as f:
            json.dump({"summary": summary, "rows": rows}, f, indent=1)
        return summary

    @seed(args.seed)
    @settings(max_examples=args.examples, database=None, deadline=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(CONFIGS)
    def draw(c):
        key = json.dumps(c, sort_keys=True)
        if key in seen:
            return
        seen.add(key)
        rows.append(run(c))
        write()
        r = rows[-1]
        print(f"{r['model']:<12} {r['parallel']:<24} sp={r['sp']!s:<5} zero={r['zero']} {r['optim']:<5} "
              f"clip={r['clip']!s:<4} {r['status']:<8} {r.get('seconds', '')} {r.get('message', '')}", flush=True)

    draw()
    summary = write()
    print(json.dumps(summary))
    return 1 if summary["false_alarms"] else 0


if __name__ == "__main__":
    sys.exit(main())
