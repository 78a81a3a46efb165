"""One exception root: every error class is a TvRayError, and an error's where is in its fields, set where raised."""
from __future__ import annotations

import inspect
import pickle

import numpy as np
import pytest

import tv_ray.errors as errors
import tv_ray.plan_check as plan_check
from plan.mlp_plans import mutated, tp_plan
from tv_ray.errors import (Asymmetric, GraphError, PlanError, ShapeError, SimulationError, TvRayError,
                           UnknownOpError)
from tv_ray.execute import Scheduler
from tv_ray.ir import Graph, Node, Op, TensorSpec
from tv_ray.ir.lint import lint
from tv_ray.plan import Plan
from tv_ray.semantics import check_graph, rule_for, run_graph
from tv_ray.semantics.table import instantiate_shape

CLASSES = {name: cls for name, cls in vars(errors).items()
           if inspect.isclass(cls) and issubclass(cls, BaseException) and cls.__module__ == errors.__name__}


def test_every_error_class_is_a_tv_ray_error_with_a_docstring():
    assert {"GraphError", "PlanError", "SimulationError", "ShapeError", "UnknownOpError", "SymbolicError",
            "TermError", "NormaliseError", "CheckpointError", "EngineError", "Unshardable", "Asymmetric",
            "EncodeError", "SolverUnavailable", "SolverBusy", "OutsideDomain", "NoReplay"} <= set(CLASSES)
    for name, cls in CLASSES.items():
        assert issubclass(cls, TvRayError), name
        assert cls.__doc__ and cls.__doc__.strip(), name


def test_no_module_but_errors_defines_an_exception_class():
    """Every exception class of tv_ray is declared in tv_ray/errors.py (read from the sources' syntax trees)."""
    import ast
    from pathlib import Path
    root = Path(errors.__file__).parent
    known = {"Exception", "BaseException", "ValueError", "TypeError", "RuntimeError", "KeyError"} | set(CLASSES)
    found = []
    for path in sorted(root.rglob("*.py")):
        if path.name == "errors.py" and path.parent == root:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and any(getattr(b, "id", getattr(b, "attr", None)) in known
                                                      for b in node.bases):
                found.append(f"{path.relative_to(root)}: {node.name}")
    assert found == []


def test_moved_classes_are_re_exported_from_their_old_modules():
    from tv_ray.engine.checkpoint import CheckpointError
    from tv_ray.semantics.symbolic import SymbolicError
    from tv_ray.terms import TermError
    from tv_ray.terms.normal import NormaliseError
    assert (SymbolicError, TermError, NormaliseError, CheckpointError) == \
        (errors.SymbolicError, errors.TermError, errors.NormaliseError, errors.CheckpointError)
    assert issubclass(NormaliseError, TermError)


def test_fields_default_to_none_and_a_misspelt_one_fails():
    err = GraphError("node y = neg(x): bad", node="y")
    assert (str(err), err.node, err.program, err.path) == ("node y = neg(x): bad", "y", None, None)
    assert err.fields() == {"node": "y", "program": None, "path": None}
    assert SimulationError("deadlock").rank is None
    with pytest.raises(TypeError, match="GraphError takes no field 'rank' \\(it takes: node, program, path\\)"):
        GraphError("x", rank=3)
    with pytest.raises(TypeError, match="TvRayError takes no field 'node' \\(it takes: none\\)"):
        TvRayError("x", node="y")


def test_fields_survive_pickling():
    """Errors cross process boundaries (Ray workers): the fields must arrive too."""
    err = pickle.loads(pickle.dumps(Asymmetric("rank 3 mixes mirrored and computed values", rank=3, node="h")))
    assert (type(err), str(err), err.rank, err.node) == \
        (Asymmetric, "rank 3 mixes mirrored and computed values", 3, "h")


def _graph(*nodes: Node) -> Graph:
    inputs = (TensorSpec.from_json({"name": "x", "shape": [2, 3]}, ""),)
    return Graph(inputs, nodes, (("out", nodes[-1].name),), "rank0")


def test_a_malformed_graph_names_its_bad_node_in_the_field():
    with pytest.raises(GraphError) as err:
        lint(_graph(Node.make("a", "neg", ["x"], shape=[2, 3]), Node.make("b", "neg", ["a", "x"], shape=[2, 3])))
    assert (err.value.node, err.value.program) == ("b", "rank0")
    with pytest.raises(GraphError) as err:
        lint(_graph(Node.make("a", "neg", ["x"], shape=[2, 3]), Node.make("b", "neg", ["gone"], shape=[2, 3])))
    assert (err.value.node, err.value.path) == ("b", "rank0.ops[1].args")
    with pytest.raises(GraphError) as err:
        check_graph(_graph(Node.make("a", "neg", ["x"], shape=[2, 3]), Node.make("b", "neg", ["a"], shape=[3, 2])))
    assert (err.value.node, err.value.program) == ("b", "rank0")


def test_an_unknown_op_names_the_op_in_the_field():
    with pytest.raises(UnknownOpError) as err:
        Node.make("y", "matmul", ["x"], shape=[2])
    assert err.value.op == "matmul"
    assert str(err.value).startswith("unknown op 'matmul'; known ops: _log_softmax, ")
    with pytest.raises(UnknownOpError) as err:
        rule_for(Op.NEG, "group")
    assert (str(err.value), err.value.op) == ("no group rule for op neg", "neg")


def test_the_interpreter_adds_the_node_to_a_rules_error():
    inputs = (TensorSpec.from_json({"name": "w", "shape": [3, 2]}, ""),
              TensorSpec.from_json({"name": "i", "shape": [2], "dtype": "int"}, ""))
    g = Graph(inputs, (Node.make("e", "embedding", ["w", "i"], shape=[2, 2]),), (("out", "e"),), "rank0")
    with pytest.raises(ShapeError) as err:   # the rule knows no node; run_graph fills it in
        run_graph(g, {}, {"w": np.ones((3, 2)), "i": np.array([0, 5])})
    assert str(err.value) == "embedding: an index lies outside [0, 3)\n  while executing e = embedding(w, i)"
    assert err.value.node == "e"


def _broken_tp_plan() -> tuple[dict, int]:
    obj = mutated(tp_plan())
    ops = obj["programs"]["tp"]["ops"]
    index = next(i for i, op in enumerate(ops) if op["out"] == "a")   # a = tanh(h), not the first op
    ops[index]["shape"] = ["batch", "ffn"]
    return obj, index


def test_plan_check_names_the_op_from_the_lint_field():
    obj, index = _broken_tp_plan()
    assert index > 0
    with pytest.raises(PlanError) as err:
        Plan.from_json(obj)
    assert str(err.value) == (f"programs.tp.ops[{index}]: node a = tanh(h): stated shape [4, 8] but tanh of [4, 4] "
                              f"gives [4, 4]; fix the stated shape or the inputs")
    assert (err.value.path, err.value.node) == (f"programs.tp.ops[{index}]", "a")


def test_plan_check_reads_the_field_not_the_message(monkeypatch):
    plan = Plan.from_json(tp_plan())
    names = [n.name for n in plan.programs["tp"].nodes]

    def fails_at(graph, *args, **kwargs):
        if graph.name == "tp":
            raise GraphError("a message that names no node", node=names[3], program="tp")

    monkeypatch.setattr(plan_check, "check_graph", fails_at)
    with pytest.raises(PlanError) as err:
        plan_check.check_plan(plan)
    assert str(err.value) == "programs.tp.ops[3]: a message that names no node"
    assert (err.value.path, err.value.node) == ("programs.tp.ops[3]", names[3])


class _Refusing(Scheduler):
    """A value domain whose ops (or collectives) raise `error`, as the symbolic run raises Asymmetric."""

    def __init__(self, plan: Plan, error: Exception, where: str):
        names, ids = plan.rank_programs()
        inputs = [{spec.name: np.zeros(instantiate_shape(spec.shape, plan.dims))
                   for spec in plan.programs[names[ids[r]]].inputs} for r in range(plan.num_ranks)]
        super().__init__(plan, dict(plan.dims), inputs)
        self.error, self.where = error, where

    def evaluate(self, state, node, args):
        if self.where == "op":
            raise self.error
        return super().evaluate(state, node, args)

    def evaluate_group(self, node, members, values):
        raise self.error


@pytest.mark.parametrize("where", ["op", "collective"])
def test_the_scheduler_lets_asymmetric_through_and_wraps_the_rest_with_rank_and_node(where):
    plan = Plan.from_json(tp_plan())
    asymmetric = Asymmetric("rank 1 h mixes mirrored and computed values")
    with pytest.raises(Asymmetric) as err:      # control flow of generation, not a failed op
        _Refusing(plan, asymmetric, where).run()
    assert err.value is asymmetric
    with pytest.raises(SimulationError) as err:
        _Refusing(plan, ShapeError("bad"), where).run()
    assert type(err.value) is SimulationError and str(err.value).endswith(": bad")
    assert (err.value.rank, err.value.node) == ((0, "h") if where == "op" else (1, "y"))
