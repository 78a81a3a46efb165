"""deployments/submit.sh: its usage without an address (stderr, exit 2) or with --help (stdout, exit 0), and what it
hands to `ray job submit` (a fake `ray` on PATH that prints its working directory and arguments)."""
from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SUBMIT = REPO / "deployments" / "submit.sh"


def _submit(args: list[str], tmp_path: Path) -> subprocess.CompletedProcess:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "ray").write_text("#!/bin/sh\npwd\nprintf '%s\\n' \"$@\"\n")
    (bin_dir / "ray").chmod(0o755)
    return subprocess.run([str(SUBMIT), *args], env={"PATH": f"{bin_dir}:/usr/bin:/bin"}, cwd=tmp_path,
                          capture_output=True, text=True, timeout=30)


@pytest.mark.parametrize("args", [[], [""], ["--model", "llama3-8b", "--parallel", "dp=512", "-o", "/shared/out"]],
                         ids=["nothing", "empty", "options only"])
def test_without_an_address_it_prints_its_usage_and_exits_2(args, tmp_path):
    done = _submit(args, tmp_path)
    assert (done.returncode, done.stdout) == (2, ""), done.stderr
    assert done.stderr.startswith(f"usage: {SUBMIT} http://HEAD:8265 ") and done.stderr.count("\n") == 1


@pytest.mark.parametrize("flag", ["-h", "--help"])
def test_help_prints_the_usage_to_stdout(flag, tmp_path):
    done = _submit([flag], tmp_path)
    assert (done.returncode, done.stderr) == (0, "")
    assert done.stdout.startswith(f"usage: {SUBMIT} http://HEAD:8265 ") and "--resume OUT" in done.stdout


def test_the_arguments_after_the_address_go_to_tv_ray_verify(tmp_path):
    done = _submit(["http://head:8265", "--resume", "/shared/llama3-8b dp512"], tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        str(REPO), "job", "submit", "--address", "http://head:8265", "--working-dir", ".",
        "--runtime-env", "deployments/runtime_env.yaml", "--", "tv-ray", "verify", "--resume", "/shared/llama3-8b dp512"]
