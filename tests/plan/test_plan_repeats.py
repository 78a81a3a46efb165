"""Microbatch repeats in plan files: microbatch k's ops written as microbatch 0's renamed, expanded on load."""
from __future__ import annotations

import copy
import json

import pytest

from tv_ray import api
from tv_ray.errors import PlanError
from tv_ray.ir import Node
from tv_ray.plan import Lineage, Plan
from tv_ray.plan_repeats import compact, compact_nodes, expand_entries, nodes_of


@pytest.fixture(scope="module")
def plan():
    """llama3-tiny, dp=2, tp=2, pp=2, mb=4, AdamW + clip 1.0."""
    return api.parallelize(api.capture_step("llama3-tiny", optim="adamw", clip=1.0), "dp=2,tp=2,pp=2,mb=4",
                           model="llama3-tiny")


def _repeats(items: list) -> list[dict]:
    return [item for item in items if "repeat" in item]


def test_a_plan_with_microbatches_is_written_with_repeats_and_reads_back_the_same(plan, tmp_path):
    compact, full = tmp_path / "plan.json", tmp_path / "full.json"
    plan.save(compact)
    plan.save(full, repeats=False)
    written = json.loads(compact.read_text())
    assert json.loads(full.read_text()) == plan.to_json()
    for name, program in written["programs"].items():
        repeats = _repeats(program["ops"])
        assert repeats and {r["mb"] for r in repeats} == {1, 2, 3}, name
        assert len(program["ops"]) < len(plan.programs[name].nodes) / 2
    assert {r["mb"] for r in _repeats(written["interior"])} == {1, 2, 3}
    assert compact.stat().st_size < 0.6 * full.stat().st_size      # the logical graph is the same in both
    assert Plan.from_json(written).to_json() == plan.to_json()
    again = Plan.load(compact)
    assert again == plan and again.to_json() == plan.to_json()


def test_a_microbatch_that_differs_stays_written_out_where_it_differs(plan, tmp_path):
    """Microbatch 2's copy of one op made to read microbatch 1's value: a repeat never stands for it."""
    obj = plan.to_json()
    ops = obj["programs"]["stage0"]["ops"]
    i, op = next((i, op) for i, op in enumerate(ops)
                 if op["op"] == "mul" and op["out"].endswith("@2") and any(a.endswith("@2") for a in op["args"]))
    odd = {**op, "args": [a[:-2] + "@1" if a.endswith("@2") else a for a in op["args"]]}
    ops[i] = odd
    changed = Plan.from_json(obj)
    path = tmp_path / "plan.json"
    changed.save(path)
    written = json.loads(path.read_text())["programs"]["stage0"]["ops"]
    assert odd in written
    assert Plan.load(path).to_json() == changed.to_json()
    assert Plan.load(path).programs["stage0"].value(odd["out"]).args == tuple(odd["args"])


def test_compacting_is_exact_run_by_run():
    """Ops and entries of microbatch k are written as a repeat only over the run where the renaming is exact."""
    def op(out, args, mb):
        return Node.make(out, "mul", args, shape=[2], meta={"mb": mb})
    nodes = [op("a@0", ["x@0", "w"], 0), op("b@0", ["a@0", "w"], 0), op("c@0", ["b@0"], 0),
             op("a@1", ["x@1", "w"], 1), op("b@1", ["a@1", "w"], 1), op("c@1", ["b@0"], 1)]    # c@1 reads b@0
    written = compact_nodes(nodes, 2)
    assert written == [0, 1, 2, {"repeat": "a@0", "count": 2, "mb": 1}, 5]
    ops = [nodes[x].to_json() if isinstance(x, int) else x for x in written]
    assert nodes_of(2)(ops, "programs.p.ops") == nodes
    mb = {"index": 0, "of": 2}
    raw = [{"where": {}, "tensor": "a@0", "logical": "a", "slice": [{"dim": 0, "split": ["dp", mb]}]},
           {"where": {}, "tensor": "b@0", "logical": "b", "slice": [{"dim": 1, "split": [mb]}]},
           {"where": {}, "tensor": "a@1", "logical": "a", "slice": [{"dim": 0, "split": ["dp", {**mb, "index": 1}]}]},
           {"where": {}, "tensor": "b@1", "logical": "b", "slice": [{"dim": 1, "split": [{**mb, "index": 1}]}]}]
    entries = [Lineage.from_json(e, "") for e in raw]
    renamed = lambda e, k: e.renamed(k, 2)     # noqa: E731
    written = compact(entries, 2, lambda e: (e.tensor, e.where), renamed, lambda at: at)
    assert written == [0, 1, {"repeat": 0, "count": 2, "mb": 1}]
    raw_written = [raw[x] if isinstance(x, int) else x for x in written]
    assert expand_entries(raw_written, 2, "interior", Lineage.from_json, renamed) == entries


def test_expanding_leaves_the_callers_object_as_it_was(plan, tmp_path):
    path = tmp_path / "plan.json"
    plan.save(path)
    written = json.loads(path.read_text())
    kept = copy.deepcopy(written)
    Plan.from_json(written)
    assert written == kept


@pytest.mark.parametrize("where, repeat, message", [
    ("ops", {"repeat": "a@0", "count": 1, "mb": 1, "k": 2},
     "programs.p.ops[2].k: unknown field 'k' of a repeat (known: repeat, count, mb)"),
    ("ops", {"repeat": "z@0", "count": 1, "mb": 1}, "programs.p.ops[2].repeat: no op 'z@0' before the repeat"),
    ("ops", {"repeat": "a@0", "count": 3, "mb": 1},
     "programs.p.ops[2].count: 3 from 'a@0' runs past what comes before the repeat (2 there)"),
    ("ops", {"repeat": "a@0", "count": 0, "mb": 1}, "programs.p.ops[2].count: expected an integer >= 1, got 0"),
    ("ops", {"repeat": "a@0", "count": 1, "mb": 2}, "programs.p.ops[2].mb: expected a microbatch in [1, 2), got 2"),
    ("ops", {"repeat": 0, "count": 1, "mb": 1},
     "programs.p.ops[2].repeat: expected the name of an earlier op, got 0"),
    ("ops", {"repeat": "w2", "count": 1, "mb": 1},
     "programs.p.ops[2]: repeats op 'w2', which has no microbatch tag @0 to rename"),
    ("interior", {"repeat": -1, "count": 1, "mb": 1},
     "interior[0].repeat: expected the index of an earlier entry, got -1"),
    ("interior", {"repeat": 0, "count": 1, "mb": 1},
     "interior[0].count: 1 from 0 runs past what comes before the repeat (0 there)"),
])
def test_a_malformed_repeat_is_refused_naming_its_place_in_the_file(where, repeat, message):
    ops = [{"out": "a@0", "op": "neg", "args": ["x@0"], "shape": [2]},
           {"out": "w2", "op": "neg", "args": ["w"], "shape": [2]}]
    obj = {"microbatches": 2, "programs": {"p": {"ops": ops + ([repeat] if where == "ops" else [])}},
           "interior": [repeat] if where == "interior" else []}
    with pytest.raises(PlanError) as err:
        if where == "ops":
            nodes_of(2)(obj["programs"]["p"]["ops"], "programs.p.ops")
        else:
            expand_entries(obj["interior"], 2, "interior", Lineage.from_json, lambda e, k: e.renamed(k, 2))
    assert str(err.value) == message


def test_a_loaded_plans_repeats_are_the_nodes_and_entries_written_out(plan, tmp_path):
    """`Plan.load` makes the nodes and entries a repeat stands for from the ones it copies, never from JSON:
    the same plan as parsing the JSON written out."""
    path, full = tmp_path / "plan.json", tmp_path / "full.json"
    plan.save(path)
    plan.save(full, repeats=False)
    written = json.loads(path.read_text())
    loaded, parsed = Plan.from_json(written), Plan.load(full)
    assert loaded == parsed == plan
    assert [n.meta for n in loaded.programs["stage0"].nodes] == [n.meta for n in plan.programs["stage0"].nodes]


def test_a_repeat_that_renames_onto_an_existing_op_is_refused_by_the_plan_check(plan):
    """Expansion is notation: what it writes out is checked like any op (here microbatch 1's ops again)."""
    obj = plan.to_json()
    ops = obj["programs"]["stage1"]["ops"]
    first = next(op["out"] for op in ops if op.get("meta", {}).get("mb") == 0)
    ops.append({"repeat": first, "count": 1, "mb": 1})
    with pytest.raises(PlanError, match=rf"^programs\.stage1\.ops\[{len(ops) - 1}\]"):
        Plan.from_json(obj)
    assert isinstance(plan.programs["stage1"].value(first), Node)
