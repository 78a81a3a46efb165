"""docs/examples/megatron_tp.py (megatron-core's linears and DistributedDataParallel on dp × tp) with a bug switch:
BUG = "no_sync" leaves out `finish_grad_sync`, so each data-parallel rank steps with its own gradient."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "docs" / "examples"))
import megatron_tp  # noqa: E402
from megatron_tp import MESH, batch, loss, model, optimizer, parallelize, shard  # noqa: E402,F401

BUG = None


def step(model, optimizer, batch):
    if BUG == "no_sync":
        model.finish_grad_sync = lambda: None       # the gradient sync left out
    return megatron_tp.step(model, optimizer, batch)
