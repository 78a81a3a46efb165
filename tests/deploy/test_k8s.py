"""The Kubernetes manifests validate offline: core kinds with kubernetes-validate --strict, the RayJob
against KubeRay's CRD schema with unknown fields refused; a misspelled field fails both."""
from __future__ import annotations

import copy
import shutil
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
import yaml

K8S = Path(__file__).resolve().parents[2] / "k8s"
VALIDATE = shutil.which("kubernetes-validate") or str(Path(sys.executable).parent / "kubernetes-validate")


def _strict(schema: dict) -> dict:
    """The CRD schema with unknown fields refused, as `kubectl --validate=strict` does."""
    schema = copy.deepcopy(schema)

    def walk(node):
        if isinstance(node, dict):
            if node.get("type") == "object" and "properties" in node and \
                    not node.get("x-kubernetes-preserve-unknown-fields") and "additionalProperties" not in node:
                node["additionalProperties"] = False
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)
    walk(schema)
    return schema


@pytest.fixture(scope="module")
def rayjob_schema() -> dict:
    crd = yaml.safe_load((K8S / "kuberay-rayjob-crd.yaml").read_text())
    version = next(v for v in crd["spec"]["versions"] if v["name"] == "v1")
    return _strict(version["schema"]["openAPIV3Schema"])


def _kubernetes_validate(path: Path) -> subprocess.CompletedProcess:
    return subprocess.run([VALIDATE, "--strict", str(path)], capture_output=True, text=True)


@pytest.mark.parametrize("name", ["job.yaml", "results-pvc.yaml"])
def test_core_manifests_pass_strict_validation(name):
    done = _kubernetes_validate(K8S / name)
    assert done.returncode == 0 and "INFO" in done.stdout and "skip" not in done.stdout.lower(), done.stdout


def test_a_misspelled_field_in_the_job_fails_strict_validation(tmp_path):
    job = yaml.safe_load((K8S / "job.yaml").read_text())
    job["spec"]["template"]["spec"]["restartPolicyy"] = job["spec"]["template"]["spec"].pop("restartPolicy")
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    done = _kubernetes_validate(tmp_path / "job.yaml")
    assert done.returncode != 0 and "restartPolicyy" in done.stdout + done.stderr


def test_the_rayjob_matches_the_kuberay_crd(rayjob_schema):
    job = yaml.safe_load((K8S / "rayjob.yaml").read_text())
    assert (job["apiVersion"], job["kind"]) == ("ray.io/v1", "RayJob")
    jsonschema.validate(job, rayjob_schema)
    assert "exec tv-ray verify " in job["spec"]["entrypoint"]    # how it runs: test_manifests_agree.py
    head = job["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]
    assert any(m["mountPath"] == "/results" for m in head["containers"][0]["volumeMounts"])


def test_a_misspelled_field_in_the_rayjob_fails(rayjob_schema):
    job = yaml.safe_load((K8S / "rayjob.yaml").read_text())
    job["spec"]["shutdownAfterJobFinish"] = job["spec"].pop("shutdownAfterJobFinishes")
    with pytest.raises(jsonschema.ValidationError) as err:
        jsonschema.validate(job, rayjob_schema)
    assert "('shutdownAfterJobFinish' was unexpected)" in err.value.message
    assert list(err.value.absolute_path) == ["spec"]
