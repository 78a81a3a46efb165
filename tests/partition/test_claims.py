"""Claims made when asked (`Claims`): microbatch k's stated claims that are their counterparts' moved are not made
one by one, and the table they make is exactly the one made in full — so the stages, keys and copies are too."""
from __future__ import annotations

import pickle
from collections import Counter
from dataclasses import replace

import numpy as np
import pytest

from tv_ray import api
from tv_ray.partition.claims import (Claims, digit_runs, input_claims, interior_claims, output_claims, stated_claims,
                                     token_data)
from tv_ray.partition.derive import unmirrored
from tv_ray.partition.generate import partition
from tv_ray.partition.symmetry import find_mirrors, microbatch_moves
from tv_ray.plan import Fixed
from tv_ray.reduce import reduce_plan
from tv_ray.semantics.table import instantiate_shape


def _setting(plan):
    """(dims, mirrors, the blocks microbatches move by, the ranks claims are made on, logical shapes)."""
    dims = reduce_plan(plan).reduced
    found, _ = find_mirrors(plan, dims, True)
    moves = microbatch_moves(plan, dims, found, True)
    shapes = {s.name: instantiate_shape(s.shape, dims) for s in plan.logical.inputs}
    shapes |= {n.name: instantiate_shape(n.shape, dims) for n in plan.logical.nodes}
    return dims, found, moves.blocks, unmirrored(plan, found), shapes


def _in_full(plan, shapes, ranks) -> dict:
    """The claims of the plan's lineage, every one made (as `claims_for` made them before `Claims`)."""
    return {**input_claims(plan, shapes, ranks), **interior_claims(plan, shapes, ranks),
            **output_claims(plan, shapes, ranks)}


@pytest.fixture(scope="module", params=[("llama3-tiny", "dp=2,tp=2,pp=2,mb=4"), ("llama3-tiny", "tp=2,mb=4"),
                                        ("gpt2-tiny", "dp=2,tp=2,mb=2")], ids=lambda p: f"{p[0]}-{p[1]}")
def planned(request):
    model, spec = request.param
    plan = api.parallelize(api.capture_step(model, optim="adamw", clip=1.0), spec, model=model)
    return (plan, *_setting(plan))


def test_claims_made_when_asked_are_the_claims_made_in_full(planned):
    plan, dims, found, blocks, ranks, shapes = planned
    claims, full = stated_claims(plan, shapes, ranks, blocks), _in_full(plan, shapes, ranks)
    assert claims.unmade > len(full) // 4              # microbatch k's claims are not made
    assert len(claims.made) + claims.unmade == len(claims) == len(full)
    assert dict(claims) == full
    assert all(claims[key] == claim for key, claim in full.items())
    assert claims.kinds() == Counter("boundary" if c.boundary else "stated" if c.given else "inferred"
                                     for c in full.values())
    assert claims.partial_axes() == {axis for c in full.values() for axis in c.partial}
    sent = pickle.loads(pickle.dumps(claims))          # to a Ray task: its moved claims are made there alike
    assert not sent._memo and dict(sent) == full


def test_the_stages_are_the_same_with_claims_made_when_asked(planned):
    plan, dims, found, blocks, ranks, shapes = planned

    def stages(claims):
        part = partition(plan, dims, claims, found or True, shards=False)
        return sorted((str(o.id), o.ranks, sorted(map(str, o.reads)), str(o.claim), o.key) for o in part.every())
    assert stages(stated_claims(plan, shapes, ranks, blocks)) == stages(Claims(_in_full(plan, shapes, ranks)))


def test_an_entry_that_is_not_its_counterparts_moved_is_made_as_it_says():
    """Microbatch 1's entry of one op names microbatch 0's samples: it is no move of its counterpart's, so it is
    made as stated (and stage generation checks that op's claim itself), and the table is still the one in full."""
    plan = api.parallelize(api.capture_step("llama3-tiny", optim="adamw", clip=1.0), "tp=2,mb=2", model="llama3-tiny")
    at, entry = next((i, e) for i, e in enumerate(plan.interior) if e.tensor.endswith("@1") and any(
        isinstance(f, Fixed) and f.index == 1 for _, factors in e.slice for f in factors))
    wrong = replace(entry, slice=tuple((dim, tuple(Fixed(0, f.of) if isinstance(f, Fixed) else f for f in factors))
                                       for dim, factors in entry.slice))
    plan = replace(plan, interior=plan.interior[:at] + (wrong,) + plan.interior[at + 1:])
    dims, found, blocks, ranks, shapes = _setting(plan)
    claims, full = stated_claims(plan, shapes, ranks, blocks), _in_full(plan, shapes, ranks)
    assert all(wrong.tensor not in moved for moved in claims.moved.values())
    assert any(key[1] == wrong.tensor for key in claims.made)
    assert dict(claims) == full
    stages = [sorted((str(o.id), str(o.claim), o.key) for o in partition(plan, dims, c, found or True).every())
              for c in (claims, Claims(full))]
    assert stages[0] == stages[1]


def test_a_claim_set_or_taken_leaves_the_others_as_they_were(planned):
    """Setting or dropping a claim (a refuted guess) changes that key alone: the claims moved from it are made
    first, as they were."""
    plan, dims, found, blocks, ranks, shapes = planned
    claims, full = stated_claims(plan, shapes, ranks, blocks), _in_full(plan, shapes, ranks)
    program, moved = next((name, moved) for name, moved in claims.moved.items() if moved)
    op, (base, k) = next((op, pair) for op, pair in moved.items() if any(key[1] == pair[0] for key in claims.made))
    rank = next(r for r, t in claims.made if t == base)
    assert claims.pop((rank, base)) == full.pop((rank, base))
    assert op not in claims.moved[program] and claims[rank, op] == full[rank, op]
    other = next((o, pair) for o, pair in claims.moved[program].items() if (rank, pair[0]) in claims.made)[0]
    claims[rank, other] = full[rank, other] = replace(full[rank, other], offsets=(0,) * len(full[rank, other].offsets))
    assert other not in claims.moved[program]
    assert dict(claims) == full
    with pytest.raises(KeyError):
        claims[rank, "nowhere"]


def test_digit_runs_tell_every_two_token_positions_apart_and_keep_a_rows_first_ids_distinct():
    """A sequence longer than the vocabulary repeats ids in the random run (positions `high` apart are equal), so a
    chunk of flattened tokens could match the rows `high` positions on in every run, a claim that is no identity
    (deepseek-tiny cp=2 at vocab 2, seq 4: rank 0's rows 0, 1, 4, 5 matched rows 2-5). Over the digit runs every
    two positions differ. And in each run a row's first `high` positions hold distinct ids: equal ids make
    gradients exactly zero, which match any slice (numbering elements by their digits alone left llama3-tiny dp=4's
    attention backward, at seq 2 and vocab 2, with no claim: 374 of 2,438 lost)."""
    shape, high = (2, 4), 2
    rng = np.random.default_rng(0)
    random_run = token_data(shape, high, rng, None).reshape(-1)
    assert random_run[0] == random_run[2] and random_run[1] == random_run[3]      # a row repeats past `high`
    assert digit_runs(shape, high) == 4         # the elements numbered; 4 blocks, 2 digits; a row's 2 blocks told apart
    runs = np.stack([token_data(shape, high, rng, k).reshape(-1) for k in range(4)])
    assert all((runs[:, i] != runs[:, j]).any() for i in range(8) for j in range(i))
    for shape, high in (((8, 2), 2), ((3, 5), 3), ((4, 3, 7), 4), ((4, 4), 16)):
        for k in range(digit_runs(shape, high)):
            run = token_data(shape, high, rng, k).reshape(-1, shape[-1])[:, :high]
            assert all(len(set(row)) == row.size for row in run), (shape, k, run)



def test_a_layers_claims_are_guessed_from_the_layer_before_and_a_wrong_guess_is_never_taken(monkeypatch):
    """Layer j's ops are first offered the neighbouring layer's claims moved to the tensor at the same place
    (`layer_images`), which spares most searches; a guess is taken only where it holds in every concrete run —
    with the images scrambled (each tensor sent to another one's image) every claim made still holds. The plan's
    intermediate lineage is left out, so its claims are matched by value (as a traced plan's are)."""
    from tv_ray.models import get
    from tv_ray.partition import claims as module
    from tv_ray.partition.derive import claims_for
    from tv_ray.partition.layers import layer_images

    spec = get("llama3-tiny").with_dims(get("llama3-tiny").dims, layers=3)
    plan = replace(api.parallelize(api.capture_step(spec, optim="adamw", clip=1.0), "tp=2", model=spec), interior=())
    dims = reduce_plan(plan).reduced
    placed, images = layer_images(plan.logical)
    assert sum(placed.get(images[x]) == placed[x] + 1 for x in images) == len(images) > 100
    searched = Counter()
    best = module._Matcher.best
    monkeypatch.setattr(module._Matcher, "best", lambda self, *a, **k: searched.update([a[1]]) or best(self, *a, **k))

    def inferred(made: dict) -> dict:
        """The claims matched by value with layer images `made`, each checked to hold in every run."""
        monkeypatch.setattr(module, "layer_images", lambda graph: (placed, made))
        searched.clear()
        runs, claims = claims_for(plan, dims)
        matcher = module._Matcher(plan, runs, [n for n, v in runs[0].logical.items() if v.dtype.kind == "f"])
        found = {key: c for key, c in claims.items() if not c.boundary}
        assert all(matcher.holds(tuple(plan.group(key[0], c.partial)) if c.partial else (key[0],), key[1], c)
                   for key, c in found.items())
        return found

    guided, searches = inferred(images), sum(searched.values())
    alone = inferred({})
    assert searches < 0.6 * sum(searched.values())
    assert len(alone) > 2000 and len(set(guided) ^ set(alone)) < len(alone) // 100
    names = list(images)
    scrambled = inferred({x: images[names[(i + 7) % len(names)]] for i, x in enumerate(names)})
    assert len(scrambled) > 0.99 * len(alone)
