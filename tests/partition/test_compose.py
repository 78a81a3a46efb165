"""The composition check (soundness rule 3) on broken inputs: each failure has its own message."""
from dataclasses import replace

from tv_ray.engine.driver import verify_plan
from tv_ray.partition.compose import composition_problems, state_lineage_problems
from tv_ray.partition.derive import derive
from tv_ray.plan import Fixed


def test_unproved_stages_break_the_chain_and_leave_outputs_uncovered(tiny_dp2_plan):
    part = derive(tiny_dp2_plan).partition
    proved = {o.id for o in part.obligations}
    assert composition_problems(tiny_dp2_plan, part, proved) == []
    first_output = next(o for o in part.obligations if o.claim.boundary)
    reader = next(o for o in part.obligations if o.reads and o.reads[0].kind != "in")
    problems = composition_problems(tiny_dp2_plan, part, proved - {reader.reads[0], first_output.id})
    assert f"stage {reader.id} reads {reader.reads[0]}, which is neither boundary lineage nor proved" in problems
    name = next(n for n, v in tiny_dp2_plan.logical.outputs if v == first_output.claim.logical)
    others = [o for o in part.obligations if o.claim.boundary and o.claim.logical == first_output.claim.logical
              and o.id != first_output.id]
    problems = composition_problems(tiny_dp2_plan, part, proved - {first_output.id} - {o.id for o in others})
    assert f"logical output {name!r} is not covered by a proved output stage" in problems


def test_updated_state_must_leave_with_its_input_lineage(tiny_dp2_plan):
    assert state_lineage_problems(tiny_dp2_plan) == []
    i, entry = next((i, e) for i, e in enumerate(tiny_dp2_plan.lineage) if e.logical.startswith("new/"))
    moved = replace(entry, slice=((0, (Fixed(0, 2),)),))
    lineage = tiny_dp2_plan.lineage[:i] + (moved,) + tiny_dp2_plan.lineage[i + 1:]
    problems = state_lineage_problems(replace(tiny_dp2_plan, lineage=lineage))
    assert len(problems) == 1
    assert problems[0].startswith(f"{entry.logical} leaves the step with lineage ")
    assert problems[0].endswith("the next step would start inconsistent")


def test_a_wrong_plan_is_never_proved_even_by_a_solver_that_proves_everything(tiny_dp2_plan, monkeypatch):
    """Belt and braces for soundness: an output that is wrong in a concrete run blocks `proved` by itself."""
    import tv_ray.engine.executor as executor
    from tv_ray.certificate.outcome import Verdict
    from tv_ray.ir import Graph, Node

    prog = tiny_dp2_plan.programs["main"]
    nodes = list(prog.nodes)
    i = next(i for i, n in enumerate(nodes) if n.op.value == "all_reduce" and n.get_meta("phase") == "bwd")
    nodes[i] = Node.make(nodes[i].name, "clone", list(nodes[i].args), {}, nodes[i].shape, nodes[i].dtype,
                         dict(nodes[i].meta))
    wrong = replace(tiny_dp2_plan, programs={"main": Graph(prog.inputs, tuple(nodes), prog.outputs, prog.name)})
    monkeypatch.setattr(executor, "solve", lambda lhs, rhs, budget: Verdict("proved", 0, "normalised"))
    outcome = verify_plan(wrong, progress=False)
    assert outcome.counts()["proved"] == outcome.counts()["obligations"]
    assert outcome.status == "unknown"
    assert any(p.startswith("program output ") and " in a concrete run" in p for p in outcome.problems)


def test_stages_whose_proofs_rest_on_each_other_do_not_compose(tiny_dp2_plan):
    """Two proved stages that read each other (a cycle) are not established, whatever their verdicts."""
    part = derive(tiny_dp2_plan).partition
    a, b = (next(o for o in part.obligations if o.claim.boundary and o.reads),
            next(o for o in part.obligations if not o.claim.boundary and o.reads))
    looped = {a.id: replace(a, reads=a.reads + (b.id,)), b.id: replace(b, reads=b.reads + (a.id,))}
    obligations = [looped.get(o.id, o) for o in part.obligations]
    broken = replace(part, obligations=obligations, mirrors=None)
    problems = composition_problems(tiny_dp2_plan, broken, {o.id for o in obligations})
    cycle = next(p for p in problems if p.startswith("the stage DAG has a cycle ("))
    assert cycle.endswith("): those stages' proofs rest on each other") and str(a.id) in cycle and str(b.id) in cycle
