"""`ray job submit ... -- tv-ray verify` end to end, against a cluster this test starts with `ray start --head`
on 127.0.0.1 and stops by its own processes (never `ray stop`, which would stop every Ray of the user)."""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def cluster():
    """A one-node Ray cluster of its own (its temp dir names every process it started)."""
    temp = tempfile.mkdtemp(prefix="tvr", dir="/tmp")
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0",
           "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
    env.pop("RAY_ADDRESS", None)
    port, dashboard, agent = _free_port(), _free_port(), _free_port()
    # the job agent's HTTP port defaults to 52365, which another Ray on this machine (this very test run's
    # local Ray) already holds: then every submission fails with "No available agent"
    started = subprocess.run([str(BIN / "ray"), "start", "--head", "--node-ip-address=127.0.0.1", f"--port={port}",
                              "--dashboard-host=127.0.0.1", f"--dashboard-port={dashboard}", "--num-cpus=2",
                              f"--dashboard-agent-listen-port={agent}",
                              f"--temp-dir={temp}", "--disable-usage-stats"],
                             env=env, capture_output=True, text=True, timeout=120)
    assert started.returncode == 0, started.stderr[-2000:]
    try:
        yield f"http://127.0.0.1:{dashboard}", env
    finally:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for pid in _started_in(temp):
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + 10
            while _started_in(temp) and time.monotonic() < deadline:
                time.sleep(0.2)
        shutil.rmtree(temp, ignore_errors=True)


def _started_in(temp: str) -> list[int]:
    """The processes of the cluster whose temp dir is `temp`: named in their command line or holding a file
    open there (the agents rename themselves, but write their logs under it)."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if temp.encode() in (entry / "cmdline").read_bytes() or \
                    any(os.readlink(fd).startswith(temp) for fd in (entry / "fd").iterdir()):
                out.append(int(entry.name))
        except OSError:
            pass
    return out


def test_a_ray_job_runs_tv_ray_verify_on_the_cluster(cluster, tmp_path):
    address, env = cluster
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
