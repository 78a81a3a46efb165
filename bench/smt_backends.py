"""Tier 2 on pysmt against the tier 2 it replaced, side by side in one run, on the shared term corpus.

    python bench/smt_backends.py [--rounds 5] [--timeout 10] [--out bench/results/smt_backends.json]

The old tier 2 (hand-written SMT-LIB text, z3/cvc5 through their own APIs, yices-smt2 one process per
query, outputs parsed by hand) is loaded from git (`git show <rev>:tv_ray/smt/*.py`) into a temporary
package for the run; it does not stay in the tree. Both run every case of tests/terms/corpus.py, without
and with the ground lemmas the engine passes (`tv_ray.terms.normal.ground_lemmas`), for each solver alone
and for the portfolio of all three. Rounds alternate old and new; the first round (cold: solvers and
processes started) is reported apart from the median of the others (warm). Printed and written: the times,
the ratio new / old, and whether the verdicts agree case by case.

`--pysmt-portfolio` also times pysmt's own `Portfolio` (one process per solver per query) on the cases
it accepts (no uninterpreted functions: pysmt declares no solver for QF_UFNRA).
"""
from __future__ import annotations

import argparse
import importlib
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.terms.corpus import CASES  # noqa: E402
from tv_ray import smt as new  # noqa: E402
from tv_ray.terms.normal import ground_lemmas  # noqa: E402

CONFIGS = {"z3": ("z3",), "cvc5": ("cvc5",), "yices": ("yices",), "portfolio": ("z3", "cvc5", "yices")}
OLD_FILES = ("__init__", "encode", "solvers", "portfolio")


def load_old(rev: str, tmp: Path):
    """The tier 2 package at `rev` as the importable package `tv_ray_smt_old`."""
    pkg = tmp / "tv_ray_smt_old"
    pkg.mkdir()
    for name in OLD_FILES:
        text = subprocess.run(["git", "show", f"{rev}:tv_ray/smt/{name}.py"], cwd=ROOT, check=True,
                              capture_output=True, text=True).stdout
        (pkg / f"{name}.py").write_text(text.replace("tv_ray.smt.", "tv_ray_smt_old.").replace(
            "from tv_ray.smt import", "from tv_ray_smt_old import"))
    sys.path.insert(0, str(tmp))
    return importlib.import_module("tv_ray_smt_old")


def workload():
    """(case name, lemmas?, lhs, rhs, lemmas) for every corpus case, without and with ground lemmas."""
    out = []
    for name, lhs, rhs, _ in CASES:
        out.append((name, False, lhs, rhs, ()))
        lemmas, _ = ground_lemmas(lhs, rhs)
        if lemmas:
            out.append((name, True, lhs, rhs, tuple(lemmas)))
    return out


def run(impl, solvers, cases, timeout_s):
    verdicts, methods = [], []
    start = time.perf_counter()
    for _, _, lhs, rhs, lemmas in cases:
        result = impl.prove(lhs, rhs, lemmas, solvers=solvers, timeout_s=timeout_s)
        verdicts.append(result.verdict)
        methods.append(getattr(result, "method", ""))
    return time.perf_counter() - start, verdicts, methods


def pysmt_portfolio(cases, timeout_s):
    """pysmt's Portfolio (z3, cvc5; a process each per query) on the cases without uninterpreted functions."""
    from pysmt.environment import get_env
    from pysmt.solvers.portfolio import Portfolio

    from tv_ray.smt.encode import encode
    seconds, verdicts = 0.0, []
    for _, _, lhs, rhs, lemmas in cases:
        enc = encode(lhs, rhs, lemmas)
        if enc.applications:
            continue
        start = time.perf_counter()
        with Portfolio(["z3", "cvc5"], environment=get_env(), logic=enc.logic) as p:
            p.add_assertion(enc.formula())
            verdicts.append("sat" if p.solve() else "unsat")
        seconds += time.perf_counter() - start
    return seconds, verdicts


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--timeout", type=float, default=10.0)
    parser.add_argument("--rev", default="HEAD", help="the git revision holding the old tier 2")
    parser.add_argument("--pysmt-portfolio", action="store_true")
    parser.add_argument("--out", default=str(ROOT / "bench/results/smt_backends.json"))
    args = parser.parse_args()
    cases = workload()
    with tempfile.TemporaryDirectory(prefix="tv_ray_old_smt_") as tmp:
        old = load_old(args.rev, Path(tmp))
        if hasattr(old, "Backend") or not hasattr(old, "SubprocessSolver"):
            raise SystemExit(f"{args.rev}:tv_ray/smt is not the old tier 2 (pass --rev)")
        times = {c: {"old": [], "new": []} for c in CONFIGS}
        disagree: dict[str, list] = {c: [] for c in CONFIGS}
        methods = {c: {} for c in CONFIGS}
        for rnd in range(args.rounds):
            for config, solvers in CONFIGS.items():
                order = (("old", old), ("new", new)) if rnd % 2 == 0 else (("new", new), ("old", old))
                got = {}
                for label, impl in order:
                    seconds, verdicts, ms = run(impl, solvers, cases, args.timeout)
                    times[config][label].append(seconds)
                    got[label] = verdicts
                    for m in ms:
                        methods[config].setdefault(label, {}).setdefault(m or "-", 0)
                        methods[config][label][m or "-"] += 1
                for (name, lem, *_), a, b in zip(cases, got["old"], got["new"]):
                    if a != b:
                        disagree[config].append({"round": rnd, "case": name, "lemmas": lem, "old": a, "new": b})
                print(f"round {rnd} {config:9s} old {times[config]['old'][-1]:7.3f} s  "
                      f"new {times[config]['new'][-1]:7.3f} s", flush=True)
    rows = []
    for config in CONFIGS:
        o, n = times[config]["old"], times[config]["new"]
        warm_o = statistics.median(o[1:]) if len(o) > 1 else o[0]
        warm_n = statistics.median(n[1:]) if len(n) > 1 else n[0]
        rows.append({"config": config, "queries": len(cases), "cold_old_s": round(o[0], 4),
                     "cold_new_s": round(n[0], 4), "cold_ratio": round(n[0] / o[0], 3),
                     "warm_old_s": round(warm_o, 4), "warm_new_s": round(warm_n, 4),
                     "warm_ratio": round(warm_n / warm_o, 3), "verdicts_agree": not disagree[config],
                     "disagreements": disagree[config][:20],
                     "methods": {k: {m: c // args.rounds for m, c in v.items()} for k, v in methods[config].items()}})
    extra = {}
    if args.pysmt_portfolio:
        seconds, verdicts = pysmt_portfolio(cases, args.timeout)
        extra = {"pysmt_portfolio": {"queries": len(verdicts), "seconds": round(seconds, 3),
                                     "per_query_ms": round(1000 * seconds / max(1, len(verdicts)), 1)}}
    print(f"{'config':10s} {'cold old':>9s} {'cold new':>9s} {'ratio':>6s} {'warm old':>9s} {'warm new':>9s} "
          f"{'ratio':>6s}  agree")
    for r in rows:
        print(f"{r['config']:10s} {r['cold_old_s']:9.3f} {r['cold_new_s']:9.3f} {r['cold_ratio']:6.2f} "
              f"{r['warm_old_s']:9.3f} {r['warm_new_s']:9.3f} {r['warm_ratio']:6.2f}  {r['verdicts_agree']}")
    if extra:
        print(json.dumps(extra))
    import pysmt
    with open(args.out, "w") as f:
        json.dump({"rounds": args.rounds, "timeout_s": args.timeout, "queries_per_round": len(cases),
                   "old_rev": args.rev, "pysmt": pysmt.__version__, "solvers": new.available_solvers(),
                   "rows": rows, **extra}, f, indent=1)
    return 0 if all(r["verdicts_agree"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
