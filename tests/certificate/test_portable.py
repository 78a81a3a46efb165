"""A certificate a person can trust and hand on: it checks wherever it is moved, its headline says what was proved
equal to what, and a check that re-proved nothing independently does not pass."""
from __future__ import annotations

import gzip
import json
import shutil
from dataclasses import replace
from types import SimpleNamespace

import pytest

from tv_ray import api, processes
from tv_ray.certificate import check_certificate
from tv_ray.cli import main
from tv_ray.errors import CertificateError
from tv_ray.ir import Graph, Node
from tv_ray.plan import Plan


@pytest.fixture(scope="module")
def plan():
    """llama3-tiny pp=2 × dp=2 (SGD), built as `tv-ray plan` builds it: its recipe recorded."""
    return api.parallelize(api.capture_step("llama3-tiny"), "dp=2,pp=2", model="llama3-tiny",
                           recipe={"optim": "sgd", "clip": None})


@pytest.fixture(scope="module")
def certified(plan, tmp_path_factory):
    """(certificate directory, the plan file it was verified from)."""
    root = tmp_path_factory.mktemp("portable")
    (root / "plans").mkdir()
    plan.save(root / "plans" / "mine.json")
    result = api.verify(str(root / "plans" / "mine.json"), engine="local", progress=False)
    assert result.proved, result.report["headline"]
    result.save(root / "out")
    return root / "out", root / "plans" / "mine.json"


def _lr_times_ten(graph: Graph) -> Graph:
    """The SGD step's learning rate ×10 (every `lr * grad` product)."""
    nodes = tuple(Node.make(n.name, n.op.value, list(n.args), {**dict(n.attrs), "other": n.attr["other"] * 10},
                            n.shape, n.dtype, dict(n.meta)) if n.name.endswith(".lr_grad") else n
                  for n in graph.nodes)
    assert sum(a is not b for a, b in zip(nodes, graph.nodes)) > 3
    return Graph(graph.inputs, nodes, graph.outputs, graph.name)


def test_a_certificate_moved_elsewhere_checks_there(certified, tmp_path):
    out, source = certified
    manifest = json.loads((out / "certificate.json").read_text())
    assert manifest["plan"]["path"] == "plan.json.gz" and manifest["plan"]["source"] == str(source.resolve())
    assert gzip.decompress((out / "plan.json.gz").read_bytes()) == source.read_bytes()
    moved = tmp_path / "elsewhere" / "cert"
    shutil.copytree(out, moved)
    shutil.copytree(source.parent, tmp_path / "plans-backup")
    shutil.rmtree(source.parent)            # the plan file it was verified from is gone
    try:
        report = check_certificate(moved, sample=5)
        assert report.obligations == manifest["counts"]["obligations"] and report.different_method == 5
    finally:
        shutil.copytree(tmp_path / "plans-backup", source.parent)


def test_the_headline_names_a_fresh_capture_of_the_model_as_the_reference(certified, capsys):
    out, _ = certified
    manifest = json.loads((out / "certificate.json").read_text())
    assert manifest["reference"]["capture"] == "matches"
    assert main(["explain", str(out)]) == 0
    text = capsys.readouterr().out.splitlines()
    assert text[0] == ("tv-ray: PROVED — llama3-tiny on 4 ranks (mesh pp=2×dp=2, 1 microbatch) equals a fresh "
                       "capture of llama3-tiny (sgd, no clipping)")
    assert text[2] == ("  recipe: parallel dp=2,pp=2 (sp: sequence parallel, zero=N: ZeRO stage), optimizer sgd, "
                       "no clipping")


def test_an_edited_logical_graph_is_proved_against_itself_and_the_headline_says_so(plan):
    edited = replace(plan, logical=_lr_times_ten(plan.logical),
                     programs={name: _lr_times_ten(p) for name, p in plan.programs.items()})
    result = api.verify(edited, engine="local", progress=False)
    assert result.proved      # the programs do what the edited logical graph does
    digest = result.reference["logical_sha256"]
    assert result.reference["capture"] == "differs"
    assert result.report["headline"].endswith(
        f"equal those of the plan's own logical graph (sha256 {digest[:12]}), which is NOT a fresh capture of "
        f"llama3-tiny (sgd, no clipping): it was edited or captured otherwise")
    assert str(result).startswith("<tv_ray.Result proved: all ") and len(str(result)) < 600


def test_the_fresh_capture_runs_in_a_forked_process_beside_the_verification_and_is_made_here_if_it_dies(
        plan, tmp_path, monkeypatch):
    import os
    capture_step = api.capture_step

    def noted(*args, **kwargs):
        with open(tmp_path / "pids", "a") as f:
            f.write(f"{os.getpid()}\n")
        return capture_step(*args, **kwargs)

    monkeypatch.setattr(api, "capture_step", noted)
    result = api.verify(plan, engine="local", progress=False)
    pids = (tmp_path / "pids").read_text().split()
    assert result.proved and result.reference["capture"] == "matches" and pids and str(os.getpid()) not in pids
    monkeypatch.setattr(processes, "_answer", lambda fn, args, sender: os._exit(3))    # dies without answering
    (tmp_path / "pids").unlink()
    result = api.verify(plan, engine="local", progress=False)
    assert result.reference["capture"] == "matches" and (tmp_path / "pids").read_text().split() == [str(os.getpid())]
    monkeypatch.undo()
    monkeypatch.setattr(api, "capture_step", noted)
    monkeypatch.setattr(processes.multiprocessing, "current_process", lambda: SimpleNamespace(daemon=True))
    (tmp_path / "pids").unlink()         # a daemonic process may not have children: captured here
    result = api.verify(plan, engine="local", progress=False)
    assert result.reference["capture"] == "matches" and (tmp_path / "pids").read_text().split() == [str(os.getpid())]


def test_the_fresh_capture_begins_from_the_plan_files_header_and_follows_the_plan_read_in_full(plan, tmp_path,
                                                                                                monkeypatch):
    """A plan file's header (`Plan.header`) names the model, dims and recipe before the logical graph, so the capture
    begins before the plan is read. Where the plan read in full says otherwise (a second "recipe" field, the one JSON
    readers keep), the header's capture is stopped and the plan's made: the reference follows the plan."""
    path = tmp_path / "plan.json"
    plan.save(path)
    assert Plan.header(path) == {"format": plan.format, "model": "llama3-tiny", "dims": dict(plan.dims),
                                 "mesh": dict(plan.mesh), "microbatches": 1, "schedule": plan.schedule,
                                 "recipe": plan.recipe}
    begun = []
    made = api._ForkedReference.__init__

    def spy(self, model, recipe, dims):
        begun.append(recipe["optim"])
        made(self, model, recipe, dims)
    monkeypatch.setattr(api._ForkedReference, "__init__", spy)
    result = api.verify(str(path), engine="local", progress=False)
    assert result.reference["capture"] == "matches" and begun == ["sgd"]
    text = path.read_text()
    head = text.index(' "recipe": ')
    lying = text[:head] + text[head:].replace('"optim": "sgd"', '"optim": "adamw"', 1)
    path.write_text(lying.rstrip()[:-1] + f',\n "recipe": {json.dumps(plan.recipe)}\n}}\n')
    assert Plan.header(path)["recipe"]["optim"] == "adamw" and Plan.load(path).recipe == plan.recipe
    begun.clear()
    result = api.verify(str(path), engine="local", progress=False)
    assert result.reference["capture"] == "matches" and begun == ["adamw", "sgd"]


def test_a_plan_without_a_recipe_is_proved_against_its_own_logical_graph(plan):
    result = api.verify(replace(plan, recipe=None), engine="local", progress=False)
    assert result.proved and result.reference["capture"] is None
    assert result.report["headline"].endswith(
        f"equal those of the plan's own logical graph (sha256 {result.reference['logical_sha256'][:12]}), "
        f"labelled 'llama3-tiny'")


def test_a_check_that_re_proves_only_by_the_recorded_method_fails_unless_allowed(normalised, monkeypatch, capsys):
    import tv_ray.certificate.check as check
    out = normalised
    monkeypatch.setattr(check, "_by_smt", lambda lhs, rhs, solvers, timeout_s: "no SMT solver here")
    with pytest.raises(CertificateError, match=r"was re-proved only by its recorded method normalised \(smt: no SMT "
                                               r"solver here\): the check is not independent for it; give other "
                                               r"--solvers, a longer --timeout, or accept it with "
                                               r"--allow-same-method$"):
        check_certificate(out)
    assert main(["check", str(out), "-q"]) == 1
    assert "FAILED" in capsys.readouterr().err
    report = check_certificate(out, allow_same_method=True)
    # a key whose sides the checker derives as the very same term holds by reflexivity: no other method needed
    assert report.same_method > 0 and report.different_method == report.methods["identical"] > 0
    assert report.same_method + report.different_method == report.unique
    assert main(["check", str(out), "-q", "--allow-same-method"]) == 0
    assert f"{report.same_method} only by the recorded one (--allow-same-method)" in capsys.readouterr().out
