"""docs/examples/megatron_lm.py (megatron-core's vocabulary-parallel embedding, linears and cross-entropy on dp × tp)
with a bug switch: BUG = "gathered_logits" has the output layer gather its logits (`gather_output=True`) before
`vocab_parallel_cross_entropy`, which takes them as this rank's part of the vocabulary: the sum of exponentials
counts every logit tp times, and the loss comes out as the right one plus log(tp) (B19: Megatron-LM #7452, item 2)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "docs" / "examples"))
import megatron_lm  # noqa: E402
import megatron_tp  # noqa: E402
from megatron_lm import HIGHS, MESH, batch, loss, model, optimizer, shard, step  # noqa: E402,F401

BUG = None


def parallelize(model, mesh):
    return megatron_tp.megatron(model, mesh, lambda config: megatron_lm.ParallelLM(
        config, gather_output=BUG == "gathered_logits"))
