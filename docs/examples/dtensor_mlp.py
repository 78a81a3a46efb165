"""A tensor-parallel MLP with DTensor, traced and verified:

    tv-ray trace docs/examples/dtensor_mlp.py --world-size 2 -o plan.json && tv-ray verify plan.json

The up projection is split by columns (ColwiseParallel), the down projection by rows (RowwiseParallel): the
forward all-reduces the down projection's partial sums; gradients are clipped to a global norm of 1.
"""
import torch
import torch.nn.functional as F
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

MESH = {"tp": 2}
CLIP = 1.0           # clip_grad_norm_: DTensor sums the shards' squared norms over tp


class MLP(torch.nn.Module):
    def __init__(self, dim: int = 4, hidden: int = 8):
        super().__init__()
        self.up = torch.nn.Linear(dim, hidden, bias=False)
        self.down = torch.nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return self.down(F.silu(self.up(x)))


def model():
    return MLP().double()


def parallelize(model, mesh):
    return parallelize_module(model, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})


def optimizer(params):
    return torch.optim.SGD(params, lr=0.1)


def batch():
    return {"x": torch.randn(3, 4, dtype=torch.float64), "y": torch.randn(3, 4, dtype=torch.float64)}


def loss(model, batch):
    return (model(batch["x"]) - batch["y"]).pow(2).mean()
