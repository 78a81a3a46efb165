"""Context parallelism through the verifier: correct plans with the sequence cut over cp proved, a gradient not
reduced over cp refuted where it enters (the cp bug classes, B4–B7, B18, C4, are tests/engine/test_bugs.py's).

Under cp every rank holds a chunk of each sample's sequence: its queries attend to every key, so the sharding
rules gather the keys and values over cp before the scores (all-gather context parallelism, as Llama 3 was
trained) and reduce-scatter their gradients back; the weights' gradients and the loss's token count are summed
over dp × cp. Ring attention (send/recv of key/value blocks, online softmax) is not built.
"""
import pytest

from tests.engine.mutants import reduced_over, refuted_at
from tv_ray import api
from tv_ray.engine.driver import verify_plan
from tv_ray.errors import ParallelConfigError
from tv_ray.ir import Op
from tv_ray.simulate import simulate


@pytest.fixture(scope="module")
def base():
    return api.parallelize(api.capture_step("llama3-tiny"), "dp=2,cp=2", model="llama3-tiny")


@pytest.mark.parametrize("model, spec, flags, optim", [
    ("llama3-tiny", "dp=2,cp=2", {"zero": 1}, "adamw"),
    ("llama3-tiny", "cp=2,tp=2", {"sp": True}, "adamw"),
    ("gpt2-tiny", "cp=2,tp=2,mb=2", {"zero": 2}, "adamw"),
    ("gpt2-tiny", "dp=2,pp=2,cp=2", {}, "adamw"),     # a mirror's own value sent: its send was evaluated as an op
    ("deepseek-tiny", "cp=2", {}, "sgd"),              # routed experts read a chunk's tokens: a strided row set
    ("deepseek-tiny", "dp=2,ep=2,cp=2", {}, "adamw"),    # no ZeRO: its dp ranks are not mirrored (2.5x the time)
])
def test_context_parallel_plan_is_proved(model, spec, flags, optim):
    plan = api.parallelize(api.capture_step(model, optim=optim, clip=1.0), spec, model=model, **flags)
    assert not simulate(plan, seed=0).deviating(1e-9)
    outcome = verify_plan(plan, progress=False)
    assert outcome.status == "proved", (outcome.counts(), outcome.problems[:3])


def test_the_plan_cuts_the_sequence_gathers_keys_and_values_and_reduces_over_dp_and_cp(base):
    program = base.programs["main"]
    assert dict(base.mesh) == {"dp": 2, "cp": 2}
    tokens = next(e for e in base.lineage if e.tensor == "tokens")
    assert tokens.slice == ((0, ("dp",)), (1, ("cp",)))                # samples over dp, the sequence over cp
    gathers = [n for n in program.nodes if n.op == Op.ALL_GATHER and n.get_meta("phase") == "fwd"]
    assert gathers and all(n.attr["axes"] == ("cp",) for n in gathers)
    assert {n.get_meta("module") for n in gathers} == {"layers.0.attn", "layers.1.attn"}
    grads = dict(program.outputs)
    assert set(program.value(grads["grad/layers.0.mlp.gate_proj.weight"]).attr["axes"]) == {"dp", "cp"}


def test_weight_gradient_not_reduced_over_cp_is_refuted_at_its_reduction(base):
    program = base.programs["main"]
    reduced = program.value(dict(program.outputs)["grad/layers.1.attn.o_proj.weight"])
    headline = refuted_at(reduced_over(base, reduced, ["dp"]), reduced.name, "bwd", "layers.1.attn.o_proj")
    assert "partial sum over cp" in headline, headline


@pytest.mark.parametrize("model, spec, flags, message", [
    ("llama3-tiny", "cp=3", {}, "cp = 3 must divide seq = 16"),
    ("llama3-tiny", "cp=3,tp=2", {"sp": True}, "cp*tp = 6 must divide seq = 16"),
])
def test_impossible_context_parallel_configs_are_refused(model, spec, flags, message):
    with pytest.raises(ParallelConfigError, match=message.replace("*", r"\*")):
        api.parallelize(api.capture_step(model), spec, model=model, **flags)
