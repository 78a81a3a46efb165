"""Stage templates (tv_ray/partition/templates.py): a stage keyed by its template is a renaming of the one
instance built — checked here by building every instance and comparing them renamed — and templates make
most stages of a plan free."""
from __future__ import annotations

import numpy as np
import pytest

from tv_ray import api
from tv_ray.ir import Op
from tv_ray.partition import stages as stages_module
from tv_ray.partition.claims import Claim
from tv_ray.partition.derive import claims_for
from tv_ray.partition.generate import partition
from tv_ray.partition.ids import Part
from tv_ray.partition.keys import formula_key
from tv_ray.partition.logical import LogicalTerms
from tv_ray.partition.templates import Templates, leaf
from tv_ray.reduce import reduce_plan
from tv_ray.terms import Kind, Term, postorder, substitute, var
from tv_ray.terms.atom import Atom

PLANS = [("llama3-tiny", "dp=2,tp=2,pp=2,mb=2", {"sp": True}), ("gpt2-tiny", "dp=2,tp=2,pp=2", {}),
         ("llama3-tiny", "dp=2", {"zero": 3}), ("llama3-tiny", "tp=2,mb=2", {"zero": 1})]


def _renamed(lhs, rhs, numbers) -> str:
    """The formula with every tensor and part named by its number in the template: two instances of one
    template give the same text (the renaming the template stands for), whatever layer or slot they are."""
    mapping = {}
    for n in postorder(*lhs, *rhs):
        if n.kind is Kind.VAR and isinstance(n.payload, Atom):
            base = n.payload.base
            label = f"P{numbers[('part', base.cid)]}.{base.p}" if isinstance(base, Part) else \
                f"T{numbers[base]}" if base in numbers else None
            if label is not None:
                mapping[n] = var(n.payload._replace(base=label))
    memo: dict = {}
    return formula_key([substitute(t, mapping, memo) for t in lhs], [substitute(t, mapping, memo) for t in rhs])


@pytest.fixture(scope="module", params=PLANS, ids=lambda p: f"{p[0]}-{p[1]}-{p[2]}")
def claimed(request):
    model, spec, flags = request.param
    plan = api.parallelize(api.capture_step(model, optim="adamw", clip=1.0), spec, model=model, **flags)
    dims = reduce_plan(plan).reduced
    return plan, dims, claims_for(plan, dims)[1]


def test_every_instance_of_a_template_is_the_built_one_renamed(claimed, monkeypatch, request):
    """Templates that never count as built: every instance is built; each must be the first one renamed —
    contribution sums' stages among them (dp without microbatches: each weight gradient's block 0 part), and
    unfolded ones, named by the numbering extended to the tensors they were unfolded by, wherever the first
    instance's unfolding carries over (`Templates.unfolded`)."""
    plan, dims, claims = claimed
    seen: dict[str, set] = {}
    descriptor, expand = Templates.descriptor, stages_module.expand
    last = {}
    contributions, instances = set(), {}
    regions: dict[str, set] = {}            # aligned template -> the offsets of its instances' regions

    unfolded_first: dict[str, tuple] = {}       # unfolded template -> its first instance's `Unfolding` and form
    carried = []                                 # later instances the first one's unfolding carries over to

    def spy_descriptor(self, provenance, claim, width=0):
        key = descriptor(self, provenance, claim, width)
        last["template"], last["numbers"], last["templates"] = key, dict(self.numbers), self
        if width:
            contributions.add(key)
        if not width and self.aligned(provenance, claim):
            regions.setdefault(key, set()).add(claim.offsets)
        return key

    record = stages_module.SymbolicRun._record

    def spy_record(self, *a, **kw):      # the template of the stage recorded: only what `_record` asks for
        last["template"] = None
        return record(self, *a, **kw)

    def spy_expand(lhs, rhs, logical):
        out = expand(lhs, rhs, logical)
        template, numbers, templates = last.get("template"), last.get("numbers"), last.get("templates")
        first = templates.unfolding(numbers, out[2], "") if template is not None and out[2] else None
        if first is not None:           # unfolded: tensors named by the numbering extended to them
            form = _renamed(*out[:2], {**numbers, **templates.extension(numbers, out[2])[0]})
            if template not in unfolded_first:
                unfolded_first[template] = first, form
            else:                   # where the first instance's unfolding carries over, the formula is its renamed
                templates.first_unfolded[template] = unfolded_first[template][0]
                taken = templates.unfolded(template, numbers)
                if taken is not None:
                    carried.append((template, taken[1] == out[2], form == unfolded_first[template][1]))
        elif template is not None:
            seen.setdefault(template, set()).add(_renamed(*out[:2], numbers))
            instances[template] = instances.get(template, 0) + 1
        last["template"] = None
        return out

    class NeverBuilt(dict):
        def get(self, key, default=None):
            return None

        def __setitem__(self, key, value):
            pass

    monkeypatch.setattr(Templates, "descriptor", spy_descriptor)
    monkeypatch.setattr(stages_module, "expand", spy_expand)
    monkeypatch.setattr(stages_module.SymbolicRun, "_record", spy_record)
    monkeypatch.setattr(Templates, "built", NeverBuilt(), raising=False)
    original_init = Templates.__init__

    def init(self, *a, **kw):
        original_init(self, *a, **kw)
        self.built = NeverBuilt()
    monkeypatch.setattr(Templates, "__init__", init)
    mirrored = partition(plan, dims, claims, symmetry=True, shards=False)
    if (mirrored.copy_of >= 0).any():       # without mirrored copies the unmirrored run is this one again
        partition(plan, dims, claims, symmetry=False, shards=False)
    assert len(seen) > 50
    assert {t: len(forms) for t, forms in seen.items() if len(forms) > 1} == {}
    assert [c for c in carried if not all(c[1:])] == []
    if request.node.callspec.params["claimed"][2] == {"sp": True}:
        assert len(carried) >= 10 and len({c[0] for c in carried}) >= 3
    if request.node.callspec.params["claimed"][1] == "dp=2,tp=2,pp=2":
        assert sum(instances.get(t, 0) > 1 for t in contributions) > 10     # compared across instances
    # aligned stages (an optimizer's update of a tensor-parallel or ZeRO shard): one template for the regions at
    # different offsets, each instance built and found the first one renamed
    assert sum(len(offsets) > 1 and len(seen.get(t, ())) == 1 for t, offsets in regions.items()) > 5


@pytest.mark.parametrize("claimed", [PLANS[0]], indirect=True, ids=["llama3-tiny-sp"])
def test_an_unfolded_template_carries_over_only_where_its_definitions_read_alike(claimed, monkeypatch):
    """An instance of an unfolded template takes the first one's key only where the tensors it is unfolded by are
    defined alike: given the numbering of an instance it carried over to, with one unfolded tensor replaced by its
    twin of the same class in another layer (other arguments) or by a tensor of another class, it gives None."""
    plan, dims, claims = claimed
    taken, unfolded = [], Templates.unfolded

    def spy(self, template, numbers):
        out = unfolded(self, template, numbers)
        if out is not None:
            taken.append((self, template, dict(numbers), out))
        return out
    monkeypatch.setattr(Templates, "unfolded", spy)
    partition(plan, dims, claims)
    assert len(taken) >= 10
    checked = 0
    for templates, template, numbers, (key, tensors) in taken:
        kept = templates.first_unfolded[template]
        assert unfolded(templates, template, numbers) == (key, tensors)
        logical = templates.logical
        for w in sorted(t for t in tensors if numbers.get(t, len(numbers)) < len(numbers)):
            node = logical.nodes[w]
            twins = [x for x, other in logical.nodes.items() if x != w and x not in numbers and
                     templates.klass(x) == templates.klass(w) and other.args != node.args]
            strangers = [x for x in logical.nodes if x not in numbers and templates.klass(x) != templates.klass(w)]
            for x in twins[:1] + strangers[:1]:
                swapped = {(x if t == w else t): n for t, n in numbers.items()}
                assert unfolded(templates, template, swapped) is None, (w, x)
                checked += 1
        assert kept.key == key
        # the first instance's record made wrong in one place: a class, the order, a step's argument
        broken = [kept._replace(rows=((kept.rows[0][0], "another class", kept.rows[0][2]),) + kept.rows[1:]),
                  kept._replace(ranks=kept.ranks[::-1])]
        # a step more: parent's argument i as another numbered tensor, or as a new number (one tensor, two numbers)
        parent, i, n = kept.steps[0]
        other = next(m for m in range(len(numbers)) if m not in (parent, n))
        twice = max(kept.ranks) + 1
        at = kept.ranks.index(n) + 1
        broken += [kept._replace(steps=kept.steps + ((parent, i, other),)),
                   kept._replace(steps=kept.steps + ((parent, i, twice),),
                                 ranks=kept.ranks[:at] + (twice,) + kept.ranks[at:])]
        for wrong in broken:
            templates.first_unfolded[template] = wrong
            assert unfolded(templates, template, numbers) is None, wrong
        templates.first_unfolded[template] = kept
    assert checked >= 10


def test_templates_key_most_stages_without_building_them_and_change_no_stage(claimed):
    plan, dims, claims = claimed
    on, off = (partition(plan, dims, claims, templates=t) for t in (True, False))
    assert on.templated > 0.3 * len(on.obligations) and off.templated == 0
    assert len(on.formulas) < len(off.formulas) + on.templated      # fewer formulas built than stages keyed
    assert [(o.id, o.reads, o.claim) for o in on.every()] == [(o.id, o.reads, o.claim) for o in off.every()]
    # one template, one key; a formula key where templates are off
    assert {o.key for o in on.obligations} <= set(on.formulas) | set(on.unformed)
    assert np.array_equal(on.copy_of, off.copy_of)


def test_a_claimed_op_whose_template_was_built_is_not_computed(claimed, monkeypatch):
    """Most template hits are never computed (`Deferred`), nor are group members' parts of a partial claim whose
    template was computed before; where one is asked for, its terms are the op's."""
    plan, dims, claims = claimed
    made, computed = _spy_deferred(monkeypatch)
    part = partition(plan, dims, claims, shards=False)
    assert len(made) > 0.5 * part.templated
    assert len(computed) < 0.1 * len(made)
    partial = {tensor for (_, tensor), claim in claims.items() if claim.partial}
    if partial:
        assert sum(deferred.node.name in partial for deferred, _ in made) > 0.2 * len(partial)
    _built_as_computed(made[:50])


def _spy_deferred(monkeypatch) -> tuple[list, list]:
    """Every `Deferred` made (with its arguments, kept) and every one built, as the run goes."""
    made, computed = [], []
    init, terms = stages_module.Deferred.__init__, stages_module.Deferred.terms

    def spy_init(self, *args):
        init(self, *args)
        made.append((self, list(self.args)))

    def spy_terms(self):
        if self.real is None:
            computed.append(self)
        return terms(self)
    monkeypatch.setattr(stages_module.Deferred, "__init__", spy_init)
    monkeypatch.setattr(stages_module.Deferred, "terms", spy_terms)
    return made, computed


def _built_as_computed(made) -> None:
    """Each deferred value, built, is its op's terms on its arguments."""
    from tv_ray.semantics.symbolic import eval_symbolic
    for deferred, args in made:
        want = eval_symbolic(deferred.node, [stages_module.terms_of(a) for a in args], deferred.dims, deferred.ctx)
        assert all(a is b for a, b in zip(deferred.terms().reshape(-1), want.reshape(-1)))


@pytest.fixture(scope="module")
def deep():
    """llama3-tiny at 4 layers, dp=2,tp=2,mb=2: layers past the first meet templates built before."""
    from tv_ray.models import get
    tiny = get("llama3-tiny")
    spec = tiny.with_dims({**tiny.dims, "batch": 4}, layers=4)
    plan = api.parallelize(api.capture_step(spec, optim="adamw", clip=1.0), "dp=2,tp=2,mb=2", model=spec)
    dims = reduce_plan(plan).reduced
    return plan, dims, claims_for(plan, dims)[1]


def test_an_op_no_claim_cuts_is_computed_once_per_template_and_built_only_when_read(deep, monkeypatch):
    """An uncut op other than a matrix product — a weight's transpose, a norm's step between two cuts — is
    computed where it stands the first time its template is met; after that it is `Deferred`, and where the next
    cut is a template hit, never built. Built, its terms are the op's."""
    plan, dims, claims = deep
    made, computed = _spy_deferred(monkeypatch)
    partition(plan, dims, claims, shards=False)
    claimed_ops = {tensor for _, tensor in claims}
    uncut = [(d, args) for d, args in made if d.node.name not in claimed_ops and d.node.op not in (Op.MM, Op.BMM)]
    assert len(uncut) > 100
    assert sum(d in computed for d, _ in uncut) < 0.3 * len(uncut)
    _built_as_computed(uncut[:50])


def test_a_chain_of_uncut_ops_longer_than_max_deferred_is_computed_where_it_stands(deep, monkeypatch):
    """No value is left to be built through more than `MAX_DEFERRED` ops not computed (building it recurses that
    deep): with the limit at 1 every uncut op reading a deferred one is computed, and the stages and keys are the
    same."""
    plan, dims, claims = deep
    made, _ = _spy_deferred(monkeypatch)
    monkeypatch.setattr(stages_module, "MAX_DEFERRED", 1)
    one = partition(plan, dims, claims, shards=False)
    assert max(d.depth for d, _ in made) == 2          # made, then declined: computed where it stands
    monkeypatch.undo()
    full = partition(plan, dims, claims, shards=False)
    assert [(o.id, o.reads, o.claim, o.key) for o in one.every()] == \
        [(o.id, o.reads, o.claim, o.key) for o in full.every()]


def test_a_continuation_read_by_deferred_ops_alone_is_never_built(claimed, monkeypatch):
    """What the run continues from after a whole or sliced cut (`Continued`) is built only where an op computes
    from it; where the next ops are template hits (deferred), never. Built, it is the slice's atoms."""
    plan, dims, claims = claimed
    made, built = [], []
    init, terms = stages_module.Continued.__init__, stages_module.Continued.terms

    def spy_init(self, logical, claim):
        init(self, logical, claim)
        made.append((self, logical, claim))

    def spy_terms(self):
        if self.real is None:
            built.append(self)
        return terms(self)
    monkeypatch.setattr(stages_module.Continued, "__init__", spy_init)
    monkeypatch.setattr(stages_module.Continued, "terms", spy_terms)
    part = partition(plan, dims, claims, shards=False)
    assert len(made) > 0.5 * len(part.obligations)
    assert 0 < len(built) < 0.5 * len(made)
    for continued, logical, claim in made[:200]:
        want = logical.value_at(claim.logical, claim.slices())
        assert continued.shape == want.shape
        # float atoms are interned (the very objects); integer data are values (`Choice`), equal
        assert all(a is b if isinstance(a, Term) else a == b
                   for a, b in zip(continued.terms().reshape(-1), want.reshape(-1)))

# -- a layer, a microbatch, a tensor-parallel rank, a ZeRO shard made different: each is its own template ---------
def _mutated(plan, pick, override: int | None = None):
    """`plan` with every op `pick` selects given `other` ×1.5 (on rank `override` alone, when given)."""
    from tests.engine.mutants import _set_attrs, edit, with_program
    prog = plan.programs["main"]
    chosen = [n for n in prog.nodes if "other" in n.attr and isinstance(n.attr["other"], float) and pick(n)]
    assert chosen
    name = "main" if override is None else f"main_r{override}"
    graph = edit(prog, name, change={n.name: _set_attrs(n, other=n.attr["other"] * 1.5) for n in chosen})
    return with_program(plan, name, graph, overrides=[override] if override is not None else []), chosen


@pytest.fixture(scope="module")
def zero_plan():
    """llama3-tiny dp=2 × tp=2, two microbatches, ZeRO 1, AdamW, clip 1.0; rank = dp*2 + tp."""
    return api.parallelize(api.capture_step("llama3-tiny", optim="adamw", clip=1.0), "dp=2,tp=2,mb=2",
                           model="llama3-tiny", zero=1)


CASES = {
    "one layer": (lambda n: n.get_meta("module", "").startswith("layers.1.") and n.get_meta("phase") == "fwd",
                  None, lambda ob: ob.module.startswith("layers.1.") and ob.phase == "fwd"),
    "one microbatch": (lambda n: n.get_meta("module", "").startswith("layers.0.") and n.get_meta("mb") == 1
                       and n.get_meta("phase") == "fwd", None, lambda ob: ob.mb == 1 and ob.phase == "fwd"),
    "one tp rank": (lambda n: n.get_meta("module", "").startswith("layers.0.") and n.get_meta("phase") == "fwd",
                    1, lambda ob: 1 in ob.ranks and ob.phase == "fwd"),
    "one ZeRO shard": (lambda n: n.get_meta("phase") == "optim", 2, lambda ob: ob.ranks == (2,) and
                       ob.phase == "optim"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_part_that_differs_is_refuted_where_it_differs(zero_plan, case):
    from tv_ray.engine.driver import verify_plan
    from tv_ray.engine.executor import LocalExecutor
    from tv_ray.engine.solve import Budget
    pick, override, where = CASES[case]
    mutant, chosen = _mutated(zero_plan, pick, override)
    outcome = verify_plan(mutant, budget=Budget(solvers=("z3",)), executor=LocalExecutor(), progress=False)
    assert outcome.partition.templated > 0.3 * len(outcome.partition.obligations)
    assert outcome.status == "refuted", outcome.problems[:3]
    first = outcome.first_refuted()
    assert where(first), (first.id, first.ranks, first.mb, first.module, first.phase)


def test_an_op_that_reads_the_rank_coordinate_is_never_shared_across_ranks():
    """local_chunk takes the rank's own chunk: two tp ranks whose stages are alike but for the coordinate are two
    templates. The intermediate lineage of one chunked tensor mis-stated as chunk 0 on every tp rank is right on
    tp rank 0 and wrong on tp rank 1: rank 1's claim alone is refuted and dropped (were the stages one template,
    one verdict would stand for both — rank 0's claim dropped, or rank 1's wrong one kept as proved)."""
    from dataclasses import replace
    from tv_ray.engine.driver import verify_plan
    from tv_ray.engine.executor import LocalExecutor
    from tv_ray.engine.solve import Budget
    from tv_ray.ir import Op
    from tv_ray.plan import Fixed
    plan = api.parallelize(api.capture_step("llama3-tiny"), "tp=2", model="llama3-tiny", sp=True)
    chunked = {n.name for n in plan.programs["main"].nodes
               if n.op == Op.LOCAL_CHUNK and tuple(n.attr["axes"]) == ("tp",)}
    entry = next(e for e in plan.interior if e.tensor in chunked and e.slice)
    wrong = replace(entry, slice=tuple((d, tuple(Fixed(0, 2) if f == "tp" else f for f in fs))
                                       for d, fs in entry.slice))
    mutant = replace(plan, interior=tuple(wrong if e is entry else e for e in plan.interior))
    for templates in (True, False):
        outcome = verify_plan(mutant, budget=Budget(solvers=("z3",)), executor=LocalExecutor(), progress=False,
                              templates=templates)
        assert outcome.status == "proved"
        assert (0, entry.tensor) not in outcome.dropped and (1, entry.tensor) in outcome.dropped


def test_an_aligned_stage_writes_its_region_relative_and_nothing_else_is_aligned():
    """An optimizer's elementwise update of one shard (gradient clipping: grad x clip coefficient) is the same
    template wherever the shard lies; read from another region, through a partial claim, through a matrix product,
    or cut at a reduction, it is not aligned and its offsets stay absolute."""
    plan = api.parallelize(api.capture_step("llama3-tiny", optim="adamw", clip=1.0), "tp=2", model="llama3-tiny")
    dims = reduce_plan(plan).reduced
    templates = Templates(LogicalTerms.build(plan.logical, dims, None), dims)
    grad, coef = "t_74", "optim.clip_coef"
    clipped = "optim.layers.0.attn.q_proj.weight.grad_clipped"
    assert templates.logical.nodes[clipped].args == (grad, coef)

    def stage(at: int, read_at: int, op: str = "mul", partial: tuple = ()):
        leaves = (leaf(Claim(grad, (read_at, 0), (4, 8), partial)), leaf(Claim(coef, (), ())))
        return ("o", (op, (), (4, 8), "float"), 3, leaves), Claim(clipped, (at, 0), (4, 8))

    assert templates.aligned(*stage(0, 0)) and templates.aligned(*stage(4, 4))
    assert templates.descriptor(*stage(0, 0)) == templates.descriptor(*stage(4, 4))
    for odd in (stage(0, 4), stage(0, 0, partial=("tp",)), stage(0, 0, op="mm")):
        assert not templates.aligned(*odd)
    assert templates.descriptor(*stage(0, 4)) != templates.descriptor(*stage(4, 0))
    summed = "optim.layers.0.attn.q_proj.weight.grad_sq_sum"          # a reduction: not elementwise
    assert not templates.aligned(("o", ("sum", (), (), "float"), 2, (leaf(Claim(grad, (0, 0), (8, 8))),)),
                                 Claim(summed, (), ()))
