"""The deployment files agree with each other and with what they are built from: every manifest names the one
registry-qualified image k8s/README.md builds and pushes; the image installs the tested versions (its Ray is the
RayJob's `rayVersion`); the Job and the RayJob resume from the checkpoint the same way, the RayJob's entry point
run as KubeRay's submitter runs it; the Job's sizing comment gives the benchmark's figures."""
from __future__ import annotations

import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "k8s"
MANIFESTS = ("job.yaml", "rayjob.yaml")


def _images(manifest: dict) -> list[str]:
    out, stack = [], [manifest]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            for key in ("containers", "initContainers"):
                out += [container["image"] for container in node.get(key, [])]
            stack += node.values()
        elif isinstance(node, list):
            stack += node
    return out


def _documented_image() -> str:
    readme = (K8S / "README.md").read_text()
    names = re.findall(r"^\s*IMAGE=(\S+)\s*$", readme, re.M)
    assert len(names) == 1, f"k8s/README.md should set IMAGE once, found {names}"
    assert "docker build -f k8s/Dockerfile -t $IMAGE . && docker push $IMAGE" in readme
    assert f'sed "s|{names[0]}|$IMAGE|"' in readme        # how the manifests get the user's name
    return names[0]


def test_every_manifest_names_the_documented_registry_image():
    image = _documented_image()
    host, _, rest = image.partition("/")
    assert rest and ("." in host or ":" in host or host == "localhost"), f"{image} names no registry"
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    assert image.rpartition(":")[2] == version, f"{image} is not tagged with the project's version {version}"
    for name in MANIFESTS:
        images = _images(yaml.safe_load((K8S / name).read_text()))
        assert images and set(images) == {image}, f"k8s/{name}: {images}, k8s/README.md: {image}"


def test_no_document_builds_or_runs_a_bare_local_image():
    files = [REPO / "README.md", REPO / "deployments" / "README.md", K8S / "README.md", K8S / "Dockerfile",
             *K8S.glob("*.yaml")]
    bare = [(f.relative_to(REPO).as_posix(), m.group()) for f in files
            for m in re.finditer(r"(?<![\w./-])tv-ray:[\w.]+", f.read_text())]
    assert bare == []


def _pins() -> dict[str, str]:
    pins = {}
    for line in (REPO / "constraints.txt").read_text().splitlines():
        name, sep, version = line.split("#")[0].strip().partition("==")
        if sep:
            pins[name.lower()] = version
    return pins


def _pip_installs(dockerfile: str) -> list[str]:
    """Every `pip install` command of the Dockerfile's RUN instructions, continuation lines joined."""
    text = re.sub(r"\\\n", " ", dockerfile)
    runs = [line[len("RUN "):] for line in text.splitlines() if line.startswith("RUN ")]
    return [command.strip() for run in runs for command in run.split("&&") if "pip install" in command]


def test_the_image_installs_the_tested_versions():
    pins = _pins()
    rayjob = yaml.safe_load((K8S / "rayjob.yaml").read_text())
    assert rayjob["spec"]["rayClusterSpec"]["rayVersion"] == pins["ray"]
    dockerfile = (K8S / "Dockerfile").read_text()
    installs = _pip_installs(dockerfile)
    assert len(installs) >= 2, installs                   # torch, then tv-ray
    assert all(re.search(r"(^|\s)-c constraints\.txt(\s|$)", command) for command in installs), installs
    copy = re.search(r"^COPY .*\bconstraints\.txt\b", dockerfile, re.M)
    assert copy and copy.start() < dockerfile.index("pip install"), "constraints.txt is not copied before pip runs"
    torch = [command for command in installs if "torch==" in command]
    assert len(torch) == 1 and f"torch=={pins['torch']} " in torch[0] + " ", torch
    assert "https://download.pytorch.org/whl/cpu" in torch[0]


FAKE_TV_RAY = "#!/bin/sh\nprintf '%s\\n' \"$@\"\n"
# `ray job ...` as KubeRay's submitter calls it, no job of that id yet; `submit` runs the entry point as Ray
# does: its CLI shlex-joins the words after `--`, the job supervisor runs that with shell=True.
FAKE_RAY = """#!{python}
import shlex, subprocess, sys
args = sys.argv[1:]
if args[:2] == ["job", "status"]:
    sys.exit(1)
if args[:2] == ["job", "submit"]:
    sys.exit(subprocess.run(shlex.join(args[args.index("--") + 1:]), shell=True).returncode)
"""


def _fake_bin(tmp_path: Path) -> dict:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("tv-ray", FAKE_TV_RAY), ("ray", FAKE_RAY.format(python=sys.executable))):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    return {"PATH": f"{bin_dir}:/usr/bin:/bin"}


def _job_command(results: Path) -> list[str]:
    container = yaml.safe_load((K8S / "job.yaml").read_text())["spec"]["template"]["spec"]["containers"][0]
    return container["command"] + [arg.replace("/results/", f"{results}/") for arg in container["args"]]


def _rayjob_command(results: Path) -> list[str]:
    """The shell line KubeRay's K8sJobMode submitter runs (ray-operator/controllers/ray/common/job.go,
    BuildJobSubmitCommand, less its wait for the dashboard), the entry point pasted in as text."""
    entrypoint = yaml.safe_load((K8S / "rayjob.yaml").read_text())["spec"]["entrypoint"].strip()
    entrypoint = entrypoint.replace("/results/", f"{results}/")
    address, job_id = "http://tv-ray-verify-head-svc:8265", "tv-ray-verify-x7k2q"
    line = (f"if ! ray job status --address {address} {job_id} >/dev/null 2>&1 ; "
            f"then ray job submit --address {address} --no-wait --submission-id {job_id} -- {entrypoint} ; "
            f"fi ; ray job logs --address {address} --follow {job_id}")
    return ["/bin/bash", "-ce", "--", line]


@pytest.mark.parametrize("command", [_job_command, _rayjob_command], ids=MANIFESTS)
def test_a_rerun_resumes_from_the_checkpoint(command, tmp_path):
    env, results = _fake_bin(tmp_path), tmp_path / "results"

    def run() -> list[str]:
        done = subprocess.run(command(results), env=env, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stdout + done.stderr
        return done.stdout.splitlines()

    fresh = run()
    assert fresh[0] == "verify" and "--resume" not in fresh and "-o" in fresh, fresh
    out = Path(fresh[fresh.index("-o") + 1])
    assert out.parent == results, fresh
    (out / "checkpoint").mkdir(parents=True)
    assert run() == fresh                                  # no run.json yet: nothing to resume (tv_ray/commands.py)
    (out / "checkpoint" / "run.json").write_text("{}")
    assert run() == ["verify", "--resume", str(out)]


def _gib(quantity: str) -> float:
    number, unit = re.fullmatch(r"([\d.]+)(Mi|Gi)", quantity).groups()
    return float(number) / (1024 if unit == "Mi" else 1)


def test_the_job_is_sized_from_the_benchmark():
    text = (K8S / "job.yaml").read_text()
    header = "\n".join(line for line in text.splitlines() if line.startswith("#"))
    header = re.sub(r"\s*\n#\s*", " ", header)
    rows = json.loads((REPO / "bench" / "results" / "trainverify_8b.json").read_text())["rows"]
    for row in rows:
        assert f"{row['parallel']} peaks at {row['peak_rss_gib']:.1f} GiB" in header, row["parallel"]
    container = yaml.safe_load(text)["spec"]["template"]["spec"]["containers"][0]
    arguments = container["args"][0].split()
    model, parallel = arguments[arguments.index("--model") + 1], arguments[arguments.index("--parallel") + 1]
    row = next(row for row in rows if (row["model"], row["parallel"]) == (model, parallel))
    assert f"{model} {parallel} peaks at {row['peak_rss_gib']:.1f} GiB (wall {row['wall_s']:.0f} s)" in header
    resources = container["resources"]
    assert row["peak_rss_gib"] < _gib(resources["requests"]["memory"]) <= _gib(resources["limits"]["memory"])
