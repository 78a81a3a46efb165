"""End to end as a user runs it: `tv-ray plan`, `tv-ray verify`, `tv-ray check`, each timed with its peak memory.

    python bench/end_to_end.py [--configs "llama3-70b:dp=16,tp=8,pp=4,mb=32:512;..."] [--before DIR] [--jobs 2]
                               [--out bench/results/end_to_end.json]

A config is MODEL:PARALLEL:BATCH (AdamW, clipping at 1.0, as TrainVerify's). Each command runs in a fresh
process of this tree's code, or of `--before DIR`'s (a checkout of another commit, put first on the path), one
after the other; with `--before`, each config runs on that tree, then on this one — side by side in one run, so
the ratio is not a day's machine against another's. A row per (config, tree, its commit): wall seconds and peak
RSS of each command (the process or its largest child), the verify and check phases they report, and what the
certificate holds — counts, and the digests of the plan and the instantiation map (the obligation table's
differs by its solving seconds), so that two trees' certificates can be compared. Rows are appended to `--out`.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]
# the `tv-ray` script's entry point (a tree before `entry` existed: `main`)
CLI = ("import sys; import tv_ray.cli as cli; sys.argv[0] = 'tv-ray'; "
       "cli.entry() if hasattr(cli, 'entry') else sys.exit(cli.main())")


def command(tree: Path, args: list[str], log: Path) -> dict:
    """`tv-ray ARGS` with `tree`'s code: seconds, peak RSS (GiB), exit code."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    start = time.perf_counter()
    with open(log, "w") as out:
        child = subprocess.Popen([sys.executable, "-c", CLI, *args], stdout=out, stderr=subprocess.STDOUT, env=env,
                                 cwd=tree)
        _, status, usage = os.wait4(child.pid, 0)       # reaped here, for its rusage: `child` is told so
        child.returncode = os.waitstatus_to_exitcode(status)
    return {"seconds": round(time.perf_counter() - start, 1), "peak_rss_gib": round(usage.ru_maxrss / 2 ** 20, 2),
            "exit": child.returncode}


def run(tree: Path, model: str, parallel: str, batch: int, jobs: int, work: Path) -> dict:
    plan, cert = work / "plan.json.gz", work / "cert"
    commit = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    row = {"tree": str(tree), "commit": commit.stdout.strip() or None, "model": model, "parallel": parallel,
           "batch": batch, "jobs": jobs}
    row["plan"] = command(tree, ["plan", "--model", model, "--parallel", parallel, "--dims", f"batch={batch}",
                                 "--optim", "adamw", "--clip", "1.0", "-o", str(plan)], work / "plan.log")
    row["verify"] = command(tree, ["verify", str(plan), "--engine", "local", "--jobs", str(jobs), "-q", "-o", str(cert)],
                            work / "verify.log")
    row["check"] = command(tree, ["check", str(cert), "--jobs", str(jobs)], work / "check.log")
    row["seconds"] = round(sum(row[c]["seconds"] for c in ("plan", "verify", "check")), 1)
    row["ok"] = all(row[c]["exit"] == 0 for c in ("plan", "verify", "check"))
    manifest = cert / "certificate.json"
    if manifest.exists():
        made = json.loads(manifest.read_text())
        row["verify"]["phases"] = made.get("phases_s")
        row |= {"counts": made["counts"], "plan_sha256": made["plan"]["sha256"],
                "instances_sha256": made["instances"]["sha256"]}
    row["check"]["says"] = " ".join(line.strip() for line in (work / "check.log").read_text().splitlines()[-2:])
    return row


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--configs", default="llama3-70b:dp=16,tp=8,pp=4,mb=32:512")
    parser.add_argument("--before", default=None, help="a checkout of the tree to compare with, run first")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--out", default=str(HERE / "bench/results/end_to_end.json"))
    args = parser.parse_args()
    trees = ([Path(args.before).resolve()] if args.before else []) + [HERE]
    out = Path(args.out)
    rows = json.loads(out.read_text()) if out.exists() else []
    for config in args.configs.split(";"):
        model, parallel, batch = config.split(":")
        for tree in trees:
            with tempfile.TemporaryDirectory(prefix="tv-ray-e2e-") as work:
                row = run(tree, model, parallel, int(batch), args.jobs, Path(work))
            row["date"] = time.strftime("%Y-%m-%d")
            print(json.dumps(row), flush=True)
            rows.append(row)
            out.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
