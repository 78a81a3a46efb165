"""The fast paths of reading, checking and writing plans agree with the plain ones (messages pinned)."""
from __future__ import annotations

import gc
import itertools
import json

import pytest

from plan.mlp_plans import dp_plan, mutated, pp_plan, tp_plan, zero_plan
from tv_ray.errors import PlanError
from tv_ray.ir import Expr
from tv_ray.ir.graph import Graph, Node, TensorSpec
from tv_ray.plan import FORMAT, Lineage, Plan, RankMap, dumps
from tv_ray.plan_check import check_plan
from tv_ray.semantics.shapes import known_le

BUILDERS = {"tp": tp_plan, "dp": dp_plan, "zero": zero_plan, "pp": pp_plan,
            "override": lambda: dp_plan("mean", overrides={"1": "dp_bug"})}
_EXPAND = {"logical": 2, "programs": 3, "lineage": 1}


def reference_dumps(obj: dict) -> str:
    """The writer as first written (one json.dumps per item), kept to pin the file layout byte for byte."""
    def layout(value, depth, indent):
        if depth == 0 or not isinstance(value, (dict, list)) or not value:
            return json.dumps(value, separators=(", ", ": "))
        pad = " " * (indent + 1)
        if isinstance(value, dict):
            items = [f"{pad}{json.dumps(k)}: {layout(v, depth - 1, indent + 1)}" for k, v in value.items()]
            return "{\n" + ",\n".join(items) + "}"
        return "[\n" + ",\n".join(pad + layout(v, depth - 1, indent + 1) for v in value) + "]"
    lines = [f" {json.dumps(key)}: {layout(value, _EXPAND.get(key, 0), 1)}" for key, value in obj.items()]
    return "{\n" + ",\n".join(lines) + "\n}\n"


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_streamed_save_is_byte_identical_to_the_reference_layout(name, tmp_path):
    plan = Plan.from_json(BUILDERS[name]())
    path = tmp_path / "plan.json"
    plan.save(path)
    text = path.read_text()
    assert text == reference_dumps(plan.to_json()) == dumps(plan.to_json())
    odd = {"format": FORMAT, "empty": {}, "nan": float("inf"), "text": "é\"\n", "programs": {"p": {"ops": [
        {"a": [1, 2.5, None, True]}], "outputs": {}}}}
    assert dumps(odd) == reference_dumps(odd)


def from_objects(obj: dict) -> Plan:
    """The plan as a parallelizer builds it: Node.make / TensorSpec / Graph / Plan, no Plan.from_json."""
    def graph(g: dict, name: str) -> Graph:
        inputs = tuple(TensorSpec.from_json(s, "") for s in g["inputs"])
        nodes = tuple(Node.make(o["out"], o["op"], o["args"], o.get("attrs"), o["shape"], o.get("dtype", "float"),
                                o.get("meta")) for o in g["ops"])
        return Graph(inputs, nodes, tuple(g["outputs"].items()), name)
    ranks = obj["ranks"]
    return Plan(format=FORMAT, model=obj["model"], dims=dict(obj["dims"]), mesh=tuple(obj["mesh"].items()),
                microbatches=obj.get("microbatches", 1), schedule=obj.get("schedule", "none"),
                logical=graph(obj["logical"], "logical"),
                programs={name: graph(p, name) for name, p in obj["programs"].items()},
                ranks=RankMap(ranks["program"], tuple(sorted((int(r), p) for r, p in
                                                             ranks.get("overrides", {}).items()))),
                lineage=tuple(Lineage.from_json(e, f"lineage[{i}]") for i, e in enumerate(obj["lineage"])))


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_plan_built_from_objects_checks_and_round_trips(name, tmp_path):
    built = from_objects(BUILDERS[name]())
    check_plan(built)
    assert built == Plan.from_json(BUILDERS[name]())
    built.save(tmp_path / "plan.json")
    assert Plan.load(tmp_path / "plan.json") == built


def test_plan_built_from_objects_is_refused_with_the_loaders_message():
    obj = mutated(tp_plan())
    obj["programs"]["tp"]["ops"][1]["shape"] = ["batch", "ffn"]      # the tp shard is ffn/2 wide
    with pytest.raises(PlanError) as loaded:
        Plan.from_json(obj)
    with pytest.raises(PlanError) as built:
        check_plan(from_objects(obj))
    assert str(built.value) == str(loaded.value)
    assert str(loaded.value).startswith("programs.tp.ops[1]: node ")


def test_collector_is_restored_after_load_check_and_save(tmp_path):
    assert gc.isenabled()
    plan = Plan.from_json(tp_plan())
    plan.save(tmp_path / "plan.json")
    assert gc.isenabled()
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(PlanError):
        Plan.load(tmp_path / "bad.json")
    obj = mutated(tp_plan())
    obj["programs"]["tp"]["ops"][0]["shape"] = [7]
    with pytest.raises(PlanError):
        Plan.from_json(obj)
    assert gc.isenabled()
    gc.disable()
    try:
        Plan.load(tmp_path / "plan.json")
        assert not gc.isenabled()     # a caller's choice is kept
    finally:
        gc.enable()


def test_known_le_on_ints_agrees_with_the_polynomial_test():
    for a, b in itertools.product(range(-3, 4), repeat=2):
        assert known_le(a, b) is known_le(Expr.const(a), Expr.const(b)) is (a <= b)
    assert known_le(Expr.of("n"), Expr.of("n+1")) is True and known_le(Expr.of("n"), Expr.of("m")) is None
