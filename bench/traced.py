"""Traced training scripts as a user runs them: `tv-ray trace`, `tv-ray verify`, `tv-ray check`, each timed.

    python bench/traced.py [--scripts "docs/examples/dtensor_llama.py:tp=4;..."] [--out bench/results/traced.json]

A config is SCRIPT[:AXIS=N,...]: the script run with its MESH replaced by the one given (a copy of the script that
imports it and sets MESH), one gloo process per rank. Each command runs in a fresh process, one after the other
(verify on the local engine, the one this machine's tests use). A row per config: the mesh, the ranks, the
recorded programs' sizes, each command's wall seconds and the verdict's counts. Rows are appended to `--out`.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]
DEFAULT = ("docs/examples/dtensor_mlp.py;tests/frontend/scripts/fsdp_mlp.py;docs/examples/dtensor_llama.py:tp=2;"
           "docs/examples/dtensor_llama.py;docs/examples/dtensor_llama.py:dp=2,tp=4;docs/examples/megatron_tp.py;"
           "docs/examples/megatron_tp.py:dp=2,tp=4;tests/frontend/scripts/megatron_sp.py;"
           "docs/examples/dtensor_llama.py:pp=2,tp=2;docs/examples/dtensor_llama.py:pp=2,dp=2,tp=2;"
           "tests/frontend/scripts/pipeline_tied.py;docs/examples/megatron_lm.py;docs/examples/megatron_pipeline.py;"
           "tests/frontend/scripts/megatron_qknorm.py;tests/frontend/scripts/ddp_accumulate.py;"
           "docs/examples/torchtitan_llama.py")


def with_mesh(script: Path, mesh: dict[str, int], out: Path) -> Path:
    """A copy of `script` whose MESH is `mesh`: it imports the script and sets MESH."""
    copy = out / f"{script.stem}_{'_'.join(f'{k}{v}' for k, v in mesh.items())}.py"
    copy.write_text(f"import sys\nsys.path.insert(0, {str(script.parent)!r})\nfrom {script.stem} import *  # noqa\n"
                    f"MESH = {mesh!r}\n")
    return copy


def timed(args: list[str]) -> tuple[float, subprocess.CompletedProcess]:
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "tv_ray.cli", *args], capture_output=True, text=True, cwd=HERE)
    return round(time.perf_counter() - start, 2), done


def measure(config: str, work: Path) -> dict:
    path, _, spec = config.partition(":")
    script = (HERE / path).resolve()
    mesh = {k: int(v) for k, v in (item.split("=") for item in spec.split(",") if item)}
    run = with_mesh(script, mesh, work) if mesh else script
    plan, out = work / f"{run.stem}.json", work / f"{run.stem}-out"
    seconds, traced = timed(["trace", str(run), "-o", str(plan)])
    row = {"script": path, "mesh": mesh or None, "seconds": {"trace": seconds}}
    if traced.returncode:
        return {**row, "error": traced.stderr.strip().splitlines()[-1]}
    summary = json.loads(traced.stdout)
    row.update(mesh=summary["mesh"], ranks=summary["ranks"], programs=summary["programs"],
               logical_ops=summary["logical_ops"])
    row["seconds"]["verify"], verified = timed(["verify", str(plan), "-o", str(out), "--engine", "local"])
    row["verdict"] = {0: "proved", 1: "refuted"}.get(verified.returncode, "unknown")
    if verified.returncode == 0:
        row["seconds"]["check"], checked = timed(["check", str(out)])
        row["checked"] = checked.returncode == 0
        counts = json.loads((out / "certificate.json").read_text())["counts"]
        row.update(obligations=counts["obligations"], unique=counts["unique"])
    row["seconds"]["total"] = round(sum(row["seconds"].values()), 2)
    return row


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--scripts", default=DEFAULT)
    parser.add_argument("--out", default="bench/results/traced.json")
    args = parser.parse_args()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=HERE).stdout
    rows = []
    with tempfile.TemporaryDirectory(prefix="tv-ray-bench-") as work:
        for config in filter(None, args.scripts.split(";")):
            row = {**measure(config, Path(work)), "commit": commit.strip(), "date": time.strftime("%Y-%m-%d")}
            print(json.dumps(row), flush=True)
            rows.append(row)
    out = Path(args.out)
    previous = json.loads(out.read_text()) if out.exists() else []
    out.write_text(json.dumps(previous + rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
