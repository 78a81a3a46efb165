"""Layer j's ops taken as layer j−1's (or j+1's) renamed (`tv_ray.partition.layers`): the same stages, order and keys
as stepping every op, and an op that is not its counterpart's renamed is stepped — a layer that computes something
else is verified, not renamed."""
from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest

from tv_ray import api
from tv_ray.engine.driver import verify_plan
from tv_ray.engine.executor import LocalExecutor
from tv_ray.engine.solve import Budget
from tv_ray.ir import Op
from tv_ray.models import get
from tv_ray.parallel.spec import ParallelSpec
from tv_ray.partition import layers
from tv_ray.partition.derive import claims_for
from tv_ray.partition.generate import partition
from tv_ray.partition.layers import LayerRenamed, LayerShift, layer_counterparts, layers_of
from tv_ray.partition.logical import LogicalTerms
from tv_ray.reduce import reduce_plan

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))
from mutants import _like, edit, with_program  # noqa: E402

LAYERS = 4


@pytest.fixture(scope="module")
def deep():
    """`deep(spec)` -> (plan, reduced dims, claims) for llama3-tiny with four layers at `spec`."""
    tiny = get("llama3-tiny")
    model = tiny.with_dims(dict(tiny.dims), layers=LAYERS)
    step = api.capture_step(model, optim="adamw", clip=1.0)
    made = {}

    def make(spec):
        if str(spec) not in made:
            plan = api.parallelize(step, spec, model=model)
            dims = reduce_plan(plan).reduced
            made[str(spec)] = plan, dims, claims_for(plan, dims)[1]
        return made[str(spec)]
    return make


def _stages(part) -> list[tuple]:
    return [(o.id, o.ranks, o.key, o.reads, o.claim, o.position, o.mb) for o in part.every()]


def _layer(name: str) -> int | None:
    found = layers.INPUT_LAYER.search(name)
    return int(found.group(1)) if found else None


def test_layer_i_plus_1_is_layer_i_renamed_in_the_logical_graph(deep):
    """τ takes each weight, optimizer state and op of layer i to the one at its place in layer i+1, for i < 3; the
    ops it shows alike are the same op on renamed arguments, and it keeps the logical order."""
    plan, dims, _ = deep("tp=2,pp=2,mb=2")
    logical = LogicalTerms.build(plan.logical, dims)
    shift = LayerShift.of(plan.logical, logical)
    assert shift.notes == []
    assert shift.renames["layers.0.attn.q_proj.weight"] == "layers.1.attn.q_proj.weight"
    assert shift.renames["exp_avg_sq/layers.2.mlp.down_proj.weight"] == "exp_avg_sq/layers.3.mlp.down_proj.weight"
    placed = layers_of(plan.logical.nodes)
    nodes = {n.name: n for n in plan.logical.nodes}
    for x, y in shift.renames.items():
        i = placed.get(x, _layer(x))
        assert i is not None and i < LAYERS - 1 and placed.get(y, _layer(y)) == i + 1
    assert not any(x in shift.renames for x, i in placed.items() if i == LAYERS - 1)
    alike = [x for x in shift.alike if x in nodes]
    assert len(alike) > 0.9 * len([x for x in shift.renames if x in nodes])
    for x in alike:
        a, b = nodes[x], nodes[shift.renames[x]]
        assert (a.op, a.attrs, a.shape) == (b.op, b.attrs, b.shape)
        assert all(shift.renames.get(p, p) == q for p, q in zip(a.args, b.args))
    order = logical.order
    kept = sorted(shift.renames, key=order.__getitem__)
    assert [order[shift.renames[x]] for x in kept] == sorted(order[shift.renames[x]] for x in kept)


def test_an_op_of_one_layer_that_differs_is_not_shown_alike(deep):
    """Layer 2's attention norm with another epsilon: neither it nor layer 1's norm (whose image it is) is alike
    with its image — nor, lined up no more, the ops that read them —, and the other ops still are."""
    plan, dims, _ = deep("tp=2,pp=2,mb=2")
    eps = next(n for n in plan.logical.nodes if n.get_meta("module") == "layers.2.attn_norm" and n.op == Op.ADD and
               "other" in n.attr)
    graph = edit(plan.logical, plan.logical.name,
                 change={eps.name: dataclasses.replace(eps, attrs=tuple(sorted({**eps.attr, "other": 0.5}.items())))})
    before = LayerShift.of(plan.logical, LogicalTerms.build(plan.logical, dims))
    after = LayerShift.of(graph, LogicalTerms.build(graph, dims))
    into = next(x for x, y in before.renames.items() if y == eps.name)
    assert {into, eps.name} <= before.alike
    assert into not in after.alike and eps.name not in after.alike and after.alike <= before.alike
    readers = {n.name for n in graph.nodes if {into, eps.name} & set(n.args)}
    assert before.alike - after.alike <= {into, eps.name} | readers


def test_a_renaming_that_changes_the_logical_order_is_refused_with_its_reason(deep):
    """Keys number a formula's tensors in logical order: where τ would not keep it, τ is empty and the note names two
    tensors it would swap."""
    plan, dims, _ = deep("tp=2,pp=2,mb=2")
    logical = LogicalTerms.build(plan.logical, dims)
    a, b = "layers.1.attn.q_proj.weight", "layers.1.attn.k_proj.weight"
    logical.order[a], logical.order[b] = logical.order[b], logical.order[a]
    shift = LayerShift.of(plan.logical, logical)
    assert (shift.renames, shift.alike) == ({}, frozenset())
    assert shift.notes == ["layers: renaming layer i to layer i+1 changes the logical order of the tensors "
                           "(layers.0.attn.q_proj.weight before layers.0.attn.k_proj.weight, "
                           f"{a} after {b}); every layer stepped"]


def test_each_op_pairs_with_the_op_at_its_place_in_the_layer_run_just_before(deep):
    """Forward and optimizer ops of layer j pair with layer j−1's, backward ops with layer j+1's (run first), each the
    same op of the same module within its layer; sends and receives (a neighbour's module) never pair."""
    plan = deep("tp=2,pp=2,mb=2")[0]
    for name, program in plan.programs.items():
        pairs = layer_counterparts(program)
        nodes = {n.name: n for n in program.nodes}
        placed = layers_of(program.nodes)
        at = {n.name: i for i, n in enumerate(program.nodes)}
        assert len(pairs) > 150, name
        for mine, (theirs, d) in pairs.items():
            a, b = nodes[mine], nodes[theirs]
            assert (a.op, a.attrs, a.shape, a.get_meta("phase"), a.get_meta("mb")) == \
                (b.op, b.attrs, b.shape, b.get_meta("phase"), b.get_meta("mb"))
            assert a.get_meta("mb") in (0, None) and a.op not in (Op.SEND, Op.RECV)
            assert placed[theirs] == placed[mine] + d and at[theirs] < at[mine]
            assert d == (1 if a.get_meta("phase") == "bwd" else -1)


def _taken(monkeypatch) -> list[str]:
    """The ops the layer path takes from now on, as they are taken."""
    taken = []
    take = LayerRenamed._kept_after

    def spy(self, state, node, value):
        taken.append(node.name)
        return take(self, state, node, value)
    monkeypatch.setattr(LayerRenamed, "_kept_after", spy)
    return taken


@pytest.mark.parametrize("spec", ["tp=2,pp=2,mb=2", "dp=2,tp=2,mb=2", ParallelSpec.parse("tp=2,mb=2", sp=True)],
                         ids=str)
def test_layer_renamed_ops_give_the_stages_of_stepping_every_op(deep, spec, monkeypatch):
    """Taken as their counterparts' renamed (partial cuts and free parts among them) or stepped: the same stages, keys,
    copies and notes."""
    plan, dims, claims = deep(spec)
    taken = _taken(monkeypatch)
    on = partition(plan, dims, claims, shards=False)
    monkeypatch.setattr(LayerRenamed, "_layer_renamed", lambda self, state, node: False)
    off = partition(plan, dims, claims, shards=False)
    assert len(taken) > 1000 and on.layer_renamed == len(taken) and off.layer_renamed == 0
    assert _stages(on) == _stages(off)
    assert (on.copy_ranks.tolist(), on.copy_of.tolist(), on.copy_mb.tolist(), on.notes) == \
        (off.copy_ranks.tolist(), off.copy_of.tolist(), off.copy_mb.tolist(), off.notes)
    assert on.formulas.keys() == off.formulas.keys()


def _verify(plan):
    return verify_plan(plan, budget=Budget(solvers=("z3",)), executor=LocalExecutor(jobs=1), progress=False)


def test_an_op_of_layer_2_reading_layer_1s_value_is_stepped_and_refuted_there(deep, monkeypatch):
    """Layer 2's query projection reads layer 1's normed input: the same op as its counterpart (layer 1's) on the very
    value that one read — which τ does not leave alone — so it is stepped, not renamed, and refuted at that op; the
    unchanged plan takes it renamed."""
    plan = deep("tp=2,mb=2")[0]
    program = plan.programs["main"]
    mm = next(n for n in program.nodes if n.get_meta("module") == "layers.2.attn.q_proj" and n.op == Op.MM and
              n.get_meta("mb") == 0)
    counterpart, d = layer_counterparts(program)[mm.name]
    assert d == -1
    taken = []
    take = LayerRenamed._layer_cut

    def spy(self, state, node, *args):
        found = take(self, state, node, *args)
        taken.append((node.name, found))
        return found
    monkeypatch.setattr(LayerRenamed, "_layer_cut", spy)
    assert _verify(plan).status == "proved"
    assert (mm.name, True) in taken
    wrong = _like(mm, mm.name, "mm", [program.value(counterpart).args[0], mm.args[1]])
    mutant = with_program(plan, "main", edit(program, "main", change={mm.name: wrong}))
    taken.clear()
    outcome = _verify(mutant)
    first = outcome.first_refuted()
    assert outcome.status == "refuted" and outcome.partition.layer_renamed > 500
    assert (mm.name, True) not in taken
    assert (first.id.tensor, first.mb, first.module) == (mm.name, 0, "layers.2.attn.q_proj")


def test_a_backward_op_reading_another_layers_activation_is_stepped_and_refuted(deep, monkeypatch):
    """Layer 2's attention backward transposes a forward activation of layer 2 (a view no claim cuts), which was taken
    as layer 1's renamed; its counterpart (layer 3's) transposes layer 3's, taken as layer 2's renamed — τ of what it
    reads, the other way round —, so it is taken renamed. Transposing layer 1's activation instead, it is stepped,
    and the plan refuted in layer 2's attention backward."""
    plan, dims, claims = deep("tp=2,mb=2")
    program = plan.programs["main"]
    pairs = layer_counterparts(program)
    transpose = next(n for n in program.nodes if n.get_meta("module") == "layers.2.attn" and n.get_meta("mb") == 0
                     and n.get_meta("phase") == "bwd" and n.op == Op.TRANSPOSE and
                     program.value(n.args[0]).get_meta("phase") == "fwd")
    activation = transpose.args[0]
    earlier, d = pairs[activation]
    assert pairs[transpose.name][1] == 1 and d == -1 and (0, activation) not in claims
    assert program.value(earlier).get_meta("module") == "layers.1.attn"
    taken = _taken(monkeypatch)
    assert _verify(plan).status == "proved"
    assert activation in taken and transpose.name in taken
    wrong = _like(transpose, transpose.name, "transpose", [earlier], dict(transpose.attr))
    mutant = with_program(plan, "main", edit(program, "main", change={transpose.name: wrong}))
    taken.clear()
    outcome = _verify(mutant)
    first = outcome.first_refuted()
    assert outcome.status == "refuted" and transpose.name not in taken
    assert (first.mb, first.module, first.phase) == (0, "layers.2.attn", "bwd")


def test_an_unfolded_counterpart_stage_lends_its_key_only_where_tau_renames_what_unfolded_it():
    """A stage whose formula was unfolded by tensors' definitions serves layer j only where each tensor is alike
    (τ of its equation is the graph's own); then layer j's stage holds τ of the set (τ⁻¹ for a backward, d = +1)."""
    run = object.__new__(LayerRenamed)
    run.layers = LayerShift({"a1": "a2", "b1": "b2"}, frozenset({"a1"}), frozenset({"a1", "a2", "b1", "b2"}), [])
    plain, alike, other = (layers.StageId("r", (0,), name) for name in ("plain", "alike", "other"))
    run._keyed_at = {plain: (0, frozenset()), alike: (1, frozenset({"a1"})), other: (2, frozenset({"b1"}))}
    assert run._keyed_stage(plain, -1) == (0, frozenset())
    assert run._keyed_stage(alike, -1) == (1, frozenset({"a2"}))
    assert run._keyed_stage(other, -1) is None                   # b1 is renamed but not alike
    assert run._keyed_stage(layers.StageId("r", (0,), "none"), -1) is None
    run._keyed_at[alike] = (1, frozenset({"a2"}))
    assert run._keyed_stage(alike, 1) == (1, frozenset({"a1"}))  # a2 is τ of an alike tensor
    assert run._keyed_stage(alike, -1) is None                   # a2 itself is no alike tensor's preimage
