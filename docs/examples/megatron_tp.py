"""megatron-core tensor parallelism — ColumnParallelLinear then RowParallelLinear, as Megatron's MLP writes them —
traced and verified (`pip install -e '.[megatron]'`: megatron-core 0.16.1, the last release for Python 3.11):

    tv-ray trace docs/examples/megatron_tp.py --world-size 2 -o plan.json && tv-ray verify plan.json -o out

megatron-core builds its own tensor-parallel process group; tv_ray finds it as the mesh's tp axis by its ranks, and
each weight's shard from megatron-core's `tensor_model_parallel` / `partition_dim` attributes."""
import torch
import torch.nn.functional as F

MESH = {"tp": 2}
D, H = 4, 8


def _megatron_on_cpu():
    torch.cuda.current_device = lambda: "cpu"        # megatron-core asks for a CUDA device even on CPU


class MLP(torch.nn.Module):
    """The single-device model: the same two linears."""
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(D, H, bias=False)
        self.fc2 = torch.nn.Linear(H, D, bias=False)

    def forward(self, x):
        return self.fc2(F.silu(self.fc1(x)))


class ParallelMLP(torch.nn.Module):
    def __init__(self, config):
        super().__init__()
        from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
        init = torch.nn.init.zeros_
        self.fc1 = ColumnParallelLinear(D, H, config=config, init_method=init, bias=False, gather_output=False)
        self.fc2 = RowParallelLinear(H, D, config=config, init_method=init, bias=False, input_is_parallel=True,
                                     skip_bias_add=False)

    def forward(self, x):
        h, _ = self.fc1(x)
        out, _ = self.fc2(F.silu(h))
        return out


def model():
    return MLP().double()


def parallelize(model, mesh):
    _megatron_on_cpu()
    from megatron.core import parallel_state
    from megatron.core.transformer import TransformerConfig
    tp = mesh["tp"].size()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    config = TransformerConfig(num_layers=1, hidden_size=D, num_attention_heads=tp, tensor_model_parallel_size=tp,
                               use_cpu_initialization=True, params_dtype=torch.float64, perform_initialization=True)
    sharded = ParallelMLP(config).double()
    rank = parallel_state.get_tensor_model_parallel_rank()
    rows = slice(rank * H // tp, (rank + 1) * H // tp)
    with torch.no_grad():
        sharded.fc1.weight.copy_(model.fc1.weight[rows])
        sharded.fc2.weight.copy_(model.fc2.weight[:, rows])
    return sharded


def optimizer(params):
    return torch.optim.SGD(params, lr=0.1)


def batch():
    return {"x": torch.randn(3, D, dtype=torch.float64), "y": torch.randn(3, D, dtype=torch.float64)}


def loss(model, batch):
    return (model(batch["x"]) - batch["y"]).pow(2).mean()
