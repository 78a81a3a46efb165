"""`tv-ray run`: one JSON line, exit 0 / 1 / 2, deviating outputs named on stderr."""
import argparse
import json

import pytest

from plan.mlp_plans import pp_plan, tp_plan
from tv_ray.plan import Plan
from tv_ray.simulate import add_run_parser


def tv_ray_run(argv, capsys):
    parser = argparse.ArgumentParser(prog="tv-ray")
    add_run_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["run", *argv])
    code = args.func(args)
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def saved(tmp_path):
    def save(obj, name="plan.json"):
        path = tmp_path / name
        Plan.from_json(obj).save(path)
        return str(path)
    return save


def test_correct_plan_exits_0(saved, capsys):
    path = saved(tp_plan())
    code, out, err = tv_ray_run([path, "--seed", "5"], capsys)
    assert (code, err) == (0, "")
    assert out.count("\n") == 1
    line = json.loads(out)
    assert list(line) == ["plan", "seed", "ranks", "max_abs_dev", "deviating", "ok"]
    assert (line["plan"], line["seed"], line["ranks"], line["deviating"], line["ok"]) == (path, 5, 2, [], True)
    assert set(line["max_abs_dev"]) == {"loss", "grad", "param", "state"}
    assert max(line["max_abs_dev"].values()) <= 1e-9


def test_deviating_plan_exits_1_naming_the_outputs(saved, capsys):
    code, out, err = tv_ray_run([saved(pp_plan(swap_tags=True)), "--tol", "1e-6"], capsys)
    assert code == 1
    line = json.loads(out)
    assert (line["deviating"], line["ok"]) == (["grad/w1", "new/exp_avg/w1", "new/w1"], False)
    assert err.count("\n") == 1
    assert err.startswith("tv-ray run: outputs deviate beyond 1e-06: grad/w1 (")
    assert "on rank 0 (pp=0)), new/exp_avg/w1 (" in err


def test_other_dims(saved, capsys):
    code, out, _ = tv_ray_run([saved(tp_plan()), "--dims", "batch=2,ffn=4"], capsys)
    assert code == 0 and json.loads(out)["ok"]


def test_bad_plan_exits_2(tmp_path, capsys):
    path = tmp_path / "plan.json"
    path.write_text('{"format": ')
    code, out, err = tv_ray_run([str(path)], capsys)
    assert (code, out) == (2, "")
    assert err == f"tv-ray run: {path}: not valid JSON at line 1 column 12: Expecting value\n"


def test_deadlock_exits_2(saved, capsys):
    code, out, err = tv_ray_run([saved(pp_plan(recv_first=True))], capsys)
    assert (code, out) == (2, "")
    assert err.startswith("tv-ray run: deadlock: rank 0 (pp=0) waits at programs.stage0.ops[0]")


def test_bad_dims_exit_2(saved, capsys):
    code, _, err = tv_ray_run([saved(tp_plan()), "--dims", "batch=two"], capsys)
    assert (code, err) == (2, "tv-ray run: --dims: expected name=size with size >= 1, got 'batch=two'\n")
