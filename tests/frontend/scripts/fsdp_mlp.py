"""An MLP sharded with FSDP2 (`fully_shard`) over two data-parallel ranks, each on its half of the batch, AdamW.

FSDP2 all-gathers each module's parameters before its forward and backward and reduce-scatters the gradients,
dividing them by the data-parallel size first (float64: the divide before the sum). BUG = "no_divide" switches
the divide off, as a reduction that sums where it should average; BUG = "divide_twice" divides twice, as sharded
data parallelism dividing once in its reduction and once more after it (B8: VeOmni PR #1079).
"""
import sys
from pathlib import Path

import torch
from torch.distributed.fsdp import fully_shard

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "docs" / "examples"))
import dtensor_mlp  # noqa: E402

MESH = {"dp": 2}
BUG = None


def model():
    return dtensor_mlp.model()         # the DTensor example's MLP


def parallelize(model, mesh):
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives as collectives
    divide = collectives._div_if_needed
    if BUG == "no_divide":      # FSDP2's divide factor of one: its reduce-scatter sums the gradients
        collectives._div_if_needed = lambda tensor, factor: None
    elif BUG == "divide_twice":
        collectives._div_if_needed = lambda tensor, factor: (divide(tensor, factor), divide(tensor, factor))
    fully_shard(model.up, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    return model


def optimizer(params):
    return torch.optim.AdamW(params, lr=0.1)


def batch():
    return {"x": torch.randn(4, 4, dtype=torch.float64), "y": torch.randn(4, 4, dtype=torch.float64)}


def shard(batch, mesh):
    r, n = mesh["dp"].get_local_rank(), mesh["dp"].size()
    return {k: v.chunk(n)[r] for k, v in batch.items()}


def loss(model, batch):
    return (model(batch["x"]) - batch["y"]).pow(2).mean()
