"""megatron-core sequence parallelism on dp × tp: a LayerNorm on this rank's part of the sequence, then
ColumnParallelLinear (which all-gathers the sequence) and RowParallelLinear (which reduce-scatters it), the output
gathered for the loss; megatron-core's DistributedDataParallel and `finalize_model_grads`, which all-reduces over tp
the gradients of parameters marked `sequence_parallel` (each tp rank's is its part of the sequence's).
BUG = "norm_unmarked" leaves the norm's parameters unmarked, so their gradients are never summed over tp
(B1: Megatron-LM #1446, the final layernorm under sequence parallelism)."""
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "docs" / "examples"))
import megatron_tp  # noqa: E402

MESH = {"dp": 2, "tp": 2}
D, H = megatron_tp.D, megatron_tp.H          # the sizes megatron_tp.megatron configures
SEQ, BATCH = 4, 4
BUG = None


class Model(torch.nn.Module):
    """The single-device model, on [sequence, batch, hidden] as megatron lays activations out."""
    def __init__(self):
        super().__init__()
        self.norm = torch.nn.LayerNorm(D)
        self.fc1 = torch.nn.Linear(D, H, bias=False)
        self.fc2 = torch.nn.Linear(H, D, bias=False)

    def forward(self, x):
        return self.fc2(F.silu(self.fc1(self.norm(x))))


class Parallel(torch.nn.Module):
    def __init__(self, config):
        super().__init__()
        from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
        self.config = config
        self.norm = torch.nn.LayerNorm(D).double()
        for param in self.norm.parameters():        # what megatron-core's own norms set under sequence parallelism
            param.sequence_parallel = BUG != "norm_unmarked"
        init = torch.nn.init.zeros_
        self.fc1 = ColumnParallelLinear(D, H, config=config, init_method=init, bias=False, gather_output=False)
        self.fc2 = RowParallelLinear(H, D, config=config, init_method=init, bias=False, input_is_parallel=True,
                                     skip_bias_add=False)

    def forward(self, x):
        from megatron.core.tensor_parallel import gather_from_sequence_parallel_region
        h, _ = self.fc1(self.norm(x))
        out, _ = self.fc2(F.silu(h))
        return gather_from_sequence_parallel_region(out, tensor_parallel_output_grad=False)   # the loss: on every tp rank


def model():
    return Model().double()


def parallelize(model, mesh):
    return megatron_tp.megatron(model, mesh, Parallel, sequence_parallel=True)


def optimizer(params):
    return torch.optim.SGD(params, lr=0.1)


def batch():
    return {"x": torch.randn(SEQ, BATCH, D, dtype=torch.float64), "y": torch.randn(SEQ, BATCH, D, dtype=torch.float64)}


def shard(batch, mesh):
    """This rank's batch columns (its dp rank's); of x, its tp rank's part of the sequence (y: all of it)."""
    dp, tp = mesh["dp"], mesh["tp"]
    rows = {name: tensor.chunk(dp.size(), dim=1)[dp.get_local_rank()] for name, tensor in batch.items()}
    return {"x": rows["x"].chunk(tp.size())[tp.get_local_rank()], "y": rows["y"]}


def loss(model, batch):
    return (model(batch["x"]) - batch["y"]).pow(2).mean()


def step(model, optimizer, batch):
    from megatron.core.distributed import finalize_model_grads
    model.zero_grad_buffer()
    value = loss(model, batch)
    value.backward()
    finalize_model_grads([model])
    for param in model.parameters():
        param.grad = param.main_grad
    optimizer.step()
    optimizer.zero_grad()
    return value
