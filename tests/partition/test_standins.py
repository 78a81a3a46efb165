"""Stand-ins (tv_ray/partition/standins.py): mirrored dp ranks never stepped give exactly the stages that
stepping them gives, and whatever they cannot stand in for falls back to stepping them."""
from __future__ import annotations

import pytest

from tv_ray import api
from tv_ray.errors import Asymmetric
from tv_ray.ir import Node
from tv_ray.partition.derive import claims_for, unmirrored
from tv_ray.partition.generate import partition
from tv_ray.partition.logical import LogicalTerms, atoms
from tv_ray.partition.standins import Mirrored, StandIns
from tv_ray.partition.stages import SymbolicRun
from tv_ray.partition.symmetry import find_mirrors, mirrors
from tv_ray.reduce import reduce_plan

# dp=2,tp=2: the mirrors' parts of the final norm's gradient (over a dp × tp group, no contribution sum) are
# free parts of their own, which they compute on until the all-reduce
PLANS = [("llama3-tiny", "dp=4", {}), ("llama3-tiny", "dp=2,tp=2,pp=2,mb=2", {"sp": True}),
         ("llama3-tiny", "dp=2,tp=2", {"sp": True}), ("gpt2-tiny", "dp=2,tp=2,pp=2,mb=2", {"sp": True})]


def _rows(part) -> list:
    return sorted((str(o.id), o.ranks, o.key, tuple(map(str, o.reads)), str(o.claim), o.tensor, o.program)
                  for o in part.every())


def _claimed(model: str, spec: str, flags: dict):
    plan = api.parallelize(api.capture_step(model, optim="adamw", clip=1.0), spec, model=model, **flags)
    dims = reduce_plan(plan).reduced
    found, _ = find_mirrors(plan, dims)
    return plan, dims, found, claims_for(plan, dims, 0, unmirrored(plan, found))[1]


@pytest.fixture(scope="module", params=PLANS, ids=lambda p: f"{p[0]}-{p[1]}-{p[2]}")
def claimed(request):
    return _claimed(*request.param)


@pytest.fixture(scope="module")
def pipelined():
    """A plan with every kind of meeting: tp and dp collectives, pipeline send/recv, microbatches."""
    plan, dims, found, claims = _claimed(*PLANS[1])
    return plan, dims, found, claims, partition(plan, dims, claims, found, virtual=False)


def test_standing_in_gives_the_stages_of_stepping_every_mirrored_rank(claimed):
    plan, dims, found, claims = claimed
    stood = partition(plan, dims, claims, found, virtual=True)
    stepped = partition(plan, dims, claims, found, virtual=False)
    assert stood.stood_in == len(found.rep) > 0 and stepped.stood_in == 0
    assert stood.mirrored == stepped.mirrored > 0
    assert _rows(stood) == _rows(stepped)
    assert stood.key_counts() == stepped.key_counts()


def test_mirrored_ranks_are_never_stepped(pipelined):
    plan, dims, found, claims, _ = pipelined
    stepped = []

    class Watched(SymbolicRun):
        def _advance(self, state, node, value):
            stepped.append(state.rank)
            super()._advance(state, node, value)

    logical = LogicalTerms.build(plan.logical, dims, found.blocks)
    Watched(plan, dims, logical, claims, found, virtual=True).run()
    assert stepped and not set(stepped) & set(found.rep)


def test_what_cannot_be_stood_in_for_is_stepped_with_the_same_stages(pipelined, monkeypatch):
    plan, dims, found, claims, stepped = pipelined
    original = StandIns._mirror_kind

    def refuse(self, state, node):
        if node.op.value == "mm":
            raise Asymmetric("refused")
        return original(self, state, node)

    monkeypatch.setattr(StandIns, "_mirror_kind", refuse)
    fell_back = partition(plan, dims, claims, found, virtual=True)
    assert fell_back.stood_in == 0 and fell_back.symmetry == stepped.symmetry == []
    assert _rows(fell_back) == _rows(stepped)


@pytest.fixture(scope="module")
def dp4_run():
    plan, dims, found, claims = _claimed("llama3-tiny", "dp=4", {})
    run = SymbolicRun(plan, dims, LogicalTerms.build(plan.logical, dims, found.blocks), claims, found, virtual=True)
    return plan, run


def test_a_mirror_that_gets_a_value_of_its_own_keeps_it_by_dp_block(dp4_run):
    plan, run = dp4_run
    node = plan.programs["main"].nodes[0]
    own = atoms("own", (2,))
    try:
        run.stood_in(node, 2, own)                      # rank 2: dp block 2, a mirror of rank 0
        assert run._stood[0] == {2: own}
        with pytest.raises(Asymmetric) as err:
            run.stood_in(node, 3, Mirrored((2,)))
    finally:
        run._stood.clear()
    assert str(err.value) == f"the mirrors of rank 0 (dp=0) get different kinds of {node.name}"


def test_a_mirror_computing_from_its_own_and_a_mirrored_value_ends_the_stand_ins(dp4_run):
    plan, run = dp4_run
    node = next(n for n in plan.programs["main"].nodes if n.op.value == "mul")
    run._kinds[0, node.args[0]] = {1: atoms("own", (2,))}
    try:
        with pytest.raises(Asymmetric) as err:
            run._mirror_kind(run.ranks[0], node)
    finally:
        run._kinds.clear()
    assert str(err.value) == (f"the mirrors of rank 0 (dp=0) compute {node.name} from values of their own and "
                              f"mirrored ones")


def test_a_send_to_a_mirrored_rank_ends_the_stand_ins(dp4_run):
    plan, run = dp4_run
    arg = plan.programs["main"].nodes[0].name
    send = Node.make("send_x", "send", (arg,), {"peer": (("dp", 1),), "tag": 0}, (), "token")
    with pytest.raises(Asymmetric) as err:
        run._send(run.ranks[0], send)
    assert str(err.value) == "rank 0 (dp=0) sends to mirrored rank 1"


def test_standing_in_needs_every_rank_off_dp_0_mirrored(pipelined):
    plan, dims, found, claims, _ = pipelined
    found = mirrors(plan, dims)
    found.notes = ["rank 3 runs in full: its program differs from dp rank 0's"]
    run = SymbolicRun(plan, dims, LogicalTerms.build(plan.logical, dims, found.blocks), claims, found, virtual=True)
    assert run.virtual == frozenset() and len(run.active) == plan.num_ranks
