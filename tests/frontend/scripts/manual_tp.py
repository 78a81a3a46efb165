"""Tensor parallelism written by hand, as Megatron-LM writes it: torch.distributed collectives inside autograd
functions (`copy_to` all-reduces the gradient in backward, `reduce_from` the output in forward).

`BUG = "backward"` drops the backward all-reduce of `copy_to` (the input's gradient stays a partial sum);
`BUG = "twice"` all-reduces the output twice."""
import torch
import torch.distributed as dist
import torch.nn.functional as F

MESH = {"tp": 2}
BUG = None
D, H = 4, 8


class CopyTo(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    def backward(ctx, grad):
        if BUG != "backward":
            grad = grad.clone()
            dist.all_reduce(grad)
        return grad


class ReduceFrom(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        x = x.clone()
        dist.all_reduce(x)
        if BUG == "twice":
            dist.all_reduce(x)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad


class Model(torch.nn.Module):
    def __init__(self, shards: int = 1):
        super().__init__()
        self.inp = torch.nn.Linear(D, D, bias=False)
        self.up = torch.nn.Linear(D, H // shards, bias=False)
        self.down = torch.nn.Linear(H // shards, D, bias=False)
        self.shards = shards

    def forward(self, x):
        h = self.inp(x)
        if self.shards > 1:
            h = CopyTo.apply(h)
        out = self.down(F.silu(self.up(h)))
        return ReduceFrom.apply(out) if self.shards > 1 else out


def model():
    return Model().double()


def parallelize(model, mesh):
    """Each rank keeps its rows of up and its columns of down."""
    tp, rank = mesh["tp"].size(), mesh["tp"].get_local_rank()
    sharded = Model(tp).double()
    rows = slice(rank * H // tp, (rank + 1) * H // tp)
    with torch.no_grad():
        sharded.inp.weight.copy_(model.inp.weight)
        sharded.up.weight.copy_(model.up.weight[rows])
        sharded.down.weight.copy_(model.down.weight[:, rows])
    for weight, dim in ((sharded.up.weight, 0), (sharded.down.weight, 1)):    # megatron-core's attributes
        weight.tensor_model_parallel, weight.partition_dim, weight.partition_stride = True, dim, 1
    return sharded


def optimizer(params):
    return torch.optim.SGD(params, lr=0.1)


def batch():
    return {"x": torch.randn(3, D, dtype=torch.float64), "y": torch.randn(3, D, dtype=torch.float64)}


def loss(model, batch):
    return (model(batch["x"]) - batch["y"]).pow(2).mean()
