"""Claims, stages and keys on a real plan: every stage of a correct plan is closed, keys deduplicate slots."""
import pytest

from tv_ray.terms.atom import Atom

from tv_ray import api
from tv_ray.partition.derive import Settings, claims_for, derive
from tv_ray.partition.keys import formula_key
from tv_ray.partition.generate import partition
from tv_ray.reduce import reduce_plan
from tv_ray.terms import const, var


@pytest.fixture(scope="module")
def plan():
    graph = api.capture_step("llama3-tiny", optim="adamw", clip=1.0)
    return api.parallelize(graph, "dp=2", model="llama3-tiny")


@pytest.fixture(scope="module")
def derived(plan):
    return derive(plan, Settings(symmetry=False))     # every rank computed: keys must still coincide across slots


def test_boundary_claims_come_from_lineage_and_cover_every_output(plan, derived):
    runs, claims, part = derived.runs, derived.claims, derived.partition
    outputs = {value for _, value in plan.logical.outputs}
    covered = {o.claim.logical for o in part.obligations if o.claim.boundary}
    assert outputs <= covered
    assert all(c.boundary for cid, c in part.boundary.items())
    # most float tensors a rank computes are matched to a logical slice
    produced = sum(1 for r, t in runs[0].order if runs[0].ranks[r][t].dtype.kind == "f")
    assert len(claims) > 0.9 * produced


def test_dp_slots_share_keys(plan, derived):
    part = derived.partition
    keys = {ob.id: ob.key for ob in part.obligations}
    by_tensor = {}
    for ob in part.obligations:
        if len(ob.ranks) == 1:
            by_tensor.setdefault(ob.tensor, {})[ob.ranks[0]] = keys[ob.id]
    same = [t for t, k in by_tensor.items() if len(k) == 2 and k[0] == k[1]]
    assert len(same) > 0.8 * len(by_tensor)
    assert len(set(keys.values())) < 0.5 * len(keys)


def test_keys_make_slots_relative_but_keep_constants_and_structure():
    x = [var(Atom("x", (i,))) for i in range(8)]
    y = [var(Atom("y", (i, 0))) for i in range(8)]
    order = {"x": 3, "y": 7, "u": 10, "w": 14}
    # the same stage on another slot: indices shifted, summands in another digest order
    assert formula_key([x[0] * y[1] + x[1] * y[2]], [x[0]], order) == \
        formula_key([x[5] * y[6] + x[6] * y[7]], [x[5]], order)
    u, w = var(Atom("u", (2,))), var(Atom("w", (4, 1)))
    assert formula_key([x[0] + y[0]], [y[0] + x[0]], order) == formula_key([u + w], [w + u], order)
    assert formula_key([x[0] * const(2)], [x[0]]) != formula_key([x[0] * const(3)], [x[0]])
    assert formula_key([x[0] + x[1]], [x[0]]) != formula_key([x[0] + x[1]], [x[1]])
    layer0 = formula_key([x[0] * y[0]], [var(Atom("z", (0,)))], {"x": 3, "y": 7, "z": 9})
    assert layer0 == formula_key([x[0] * y[0]], [var(Atom("z", (0,)))], {"x": 30, "y": 71, "z": 90})   # another layer
    one_hot = [var(Atom("tok", (0,), (0, 3))), var(Atom("tok", (0,), (1, 3))), var(Atom("tok", (1,), (0, 3)))]
    assert formula_key([one_hot[0] + one_hot[1]], [x[0]]) != formula_key([one_hot[0] + one_hot[2]], [x[0]])


def test_a_claim_that_does_not_hold_is_an_obligation_that_fails(plan):
    from dataclasses import replace
    from tv_ray.engine.solve import solve
    reduction = reduce_plan(plan)
    runs, claims = claims_for(plan, reduction.reduced)
    # rank 1's copy of a batch-sliced activation, claimed to be rank 0's rows instead of its own
    (rank, tensor), claim = next((k, c) for k, c in claims.items()
                                 if k[0] == 1 and not c.boundary and c.offsets and c.offsets[0] > 0)
    claims[rank, tensor] = replace(claim, offsets=(0,) + claim.offsets[1:])
    part = partition(plan, reduction.reduced, claims, symmetry=False)   # rank 1 cut at its own (false) claim
    ob = next(o for o in part.obligations if o.ranks == (1,) and o.tensor == tensor)
    assert solve(*part.formulas[ob.key]).verdict == "refuted"


def test_an_all_reduce_of_a_partial_claims_own_parts_is_the_slice(monkeypatch):
    """tp=2: a row-parallel output is a partial sum over tp, all-reduced. Each member brings its own free part
    (the last one the slice minus the others'), so the sum is the slice identically: the result is its atoms,
    recognised (`_summed_parts`), not summed — and the stages are those of the sum computed, keys aside."""
    from tv_ray.partition.stages import SymbolicRun
    plan = api.parallelize(api.capture_step("llama3-tiny", optim="adamw", clip=1.0), "tp=2", model="llama3-tiny")
    dims = reduce_plan(plan).reduced
    claims = claims_for(plan, dims)[1]
    found = []
    summed = SymbolicRun._summed_parts

    def spy(self, node, members, values):
        claim = summed(self, node, members, values)
        found.append((claim, [self._free.get(id(v)) for v in values]))
        return claim
    monkeypatch.setattr(SymbolicRun, "_summed_parts", spy)
    recognised = partition(plan, dims, claims, symmetry=False, templates=False)
    hits = [(claim, parts) for claim, parts in found if claim is not None]
    assert len(hits) > 10
    assert all(claim.partial == ("tp",) and [p[3] for p in parts] == [0, 1] for claim, parts in hits)
    monkeypatch.setattr(SymbolicRun, "_summed_parts", lambda self, node, members, values: None)
    computed = partition(plan, dims, claims, symmetry=False, templates=False)
    assert [(o.id, o.reads, o.claim) for o in recognised.obligations] == \
        [(o.id, o.reads, o.claim) for o in computed.obligations]
    from tv_ray.engine.solve import solve
    changed = {o.key for o in computed.obligations} - {o.key for o in recognised.obligations}
    assert changed and all(solve(*computed.formulas[k]).verdict == "proved" for k in changed)


def test_a_sum_over_part_of_a_partial_claims_group_is_kept_and_a_group_holding_every_part_once_is_the_slice(
        monkeypatch):
    """dp=2,tp=2: the embedding gradient is partial over dp × tp, all-reduced over dp, then split over tp. The dp
    all-reduce adds two of the four free parts: kept as their sum, not built (`FreeSum`); the split's two members
    hold the sums of parts {0, 2} and {1, 3}, every part once, so their sum is the slice identically and the stage
    is the slice against itself, nothing summed (`_sums_every_part`). The stages are those of the sums built, and
    the one whose formula changed is proved as it was."""
    from tv_ray.engine.solve import solve
    from tv_ray.partition.lazy import FreeSum
    from tv_ray.partition.stages import SymbolicRun
    plan = api.parallelize(api.capture_step("llama3-tiny", optim="adamw", clip=1.0), "dp=2,tp=2", model="llama3-tiny")
    dims = reduce_plan(plan).reduced
    claims = claims_for(plan, dims)[1]
    every = SymbolicRun._sums_every_part
    seen = []

    def spy(self, claim, values):
        found = every(self, claim, values)
        if values and all(isinstance(v, FreeSum) for v in values):
            seen.append((claim.logical, claim.partial, sorted(v.positions for v in values), found))
        return found
    monkeypatch.setattr(SymbolicRun, "_sums_every_part", spy)
    kept = partition(plan, dims, claims)
    assert seen == [("embedding_dense_backward", ("tp",), [(0, 2), (1, 3)], True)], seen
    monkeypatch.setattr(SymbolicRun, "_sums_every_part", lambda self, claim, values: False)
    monkeypatch.setattr(SymbolicRun, "_summed_subgroup", lambda self, node, members, values: None)
    built = partition(plan, dims, claims)
    assert [(o.id, o.reads, o.claim) for o in kept.every()] == [(o.id, o.reads, o.claim) for o in built.every()]
    changed = [(a, b) for a, b in zip(kept.every(), built.every()) if a.key != b.key]
    assert changed and {a.claim.logical for a, _ in changed} == {"embedding_dense_backward"}
    for a, b in changed:
        lhs, rhs = kept.formulas[a.key]
        assert len(lhs) == len(rhs) and all(x is y for x, y in zip(lhs, rhs))
        assert solve(*built.formulas[b.key]).verdict == "proved"
