"""Pipeline shards (`tv_ray.partition.generate`): each pipeline stage's ranks run apart, rebuilding what the other
stages send them from the senders' claims — the same stages, keys and DAG as the whole run, or no shards at all."""
from __future__ import annotations

from dataclasses import replace

import pytest

from tests.engine.mutants import MUTANTS
from tv_ray import api
from tv_ray.engine.driver import verify_plan
from tv_ray.partition.claims import Claims
from tv_ray.partition.derive import claims_for
from tv_ray.engine.executor import LocalExecutor
from tv_ray.partition.generate import Renamings, merge, partition, pipeline_shards, run_shards
from tv_ray.errors import Unshardable
from tv_ray.partition.lazy import Continued
from tv_ray.partition.logical import LogicalTerms
from tv_ray.partition.microbatches import place
from tv_ray.partition.stages import fingerprint
from tv_ray.partition.symmetry import find_mirrors, microbatch_moves
from tv_ray.reduce import reduce_plan


def _stages(part) -> list:
    return sorted((o.id, o.ranks, o.key, o.reads, o.claim.logical) for o in part.every())


@pytest.fixture(scope="module")
def pipelined(claimed):
    return claimed("dp=2,tp=2,pp=2,mb=2")          # dp mirrored, microbatch 1 moved from microbatch 0


def test_shards_give_the_stages_of_the_whole_run(pipelined):
    plan, dims, claims = pipelined
    whole = partition(plan, dims, claims, shards=False)
    sharded = partition(plan, dims, claims, shards=True)
    assert (whole.shards, sharded.shards) == (0, 2)
    assert sharded.mirrored > 2000 and sharded.moved > 700 and sharded.accumulated > 30
    assert _stages(sharded) == _stages(whole)
    assert set(sharded.formulas) == set(whole.formulas) and sharded.boundary.keys() == whole.boundary.keys()
    assert (sharded.mirrored, sharded.moved, sharded.accumulated, sharded.notes) == \
        (whole.mirrored, whole.moved, whole.accumulated, whole.notes)
    workers = LocalExecutor(jobs=2)
    try:                                          # each shard in its own worker process: the same stages
        apart = partition(plan, dims, claims, shards=True, generate=workers.map, groups=workers.width())
    finally:
        workers.close()
    assert [(o.id, o.key, o.position) for o in apart.obligations] == \
        [(o.id, o.key, o.position) for o in sharded.obligations]
    assert [(p.copy_ranks.tolist(), p.copy_of.tolist(), p.copy_mb.tolist()) for p in (apart, sharded)] == \
        [(sharded.copy_ranks.tolist(), sharded.copy_of.tolist(), sharded.copy_mb.tolist())] * 2
    position = {o.id: o.position for o in sharded.obligations}
    assert [o.position for o in sharded.obligations] == list(range(len(sharded.obligations)))
    assert all(position[r] < position[o.id] for o in sharded.obligations for r in o.reads if r in position)


def test_a_value_sent_uncut_is_rebuilt_by_replaying_its_ops():
    """GPT-2's stage 1 sends t_12, a transpose no claim cuts: the receiving shard re-runs it on its cut input."""
    plan = api.parallelize(api.capture_step("gpt2-tiny", optim="adamw", clip=1.0), "tp=2,pp=2,mb=2",
                           model="gpt2-tiny", zero=0)
    dims = reduce_plan(plan).reduced
    claims = claims_for(plan, dims)[1]
    assert (3, "t_12@0") not in claims
    whole, sharded = (partition(plan, dims, claims, shards=s) for s in (False, True))
    assert sharded.shards == 2 and _stages(sharded) == _stages(whole)


def test_a_sent_value_unlike_what_its_receiver_rebuilt_is_refused(pipelined):
    plan, dims, claims = pipelined
    found, _ = find_mirrors(plan, dims, True)
    moves = microbatch_moves(plan, dims, found, True)
    runs = run_shards(plan, dims, claims, Renamings(found, moves, moves.blocks), pipeline_shards(plan, claims))
    where = min(runs[0].sent)
    assert where == (0, 4, 16, 0) and runs[0].sent[where] == runs[1].assumed[where]
    assert runs[0].sent[where][1][0] == "continued"      # by its claim (`_recipe`): its terms never digested
    runs[0].sent[where] = ("terms", ((1,), "0" * 64), ())
    with pytest.raises(Unshardable, match=r"^send #1 from rank 0 to rank 4 \(tag 16\) is not the continuation "
                                          r"of its claim that the receiving shard rebuilt$"):
        merge(runs)
    del runs[0].sent[where]
    with pytest.raises(Unshardable, match=r"^send #1 from rank 0 to rank 4 \(tag 16\) was received but never "
                                          r"sent$"):
        merge(runs)


def test_a_continuation_is_fingerprinted_by_its_claim_and_anything_else_by_its_terms(pipelined):
    plan, dims, claims = pipelined
    logical = LogicalTerms.build(plan.logical, dims)
    whole = [c for c in claims.values() if not c.partial and c.shape]
    claim, other = whole[0], next(c for c in whole if place(c) != place(whole[0]))
    lazy, built = Continued(logical, claim), Continued(logical, claim)
    terms = built.terms()
    assert fingerprint(lazy, {"b", "a"}) == fingerprint(built, {"a", "b"}) == \
        ("terms", ("continued", place(claim)), ("a", "b"))
    assert fingerprint(Continued(logical, other), ()) != fingerprint(lazy, ())
    # the same terms as an array: a digest of them, equal for equal terms, unlike the recipe (a kind of its own)
    digest = fingerprint(terms, ())
    assert digest == fingerprint(terms.copy(), ()) != fingerprint(lazy, ())
    assert digest != fingerprint(Continued(logical, other).terms(), ())


def test_a_collective_across_pipeline_stages_keeps_the_run_whole(pipelined):
    plan, dims, claims = pipelined
    assert len(pipeline_shards(plan, claims)) == 2
    key = next(k for k, c in claims.items() if c.partial)
    assert pipeline_shards(plan, Claims({**claims, key: replace(claims[key], partial=("pp",))})) is None
    flat = api.parallelize(api.capture_step("llama3-tiny", optim="adamw", clip=1.0), "dp=2,tp=2", model="llama3-tiny")
    assert pipeline_shards(flat, {}) is None


@pytest.mark.parametrize("name", ["A6", "A11"])
def test_a_bug_is_refuted_at_the_same_stages_with_and_without_shards(name, pipelined):
    mutant = MUTANTS[name](pipelined[0])
    outcomes = [verify_plan(mutant.plan, progress=False, shards=s) for s in (False, True)]
    refuted = [sorted(o.id for o in out.partition.every() if out.verdicts[o.key].verdict == "refuted")
               for out in outcomes]
    assert [o.status for o in outcomes] == ["refuted", "refuted"] and outcomes[1].partition.shards == 2
    assert refuted[0] == refuted[1] and refuted[0]
    assert not mutant.diagnosis_problems(outcomes[1].first_refuted())


def test_depths_are_the_topological_generations_the_size_networkx_s_and_a_cycle_is_named():
    import random
    from types import SimpleNamespace

    import networkx as nx

    from tv_ray.errors import TvRayError
    from tv_ray.partition.dag import depths, size
    rng = random.Random(0)
    boundary = [f"in{i}" for i in range(4)]
    for n in (1, 5, 40, 300):
        # stage i reads earlier stages and ids that are no stage (a boundary input, a copy); one id twice
        obs = [SimpleNamespace(id=f"s{i}", reads=frozenset({f"s{j}" for j in rng.sample(range(i), min(i, 3))}
                                                         | {f"in{i % 4}"})) for i in range(n)]
        obs.append(SimpleNamespace(id=f"s{n - 1}", reads=frozenset({"s0"} if n > 1 else ())))
        rng.shuffle(obs)
        dag = nx.DiGraph()
        dag.add_nodes_from(ob.id for ob in obs)
        dag.add_edges_from((r, ob.id) for ob in obs for r in ob.reads if r.startswith("s"))
        assert depths(obs) == {c: d for d, layer in enumerate(nx.topological_generations(dag)) for c in layer}
        full = nx.DiGraph()          # the stage DAG as a graph: boundary inputs, stages, every read an edge
        full.add_nodes_from(boundary)
        full.add_nodes_from(ob.id for ob in obs)
        full.add_edges_from((r, ob.id) for ob in obs for r in ob.reads)
        assert size(boundary, obs) == (full.number_of_nodes() - len(boundary), full.number_of_edges())
    obs = [SimpleNamespace(id="a", reads=frozenset({"c", "x"})), SimpleNamespace(id="b", reads=frozenset({"a"})),
           SimpleNamespace(id="c", reads=frozenset({"b"})), SimpleNamespace(id="d", reads=frozenset({"c"}))]
    with pytest.raises(TvRayError) as err:
        depths(obs)
    assert str(err.value).startswith("the stage DAG has a cycle through ") and \
        set(str(err.value).split("through ")[1].split(", ")) == {"a", "b", "c"}
