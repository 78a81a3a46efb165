"""`ray job submit ... -- tv-ray verify` end to end, against a cluster this test starts with `ray start --head`
on 127.0.0.1 and stops by its own processes (`ray_head`, tests/conftest.py)."""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def test_a_ray_job_runs_tv_ray_verify_on_the_cluster(ray_head, tmp_path):
    address, env = ray_head.dashboard, ray_head.env
    out = tmp_path / "out"
    submit = [str(BIN / "ray"), "job", "submit", "--address", address, "--working-dir", str(REPO),
              "--runtime-env", str(REPO / "deployments" / "runtime_env.yaml"), "--",
              "tv-ray", "verify", "--model", "llama3-tiny", "--parallel", "dp=2,tp=2", "-o", str(out), "--solvers", "z3"]
    deadline = time.monotonic() + 120
    while True:             # a fresh head takes a while to start its job agent ("No available agent ...")
        job = subprocess.run(submit, env=env, capture_output=True, text=True, timeout=600, cwd=REPO)
        if job.returncode == 0 or "No available agent" not in job.stdout + job.stderr or time.monotonic() > deadline:
            break
        time.sleep(3)
    assert job.returncode == 0, job.stdout[-3000:] + job.stderr[-3000:]
    assert "tv-ray: PROVED" in job.stdout and "ray(1 actor on 1 node)" in job.stdout
    manifest = json.loads((out / "certificate.json").read_text())
    assert manifest["executor"] == "ray(1 actor on 1 node)" and manifest["counts"]["unknown"] == 0
    assert "succeeded" in job.stdout.lower()
