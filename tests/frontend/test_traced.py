"""Training scripts run on every rank (gloo, CPU), recorded into plans and verified against their single-device step."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.frontend.buggy import SCRIPTS, with_bug
import tv_ray
from tv_ray.errors import CaptureError, TraceFailed
from tv_ray.frontend.traced import trace
from tv_ray.plan import Fixed

ROOT = Path(__file__).resolve().parents[2]
DTENSOR_MLP = ROOT / "docs" / "examples" / "dtensor_mlp.py"
DTENSOR_LLAMA = ROOT / "docs" / "examples" / "dtensor_llama.py"


def manual_tp_line(text: str) -> str:
    """"file:line" of the first line of manual_tp.py holding `text`."""
    lines = (SCRIPTS / "manual_tp.py").read_text().splitlines()
    return f"{SCRIPTS / 'manual_tp.py'}:{next(i for i, line in enumerate(lines, 1) if text in line)}"


def manual_tp_where_rank_1(tmp_path, name: str, does: str) -> Path:
    """manual_tp.py with rank 1 doing `does` (a line) as its batch() begins, before any collective."""
    script = tmp_path / f"{name}.py"
    script.write_text((SCRIPTS / "manual_tp.py").read_text().replace(
        "def batch():", f"def batch():\n    import os, signal, time, torch.distributed as dist\n"
                        f"    if dist.get_rank() == 1:\n        {does}\n"))
    return script


def verified(plan):
    return tv_ray.verify(plan, engine="local", progress=False)


def test_dtensor_tensor_parallel_mlp_is_proved():
    plan = tv_ray.trace(DTENSOR_MLP, world_size=2)
    assert list(plan.programs) == ["rank0"] and plan.num_ranks == 2      # both ranks run one program, stored once
    ops = [node.op.value for node in plan.programs["rank0"].nodes]
    assert ops.count("all_reduce") == 2         # the down projection's output, the squared norms (clipping)
    result = verified(plan)
    assert result.proved, result.report.get("headline")


def test_torchtitan_style_llama_is_proved_and_checked(tmp_path):
    """Issue (a): sequence parallel norms, a vocabulary-parallel embedding, output and loss (loss_parallel), FSDP2
    over dp, AdamW and clip_grad_norm_, two layers, on a 2 × 2 mesh."""
    from tv_ray.certificate import check_certificate
    plan = trace(DTENSOR_LLAMA)
    assert dict(plan.mesh) == {"dp": 2, "tp": 2}
    collectives = {(node.op.value, tuple(node.attr.get("axes", ()))) for program in plan.programs.values()
                   for node in program.nodes}
    assert {("all_gather", ("dp",)), ("reduce_scatter", ("dp",)), ("all_gather", ("tp",)),
            ("reduce_scatter", ("tp",)), ("all_reduce", ("tp",))} <= collectives
    assert {s.name.split("/")[0] for s in plan.logical.inputs} >= {"step", "exp_avg", "exp_avg_sq"}
    loss = next(e for e in plan.lineage if e.tensor == "loss")
    assert (loss.partial, loss.scale) == (("dp",), 2)      # each dp rank's mean over its own rows
    result = verified(plan)
    assert result.proved, result.report.get("headline")
    result.save(tmp_path / "out")
    report = check_certificate(tmp_path / "out")          # raises if anything fails
    assert report.different_method == report.unique == result.outcome.counts()["unique"]


def test_torchtitan_style_llama_pipelined_on_eight_ranks_is_proved(tmp_path):
    """Issue (a) on 8 ranks: the same Llama split into two pipeline stages (torch.distributed.pipelining, 1F1B, two
    microbatches) × FSDP2 over dp × tensor parallel, its clipping norm summed over the stages."""
    script = tmp_path / "dtensor_llama_pp.py"
    script.write_text(f"import sys\nsys.path.insert(0, {str(DTENSOR_LLAMA.parent)!r})\n"
                      f"from dtensor_llama import *  # noqa\nMESH = {{'pp': 2, 'dp': 2, 'tp': 2}}\n")
    plan = trace(script)
    assert plan.num_ranks == 8 and len(plan.programs) == 4     # a program per stage and tp rank; dp ranks share
    assert {e.scale for e in plan.interior} == {2}       # each gradient as the last microbatch left it: twice the step's
    result = verified(plan)
    assert result.proved, result.report.get("headline")


def test_fsdp2_data_parallel_mlp_with_adamw_is_proved():
    """FSDP2 divides each gradient by dp before its reduce-scatter: until then every backward value is dp times a
    slice of the logical one (a scaled claim), each weight gradient a partial sum of dp times the logical one."""
    plan = trace(SCRIPTS / "fsdp_mlp.py")
    ops = [node.op.value for node in plan.programs["rank0"].nodes]
    assert ops.count("all_gather") == 3 and ops.count("reduce_scatter") == 2     # up's gathered again for backward
    result = verified(plan)
    assert result.proved, result.report.get("headline")
    scaled = {(c.scale, c.partial) for c in result.outcome.claims.values() if c.scale != 1}
    assert scaled == {(2, ()), (2, ("dp",))}


@pytest.mark.parametrize("bug, factor", [("no_divide", "physical = 2 × logical: a sum where a mean was meant"),
                                         ("divide_twice", "physical = 0.5 × logical")])
def test_fsdp2_gradients_divided_wrong_are_refuted_with_the_factor(tmp_path, bug, factor):
    """Its divide switched off (a reduction summing where it should average) or done twice (B8)."""
    result = verified(trace(with_bug(tmp_path, "fsdp_mlp", bug)))
    assert result.status == "refuted"
    assert result.report["stage"]["phase"] == "bwd"
    assert factor in result.report["headline"] and "grad/" in result.report["headline"]


def test_clipping_that_clips_is_proved_and_a_gradient_left_out_of_its_norm_is_refuted(tmp_path):
    """B27: the global norm over every gradient but one, every gradient still clipped by it (clipping active in
    every run, so the wrong norm changes the update)."""
    result = verified(trace(SCRIPTS / "dtensor_mlp_clip.py"))
    assert result.proved, result.report.get("headline")
    result = verified(trace(with_bug(tmp_path, "dtensor_mlp_clip", "norm_drops_one")))
    assert result.status == "refuted"
    stage = result.report["stage"]
    assert stage["phase"] == "optim" and stage["module"] == "up" and "new/up.weight" in result.report["headline"]


def test_optimizers_torch_cannot_be_recorded_as_are_refused():
    from tv_ray.frontend.traced import _optimizer
    params = [torch.nn.Parameter(torch.ones(2))]
    assert _optimizer(torch.optim.AdamW(params, lr=0.1, weight_decay=0.5)).weight_decay == 0.5
    refused = {torch.optim.AdamW(params, amsgrad=True): "optimizer AdamW with amsgrad: not recorded",
               torch.optim.Adam(params, weight_decay=0.1): "optimizer Adam with (L2) weight_decay: only decoupled "
                                                            "weight decay (AdamW) is recorded",
               torch.optim.SGD(params, lr=0.1, momentum=0.9): "optimizer SGD with {'momentum': 0.9}: only plain SGD "
                                                               "(lr) is recorded",
               torch.optim.Adagrad(params): "optimizer Adagrad: torch.optim.SGD and AdamW are recorded",
               torch.optim.AdamW([{"params": params}, {"params": [torch.nn.Parameter(torch.ones(1))], "lr": 1.0}]):
                   "optimizer AdamW with parameter groups of different lr: one of each is recorded"}
    for optimizer, message in refused.items():
        with pytest.raises(CaptureError) as err:
            _optimizer(optimizer)
        assert str(err.value) == message


def test_megatron_style_tensor_parallelism_is_proved():
    result = verified(trace(SCRIPTS / "manual_tp.py"))
    assert result.proved, result.report.get("headline")


def test_megatron_core_tensor_parallelism_is_proved():
    """megatron-core's own ColumnParallelLinear / RowParallelLinear and DistributedDataParallel on dp × tp, its own
    process groups (the `megatron` extra)."""
    pytest.importorskip("megatron.core", reason="the megatron extra: pip install -e '.[test,megatron]'")
    plan = trace(ROOT / "docs" / "examples" / "megatron_tp.py")
    lineage = {(entry.tensor, entry.where): entry.slice for entry in plan.lineage}
    assert lineage["fc1.weight", (("dp", 1), ("tp", 1))] == ((0, (Fixed(1, 2),)),)      # partition_dim 0
    assert lineage["fc2.weight", (("dp", 1), ("tp", 1))] == ((1, (Fixed(1, 2),)),)      # partition_dim 1
    assert ("all_reduce", ("dp",)) in {(node.op.value, tuple(node.attr.get("axes", ())))
                                       for node in plan.programs["rank0"].nodes}    # its DDP's, of the scaled buffer
    result = verified(plan)
    assert result.proved, result.report.get("headline")


def test_megatron_core_without_its_gradient_sync_is_refuted_at_the_gradient(tmp_path):
    """megatron-core's DistributedDataParallel without `finish_grad_sync`: each dp rank's gradient is its own
    rows' — a partial sum over dp of dp times the gradient, neither scaled nor reduced, named so."""
    pytest.importorskip("megatron.core", reason="the megatron extra: pip install -e '.[megatron]'")
    result = verified(trace(with_bug(tmp_path, "megatron_ddp", "no_sync")))
    assert result.status == "refuted"
    assert result.report["stage"]["phase"] == "bwd" and "grad/fc" in result.report["headline"]
    assert "(sum over dp): both the reduction over dp and the division by 2 must come before" in \
        result.report["headline"]


def test_megatron_core_sequence_parallelism_is_proved_and_its_unmarked_norm_refuted(tmp_path):
    """megatron-core's linears under sequence parallelism, its DistributedDataParallel and `finalize_model_grads` on
    dp × tp; B1: a norm whose parameters lack megatron's `sequence_parallel` mark keeps each tp rank's gradient."""
    pytest.importorskip("megatron.core", reason="the megatron extra: pip install -e '.[megatron]'")
    plan = trace(SCRIPTS / "megatron_sp.py")
    x = next(e for e in plan.lineage if e.tensor == "x" and e.where == (("dp", 1), ("tp", 0)))
    assert [(dim, factors) for dim, factors in x.slice] == [(0, (Fixed(0, 2),)), (1, (Fixed(1, 2),))]
    result = verified(plan)
    assert result.proved, result.report.get("headline")
    result = verified(trace(with_bug(tmp_path, "megatron_sp", "norm_unmarked")))
    assert result.status == "refuted" and "grad/norm.weight" in result.report["headline"]
    assert "physical is one rank's partial sum over tp" in result.report["headline"]


def test_torch_ddp_accumulating_gradients_is_proved_and_reduced_before_the_last_microbatch_refuted(tmp_path):
    """torch's DistributedDataParallel (its reducer's bucket copies, divide and all-reduce) accumulating two
    microbatches, the first under `no_sync()`; synced on the first instead, the gradient is reduced before the last
    microbatch and each rank steps with its own part of it."""
    plan = trace(SCRIPTS / "ddp_accumulate.py")
    assert [n.attr.get("reduce") for n in plan.programs["rank0"].nodes if n.op.value == "all_reduce"] == ["sum"]
    result = verified(plan)
    assert result.proved, result.report.get("headline")
    result = verified(trace(with_bug(tmp_path, "ddp_accumulate", "sync_first")))
    assert result.status == "refuted" and result.report["stage"]["phase"] == "bwd"
    assert "(grad/down.weight)" in result.report["headline"]


def test_megatron_core_query_norm_is_proved_and_its_sum_left_to_sequence_parallelism_refuted(tmp_path):
    """A per-head norm on each tp rank's heads (megatron's `q_layernorm`), whose gradient `finalize_model_grads` sums
    over tp under `qk_layernorm`. B3: the sum left to the sequence-parallel mark alone, so without sequence
    parallelism each tp rank keeps its own heads' part."""
    pytest.importorskip("megatron.core", reason="the megatron extra: pip install -e '.[megatron]'")
    result = verified(trace(SCRIPTS / "megatron_qknorm.py"))
    assert result.proved, result.report.get("headline")
    result = verified(trace(with_bug(tmp_path, "megatron_qknorm", "sp_only")))
    assert result.status == "refuted" and "(grad/q_layernorm.weight)" in result.report["headline"]
    assert "physical is one rank's partial sum over tp" in result.report["headline"]


def test_a_pipeline_with_tied_embeddings_is_proved_and_its_unsynced_copies_refuted(tmp_path):
    """torch.distributed.pipelining's 1F1B schedule over two stages and two microbatches: its sends and receives,
    its division of the gradients by the microbatches, and the tied embedding's gradient all-reduced over the first
    and last stage. B21: that all-reduce skipped, each stage's copy takes its own uses' part of the gradient; and
    the schedule's division switched off."""
    plan = trace(SCRIPTS / "pipeline_tied.py")
    p2p = {(n.op.value, dict(n.attr["peer"])["pp"]) for g in plan.programs.values() for n in g.nodes
           if n.op.value in ("send", "recv")}
    assert p2p == {("send", 1), ("recv", 1), ("send", -1), ("recv", -1)}
    # the second microbatch's forward runs after the first's backward: still forward, not the optimizer's step
    assert {n.get_meta("phase") for g in plan.programs.values() for n in g.nodes if n.get_meta("module")} == \
        {"fwd", "bwd"}
    result = verified(plan)
    assert result.proved, result.report.get("headline")
    result = verified(trace(with_bug(tmp_path, "pipeline_tied", "tie_unsynced")))
    assert result.status == "refuted" and "(grad/tok_embeddings.weight)" in result.report["headline"]
    assert "physical is one rank's partial sum over pp" in result.report["headline"]
    result = verified(trace(with_bug(tmp_path, "pipeline_tied", "unscaled")))
    assert result.status == "refuted" and result.report["stage"]["phase"] == "bwd"
    assert "physical = 2 × logical: a sum where a mean was meant" in result.report["headline"]


def test_megatron_core_pipeline_schedule_is_proved_and_its_unsynced_tied_copies_refuted(tmp_path):
    """megatron-core's own 1F1B schedule (docs/examples/megatron_pipeline.py on pp × tp): its sends and receives,
    its division by the microbatches, `finalize_model_grads` all-reducing the tied weight's copies over pp (and over
    megatron's data-parallel group of one rank: its input). B21: the model not marked as sharing them."""
    pytest.importorskip("megatron.core", reason="the megatron extra: pip install -e '.[megatron]'")
    plan = trace(SCRIPTS / "megatron_tie.py")
    assert {n.op.value for g in plan.programs.values() for n in g.nodes} >= {"send", "recv"}
    result = verified(plan)
    assert result.proved, result.report.get("headline")
    result = verified(trace(with_bug(tmp_path, "megatron_tie", "tie_unsynced")))
    assert result.status == "refuted" and "(grad/embedding.weight)" in result.report["headline"]
    assert "physical is one rank's partial sum over pp" in result.report["headline"]


def test_torchtitan_parallelize_llama_is_proved():
    """torchtitan's own Llama3 and `parallelize_llama` (TP + SP over DTensor, FSDP2, its loss and clipping) on
    dp × tp, as docs/examples/torchtitan_llama.py runs it on CPU."""
    pytest.importorskip("torchtitan", reason="pip install --no-deps -r requirements-torchtitan.txt")
    plan = trace(ROOT / "docs" / "examples" / "torchtitan_llama.py")
    ops = {n.op.value for n in plan.programs["rank0"].nodes}
    assert {"all_gather", "reduce_scatter", "all_reduce"} <= ops
    result = verified(plan)
    assert result.proved, result.report.get("headline")


def test_megatron_core_vocabulary_parallel_layers_are_proved_and_gathered_logits_refuted(tmp_path):
    """megatron-core's VocabParallelEmbedding, linears and vocab_parallel_cross_entropy (its own backward; logits
    upcast with `.float()`) under its DistributedDataParallel on dp × tp. B19: the output layer gathers the logits
    the loss takes as this rank's part of the vocabulary — the loss comes out as the right one plus log(tp)."""
    pytest.importorskip("megatron.core", reason="the megatron extra: pip install -e '.[megatron]'")
    plan = trace(ROOT / "docs" / "examples" / "megatron_lm.py")
    reduces = {(n.op.value, n.attr.get("reduce")) for n in plan.programs["rank0"].nodes if n.op.value == "all_reduce"}
    assert reduces == {("all_reduce", "sum"), ("all_reduce", "max")}     # the logits' maximum over tp
    result = verified(plan)
    assert result.proved, result.report.get("headline")
    result = tv_ray.verify(trace(with_bug(tmp_path, "megatron_vocab", "gathered_logits")), engine="local",
                           progress=False, timeout=0.5)
    assert result.status == "refuted"
    stage = result.report["stage"]
    assert stage["phase"] == "fwd" and "(loss) — physical = logical + 0.693147 (= log 2)" in result.report["headline"]
    assert stage["source"].endswith("megatron_lm.py:" + str(next(
        i for i, line in enumerate((ROOT / "docs" / "examples" / "megatron_lm.py").read_text().splitlines(), 1)
        if "vocab_parallel_cross_entropy(model(" in line)))


def test_a_missing_backward_all_reduce_is_located(tmp_path):
    result = verified(trace(with_bug(tmp_path, "manual_tp", "backward")))
    assert result.status == "refuted"
    stage = result.report["stage"]
    assert stage["phase"] == "bwd" and stage["module"] == "inp"
    assert stage["source"] == manual_tp_line("h = self.inp(x)")     # autograd's op: the forward op it differentiates
    assert "grad/inp.weight" in result.report["headline"]
    assert "a reduction (all-reduce / reduce-scatter) over tp is missing" in result.report["headline"]


def test_an_output_reduced_twice_is_refuted_at_the_line_that_computes_the_loss(tmp_path):
    result = verified(trace(with_bug(tmp_path, "manual_tp", "twice")))
    assert result.status == "refuted"
    stage = result.report["stage"]
    assert stage["phase"] == "fwd" and stage["source"] == manual_tp_line(".pow(2).mean()")
    assert "physical = 0.962546 × logical" in result.report["headline"]


def test_a_failing_rank_reports_its_traceback(tmp_path):
    script = manual_tp_where_rank_1(tmp_path, "fails", "raise ValueError('no data on this rank')")
    with pytest.raises(TraceFailed) as err:
        trace(script)
    assert str(err.value).startswith("rank 1 of 2 failed:\nTraceback (most recent call last):")
    assert str(err.value).endswith("ValueError: no data on this rank")
    done = subprocess.run([sys.executable, "-m", "tv_ray.cli", "trace", str(script), "-o", str(tmp_path / "p.json")],
                          capture_output=True, text=True)
    assert done.returncode == 2 and "rank 1 of 2 failed" in done.stderr and not (tmp_path / "p.json").exists()


def test_a_script_that_fails_to_load_in_the_launcher_reports_its_traceback(tmp_path):
    script = tmp_path / "fails_to_load.py"
    script.write_text((SCRIPTS / "manual_tp.py").read_text() + "\nimport multiprocessing\n"
                      "if multiprocessing.parent_process() is not None:\n"
                      "    raise RuntimeError('loaded in a child process')\n")
    with pytest.raises(TraceFailed) as err:
        trace(script)
    assert str(err.value).startswith("the launcher of 2 ranks failed:\nTraceback (most recent call last):")
    assert str(err.value).endswith("RuntimeError: loaded in a child process")


def test_a_rank_killed_without_a_traceback_is_named_with_its_exit_code(tmp_path):
    script = manual_tp_where_rank_1(tmp_path, "killed", "os.kill(os.getpid(), signal.SIGKILL)")
    with pytest.raises(TraceFailed) as err:
        trace(script)
    assert str(err.value) == "the launcher of 2 ranks failed:\nrank 1 ended with exit code -9 and left no traceback"


def test_an_interrupted_trace_ends_with_130_and_leaves_no_rank_behind(tmp_path):
    """Rank 1 sleeps before its first collective, rank 0 waits in it; Ctrl-C ends the command, its launcher and
    both ranks."""
    from tv_ray.commands import _descendants
    started = tmp_path / "started"
    script = manual_tp_where_rank_1(tmp_path, "sleeps", f"open({str(started)!r}, 'w').close(); time.sleep(600)")
    run = subprocess.Popen([sys.executable, "-m", "tv_ray.cli", "trace", str(script), "-o", str(tmp_path / "p.json")],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not started.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert started.exists(), "rank 1 never reached batch()"
    below = _descendants(run.pid)       # the fork server, the launcher, the two ranks
    assert len(below) >= 4, below
    run.send_signal(signal.SIGINT)
    _, err = run.communicate(timeout=60)
    assert run.returncode == 130 and err.endswith("tv-ray trace: interrupted\n"), err

    def alive() -> list[int]:
        pids = []
        for pid in below:
            try:
                if Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z":
                    pids.append(pid)
            except OSError:       # ended and reaped
                pass
        return pids
    deadline = time.monotonic() + 20
    while alive() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert alive() == []


def test_a_script_without_its_contract_is_refused(tmp_path):
    script = tmp_path / "bare.py"
    script.write_text("MESH = {'tp': 2}\ndef model(): pass\n")
    with pytest.raises(CaptureError) as err:
        trace(script)
    assert str(err.value) == (f"{script}: defines no parallelize, optimizer, batch, loss (a traced script defines "
                              f"MESH, model, parallelize, optimizer, batch, loss; see tv_ray.frontend.traced)")
    with pytest.raises(CaptureError) as err:
        trace(DTENSOR_MLP, world_size=4)
    assert str(err.value) == f"{DTENSOR_MLP}: MESH {{'tp': 2}} has 2 ranks, but --world-size is 4"


def test_a_batch_chunk_is_found_only_where_it_is_unambiguous():
    """Input lineage is assumed, so a rank's batch that equals two chunks of the global batch is refused, not guessed."""
    from tv_ray.frontend.traced import _found
    whole = torch.tensor([[1, 2], [3, 4], [1, 2], [5, 6]])
    assert _found(whole[2:], whole, "tokens") == {"dims": [[2, 2, 4], [0, 2, 2]], "partial": []}
    with pytest.raises(CaptureError) as err:
        _found(whole[:1], whole, "tokens")
    assert str(err.value) == ("batch tensor 'tokens' (1, 2) on this rank equals 2 chunks of the global batch's (4, 2) "
                              "(dim, chunk: [(0, 0), (0, 2)]); make batch() draw distinct rows")
    with pytest.raises(CaptureError, match="is no chunk of the global batch"):
        _found(torch.tensor([[9, 9]]), whole, "tokens")


def test_a_script_calling_trace_at_its_top_level_traces_once(tmp_path):
    """No ``if __name__ == "__main__"`` guard: multiprocessing would import the caller's script again in the fork
    server and the launcher, and trace again there; it is kept out of their sight."""
    caller = tmp_path / "caller.py"
    caller.write_text(f"import tv_ray\nplan = tv_ray.trace({str(DTENSOR_MLP)!r})\nprint('traced', plan.num_ranks)\n")
    done = subprocess.run([sys.executable, str(caller)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["traced", "2"]


def test_tv_ray_trace_writes_a_plan_verify_proves(tmp_path):
    plan = tmp_path / "plan.json"
    done = subprocess.run([sys.executable, "-m", "tv_ray.cli", "trace", str(DTENSOR_MLP), "--world-size", "2",
                           "-o", str(plan)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout)
    assert summary["ranks"] == 2 and summary["mesh"] == {"tp": 2} and list(summary["programs"]) == ["rank0"]
    assert tv_ray.verify(str(plan), engine="local", progress=False).proved
