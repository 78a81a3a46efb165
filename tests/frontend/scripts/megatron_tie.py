"""docs/examples/megatron_pipeline.py (megatron-core's own pipeline schedule, its output layer tied to its embedding)
on pp × tp, with a bug switch: BUG = "tie_unsynced" leaves the model's `share_embeddings_and_output_weights` unset,
so `finalize_model_grads` never all-reduces the tied weight's copies over the first and last stage, each stepping
with its own uses' part of the gradient (B21: the copies never synchronised)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "docs" / "examples"))
import megatron_pipeline  # noqa: E402
from megatron_pipeline import HIGHS, batch, loss, model, optimizer, shard, step  # noqa: E402,F401

MESH = {"pp": 2, "tp": 2}
BUG = None


def parallelize(model, mesh):
    ddp = megatron_pipeline.parallelize(model, mesh)
    ddp.module.share_embeddings_and_output_weights = BUG != "tie_unsynced"
    return ddp
