"""The built-in recipe: plans it builds simulate to the logical step; mutants and bad configs are caught."""
from __future__ import annotations

import copy
import json

import pytest
import torch

import tv_ray
import tv_ray.models
from tv_ray.errors import ParallelConfigError
from tv_ray.execute import check_order
from tv_ray.ir import Op
from tv_ray.plan import Plan
from tv_ray.simulate import simulate

TOL = 1e-9


@pytest.fixture(scope="module")
def llama_adamw():
    return tv_ray.capture_step("llama3-tiny", optim="adamw", clip=1.0, tied=True)


@pytest.fixture(scope="module")
def llama_sgd():
    return tv_ray.capture_step("llama3-tiny", optim="sgd", tied=False)


@pytest.fixture(scope="module")
def gpt2_sgd():
    return tv_ray.capture_step("gpt2-tiny", optim="sgd", clip=0.5)


def _worst(plan: Plan, seed: int = 0) -> dict[str, float]:
    result = simulate(plan, seed=seed)
    return {name: dev for name, dev in result.deviation.items() if dev > TOL}


# A pairwise-covering subset of dp, tp, pp, mb in {1, 2} x sp x zero 0-3 (the full grid is bench/plan_grid.py).
GRID = [
    ("dp=1", {}),
    ("dp=2", {"zero": 1}),
    ("tp=2", {"sp": True}),
    ("pp=2,mb=2", {}),
    ("dp=2,tp=2", {"zero": 2}),
    ("dp=2,pp=2", {"zero": 3}),
    ("tp=2,pp=2,mb=2", {"sp": True, "zero": 1}),
    ("dp=2,tp=2,pp=2,mb=2", {"sp": True, "zero": 2}),
    ("dp=2,mb=2", {"zero": 3}),
]


@pytest.mark.parametrize("spec,flags", GRID, ids=[s + "".join(f",{k}={v}" for k, v in f.items()) for s, f in GRID])
def test_llama_adamw_tied_plans_match_logical_step(llama_adamw, spec, flags):
    plan = tv_ray.parallelize(llama_adamw, spec, model="llama3-tiny", **flags)
    assert _worst(plan) == {}
    outputs = {name for p in plan.programs.values() for name in p.output_map}
    assert "new/embed.weight" in outputs and "new/exp_avg_sq/layers.1.mlp.down_proj.weight" in outputs


@pytest.mark.parametrize("spec,flags", GRID[::2], ids=[s for s, _ in GRID[::2]])
def test_llama_sgd_untied_plans_match_logical_step(llama_sgd, spec, flags):
    plan = tv_ray.parallelize(llama_sgd, spec, model="llama3-tiny", **flags)
    assert _worst(plan, seed=1) == {}


@pytest.mark.parametrize("spec,flags", GRID[1::2], ids=[s for s, _ in GRID[1::2]])
def test_gpt2_plans_match_logical_step(gpt2_sgd, spec, flags):
    plan = tv_ray.parallelize(gpt2_sgd, spec, model="gpt2-tiny", **flags)
    assert _worst(plan, seed=2) == {}


def test_gpt2_mlp_linears_are_split_over_tp_megatron_style(gpt2_sgd):
    """addmm is captured as mm + bias add: c_fc runs column-parallel, c_proj row-parallel with an all-reduce
    before its bias is added once (a fused addmm could only run replicated)."""
    program = tv_ray.parallelize(gpt2_sgd, "tp=2", model="gpt2-tiny").programs["main"]
    fwd = [n for n in program.nodes if n.get_meta("phase") == "fwd" and n.get_meta("module") in
           ("layers.0.mlp.c_fc", "layers.0.mlp.c_proj")]
    assert [(n.op.value, str(n.shape[-1])) for n in fwd if n.op.value not in ("view", "transpose")] == [
        ("mm", "ffn/2"), ("add", "ffn/2"),                                          # c_fc: columns split
        ("mm", "head_dim*heads"), ("all_reduce", "head_dim*heads"), ("add", "head_dim*heads")]    # c_proj


def test_plan_round_trips_through_its_file(llama_sgd, tmp_path):
    plan = tv_ray.parallelize(llama_sgd, "dp=2,tp=2,pp=2,mb=2", model="llama3-tiny", sp=True)
    path = tmp_path / "plan.json"
    plan.save(path)
    assert Plan.load(path) == plan
    assert sorted(plan.programs) == ["stage0", "stage1"]
    assert plan.num_ranks == 8


# -- mutants: each must deviate, and the deviating outputs are named ---------------------------------
@pytest.fixture(scope="module")
def base_plan(llama_sgd):
    return tv_ray.parallelize(llama_sgd, "dp=2,tp=2,pp=2,mb=2", model="llama3-tiny", zero=2).to_json()


def _ops(obj, program):
    return obj["programs"][program]["ops"]


def _deviating(obj) -> list[str]:
    return sorted(_worst(Plan.from_json(obj)))


def test_dropped_gradient_all_reduce_deviates(llama_sgd):
    obj = tv_ray.parallelize(llama_sgd, "dp=2,pp=2", model="llama3-tiny").to_json()
    ops = _ops(obj, "stage1")
    # the dp all_reduce of the final norm's weight gradient, replaced by identity (bug class A1)
    i = next(i for i, op in enumerate(ops) if op["op"] == "all_reduce" and op["attrs"]["axes"] == ["dp"]
             and op["shape"] == ["head_dim*kv_heads*n_rep"])
    ops[i] = {"out": ops[i]["out"], "op": "clone", "args": ops[i]["args"], "shape": ops[i]["shape"]}
    assert _deviating(obj) == ["grad/norm.weight", "new/norm.weight"]


def test_divisor_changed_on_one_rank_deviates(base_plan):
    obj = copy.deepcopy(base_plan)
    program = copy.deepcopy(obj["programs"]["stage1"])
    i = next(i for i, op in enumerate(program["ops"]) if op["op"] == "div" and "other" in op.get("attrs", {}))
    program["ops"][i]["attrs"]["other"] *= 2
    obj["programs"]["stage1_bug"] = program
    obj["ranks"]["overrides"] = {"5": "stage1_bug"}
    bad = _deviating(obj)
    assert "loss" in bad and len(bad) == 43     # the loss and every gradient and update downstream of it


def test_swapped_send_recv_peers_deviate(base_plan):
    obj = copy.deepcopy(base_plan)
    sends = [op for op in _ops(obj, "stage0") if op["op"] == "send"]
    by_shape: dict[str, list] = {}
    for op in sends:
        shape = json.dumps(next(o for o in _ops(obj, "stage0") if o["out"] == op["args"][0])["shape"])
        by_shape.setdefault(shape, []).append(op)
    a, b = next(group for group in by_shape.values() if len(group) >= 2)[:2]
    a["attrs"]["tag"], b["attrs"]["tag"] = b["attrs"]["tag"], a["attrs"]["tag"]
    bad = _deviating(obj)
    assert "loss" in bad and len(bad) == 43


def test_reduce_scatter_over_wrong_axis_deviates(base_plan):
    obj = copy.deepcopy(base_plan)
    ops = _ops(obj, "stage1")
    op = next(op for op in ops if op["op"] == "reduce_scatter" and op["attrs"]["axes"] == ["dp"])
    op["attrs"]["axes"] = ["tp"]
    assert _deviating(obj) == ["grad/lm_head.weight", "new/lm_head.weight"]


# -- configs the model cannot take -------------------------------------------------------------------
@pytest.mark.parametrize("spec,flags,message", [
    ("tp=3", {}, "parallel spec tp=3: tp = 3 must divide kv_heads = 2"),
    ("pp=3", {}, "parallel spec pp=3: pp = 3 is more than the model's 2 layers"),
    ("dp=3", {}, "parallel spec dp=3: dp*mb = 3 must divide batch = 8"),
    ("dp=2", {"sp": True}, "--sp (sequence parallel) needs tp > 1: it shards the sequence over tp"),
    ("dp=2,xp=2", {}, "parallel spec 'dp=2,xp=2': 'xp=2' is not one of dp=N, tp=N, pp=N, mb=N, cp=N, ep=N"),
    ("dp=2", {"zero": 4}, "--zero 4: ZeRO stage must be 0, 1, 2 or 3"),
    ("dp=2,ep=2", {}, "parallel spec dp=2,ep=2: ep > 1 needs a model with routed experts (a MoE model)"),
    ("dp=2,ep=4", {}, "ep = 4 must divide dp = 2: expert parallelism is carved out of the data-parallel ranks"),
    ("dp=2,cp=3", {}, "parallel spec dp=2,cp=3: cp = 3 must divide seq = 16"),
])
def test_impossible_configs_are_refused(llama_sgd, spec, flags, message):
    with pytest.raises(ParallelConfigError) as err:
        tv_ray.parallelize(llama_sgd, spec, model="llama3-tiny", **flags)
    assert str(err.value) == message


def test_a_gradient_whose_dp_cut_does_not_divide_is_refused_where_it_is_reduce_scattered():
    """ZeRO-2 at dp=3 × tp=3: each ffn gradient is cut 9 ways, which 96 columns do not allow (a plan that did not
    validate, naming an op, before)."""
    dims = {"heads": 3, "ffn": 96, "vocab": 96, "batch": 6, "seq": 12}
    graph = tv_ray.capture_step("gpt2-tiny", dims=dims)
    with pytest.raises(ParallelConfigError) as err:
        tv_ray.parallelize(graph, "dp=3,tp=3", model="gpt2-tiny", dims=dims, zero=2)
    assert str(err.value) == "reduce-scattering view_38 dim 0 over dp: 9 does not divide ffn = 96"
    assert tv_ray.parallelize(graph, "dp=3,tp=3", model="gpt2-tiny", dims={**dims, "ffn": 144, "vocab": 144}, zero=2)


def test_tv_ray_run_exits_1_naming_the_deviating_outputs(llama_sgd, tmp_path, capsys):
    from tv_ray.cli import main
    obj = tv_ray.parallelize(llama_sgd, "dp=2,tp=2", model="llama3-tiny", zero=2).to_json()
    op = next(op for op in obj["programs"]["main"]["ops"]
              if op["op"] == "reduce_scatter" and op["attrs"]["axes"] == ["dp"])
    op["attrs"]["axes"] = ["tp"]
    path = tmp_path / "bug.json"
    path.write_text(json.dumps(obj))
    assert main(["run", str(path), "--seed", "0"]) == 1
    out, err = capsys.readouterr()
    assert json.loads(out)["deviating"] == ["grad/lm_head.weight", "new/lm_head.weight"]
    assert err.startswith("tv-ray run: outputs deviate beyond 1e-09: grad/lm_head.weight (")


@pytest.mark.parametrize("spec,flags", [("pp=4,mb=4", {}), ("pp=4,mb=8", {}), ("pp=4,dp=2,tp=2,mb=2", {"sp": True}),
                                        ("dp=2,pp=2,mb=4", {"zero": 3})])   # ZeRO-3's weights gathered, not samples
def test_deeper_pipelines_run_1f1b_without_deadlock(spec, flags):
    model = tv_ray.models.get("llama3-tiny").with_dims(layers=4, tied=True)
    graph = tv_ray.capture_step(model, optim="adamw", clip=1.0)
    plan = tv_ray.parallelize(graph, spec, model=model, **flags)
    assert sorted(plan.programs) == [f"stage{s}" for s in range(dict(plan.mesh)["pp"])]
    assert _worst(plan, seed=5) == {}


@pytest.mark.parametrize("spec, zero", [("tp=2,pp=2,mb=4", 0), ("dp=2,pp=2,mb=4", 3)])
def test_the_last_stage_of_a_moe_pipeline_runs_1f1b(spec, zero):
    """Two ways every backward of the last stage came to wait for its last forward, deadlocking against the first
    stage's 1F1B. With tp the MoE loss (cross-entropy plus the aux loss) is summed over the microbatches and then
    all-reduced once, and the backward's seed, a full_like of the loss, read that sum: the seed is a constant now.
    Under ZeRO-3 the experts' bmm matched its batch dim (the experts) to the weight's dp cut, which gathered the
    tokens of every microbatch at once: batch axes stay on the data, the weight is gathered."""
    plan = tv_ray.parallelize(tv_ray.capture_step("deepseek-tiny"), spec, model="deepseek-tiny", zero=zero)
    last = plan.programs["stage1"].nodes
    forward_recvs = [i for i, n in enumerate(last) if n.op == Op.RECV and n.get_meta("phase") == "fwd"]
    microbatch = [last[i].get_meta("mb") for i in forward_recvs]
    first_send = next(i for i, n in enumerate(last) if n.op == Op.SEND)
    assert last[first_send].get_meta("mb") == 0
    assert all(mb == 0 for i, mb in zip(forward_recvs, microbatch) if i < first_send)   # F0 B0 F1 B1 …
    check_order(plan, plan.dims)
    assert _worst(plan, seed=0) == {}


def test_samples_are_cut_over_dp_and_a_buffer_without_samples_is_whole():
    """A module's data at constant shapes is cut over dp (dim 0); a named-dims buffer with no batch dim (the
    router's correction bias) is held whole by every rank."""
    class Square(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Linear(4, 4, bias=False)

        def forward(self, x):
            return self.w(x).pow(2).mean()
    graph = tv_ray.capture_step(Square().double(), (torch.randn(8, 4, dtype=torch.float64),))
    plan = tv_ray.parallelize(graph, "dp=2")
    assert [(e.tensor, e.slice) for e in plan.lineage if e.tensor == "x"] == [("x", ((0, ("dp",)),))]
    moe = tv_ray.parallelize(tv_ray.capture_step("deepseek-tiny"), "dp=4,ep=2", model="deepseek-tiny")
    assert [e.slice for e in moe.lineage if e.tensor == "layers.1.mlp.gate.bias"] == [()]
    assert [e.slice for e in moe.lineage if e.tensor == "tokens"] == [((0, ("dp", "ep")),)]
