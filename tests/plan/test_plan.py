"""Plan loading, saving and the mesh / lineage helpers."""
import gzip
import json

import numpy as np
import pytest

from plan.mlp_plans import dp_plan, pp_plan, tp_plan, zero_plan
from tv_ray.errors import PlanError
from tv_ray.plan import Fixed, Lineage, Plan

BUILDERS = {"tp": tp_plan, "dp": dp_plan, "dp_mean": lambda: dp_plan("mean"), "zero": zero_plan, "pp": pp_plan,
            "override": lambda: dp_plan("mean", overrides={"1": "dp_bug"})}


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_save_load_round_trip(name, tmp_path):
    plan = Plan.from_json(BUILDERS[name]())
    path = tmp_path / "plan.json"
    plan.save(path)
    again = Plan.load(path)
    assert again == plan
    assert again.to_json() == plan.to_json()
    assert json.loads(path.read_text()) == plan.to_json()


def test_a_plan_saved_as_gz_is_the_same_text_compressed_and_loads_the_same(tmp_path):
    plan = Plan.from_json(pp_plan())
    plain, packed = tmp_path / "plan.json", tmp_path / "plan.json.gz"
    plan.save(plain)
    plan.save(packed)
    assert packed.read_bytes()[:2] == b"\x1f\x8b"
    assert gzip.decompress(packed.read_bytes()) == plain.read_bytes()
    assert Plan.load(packed) == plan
    first = packed.read_bytes()
    plan.save(packed)                   # no time stamp: the same plan, the same bytes (its certificate's hash)
    assert packed.read_bytes() == first
    renamed = tmp_path / "plan.json"    # read by content, whatever the name
    renamed.write_bytes(first)
    assert Plan.load(renamed) == plan


def test_a_broken_gz_plan_is_refused_with_its_path(tmp_path):
    path = tmp_path / "plan.json.gz"
    Plan.from_json(tp_plan()).save(path)
    path.write_bytes(path.read_bytes()[:-40])
    with pytest.raises(PlanError, match=rf"^{path}: not a plan file \(neither JSON text nor gzip-compressed JSON\): "
                                        r"Compressed file ended before the end-of-stream marker was reached$"):
        Plan.load(path)


def test_saved_file_has_one_op_per_line(tmp_path):
    plan = Plan.from_json(tp_plan())
    path = tmp_path / "plan.json"
    plan.save(path)
    lines = path.read_text().splitlines()
    ops = [line for line in lines if line.lstrip().startswith('{"out": ')]
    assert len(ops) == len(plan.programs["tp"].nodes) + len(plan.logical.nodes)


def test_mesh_coordinates_are_row_major_last_axis_fastest():
    plan = Plan.from_json(zero_plan())          # mesh dp=2, tp=2
    assert plan.num_ranks == 4
    assert [plan.coords(r) for r in range(4)] == [{"dp": 0, "tp": 0}, {"dp": 0, "tp": 1},
                                                 {"dp": 1, "tp": 0}, {"dp": 1, "tp": 1}]
    assert all(plan.rank_of(plan.coords(r)) == r for r in range(4))
    assert plan.group(3, ["tp"]) == [2, 3]
    assert plan.group(3, ["dp"]) == [1, 3]
    assert plan.group(0, ["tp", "dp"]) == [0, 2, 1, 3]      # first listed axis outermost
    assert plan.describe(2) == "rank 2 (dp=1, tp=0)"
    with pytest.raises(PlanError, match=r"^rank 4 is not in the mesh \(ranks 0..3\)$"):
        plan.coords(4)


def test_programs_from_template_and_overrides():
    plan = Plan.from_json(pp_plan())
    assert [plan.program_of(r) for r in range(2)] == ["stage0", "stage1"]
    bug = Plan.from_json(dp_plan("mean", overrides={"1": "dp_bug"}))
    assert [bug.program_of(r) for r in range(2)] == ["dp", "dp_bug"]


def test_lineage_for_and_slice_bounds():
    plan = Plan.from_json(zero_plan())
    entries = {e.tensor: e for e in plan.lineage_for(1)}
    assert entries["shard/w2"] == Lineage((), "shard/w2", "w2", ((0, ("tp", "dp")),))
    # w2 is (ffn=8, d=4); split dim 0 by tp (outer) then dp: rank 1 = (dp=0, tp=1) holds chunk 2 of 4
    assert plan.slice_bounds(entries["shard/w2"], 1, (8, 4)) == ((4, 6), (0, 4))
    assert plan.slice_bounds(entries["shard/w1"], 1, (4, 8)) == ((0, 2), (4, 8))
    pp = Plan.from_json(pp_plan())
    mb1 = next(e for e in pp.lineage_for(0) if e.tensor == "x.mb1")
    assert mb1.slice == ((0, (Fixed(1, 2),)),)
    assert pp.slice_bounds(mb1, 0, (4, 4)) == ((2, 4), (0, 4))
    assert {e.tensor for e in pp.lineage_for(1)} == {"w2", "loss", "grad/w2", "new/w2"}


def test_rank_programs_are_vectorised_over_the_mesh():
    names, ids = Plan.from_json(pp_plan()).rank_programs()
    assert names == ("stage0", "stage1")
    assert np.array_equal(ids, [0, 1])


def test_a_mesh_of_8192_ranks_validates_per_program_not_per_rank():
    import time
    obj = tp_plan()
    obj["mesh"] = {"pp": 16, "dp": 256, "tp": 2}
    obj["ranks"] = {"program": "tp", "overrides": {"8191": "tp"}}
    start = time.perf_counter()
    plan = Plan.from_json(obj)
    assert time.perf_counter() - start < 2.0
    assert plan.num_ranks == 8192
    assert plan.coords(8191) == {"pp": 15, "dp": 255, "tp": 1}
    assert plan.group(8191, ["tp"]) == [8190, 8191]
    assert plan.program_of(8191) == "tp"


def test_the_header_is_the_fields_before_the_logical_graph_and_nothing_else_is_read_as_one(tmp_path):
    """`Plan.header`: format, model, dims, mesh, microbatches and schedule (and a recipe) of a saved plan, plain or
    compressed; {} for a file that does not start so — JSON written in another order, a broken file, no file."""
    plan = Plan.from_json(pp_plan())
    plain, packed = tmp_path / "plan.json", tmp_path / "plan.json.gz"
    plan.save(plain)
    plan.save(packed)
    head = {key: value for key, value in plan.to_json().items() if key not in
            ("logical", "programs", "ranks", "lineage", "interior")}
    assert Plan.header(plain) == Plan.header(packed) == head and "dims" in head and "recipe" not in head
    other, written = tmp_path / "other.json", plan.to_json()
    other.write_text(json.dumps({"logical": written.pop("logical"), **written}, indent=1))   # "logical" first
    assert Plan.header(other) == {} and Plan.load(other) == plan
    recipe = plain.read_text().replace(' "schedule": ', ' "recipe": {"optim": "sgd"},\n "schedule": ', 1)
    plain.write_text(recipe)            # a recipe written by hand: read as the plan reads it, defaults filled in
    assert Plan.header(plain)["recipe"] == Plan.load(plain).recipe == {"optim": "sgd", "clip": None, "tied": None,
                                                                       "masked": False, "parallel": ""}
    plain.write_text(recipe.replace('{"optim": "sgd"}', '{"optim": 3}'))
    assert Plan.header(plain) == {}     # not a plan's: nothing begun from it (reading it in full says why)
    broken = tmp_path / "broken.json.gz"
    broken.write_bytes(packed.read_bytes()[:20])
    assert Plan.header(broken) == {} and Plan.header(tmp_path / "missing.json") == {}
