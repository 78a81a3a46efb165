"""A tiny Llama parallelised as torchtitan parallelises it on a dp × tp mesh — DTensor tensor parallelism with
sequence parallel norms, a vocabulary-parallel embedding and output and loss_parallel's cross-entropy, FSDP2
(`fully_shard`) over dp, AdamW and gradient clipping — traced and verified:

    tv-ray trace docs/examples/dtensor_llama.py --world-size 4 -o plan.json && tv-ray verify plan.json -o out

With a "pp" axis in MESH (a script that imports this one and sets MESH = {"pp": 2, "dp": 2, "tp": 2}: 8 ranks)
the layers are split into pipeline stages as torchtitan splits them — the embedding on the first, the norm and
output on the last, each stage's modules deleted from the others — and run by torch.distributed.pipelining's
1F1B schedule over MICROBATCHES microbatches; clipping takes the global norm over the stages.
"""
import math
import torch
import torch.nn.functional as F
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import PipelineStage, Schedule1F1B
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                               SequenceParallel, loss_parallel, parallelize_module)

MESH = {"dp": 2, "tp": 2}
DIM, HEADS, LAYERS, VOCAB, HIDDEN = 8, 4, 2, 16, 16
BATCH, SEQ, MICROBATCHES = 4, 4, 2
CLIP = 1.0
HIGHS = {"tokens": VOCAB, "targets": VOCAB}


class RMSNorm(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


def rotary(x):
    """x: (batch, seq, heads, head_dim), the rotation computed in the forward (no buffers)."""
    b, s, h, d = x.shape
    freqs = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=x.dtype) / d))
    angles = torch.arange(s, dtype=x.dtype)[:, None] * freqs[None, :]
    cos, sin = angles.cos()[None, :, None, :], angles.sin()[None, :, None, :]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.wq = nn.Linear(DIM, DIM, bias=False)
        self.wk = nn.Linear(DIM, DIM, bias=False)
        self.wv = nn.Linear(DIM, DIM, bias=False)
        self.wo = nn.Linear(DIM, DIM, bias=False)

    def forward(self, x):
        b, s, _ = x.shape
        hd = DIM // HEADS
        q = rotary(self.wq(x).view(b, s, -1, hd)).transpose(1, 2)
        k = rotary(self.wk(x).view(b, s, -1, hd)).transpose(1, 2)
        v = self.wv(x).view(b, s, -1, hd).transpose(1, 2)
        scores = q @ k.transpose(-2, -1) / math.sqrt(hd)
        mask = torch.triu(torch.full((s, s), float("-inf"), dtype=x.dtype), 1)
        out = torch.softmax(scores + mask, dim=-1) @ v
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1 = nn.Linear(DIM, HIDDEN, bias=False)
        self.w2 = nn.Linear(HIDDEN, DIM, bias=False)
        self.w3 = nn.Linear(DIM, HIDDEN, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attention_norm, self.attention = RMSNorm(DIM), Attention()
        self.ffn_norm, self.feed_forward = RMSNorm(DIM), FeedForward()

    def forward(self, x):
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleDict({str(i): Block() for i in range(LAYERS)})
        self.norm = RMSNorm(DIM)
        self.output = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens):          # a pipeline stage holds some of the modules; the others are None
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        for layer in self.layers.values():
            h = layer(h)
        return self.output(self.norm(h)) if self.output is not None else h


def model():
    return Llama().double()


def parallelize(model, mesh):
    if "pp" in mesh.mesh_dim_names:
        stage(model, mesh["pp"])
    tp = mesh["tp"]
    plan = {"tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "norm": SequenceParallel(),
            "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False)}
    parallelize_module(model, tp, {name: style for name, style in plan.items() if getattr(model, name) is not None})
    for block in model.layers.values():
        parallelize_module(block, tp, {
            "attention_norm": SequenceParallel(),
            "attention": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(), "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            "ffn_norm": SequenceParallel(),
            "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "feed_forward.w1": ColwiseParallel(), "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
            "feed_forward.w3": ColwiseParallel()})
    if "dp" in mesh.mesh_dim_names:         # a mesh without dp (MESH = {"tp": 2}): tensor parallelism alone
        for block in model.layers.values():
            fully_shard(block, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
    if "pp" in mesh.mesh_dim_names:
        global SCHEDULE, PP
        PP = mesh["pp"]
        SCHEDULE = Schedule1F1B(PipelineStage(model, PP.get_local_rank(), PP.size(), torch.device("cpu"),
                                              group=PP.get_group()), n_microbatches=MICROBATCHES, loss_fn=cross_entropy)
    return model


SCHEDULE = PP = None        # with pp: this rank's pipeline schedule and the pipeline's mesh


def stage(model, pp):
    """This rank's pipeline stage: its share of the layers (in order), the embedding on the first stage, the norm
    (where the model has one) and output on the last; the other modules deleted."""
    s, stages, layers = pp.get_local_rank(), pp.size(), len(model.layers)
    for k in list(model.layers):
        if int(k) * stages // layers != s:
            del model.layers[k]
    if s != 0:
        model.tok_embeddings = None
    if s != stages - 1:
        model.output = None
        if hasattr(model, "norm"):
            model.norm = None


def optimizer(params):
    return torch.optim.AdamW(params, lr=0.1)


def batch():
    return {"tokens": torch.randint(0, VOCAB, (BATCH, SEQ)), "targets": torch.randint(0, VOCAB, (BATCH, SEQ))}


def shard(batch, mesh):
    """This rank's rows of the batch: its data-parallel rank's share (every tensor-parallel rank reads them); with
    pp, the first stage reads the tokens and the last the targets."""
    if "dp" in mesh.mesh_dim_names:
        rank, size = mesh["dp"].get_local_rank(), mesh["dp"].size()
        batch = {name: tensor.chunk(size)[rank] for name, tensor in batch.items()}
    if "pp" in mesh.mesh_dim_names:
        s, stages = mesh["pp"].get_local_rank(), mesh["pp"].size()
        batch = {name: t for name, t in batch.items() if (name == "tokens" and s == 0) or
                 (name == "targets" and s == stages - 1)}
    return batch


def cross_entropy(pred, targets):
    return F.cross_entropy(pred.flatten(0, 1), targets.flatten(0, 1))


def loss(model, batch):
    return cross_entropy(model(batch["tokens"]), batch["targets"])


def step(model, optimizer, batch):
    """The training step as torchtitan runs it: the loss and its backward under loss_parallel (with pp: the
    pipeline schedule's microbatches, the last stage's losses averaged), clipping, AdamW."""
    with loss_parallel():
        if SCHEDULE is None:
            value = loss(model, batch)
            value.backward()
        else:
            losses = []
            first = (batch["tokens"],) if "tokens" in batch else ()
            SCHEDULE.step(*first, target=batch.get("targets"), losses=losses)
            value = torch.stack([x.full_tensor() if isinstance(x, DTensor) else x for x in losses]).mean() \
                if losses else None
    clip(model)
    optimizer.step()
    optimizer.zero_grad()
    return value


def clip(model):
    """clip_grad_norm_ over every stage's gradients: each stage's norm, squared, summed over the pipeline (as
    torchtitan's clip_grad_norm_ takes it)."""
    params = list(model.parameters())
    total = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
    if PP is not None:
        total = total.full_tensor() if isinstance(total, DTensor) else total
        total = total ** 2
        dist.all_reduce(total, group=PP.get_group())
        total = total ** 0.5
    torch.nn.utils.clip_grads_with_norm_(params, CLIP, total)
