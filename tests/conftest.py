"""The suite runs on every core (pytest-xdist, `-n auto --dist loadgroup` in pyproject.toml): the modules that start
Ray (`RAY_MODULES`) run one after another on one worker, so two Rays never share the machine's cores, and a test
elsewhere that starts Ray fails, saying so. `ray_head`: a Ray cluster of the test's own, `ray start --head` on
127.0.0.1 with free ports and its own temp dir, stopped by its own processes (never `ray stop`, which would stop
every Ray of the user)."""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

BIN = Path(sys.executable).parent
RAY_MODULES = {"deploy/test_job_submission.py", "engine/test_checkpoint.py",
               "engine/test_grid_subset.py", "engine/test_ray_cluster.py", "engine/test_ray_engine.py",
               "engine/test_verify_cli.py"}
HERE = Path(__file__).resolve().parent


def _module(item) -> str:
    return Path(item.fspath).resolve().relative_to(HERE).as_posix()


def pytest_collection_modifyitems(items):
    for item in items:
        if _module(item) in RAY_MODULES:
            item.add_marker(pytest.mark.xdist_group("ray"))


def _ray_up() -> bool:
    ray = sys.modules.get("ray")
    return ray is not None and ray.is_initialized()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    before = _ray_up()
    result = yield
    if not before and _ray_up() and _module(item) not in RAY_MODULES:
        raise AssertionError(f"{item.nodeid} started Ray in the test process; add {_module(item)} to RAY_MODULES "
                             f"(tests/conftest.py) so that it runs on the Ray worker")
    return result


@pytest.fixture(scope="session")
def tiny_dp2_plan():
    """llama3-tiny (AdamW, clip 1.0) at dp=2."""
    from tv_ray import api
    graph = api.capture_step("llama3-tiny", optim="adamw", clip=1.0)
    return api.parallelize(graph, "dp=2", model="llama3-tiny")


@dataclass
class Head:
    address: str            # GCS host:port, for `--address`
    dashboard: str          # http://host:port, for `ray job submit`
    env: dict
    temp: str

    def processes(self) -> list[int]:
        """The cluster's processes: its temp dir is in their command line or they hold a file open under it
        (the agents rename themselves, but write their logs there)."""
        out = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                if self.temp.encode() in (entry / "cmdline").read_bytes() or \
                        any(os.readlink(fd).startswith(self.temp) for fd in (entry / "fd").iterdir()):
                    out.append(int(entry.name))
            except OSError:
                pass
        return out

    def kill(self, signals=(signal.SIGKILL,), spare: tuple[int, ...] = ()) -> None:
        """Every process of the cluster (but `spare`: a driver that writes under the temp dir too) gone."""
        for sig in signals:
            for pid in set(self.processes()) - set(spare):
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + 10
            while set(self.processes()) - set(spare) and time.monotonic() < deadline:
                time.sleep(0.2)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def ray_head():
    temp = tempfile.mkdtemp(prefix="tvr", dir="/tmp")
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0",
           "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
    env.pop("RAY_ADDRESS", None)
    for _ in range(3):
        port, dashboard, agent = _free_port(), _free_port(), _free_port()
        # the job agent's HTTP port defaults to 52365, which another Ray on this machine (this very test run's
        # local Ray) already holds: then every submission fails with "No available agent"
        started = subprocess.run([str(BIN / "ray"), "start", "--head", "--node-ip-address=127.0.0.1",
                                  f"--port={port}", "--dashboard-host=127.0.0.1", f"--dashboard-port={dashboard}",
                                  "--num-cpus=2", f"--dashboard-agent-listen-port={agent}", f"--temp-dir={temp}",
                                  "--disable-usage-stats"], env=env, capture_output=True, text=True, timeout=120)
        head = Head(f"127.0.0.1:{port}", f"http://127.0.0.1:{dashboard}", env, temp)
        if started.returncode == 0 or "is used by other components" not in started.stderr:
            break
        head.kill()     # a port picked here was also picked by Ray for one of its own components: again
    assert started.returncode == 0, started.stderr[-2000:]
    try:
        yield head
    finally:
        head.kill((signal.SIGTERM, signal.SIGKILL))
        shutil.rmtree(temp, ignore_errors=True)
