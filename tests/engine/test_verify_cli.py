"""`tv-ray verify` end to end: exit 0 with a certificate, 1 with a located report, 2 with a clear error."""
import gzip
import json
from dataclasses import replace

import pytest

from tv_ray.api import verify
from tv_ray.cli import main
from tv_ray.errors import ParallelConfigError
from tv_ray.ir import Graph, Node
from tv_ray.plan import Plan


def _drop_a_gradient_all_reduce(plan):
    """A1 on dp=2: layers.1.mlp.down_proj's weight-gradient all-reduce over dp becomes a copy."""
    prog = plan.programs["main"]
    nodes = list(prog.nodes)
    i = next(i for i, n in enumerate(nodes) if n.op.value == "all_reduce" and n.get_meta("phase") == "bwd"
             and n.get_meta("module") == "layers.1.mlp.down_proj")
    n = nodes[i]
    nodes[i] = Node.make(n.name, "clone", list(n.args), {}, n.shape, n.dtype, dict(n.meta))
    return replace(plan, programs={"main": Graph(prog.inputs, tuple(nodes), prog.outputs, prog.name)}), n.name


def test_correct_plan_exits_0_with_a_certificate(tiny_dp2_plan, tmp_path, capsys):
    tiny_dp2_plan.save(tmp_path / "plan.json")
    assert main(["verify", str(tmp_path / "plan.json"), "-o", str(tmp_path / "out"), "--jobs", "2"]) == 0
    out = capsys.readouterr().out
    assert "PROVED" in out and "unique keys by tier" in out
    manifest = json.loads((tmp_path / "out" / "certificate.json").read_text())
    assert manifest["plan"]["path"] == "plan.json.gz"        # a copy inside OUT: the certificate moves whole
    assert gzip.decompress((tmp_path / "out" / "plan.json.gz").read_bytes()) == (tmp_path / "plan.json").read_bytes()
    assert manifest["composition"]["problems"] == []


def test_missing_all_reduce_exits_1_and_names_module_rank_and_reduction(tiny_dp2_plan, tmp_path, capsys):
    mutant, tensor = _drop_a_gradient_all_reduce(tiny_dp2_plan)
    mutant.save(tmp_path / "bad.json")
    assert main(["verify", str(tmp_path / "bad.json"), "-o", str(tmp_path / "out"), "-q"]) == 1
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["status"] == "refuted"
    stage = report["stage"]
    assert (stage["module"], stage["phase"], stage["tensor"], stage["ranks"]) == \
        ("layers.1.mlp.down_proj", "bwd", tensor, [0])
    assert "partial sum over dp" in stage["factor"]
    assert stage["max_abs_dev"] > 1e-6 and len(stage["physical_values"]) == 6
    assert main(["explain", str(tmp_path / "out")]) == 0
    text = capsys.readouterr().out
    assert "layers.1.mlp.down_proj (backward)" in text
    # outputs by the names the model gives them (as `tv-ray run` names them), not by SSA names
    wrong = {d["output"] for d in report["outputs_wrong"]}
    assert "grad/layers.1.mlp.down_proj.weight" in wrong and all("/" in name for name in wrong)
    assert "  output grad/layers.1.mlp.down_proj.weight on rank(s) " in text
    assert "realises -" not in text and "module - " not in text


def test_errors_exit_2_and_say_what(tmp_path, capsys):
    assert main(["verify", "-o", str(tmp_path / "o"), "--model", "llama3-tiny"]) == 2
    assert "--model needs --parallel SPEC" in capsys.readouterr().err
    (tmp_path / "broken.json").write_text('{"format": "tv-ray-plan/1", "model": 3')
    assert main(["verify", str(tmp_path / "broken.json"), "-o", str(tmp_path / "o")]) == 2
    assert "tv-ray verify:" in capsys.readouterr().err


def test_a_missing_pipeline_send_is_refuted_as_missing_communication(tmp_path, capsys):
    """Stage 0 never sends one activation: stage 1 waits forever, so the plan computes nothing — refuted
    (exit 1), and the report names the waiting ranks and what they wait for."""
    from tv_ray import api
    plan = api.parallelize(api.capture_step("llama3-tiny", optim="sgd", clip=None), "pp=2", model="llama3-tiny")
    prog = plan.programs["stage0"]
    send = next(n for n in prog.nodes if n.op.value == "send")
    cut = replace(plan, programs={**plan.programs, "stage0": Graph(
        prog.inputs, tuple(n for n in prog.nodes if n.name != send.name), prog.outputs, prog.name)})
    cut.save(tmp_path / "cut.json")
    assert main(["verify", str(tmp_path / "cut.json"), "-o", str(tmp_path / "out"), "-q"]) == 1
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["status"] == "refuted"
    assert report["headline"].startswith("missing or misrouted communication — deadlock: rank 0 (pp=0) waits at ")
    assert (f"rank 1 (pp=1) waits at programs.stage1.ops[79] ({send.args[0]}<0 = recv from rank 0 (pp=0), "
            f"tag {send.attr['tag']})") in report["headline"]


def test_progress_bars_count_ops_generated_and_obligations_solved(tiny_dp2_plan, capsys):
    result = verify(tiny_dp2_plan, solvers=("z3",), engine="local", progress=True)
    err = capsys.readouterr().err.replace("\r", "\n")
    ops = sum(len(tiny_dp2_plan.programs[tiny_dp2_plan.rank_programs()[0][i]].nodes)
              for i in tiny_dp2_plan.rank_programs()[1])
    counts = result.outcome.counts()
    generating = [line for line in err.splitlines() if line.startswith("generating: 100%")]
    solving = [line for line in err.splitlines() if line.startswith("solving: 100%")]
    assert generating and f"{ops}/{ops} " in generating[-1] and f"unique {counts['unique']}]" in generating[-1]
    assert solving and f"proved {counts['obligations']} refuted 0 unknown 0" in solving[-1]


def test_shards_on_generates_one_pipeline_stage_per_shard_and_the_checker_follows(tmp_path, capsys):
    from tv_ray import api
    plan = api.parallelize(api.capture_step("llama3-tiny", optim="sgd", clip=None), "pp=2,mb=2", model="llama3-tiny")
    plan.save(tmp_path / "plan.json")
    assert main(["verify", str(tmp_path / "plan.json"), "-o", str(tmp_path / "out"), "-q", "--engine", "local",
                 "--jobs", "2", "--shards", "on"]) == 0
    manifest = json.loads((tmp_path / "out" / "certificate.json").read_text())
    assert manifest["stage_dag"]["shards"] == 2 and manifest["settings"]["shards"] is True
    assert manifest["symmetry"]["notes"] == []
    for jobs in ("2", "1"):          # the shards re-derived in two forked processes, then in this one
        assert main(["check", str(tmp_path / "out"), "--sample", "5", "--jobs", jobs]) == 0
    capsys.readouterr()
    with pytest.raises(SystemExit):
        main(["check", str(tmp_path / "out"), "--jobs", "0"])
    assert "argument --jobs: 0: at least one process" in capsys.readouterr().err


def test_verify_model_builds_its_plan_at_the_given_dims(tmp_path):
    """`--dims` reaches the plan `verify --model` builds (llama3-tiny's own batch is 8)."""
    assert main(["verify", "--model", "llama3-tiny", "--parallel", "dp=2", "--dims", "batch=4", "-o",
                 str(tmp_path / "out"), "-q", "--engine", "local"]) == 0
    manifest = json.loads((tmp_path / "out" / "certificate.json").read_text())
    assert manifest["plan"]["path"] == "plan.json.gz" and manifest["plan"]["mesh"] == {"dp": 2}
    plan = json.loads(gzip.decompress((tmp_path / "out" / "plan.json.gz").read_bytes()))
    assert plan["dims"]["batch"] == 4 and plan["dims"]["seq"] == 16


def test_verify_model_untied_reaches_the_plan(tmp_path):
    """gpt2-tiny ties its head to the embedding; `--untied` gives the plan a separate lm_head weight."""
    assert main(["verify", "--model", "gpt2-tiny", "--parallel", "dp=2", "--untied", "-o", str(tmp_path / "out"),
                 "-q", "--engine", "local"]) == 0
    inputs = {spec.name for spec in Plan.load(tmp_path / "out" / "plan.json.gz").logical.inputs}
    assert {"wte.weight", "lm_head.weight"} <= inputs


def test_model_flags_with_a_plan_file_or_resume_are_refused_by_name(tmp_path, capsys):
    plan = str(tmp_path / "plan.json")
    assert main(["verify", plan, "-o", str(tmp_path / "o"), "--sp", "--dims", "batch=4", "--untied",
                 "--optim", "adamw", "--sp"]) == 2
    assert capsys.readouterr().err == (
        f"tv-ray verify: the plan file {plan} is verified as written; --sp, --dims, --untied, --optim (for building "
        "a plan with --model) would be ignored: drop them, or give --model NAME instead of the plan file\n")
    assert main(["verify", "--resume", str(tmp_path / "o"), "--parallel", "dp=2"]) == 2
    assert capsys.readouterr().err == ("tv-ray verify: --resume OUT continues with the plan recorded in OUT; "
                                       "--parallel (for building a plan with --model) would be ignored: drop it\n")


def test_the_api_refuses_model_arguments_with_a_plan(tiny_dp2_plan):
    with pytest.raises(ParallelConfigError, match=r"^parallel, tied, dims build a plan from a model name; a plan "
                                                  r"is verified as it is$"):
        verify(tiny_dp2_plan, "dp=2", tied=False, dims={"batch": 4}, engine="local")


def test_a_consumer_of_a_never_reduced_partial_sum_names_that_input(tmp_path):
    """The tp all-reduce after layers.0 attention (its row-parallel o_proj) is dropped: its reader (the residual add) fails, and
    the headline names the input that was never reduced over tp, with its ranks."""
    from tv_ray import api
    plan = api.parallelize(api.capture_step("llama3-tiny"), "tp=2", model="llama3-tiny")
    prog = plan.programs["main"]
    gone = next(n for n in prog.nodes if n.op.value == "all_reduce" and n.get_meta("phase") == "fwd"
                and n.name.startswith("_unsafe_view_7~"))
    nodes = tuple(Node.make(n.name, n.op.value, [gone.args[0] if a == gone.name else a for a in n.args],
                            dict(n.attrs), n.shape, n.dtype, dict(n.meta)) for n in prog.nodes if n is not gone)
    mutant = replace(plan, programs={"main": Graph(prog.inputs, nodes, prog.outputs, prog.name)},
                     interior=tuple(e for e in plan.interior if e.tensor != gone.name))
    mutant.save(tmp_path / "bad.json")
    assert main(["verify", str(tmp_path / "bad.json"), "-o", str(tmp_path / "out"), "-q", "--engine", "local"]) == 1
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    unreduced = report["stage"]["unreduced_input"]
    assert (unreduced["tensor"], unreduced["ranks"], unreduced["axes"]) == (gone.args[0], [0, 1], ["tp"])
    assert report["headline"].endswith(f" — it reads {gone.args[0]} on ranks 0, 1, a partial sum over tp never "
                                       f"reduced: the all-reduce / reduce-scatter over tp before "
                                       f"{report['stage']['tensor']} is missing")
