"""torch's DistributedDataParallel over two data-parallel ranks with gradient accumulation: each rank's rows in two
microbatches, the first backward under `no_sync()` (its gradient kept on the rank), the last one's all-reduce (DDP
divides by dp before summing) carrying both; each microbatch's loss divided by the microbatches.
BUG = "sync_first" syncs the first microbatch and accumulates the last locally: a gradient reduced before the last
microbatch, each rank stepping with its own last microbatch's part."""
import contextlib
import sys
from pathlib import Path

import torch
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fsdp_mlp import batch, loss, model, shard  # noqa: E402,F401  the same MLP, batch and loss

MESH = {"dp": 2}
MICROBATCHES = 2
BUG = None


def parallelize(model, mesh):
    return DistributedDataParallel(model, process_group=mesh["dp"].get_group())


def optimizer(params):
    return torch.optim.SGD(params, lr=0.1)


def step(model, optimizer, batch):
    parts = [dict(zip(batch, rows)) for rows in zip(*(t.chunk(MICROBATCHES) for t in batch.values()))]
    total = 0
    for i, part in enumerate(parts):
        last = i == len(parts) - 1
        with contextlib.nullcontext() if last != (BUG == "sync_first") else model.no_sync():
            value = loss(model, part) / MICROBATCHES
            value.backward()
        total = total + value.detach()
    optimizer.step()
    optimizer.zero_grad()
    return total
