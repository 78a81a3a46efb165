"""Every malformed plan is refused with one line that starts with the JSON path of the problem."""
import pytest

from plan.mlp_plans import entry, mutated, pp_plan, pp_stage0, tp_plan, zero_plan
from tv_ray.errors import PlanError
from tv_ray.plan import Plan


def refused(obj) -> str:
    with pytest.raises(PlanError) as info:
        Plan.from_json(obj)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_truncated_json(tmp_path):
    path = tmp_path / "plan.json"
    path.write_text('{\n "format": "tv-ray-plan/1",\n "model": ')
    with pytest.raises(PlanError) as info:
        Plan.load(path)
    assert str(info.value) == f"{path}: not valid JSON at line 3 column 11: Expecting value"


def test_truncated_real_plan(tmp_path):
    path = tmp_path / "plan.json"
    Plan.from_json(tp_plan()).save(path)
    path.write_text(path.read_text()[:-200])
    with pytest.raises(PlanError, match=rf"^{path}: not valid JSON at line \d+ column \d+: "):
        Plan.load(path)


def test_missing_file(tmp_path):
    with pytest.raises(PlanError, match=r"nope.json: cannot read: No such file or directory$"):
        Plan.load(tmp_path / "nope.json")


def test_wrong_format_tag():
    obj = tp_plan()
    obj["format"] = "tv-ray-plan/0"
    assert refused(obj) == "format: expected 'tv-ray-plan/1', got 'tv-ray-plan/0'"


def test_unknown_field():
    obj = tp_plan()
    obj["stages"] = 2
    assert refused(obj).startswith("stages: unknown field 'stages' (known: format, model, dims, mesh,")
    obj = tp_plan()
    obj["lineage"][0]["replicas"] = 2
    assert refused(obj) == ("lineage[0].replicas: unknown field 'replicas' "
                            "(known: where, tensor, logical, slice, partial, scale)")


def test_unknown_op():
    obj = tp_plan()
    obj["programs"]["tp"]["ops"][0]["op"] = "matmul"
    assert refused(obj).startswith("programs.tp.ops[0].op: unknown op 'matmul'; known ops: _log_softmax, ")


def test_shape_mismatch_names_path_and_node():
    obj = tp_plan()
    obj["programs"]["tp"]["ops"][0]["shape"] = ["batch", "ffn"]
    assert refused(obj) == ("programs.tp.ops[0]: node h = mm(x, w1): stated shape [4, 8] but mm of [4, 4] and "
                            "[4, 4] gives [4, 4]; fix the stated shape or the inputs")


def test_collective_on_an_axis_the_mesh_lacks():
    obj = zero_plan()
    index = next(i for i, op in enumerate(obj["programs"]["zero"]["ops"]) if op["op"] == "reduce_scatter")
    obj["programs"]["zero"]["ops"][index]["attrs"]["axes"] = ["cp"]
    assert refused(obj) == f"programs.zero.ops[{index}].attrs.axes: axis 'cp' is not in the mesh (dp, tp)"


def test_communication_in_the_logical_graph():
    obj = tp_plan()
    obj["logical"]["ops"][2] = {"out": "p", "op": "all_reduce", "args": ["p0"], "shape": ["batch", "d"],
                                "attrs": {"axes": ["tp"], "reduce": "sum"}}
    obj["logical"]["ops"].insert(2, {"out": "p0", "op": "mm", "args": ["a", "w2"], "shape": ["batch", "d"]})
    assert refused(obj) == ("logical.ops[3].op: all_reduce belongs to rank programs; the logical graph is one "
                            "device's step")


def test_rank_with_no_program():
    obj = zero_plan()
    obj["programs"] = {"zero0": obj["programs"]["zero"]}
    obj["ranks"] = {"program": "zero{tp}"}
    assert refused(obj) == "ranks.program: rank 1 (dp=0, tp=1) runs 'zero1', which is not in programs"


def test_template_naming_a_missing_axis():
    obj = tp_plan()
    obj["ranks"] = {"program": "tp{pp}"}
    assert refused(obj) == "ranks.program: template field {pp} is not a mesh axis (tp)"


def test_overrides_naming_unknown_ranks_or_programs():
    obj = tp_plan()
    obj["ranks"] = {"program": "tp", "overrides": {"9": "tp"}}
    assert refused(obj) == "ranks.overrides.9: '9' is not a rank of the mesh (ranks 0..1)"
    obj["ranks"] = {"program": "tp", "overrides": {"1": "tp_bug"}}
    assert refused(obj) == "ranks.overrides.1: program 'tp_bug' is not in programs"


def test_missing_dim():
    obj = tp_plan()
    del obj["dims"]["ffn"]
    assert refused(obj) == ("logical.inputs[1].shape[1]: shape expression ffn uses dimension 'ffn', which the "
                            "dims table does not define")


def test_input_without_lineage():
    obj = tp_plan()
    del obj["lineage"][2]
    assert refused(obj) == ("programs.tp.inputs[2]: rank 0 (tp=0) has no lineage entry for input 'w2'; each "
                            "program input needs exactly one")


def test_input_with_two_lineage_entries():
    obj = tp_plan()
    obj["lineage"].append(entry("x", where={"tp": 1}))
    assert refused(obj) == ("programs.tp.inputs[0]: rank 1 (tp=1) has 2 lineage entries (lineage[0], lineage[10]) "
                            "for input 'x'; each program input needs exactly one")


def test_partial_on_an_input():
    obj = tp_plan()
    obj["lineage"][0]["partial"] = ["tp"]
    assert refused(obj) == "lineage[0].partial: program input 'x' of 'tp' is a whole value, not a partial sum"


def test_scale_on_an_input_and_malformed_scales():
    obj = tp_plan()
    obj["lineage"][0]["scale"] = 2
    assert refused(obj) == "lineage[0].scale: program input 'x' of 'tp' is its slice of 'x' itself, not a multiple of it"
    for bad in (0, -2, "-1/2", 1.5, "two", "1/0", True):
        obj = tp_plan()
        obj["lineage"][4]["scale"] = bad
        expected = f"expected a positive scale, got {bad!r}" if bad in (0, -2, "-1/2") else \
            f"expected a positive integer or a fraction \"p/q\", got {bad!r}"
        assert refused(obj) == f"lineage[4].scale: {expected}"


def test_lineage_naming_missing_tensors():
    obj = tp_plan()
    obj["lineage"][4]["tensor"] = "losses"
    assert refused(obj) == "lineage[4].tensor: rank 0 (tp=0) runs 'tp', which has no input or output 'losses'"
    obj = tp_plan()
    obj["lineage"][4]["logical"] = "losses"
    assert refused(obj) == "lineage[4].logical: 'losses' is neither an input nor an output of the logical graph"
    obj = tp_plan()
    obj["lineage"][0]["where"] = {"cp": 0}
    assert refused(obj) == "lineage[0].where.cp: axis 'cp' is not in the mesh (tp)"


def test_local_shape_must_equal_the_slice_shape():
    obj = tp_plan()
    obj["lineage"][1]["slice"][0]["split"].append({"index": 0, "of": 2})
    assert refused(obj) == "lineage[1]: 'w1' in program 'tp' has shape (4, 4), but its slice of 'w1' has shape (4, 2)"


def test_split_must_divide():
    obj = tp_plan()
    obj["mesh"]["tp"] = 3
    assert refused(obj) == "lineage[1].slice[0].split: dim 1 of 'w1' has size 8, which does not split into 3 equal chunks"


def test_uncovered_logical_output():
    obj = zero_plan()
    index = next(i for i, e in enumerate(obj["lineage"]) if e["tensor"] == "grad/w2")
    obj["lineage"][index] = entry("grad/w2", where={"dp": 0}, slice_=[(0, ["tp", {"index": 0, "of": 2}])])
    assert refused(obj) == ("logical.outputs.grad/w2: not covered by output lineage (no rank holds "
                            "grad/w2[2:4, 0:4]); shape (8, 4)")
    obj = zero_plan()
    obj["lineage"] = [e for e in obj["lineage"] if e["logical"] != "new/w2"]
    assert refused(obj) == ("logical.outputs.new/w2: not covered by output lineage (no output lineage entry names "
                            "it); shape (8, 4)")


def test_send_to_a_peer_outside_the_mesh():
    obj = mutated(pp_plan())
    obj["programs"]["stage0"] = pp_stage0(peer={"pp": -1})     # src and dst swapped
    assert refused(obj) == "programs.stage0.ops[2].attrs.peer: rank 0 (pp=0) has no peer at pp-1 (pp has 2 positions)"


def test_intermediate_lineage_is_checked_like_boundary_lineage():
    """`interior` entries: an op of the program, a tensor of the logical graph, the slice's shape."""
    good = [entry("h", slice_=[(1, ["tp"])]), entry("p", partial=["tp"]), entry("y", "p")]
    obj = tp_plan()
    obj["interior"] = good
    plan = Plan.from_json(obj)
    assert [e.tensor for e in plan.interior] == ["h", "p", "y"]
    obj["interior"] = good + [entry("x", "h", slice_=[(1, ["tp"])])]
    assert refused(obj) == "interior[3].tensor: rank 0 (tp=0) runs 'tp', which has no op 'x'"
    obj["interior"] = good + [entry("h", "hidden")]
    assert refused(obj) == "interior[3].logical: 'hidden' is not a tensor of the logical graph"
    obj["interior"] = good + [entry("h")]
    assert refused(obj) == ("interior[3]: 'h' in program 'tp' is float (4, 4), but its slice of 'h' is "
                            "float (4, 8)")
    obj["interior"] = {"h": "h"}
    assert refused(obj) == "interior: expected a list of lineage entries"


def test_an_ignored_target_value_inside_the_range_or_on_a_float_input():
    """Masked targets may hold the loss's ignore_index (-100) besides [0, vocab): `ignore`."""
    from tv_ray import api
    obj = api.parallelize(api.capture_step("llama3-tiny", masked=True), "dp=2", model="llama3-tiny").to_json()
    inputs = obj["logical"]["inputs"]
    i, targets = next((i, s) for i, s in enumerate(inputs) if s["name"] == "targets")
    assert targets["ignore"] == -100 and all("ignore" not in s for s in inputs if s["name"] != "targets")
    targets["ignore"] = 1
    assert refused(obj) == (f"logical.inputs[{i}].ignore: ignore 1 of 'targets' lies in [0, high): a value the loss "
                            f"ignores must be no valid one")
    targets["ignore"] = -100
    j = next(j for j, s in enumerate(inputs) if s["dtype"] == "float")
    inputs[j]["ignore"] = -1
    assert refused(obj) == (f"logical.inputs[{j}].ignore: expected an integer on an int input (the value a loss "
                            f"ignores), got -1 on a float input")
