"""Diagnosis: a refuted run turned into a report a person can act on — first failing stage, rank, tensor, numbers.

The headline is the first refuted stage in execution order: the logical op it
realises (module path, forward/backward/optimizer), the rank(s) and
microbatch, the physical tensor and the logical slice it should equal. The
numbers are replayed through the concrete float64 semantics of both graphs
(the runs claims were matched on), never taken from a solver model alone: a
run is reported as refuted only if some program output there really differs
from its output lineage (soundness rule 5: `Outcome.status` decides that; the report repeats the
outcome's status and never changes it). When the stage's physical value
is a constant multiple of (or offset from) the logical one, the report says
so — "physical = 2 × logical" is a sum where a mean was meant, or a missing
division.

    >>> report = diagnose(outcome)
    >>> print(explain(report))
"""
from __future__ import annotations

import itertools

import numpy as np

from tv_ray.certificate.outcome import Outcome, Status, replay_stage, replays
from tv_ray.errors import GraphError
from tv_ray.ir import Node, Op
from tv_ray.partition.claims import ConcreteRun, group_value
from tv_ray.partition.stages import Obligation

SHOW = 6   # elements shown per tensor


def _factor(physical: np.ndarray, logical: np.ndarray) -> str | None:
    """'physical = c × logical' or 'physical = logical + c' when the difference is that simple."""
    if physical.shape != logical.shape or physical.size == 0:
        return None
    mask = np.abs(logical) > 1e-12
    if mask.any():
        ratios = physical[mask] / logical[mask]
        r = float(ratios.reshape(-1)[0])
        if np.allclose(ratios, r, rtol=1e-6) and np.allclose(physical[~mask], 0, atol=1e-12) and abs(r - 1) > 1e-6:
            hint = {2.0: "a sum where a mean was meant, or a missing division",
                    0.5: "a division applied twice, or a mean where a sum was meant"}
            near = min(hint, key=lambda k: abs(k - r))
            why = f": {hint[near]}" if abs(near - r) < 1e-6 else ""
            return f"physical = {r:.6g} × logical{why}"
    diff = physical - logical
    c = float(diff.reshape(-1)[0])
    if np.allclose(diff, c, rtol=1e-6, atol=1e-12) and abs(c) > 1e-9:
        k = round(float(np.exp(c)))
        note = f" (= log {k})" if 2 <= k <= 4096 and abs(c - np.log(k)) < 1e-6 else ""
        return f"physical = logical + {c:.6g}{note}"
    return None


def _every_run(outcome: Outcome, ob: Obligation) -> tuple[np.ndarray, np.ndarray]:
    """The stage's physical and claimed values over every concrete run that holds it (`replays`), flat and per unit
    of the claim's scale (one value — a loss — fits both a factor and an offset; several runs tell them apart, and an
    offset is the one of each rank's value: a data-parallel group's mean losses sum to dp × the loss)."""
    runs = replays(outcome.runs, ob)
    scale = float(ob.claim.scale)
    return tuple(np.concatenate([np.asarray(getattr(r, side), dtype=np.float64).reshape(-1) for r in runs]) / scale
                 if runs else np.zeros(0) for side in ("physical", "logical"))


def _missing_reduction(outcome: Outcome, ob: Obligation, run: ConcreteRun, logical: np.ndarray) -> str | None:
    """'physical is a partial sum over dp' when summing it over a mesh group gives the logical value."""
    plan = outcome.plan
    made = plan.programs[ob.program].value(ob.tensor)
    # an axis the op itself reduced over is not missing a reduction: a sum over it matching is a coincidence of the
    # run's data (at reduced dims two ranks' token rows can repeat)
    done = set(made.attr["axes"]) if getattr(made, "op", None) in (Op.ALL_REDUCE, Op.REDUCE_SCATTER) else set()
    axes = [a for a, n in plan.mesh if n > 1 and a not in ob.claim.partial and a not in done]
    for k in range(1, len(axes) + 1):
        for subset in itertools.combinations(axes, k):
            members = tuple(sorted({m for r in ob.ranks for m in plan.group(r, ob.claim.partial + subset)}))
            total = group_value(run, members, ob.tensor)
            if total is None:
                total = _counterparts_summed(outcome, run, members, ob)
            if total is not None and total.shape == logical.shape and np.allclose(total, logical, rtol=1e-7,
                                                                                   atol=1e-12):
                what = "×".join(subset)
                return (f"physical is one rank's partial sum over {what}: summed over the {what} group it equals "
                        f"the logical value — a reduction (all-reduce / reduce-scatter) over {what} is missing "
                        f"or was applied too early")
    return None


def _counterparts_summed(outcome: Outcome, run: ConcreteRun, members: tuple[int, ...], ob: Obligation) \
        -> np.ndarray | None:
    """Where the members run other programs (a pipeline's stages), the sum over them of the tensor each claims as
    the same slice and multiple (a tied weight's gradient: each stage's own uses' part); None where one has none."""
    claim = outcome.claims.get((ob.ranks[0], ob.tensor))
    if claim is None:
        return None
    same = (claim.logical, claim.offsets, claim.shape, claim.scale)
    values = []
    for m in members:
        program = outcome.plan.programs[outcome.plan.program_of(m)]
        found = next((run.ranks[m][n.name] for n in program.nodes if n.name in run.ranks[m]
                      and (c := outcome.claims.get((m, n.name))) is not None
                      and (c.logical, c.offsets, c.shape, c.scale) == same), None)
        if found is None:
            return None
        values.append(found)
    return np.sum(values, axis=0)


def _values(a: np.ndarray) -> list:
    flat = np.asarray(a, dtype=np.float64).reshape(-1)[:SHOW]
    return [float(f"{v:.6g}") for v in flat]


def _inside(outcome: Outcome, ob: Obligation) -> list[Node]:
    """The stage's ops on its first rank, in program order: its tensor's and every op between it and the stage's
    inputs (the claimed values it reads)."""
    rank = ob.ranks[0]
    program = outcome.plan.programs[outcome.plan.program_of(rank)]
    nodes = {n.name: n for n in program.nodes}
    stack, seen = [ob.tensor], set()
    while stack:
        name = stack.pop()
        if name in seen or name not in nodes:
            continue
        seen.add(name)
        stack.extend(a for a in nodes[name].args if (rank, a) not in outcome.claims)
    return [n for n in program.nodes if n.name in seen]


def _suspect(outcome: Outcome, ob: Obligation) -> dict | None:
    """The earliest op inside the stage (unclaimed, between the stage's inputs and its tensor) that says which
    logical op it realises: where the value first left the logical one. (Ops computed from token data alone
    are exact and never claimed: they are not suspects; positions are numbers a plan computes with — RoPE's
    frequencies from an arange —, so what is made from them is.)"""
    rank = ob.ranks[0]
    program = outcome.plan.programs[outcome.plan.program_of(rank)]
    data_only: dict[str, bool] = {}
    for node in program.nodes:          # computed from token data (and constants) alone
        data_only[node.name] = node.op is not Op.ARANGE and \
            all(data_only.get(a, program.dtype_of(a) != "float") for a in node.args)
    realising = [n for n in _inside(outcome, ob) if n.name != ob.tensor and n.get_meta("realises")
                 and not data_only[n.name]]
    if not realising:
        return None
    first = realising[0]
    return {"rank": rank, "program": outcome.plan.program_of(rank), "op": first.name, "kind": str(first.op),
            "realises": first.get_meta("realises"), "module": first.get_meta("module", "") or "",
            "phase": first.get_meta("phase", "") or ""}


PHASES = {"fwd": "forward", "bwd": "backward", "optim": "optimizer step"}
COLLECTIVE_OPS = {"all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast"}


def _unreduced_input(outcome: Outcome, ob: Obligation) -> dict | None:
    """When the first refuted stage is not a collective and reads a proved partial sum (a group's claim over
    some axes) that its own claim does not sum over: that input was never reduced — name it and its ranks
    (the cause), not only the consumer."""
    if ob.op in COLLECTIVE_OPS:
        return None
    by_id = {o.id: o for o in outcome.partition.obligations}
    for src in ob.reads:
        read = by_id.get(outcome.partition.representative(src))
        if read is None or not read.claim.partial:
            continue
        axes = [a for a in read.claim.partial if a not in ob.claim.partial]
        if axes:
            what, ranks = "×".join(axes), ", ".join(map(str, src.ranks))
            text = f"it reads {src.tensor} on ranks {ranks}, a partial sum over {what} never reduced: the " \
                   f"all-reduce / reduce-scatter over {what} before {ob.tensor} is missing"
            if read.claim.scale != 1:       # a pre-divided gradient's: which of the two is missing is not known
                text = f"it reads {src.tensor} on ranks {ranks}, {read.claim.describe()}: both the reduction over " \
                       f"{what} and the division by {read.claim.scale} must come before {ob.tensor}"
            return {"stage": str(src), "tensor": src.tensor, "ranks": list(src.ranks), "axes": axes, "text": text}
    return None


def _extra_reduction(outcome: Outcome, ob: Obligation) -> dict | None:
    """When the first refuted stage sums a claimed value over axes it is not a partial sum over (the stage's own
    collective, or one inside it): that reduction is one too many, or over too wide a group — name it, its input
    and the axes (the cause: the value summed was right)."""
    rank = ob.ranks[0]
    for node in _inside(outcome, ob):
        if node.op not in (Op.ALL_REDUCE, Op.REDUCE_SCATTER) or node.attr["reduce"] != "sum":
            continue
        read = outcome.claims.get((rank, node.args[0]))
        extra = [a for a in node.attr["axes"] if read is not None and a not in read.partial]
        if extra:
            what, over = "×".join(extra), "×".join(node.attr["axes"])
            text = (f"{node.name} sums {node.args[0]} over {over} on rank {rank}, but it is "
                    f"{read.describe()}, not a partial sum over {what}: the reduction over {what} is one too many")
            return {"op": node.name, "tensor": node.args[0], "axes": extra, "text": text}
    return None


def describe_reference(ref: dict | None) -> str:
    """What the proofs are about, in words: a fresh capture of a built-in model, or the plan's own logical
    graph named by its hash (`tv_ray.api.reference`)."""
    if not ref:
        return "the plan's own logical graph"
    own = f"the plan's own logical graph (sha256 {ref['logical_sha256'][:12]})"
    recipe = ref.get("recipe")
    if recipe is None or not ref.get("capture"):
        return own + (f", labelled {ref['model']!r}" if ref.get("model") else "")
    flags = f"{recipe['optim']}, " + (f"clip {recipe['clip']:g}" if recipe.get("clip") else "no clipping") + \
        ("" if recipe.get("tied") is None else ", tied" if recipe["tied"] else ", untied") + \
        (", masked targets" if recipe.get("masked") else "")
    if ref["capture"] == "matches":
        return f"a fresh capture of {ref['model']} ({flags})"
    if ref["capture"] == "differs":
        return f"{own}, which is NOT a fresh capture of {ref['model']} ({flags}): it was edited or captured otherwise"
    return f"{own}; capturing {ref['model']} ({flags}) again {ref['capture']}"


def public_names(outcome: Outcome) -> dict[str, str]:
    """Logical tensor -> the name the model gives it: program outputs as `tv-ray run` names them
    (``grad/lm_head.weight``, ``new/lm_head.weight``, ``loss``)."""
    names: dict[str, str] = {}
    for name, value in outcome.plan.logical.outputs:
        names.setdefault(value, name)
    return names


def _named(claim_text: str, logical: str, names: dict[str, str]) -> str:
    """A claim's text with the model's name of its logical tensor after it (when it has one)."""
    return f"{claim_text} ({names[logical]})" if logical in names else claim_text


def diagnose(outcome: Outcome, reference: dict | None = None) -> dict:
    """The report of a run: the first refuted stage with replayed values, what stayed open, or what was proved
    and equal to what (`reference`, see `describe_reference`). It repeats the outcome's status."""
    counts = outcome.counts()
    report: dict = {"format": "tv-ray-report/1", "status": outcome.status.value, "model": outcome.plan.model,
                    "reference": reference, "reference_text": describe_reference(reference),
                    "counts": counts, "tiers": outcome.tiers(), "dims": outcome.reduction.reduced,
                    "problems": outcome.problems[:20]}
    names = public_names(outcome)
    if outcome.failure:
        report["headline"] = f"missing or misrouted communication — {outcome.failure}"
        return report
    ob = outcome.first_refuted()
    if ob is None:
        open_ = [o for o in outcome.partition.obligations if not outcome.verdict_of(o).proved]
        report["headline"] = (f"not proved: {len(open_)} stage(s) open, {len(outcome.problems)} composition "
                              f"problem(s)" if open_ or outcome.problems else
                              f"all {counts['obligations']} obligations ({counts['unique']} unique) proved; loss, "
                              f"every gradient and every updated parameter and state equal those of "
                              f"{report['reference_text']}")
        report["open"] = [{"stage": str(o.id), "module": o.module, "phase": o.phase, "tensor": o.tensor,
                           "logical": _named(o.claim.describe(), o.claim.logical, names),
                           "reason": outcome.verdict_of(o).reason}
                          for o in sorted(open_, key=lambda o: o.position)[:20]]
        return report
    stage = _stage_report(outcome, ob, names)
    report["stage"] = stage
    if outcome.status is not Status.REFUTED:
        report["headline"] = outcome.unconfirmed
        return report
    where = f"{ob.module or 'model'} ({PHASES.get(ob.phase, ob.phase or 'step')})"
    mb = f", microbatch {ob.mb}" if ob.mb is not None else ""
    ranks = ", ".join(map(str, ob.ranks))
    unreduced = _unreduced_input(outcome, ob)
    if unreduced:
        stage["unreduced_input"] = unreduced
    extra = _extra_reduction(outcome, ob)
    if extra:
        stage["extra_reduction"] = extra
    why = " — ".join(filter(None, [stage.get("factor") or (unreduced or {}).get("text"), (extra or {}).get("text")]))
    if not why and stage.get("suspect"):          # nothing says more: the earliest op the stage computes
        s = stage["suspect"]
        why = f"first op inside the stage: {s['program']}.{s['op']} = {s['kind']} (realises {s['realises']})"
    report["headline"] = (f"first wrong tensor: {where}, logical op {ob.realises or ob.claim.logical}, "
                          f"rank{'s' if len(ob.ranks) > 1 else ''} {ranks}{mb}: {ob.program}.{ob.tensor} "
                          f"should equal {stage['logical']}" + (f" — {why}" if why else ""))
    report["outputs_wrong"] = [{**d, "output": names.get(d["logical"], d["logical"])} for d in outcome.deviations[:20]]
    report["outputs_wrong_count"] = len(outcome.deviations)
    return report


def _source_of(outcome: Outcome, ob: Obligation) -> str | None:
    """The line of the user's code that ran the stage's op (a traced plan's `meta.source`), if the plan says."""
    program = outcome.plan.programs.get(ob.program)
    try:
        node = program.value(ob.tensor) if program is not None else None
    except GraphError:
        return None
    return node.get_meta("source") if hasattr(node, "get_meta") else None


def _stage_report(outcome: Outcome, ob: Obligation, names: dict[str, str]) -> dict:
    verdict = outcome.verdict_of(ob)
    out: dict = {"id": str(ob.id), "ranks": list(ob.ranks), "microbatch": ob.mb, "program": ob.program,
                 "tensor": ob.tensor, "op": ob.op, "module": ob.module, "phase": ob.phase,
                 "realises": ob.realises, "logical": _named(ob.claim.describe(), ob.claim.logical, names),
                 "claim": ob.claim.to_json(),
                 "verdict": verdict.to_json(), "reads": list(map(str, ob.reads))}
    source = _source_of(outcome, ob)
    if source:
        out["source"] = source
    best = replay_stage(outcome.runs, ob)
    if best is not None:
        i, p, logical = best.run, best.physical, best.logical
        out.update(run=i, max_abs_dev=best.deviation, physical_values=_values(p), logical_values=_values(logical))
        factor = _factor(*_every_run(outcome, ob)) or _missing_reduction(outcome, ob, outcome.runs[i], logical)
        if factor:
            out["factor"] = factor
        run = outcome.runs[i]
        inputs = {}
        for src in ob.reads[:6]:
            if src.kind in ("in", "r"):
                v = run.ranks[src.ranks[0]].get(src.tensor)
                if v is not None:
                    inputs[str(src)] = _values(v)
        out["input_values"] = inputs
    suspect = _suspect(outcome, ob)
    if suspect:
        out["suspect"] = suspect
    return out


def explain(report: dict) -> str:
    """The report as text for a person (what `tv-ray explain OUT` prints)."""
    lines = [f"tv-ray: {report['status'].upper()} — {report.get('headline', '')}"]
    if report.get("status") != "proved" and report.get("reference_text"):
        lines.append(f"  reference: {report['reference_text']}")
    c = report.get("counts", {})
    lines.append(f"  obligations {c.get('obligations', 0)}, unique {c.get('unique', 0)}, proved "
                 f"{c.get('proved', 0)}, refuted {c.get('refuted', 0)}, unknown {c.get('unknown', 0)}")
    stage = report.get("stage")
    if stage:
        lines.append(f"  stage {stage['id']}: {stage['op']} in program {stage['program']} on rank(s) "
                     f"{stage['ranks']}" + (f", microbatch {stage['microbatch']}" if stage.get('microbatch')
                                            is not None else ""))
        realises = f", realises logical op {stage['realises']}" if stage.get("realises") else ""
        lines.append(f"    module {stage['module'] or 'model'} ({PHASES.get(stage['phase'], stage['phase'] or 'step')})"
                     f"{realises}")
        if stage.get("source"):
            lines.append(f"    source {stage['source']}")
        lines.append(f"    physical {stage['tensor']} should equal {stage['logical']}")
        if "physical_values" in stage:
            lines.append(f"    replayed (run {stage['run']}): physical {stage['physical_values']}")
            lines.append(f"                      logical  {stage['logical_values']}  "
                         f"(max |diff| {stage['max_abs_dev']:.3g})")
        if stage.get("factor"):
            lines.append(f"    {stage['factor']}")
        if stage.get("unreduced_input"):
            lines.append(f"    {stage['unreduced_input']['text']}")
        for name, values in stage.get("input_values", {}).items():
            lines.append(f"    input {name}: {values}")
        if stage.get("suspect"):
            s = stage["suspect"]
            lines.append(f"    first op inside the stage: {s['op']} = {s['kind']} on rank {s['rank']} "
                         f"(realises {s['realises']}, {s['module'] or '-'} {s['phase']})")
    for d in report.get("outputs_wrong", [])[:5]:
        lines.append(f"  output {d.get('output', d['logical'])} on rank(s) {d['ranks']}: max |physical - logical| "
                     f"{d['max_abs_dev']:.3g}")
    if report.get("outputs_wrong_count", 0) > 5:
        lines.append(f"  … {report['outputs_wrong_count'] - 5} more wrong outputs")
    for o in report.get("open", [])[:5]:
        lines.append(f"  open: {o['stage']} ({o['module'] or '-'} {o['phase']}): {o['reason'][:160]}")
    for p in report.get("problems", [])[:5]:
        lines.append(f"  composition: {p}")
    return "\n".join(lines)


__all__ = ["diagnose", "explain", "describe_reference", "public_names"]
