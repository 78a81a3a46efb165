"""megatron-core tensor parallelism on dp × tp with a norm inside the tensor-parallel region: a per-head LayerNorm (a
query norm, megatron's `q_layernorm`) on each rank's heads of a ColumnParallelLinear's output, then RowParallelLinear.
The norm's weight is whole on every tp rank but each rank's gradient comes from its own heads, so
`finalize_model_grads` sums it over tp — for parameters named `q_layernorm` when `config.qk_layernorm` is set,
with or without sequence parallelism.
BUG = "sp_only" clears `qk_layernorm`, leaving the sum to the sequence-parallel mark alone: without sequence
parallelism each tp rank keeps its own heads' part of the gradient (B3: Megatron-LM #7452 item 11, a norm gradient
all-reduced only when sequence parallelism is on)."""
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path[:0] = [str(Path(__file__).resolve().parents[3] / "docs" / "examples"), str(Path(__file__).resolve().parent)]
import megatron_tp  # noqa: E402
from megatron_sp import batch, loss, optimizer, step  # noqa: E402,F401  its batch, loss and step

MESH = {"dp": 2, "tp": 2}
D, H = megatron_tp.D, megatron_tp.H
HEADS = 2
BUG = None


class Model(torch.nn.Module):
    """The single-device model, on [sequence, batch, hidden]."""
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(D, H, bias=False)
        self.q_layernorm = torch.nn.LayerNorm(H // HEADS)
        self.fc2 = torch.nn.Linear(H, D, bias=False)

    def forward(self, x):
        h = self.fc1(x)
        h = self.q_layernorm(h.unflatten(-1, (-1, H // HEADS))).flatten(-2)
        return self.fc2(F.silu(h))


class Parallel(torch.nn.Module):
    def __init__(self, config):
        super().__init__()
        from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
        init = torch.nn.init.zeros_
        self.fc1 = ColumnParallelLinear(D, H, config=config, init_method=init, bias=False, gather_output=False)
        self.q_layernorm = torch.nn.LayerNorm(H // HEADS).double()
        for param in self.q_layernorm.parameters():     # as megatron-core's own norms mark theirs
            param.sequence_parallel = config.sequence_parallel
        self.fc2 = RowParallelLinear(H, D, config=config, init_method=init, bias=False, input_is_parallel=True,
                                     skip_bias_add=False)

    def forward(self, x):
        h, _ = self.fc1(x)                              # this rank's heads
        h = self.q_layernorm(h.unflatten(-1, (-1, H // HEADS))).flatten(-2)
        out, _ = self.fc2(F.silu(h))
        return out


def model():
    return Model().double()


def parallelize(model, mesh):
    return megatron_tp.megatron(model, mesh, Parallel, qk_layernorm=BUG != "sp_only")


def shard(batch, mesh):
    """This rank's batch columns: its dp rank's."""
    dp = mesh["dp"]
    return {name: tensor.chunk(dp.size(), dim=1)[dp.get_local_rank()] for name, tensor in batch.items()}
