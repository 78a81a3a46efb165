"""Microbatch k's ops taken as microbatch 0's renamed without evaluating them (`tv_ray.partition.microbatches`):
the same stages, order and keys as evaluating every op, and an op that is not its counterpart's renamed is
evaluated — a microbatch that differs is verified, not renamed."""
from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest

from tv_ray.engine.driver import verify_plan
from tv_ray.engine.executor import LocalExecutor
from tv_ray.engine.solve import Budget
from tv_ray.ir import Op
from tv_ray.parallel.spec import ParallelSpec
from tv_ray.partition.claims import Claim, _Matcher
from tv_ray.partition.compose import composition_problems
from tv_ray.partition.derive import claims_for
from tv_ray.partition.generate import partition
from tv_ray.partition import microbatches
from tv_ray.partition.microbatches import CopyIndex, Renamed, counterparts, runs
from tv_ray.partition.symmetry import find_mirrors, microbatch_moves

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))
from mutants import _like, edit, with_program  # noqa: E402


def _stages(part) -> list[tuple]:
    return [(o.id, o.ranks, o.key, o.reads, o.claim, o.position, o.mb) for o in part.every()]


def _segments_taken(monkeypatch) -> list[tuple[int, int]]:
    """The ops and partial cuts of each run segment taken at once (`Renamed._take_segment`), from here on."""
    taken, take = [], Renamed._take_segment

    def spy(self, state, segment, checked):
        taken.append((len(segment.nodes), len(checked.group_cuts)))
        return take(self, state, segment, checked)
    monkeypatch.setattr(Renamed, "_take_segment", spy)
    return taken


@pytest.mark.parametrize("spec", ["dp=2,tp=2,pp=2,mb=4", ParallelSpec.parse("tp=2,pp=2,mb=4", sp=True)],
                         ids=str)
def test_renamed_ops_give_the_stages_of_evaluating_every_op(claimed, spec, monkeypatch):
    """Renamed in run segments (partial cuts among them), renamed op by op, evaluated: the same stages, copies and
    keys."""
    plan, dims, claims = claimed(spec)
    taken = _segments_taken(monkeypatch)
    on = partition(plan, dims, claims, shards=False)
    monkeypatch.setattr(microbatches, "MIN_RUN", 10 ** 9)
    alone, off = partition(plan, dims, claims, shards=False), partition(plan, dims, claims, shards=False,
                                                                        renamed=False)
    assert off.renamed == 0 and on.renamed == alone.renamed > 1000 and on.moved == off.moved > 1000
    assert len(taken) > 50 and sum(ops for ops, _ in taken) > on.renamed / 2 and sum(g for _, g in taken) > 100
    for part in (on, alone):
        assert _stages(part) == _stages(off)
        assert (part.copy_ranks.tolist(), part.copy_of.tolist(), part.copy_mb.tolist(), part.notes) == \
            (off.copy_ranks.tolist(), off.copy_of.tolist(), off.copy_mb.tolist(), off.notes)
        assert part.formulas.keys() == off.formulas.keys()


def test_a_run_of_microbatch_k_pairs_with_microbatch_0s_wired_alike(claimed):
    """Every op of a run is paired, its counterpart at the same place in its counterpart's run, every argument
    from inside the run read from there by the counterpart too; collectives end runs and are paired."""
    plan = claimed("tp=2,pp=2,mb=4")[0]
    program = plan.programs["stage1"]
    at = {node.name: i for i, node in enumerate(program.nodes)}
    pairs = counterparts(program)
    found = runs(program, pairs, [[] for _ in program.nodes], at)
    assert sum(len(run.nodes) for run in found.values()) > len(pairs) / 2
    assert any(n.op == Op.ALL_REDUCE and n.name in pairs for n in program.nodes)
    for start, run in found.items():
        first = at[run.bases[0]]
        assert len(run.nodes) >= microbatches.MIN_RUN and program.nodes[start] is run.nodes[0]
        for i, (node, base) in enumerate(zip(run.nodes, run.bases)):
            assert pairs[node.name] == base and at[base] == first + i and node.get_meta("mb") == run.k > 0
            assert node.op not in (Op.ALL_REDUCE, Op.SEND, Op.RECV)
            for j, (mine, theirs) in zip(run.wiring[i], zip(node.args, program.value(base).args)):
                assert (mine, theirs) == ((run.nodes[j].name, run.bases[j]) if j >= 0 else run.entries[-1 - j])


def test_a_segment_whose_entry_is_another_microbatchs_value_is_taken_op_by_op_and_refuted(claimed, monkeypatch):
    """mm_3@2 reads microbatch 1's attention output, in a pipeline stage where the ops of microbatch 2 around it
    run in segments: it starts a run whose entry is microbatch 1's value, not σ₂ of its counterpart's — the
    segment is refused, the op evaluated and refuted there."""
    plan = claimed("pp=2,mb=4")[0]
    name = next(n for n, p in plan.programs.items() if any(node.name == "mm_3@2" for node in p.nodes))
    program = plan.programs[name]
    mm = program.value("mm_3@2")
    wrong = _like(mm, "mm_3@2", "mm", ["view_11@1", mm.args[1]])
    mutant = with_program(plan, name, edit(program, name, change={"mm_3@2": wrong}))
    at = {node.name: i for i, node in enumerate(mutant.programs[name].nodes)}
    run = runs(mutant.programs[name], counterparts(mutant.programs[name]), [[] for _ in at], at)[at["mm_3@2"]]
    assert ("view_11@1", "view_11@0") in run.entries
    taken = _segments_taken(monkeypatch)
    outcome = _verify(mutant)
    first = outcome.first_refuted()
    assert outcome.status == "refuted" and sum(ops for ops, _ in taken) > 200
    assert (str(first.id), first.mb, first.module) == (f"r{first.ranks[0]}/mm_3@2", 2, "layers.0.attn.o_proj")


def test_each_op_of_a_microbatch_pairs_with_microbatch_0s_at_its_place(claimed):
    plan = claimed("pp=2,mb=4")[0]
    for name, program in plan.programs.items():
        pairs = counterparts(program)
        nodes = {n.name: n for n in program.nodes}
        later = [n for n in program.nodes if (n.get_meta("mb") or 0) > 0]
        assert pairs and set(pairs) <= {n.name for n in later}
        for mine, theirs in pairs.items():
            assert nodes[theirs].get_meta("mb") == 0 and nodes[theirs].op == nodes[mine].op
            assert nodes[theirs].get_meta("realises") == nodes[mine].get_meta("realises")
        # a send or receive carries its microbatch's own tag, and pairs all the same (the stage it cuts is renamed
        # through the pairing); it is stepped either way, never taken as renamed
        messages = [m for m in pairs if nodes[m].op in (Op.SEND, Op.RECV)]
        assert messages and all(nodes[m].attr["tag"] != nodes[pairs[m]].attr["tag"] for m in messages)
        assert all(n.name in pairs for n in later), name


def test_a_programs_counterparts_are_found_once_and_forgotten_with_it(claimed):
    import gc
    program = claimed("pp=2,mb=4")[0].programs["stage0"]
    copy = dataclasses.replace(program)          # an equal program, another object: found for itself
    pairs = counterparts(program)
    assert counterparts(program) is pairs and counterparts(copy) == pairs and counterparts(copy) is not pairs
    held = id(copy)
    del copy
    gc.collect()
    assert held not in microbatches._PAIRED and id(program) in microbatches._PAIRED


def test_a_copy_is_found_by_its_id_and_nothing_else_is(claimed):
    plan, dims, claims = claimed("dp=2,tp=2,pp=2,mb=4")
    part = partition(plan, dims, claims, shards=False)
    rows = part._microbatch_copy_rows()
    index = CopyIndex(part.obligations, part.shifts, part.copy_of[rows], part.copy_mb[rows])
    assert len(rows) > 100
    for i, ob in enumerate(part.obligations):
        assert index.find(ob.id) == (i, 0)
    for i in rows.tolist():
        stage, k = int(part.copy_of[i]), int(part.copy_mb[i])
        assert index.find(part.copy(i).id) == (stage, k)
        assert part.representative(part.copy(i).id) == part.obligations[stage].id
    # an op of microbatch k whose stage was recorded (not kept as a copy): its own, not a copy
    moved = [(i, ob) for i, ob in enumerate(part.obligations) if ob.mb]
    assert moved and all(index.find(ob.id) == (i, 0) for i, ob in moved)
    # no op of that name, and a copy the map does not hold: no stage
    cid = part.copy(int(rows[0])).id
    assert index.find(cid._replace(tensor=cid.tensor + "_x")) is None
    assert CopyIndex(part.obligations, part.shifts, part.copy_of[rows][1:], part.copy_mb[rows][1:]).find(cid) is None
    assert part.representative(cid._replace(tensor=cid.tensor + "_x")) == cid._replace(tensor=cid.tensor + "_x")


def _verify(plan):
    return verify_plan(plan, budget=Budget(solvers=("z3",)), executor=LocalExecutor(jobs=1), progress=False)


def test_an_op_reading_another_microbatchs_value_is_evaluated_and_refuted_there(claimed):
    """mm_3@2 reads microbatch 1's attention output: the same op as its counterpart mm_3@0 on σ₁ of its
    argument, so its value is microbatch 0's renamed to block 1 — and its claim, block 2's, is not that."""
    plan = claimed("mb=4")[0]
    program = plan.programs["main"]
    mm = program.value("mm_3@2")
    wrong = _like(mm, "mm_3@2", "mm", ["view_11@1", mm.args[1]])
    mutant = with_program(plan, "main", edit(program, "main", change={"mm_3@2": wrong}))
    outcome = _verify(mutant)
    first = outcome.first_refuted()
    assert outcome.status == "refuted" and outcome.partition.renamed > 500
    assert (str(first.id), first.mb, first.module) == ("r0/mm_3@2", 2, "layers.0.attn.o_proj")


def test_a_stage_of_microbatch_k_is_kept_as_microbatch_0s_and_stands_or_falls_with_it(claimed):
    """Most stages of microbatches k > 0 are not recorded but kept in the instantiation map (`Shifts`): expanded,
    each is the stage recorded at its op; a recorded stage reading one reads microbatch 0's in the composition, so
    microbatch 0's unproved leaves it unproved."""
    plan, dims, claims = claimed("pp=2,mb=4")
    part = partition(plan, dims, claims, shards=False)
    copies = list(part.microbatch_copies())
    assert len(copies) > len(part.obligations) and {c.mb for _, c in copies} == {1, 2, 3}
    assert all(c.key == part.obligations[i].key and claims[c.ranks[0], c.tensor] == c.claim for i, c in copies)
    first_of = {c.id: part.obligations[i].id for i, c in copies}
    assert all(part.representative(cid) == first for cid, first in first_of.items())   # named without expanding
    reader, read = next((o, r) for o in part.obligations for r in o.reads if r in first_of)
    everything = {o.id for o in part.obligations}
    assert composition_problems(plan, part, everything) == []
    problems = composition_problems(plan, part, everything - {first_of[read]})
    assert f"stage {reader.id} reads {first_of[read]}, which is neither boundary lineage nor proved" in problems


class _Misplaced:
    """Blocks whose move lands one block too far: an offered claim with samples never holds."""

    def __init__(self, blocks):
        self.tags = blocks.tags
        self._blocks = blocks

    def move(self, claim, k, width=1):
        return self._blocks.move(claim, k + 1, width)


def test_microbatch_ks_ops_take_their_counterparts_claims_moved_only_where_they_hold(claimed, monkeypatch):
    """Claims by value (`infer_claims`): microbatch 1's ops are offered microbatch 0's claims moved to block 1,
    kept where they hold in every concrete run; where the offer is wrong they are matched by search. The plan
    without its stated interior lineage, so that every claim inside a stage is matched by value."""
    plan, dims, _ = claimed("tp=2,mb=2")
    plan = dataclasses.replace(plan, interior=[])
    blocks = microbatch_moves(plan, dims, None, True).blocks
    searches = []
    best = _Matcher.best
    monkeypatch.setattr(_Matcher, "best", lambda self, *a: searches.append(a[1]) or best(self, *a))
    runs, searched = claims_for(plan, dims)
    alone = len(searches)
    offered = claims_for(plan, dims, runs=runs, blocks=blocks)[1]
    offers = alone - (len(searches) - alone)      # searches the offers saved
    misplaced = claims_for(plan, dims, runs=runs, blocks=_Misplaced(blocks))[1]
    matcher = _Matcher(plan, runs, [n for n, v in runs[0].logical.items() if v.dtype.kind == "f"])
    names, ids = plan.rank_programs()
    taken = wrong = 0
    for rank in range(plan.num_ranks):
        for op, base in counterparts(plan.programs[names[ids[rank]]]).items():
            first, mine = offered.get((rank, base)), offered.get((rank, op))
            if first is None or mine is None or first.partial or blocks.tags.get(first.logical) is None:
                continue
            assert matcher.holds((rank,), op, mine)
            taken += mine == blocks.move(first, 1)
            # the misplaced offer never holds: microbatch 1's op is matched by search, as without an offer
            assert misplaced.get((rank, op)) == searched.get((rank, op)), (rank, op)
            wrong += 1
    assert taken > 500 and wrong >= taken and offers >= taken


def test_a_continuations_footprint_is_read_off_its_claim_as_its_terms_give_it(claimed, monkeypatch):
    from tv_ray.partition.lazy import Continued
    from tv_ray.partition.logical import LogicalTerms
    from tv_ray.partition.stages import SymbolicRun
    plan, dims, claims = claimed("dp=2,tp=2,pp=2,mb=4")
    moves = microbatch_moves(plan, dims, find_mirrors(plan, dims, True)[0], True)
    logical = LogicalTerms.build(plan.logical, dims, moves.blocks)
    places = {(c.logical, c.offsets, c.shape): c for c in claims.values()
              if not c.partial and logical.atomic(c.logical)}
    spanned = [(moves.blocks.spanned(c), moves.footprint(Continued(logical, c).terms())[0]) for c in places.values()]
    assert len(spanned) > 100 and sum(bool(b) for b, _ in spanned) > 50 and sum(not b for b, _ in spanned) > 50
    assert all(mine == theirs for mine, theirs in spanned)
    # and in a run: the continuations whose footprint it asks for are read off their claims, as their terms give it
    original, seen = SymbolicRun._footprint, []

    def both(self, value):
        unbuilt = isinstance(value, Continued) and value.real is None
        logical, claim = (value.logical, value.claim) if unbuilt else (None, None)
        got = original(self, value)
        if unbuilt and logical.atomic(claim.logical):
            seen.append((got, self.moves.footprint(Continued(logical, claim).terms())))
        return got

    monkeypatch.setattr(SymbolicRun, "_footprint", both)
    partition(plan, dims, claims, shards=False)
    assert len(seen) > 20 and all(mine == theirs for mine, theirs in seen)


def test_moves_to_is_move_compared_field_by_field(claimed):
    """`Blocks.moves_to(claim, k, other)` — what a run segment asks of each cut — is `move(claim, k) == other`:
    true for the moved claim, false for one that differs in any field (a claim field it does not compare fails
    the first assertion, so adding one to `Claim` means adding it there)."""
    plan, dims, claims = claimed("tp=2,pp=2,mb=4")
    moves = microbatch_moves(plan, dims, None, True)
    blocks = moves.blocks
    assert [f.name for f in dataclasses.fields(Claim)] == ["logical", "offsets", "shape", "partial", "boundary", "given",
                                                          "scale"]
    tagged = [c for c in claims.values() if blocks.tags.get(c.logical) is not None and moves.first(c)][:50]
    untagged = [c for c in claims.values() if blocks.tags.get(c.logical) is None][:20]
    assert len(tagged) == 50 and untagged
    for claim in tagged + untagged:
        for k in (1, 3):
            moved = blocks.move(claim, k)
            assert blocks.moves_to(claim, k, moved)
            tag = blocks.tags.get(claim.logical)
            d = tag.dim if tag is not None else 0
            others = [dataclasses.replace(moved, logical=moved.logical + "x"),
                      dataclasses.replace(moved, shape=tuple(n + 1 for n in moved.shape)),
                      dataclasses.replace(moved, partial=() if moved.partial else ("tp",)),
                      dataclasses.replace(moved, boundary=not moved.boundary),
                      dataclasses.replace(moved, given=not moved.given),
                      dataclasses.replace(moved, scale=moved.scale * 2)]
            if moved.offsets:
                others.append(moved.shifted(d, 1))
                others += [moved.shifted(e, 1) for e in range(len(moved.offsets)) if e != d]
            for other in others:
                assert not blocks.moves_to(claim, k, other) and blocks.move(claim, k) != other
