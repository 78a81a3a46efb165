"""megatron-core on a dp × tp mesh — ColumnParallelLinear then RowParallelLinear, as Megatron's MLP writes them,
wrapped in megatron-core's DistributedDataParallel — traced and verified (`pip install -e '.[megatron]'`: megatron-core
0.16.1, the last release for Python 3.11):

    tv-ray trace docs/examples/megatron_tp.py --world-size 4 -o plan.json && tv-ray verify plan.json -o out

megatron-core builds its own process groups; tv_ray finds them as the mesh's axes by their ranks, and each weight's
shard from megatron-core's `tensor_model_parallel` / `partition_dim` attributes. Its DistributedDataParallel adds
each gradient into a contiguous buffer (`main_grad`), scales the buffer by 1/dp and all-reduces it over dp; the step
hands the reduced `main_grad` to the optimizer as Megatron's optimizer does."""
import types

import torch
import torch.nn.functional as F

MESH = {"dp": 2, "tp": 2}
D, H = 4, 8


def _megatron_on_cpu():
    """CPU stand-ins for what megatron-core asks of CUDA even on CPU: `torch.cuda.current_device()` (its gradient
    buffers, its pipeline's receive buffers) answers "cpu"; the pipeline schedule's token count,
    `torch.zeros([], device="cuda")`, is made on the CPU (the schedule module's `torch` is torch with that one factory
    redirected: a module, not a mode, so no frame of this file is on the stack of the ops the recorder takes a source
    line from)."""
    torch.cuda.current_device = lambda: "cpu"
    from megatron.core.pipeline_parallel import schedules

    class CpuTorch(types.ModuleType):
        def __getattr__(self, name):
            return getattr(torch, name)

        @staticmethod
        def zeros(*args, device=None, **kwargs):
            return torch.zeros(*args, device="cpu" if str(device).startswith("cuda") else device, **kwargs)
    if not isinstance(schedules.torch, CpuTorch):
        schedules.torch = CpuTorch("torch")


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
    return megatron(model, mesh, ParallelMLP)


def megatron(model, mesh, parallel, **options):
    """megatron-core set up for the mesh's tp and pp sizes (its default order: tp innermost, then dp, pp outermost —
    the mesh's), `parallel(config)` built (config: a TransformerConfig with `options`; `parallel` builds this rank's
    pipeline stage) with `model`'s weights — a tensor-parallel parameter its shard along `partition_dim`, a tied one
    by each of its names — and wrapped in megatron-core's DistributedDataParallel."""
    _megatron_on_cpu()
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.transformer import TransformerConfig
    tp, pp = mesh["tp"].size(), mesh["pp"].size() if "pp" in mesh.mesh_dim_names else 1
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    if pp > 1:      # the schedule's receive buffers' dtype; no torch.cuda.synchronize() after its sends and receives
        options = {"pipeline_dtype": torch.float64, "batch_p2p_sync": False, **options}
    config = TransformerConfig(num_layers=pp, hidden_size=D, num_attention_heads=tp, tensor_model_parallel_size=tp,
                               pipeline_model_parallel_size=pp, use_cpu_initialization=True,
                               params_dtype=torch.float64, perform_initialization=True, **options)
    sharded = parallel(config).double()
    rank = parallel_state.get_tensor_model_parallel_rank()
    whole = dict(model.named_parameters(remove_duplicate=False))
    with torch.no_grad():
        for name, param in sharded.named_parameters():
            value = whole[name]
            if getattr(param, "tensor_model_parallel", False):
                value = value.chunk(tp, dim=param.partition_dim)[rank]
            param.copy_(value)
    return DistributedDataParallel(config, DistributedDataParallelConfig(overlap_grad_reduce=False), module=sharded)


def optimizer(params):
    return torch.optim.SGD(params, lr=0.1)


def batch():
    return {"x": torch.randn(4, D, dtype=torch.float64), "y": torch.randn(4, D, dtype=torch.float64)}


def shard(batch, mesh):
    """This rank's rows: its data-parallel rank's share (all of them on a mesh without dp)."""
    if "dp" not in mesh.mesh_dim_names:
        return batch
    rank, size = mesh["dp"].get_local_rank(), mesh["dp"].size()
    return {name: tensor.chunk(size)[rank] for name, tensor in batch.items()}


def loss(model, batch):
    return (model(batch["x"]) - batch["y"]).pow(2).mean()


def step(model, optimizer, batch, loss_of=loss):
    """Megatron's training step: the gradient buffer zeroed, forward and backward (of `loss_of(model, batch)`), the
    gradients all-reduced over dp (`finish_grad_sync`), the reduced `main_grad` handed to the optimizer."""
    model.zero_grad_buffer()
    value = loss_of(model, batch)
    value.backward()
    model.finish_grad_sync()
    for param in model.parameters():
        param.grad = param.main_grad
    optimizer.step()
    optimizer.zero_grad()
    return value
