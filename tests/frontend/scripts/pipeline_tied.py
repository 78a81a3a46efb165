"""A small language model with tied input and output embeddings, pipelined over two stages with
torch.distributed.pipelining (1F1B, two microbatches), SGD. The first stage holds the embedding, the last the
output layer: each holds a copy of the tied weight, whose gradient the step all-reduces over the pipeline (the
first and last stage: Megatron's embedding group). BUG = "tie_unsynced" skips that all-reduce, so the copies drift
apart (B21: piper #13); BUG = "unscaled" keeps the schedule from dividing the gradients by its microbatches (a sum
of the microbatches' mean gradients where their mean was meant)."""
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "docs" / "examples"))
import dtensor_llama  # noqa: E402

MESH = {"pp": 2}
VOCAB, DIM, BATCH, SEQ, MICROBATCHES = 8, 4, 4, 2, 2
HIGHS = {"tokens": VOCAB, "targets": VOCAB}
BUG = None
SCHEDULE = None


class LM(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleDict({str(i): nn.Linear(DIM, DIM) for i in range(2)})
        self.output = nn.Linear(DIM, VOCAB, bias=False)
        self.output.weight = self.tok_embeddings.weight

    def forward(self, tokens):        # a pipeline stage holds some of the modules; the others are None
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        for layer in self.layers.values():
            h = torch.tanh(layer(h))
        return self.output(h) if self.output is not None else h


def model():
    return LM().double()


def parallelize(model, mesh):
    """This rank's stage of the model (layer k on stage k, the embedding first, the output last) and its schedule."""
    global SCHEDULE
    pp = mesh["pp"]
    dtensor_llama.stage(model, pp)      # split as the Llama example splits its stages
    SCHEDULE = Schedule1F1B(PipelineStage(model, pp.get_local_rank(), pp.size(), torch.device("cpu"),
                                          group=pp.get_group()),
                            n_microbatches=MICROBATCHES, loss_fn=cross_entropy, scale_grads=BUG != "unscaled")
    return model


def cross_entropy(pred, targets):
    return F.cross_entropy(pred.flatten(0, 1), targets.flatten(0, 1))


def optimizer(params):
    return torch.optim.SGD(params, lr=0.1)


def batch():
    return {"tokens": torch.randint(0, VOCAB, (BATCH, SEQ)), "targets": torch.randint(0, VOCAB, (BATCH, SEQ))}


def shard(batch, mesh):
    """The first stage reads the tokens, the last the targets."""
    return {"tokens": batch["tokens"]} if mesh["pp"].get_local_rank() == 0 else {"targets": batch["targets"]}


def loss(model, batch):
    return cross_entropy(model(batch["tokens"]), batch["targets"])


def step(model, optimizer, batch):
    losses = []
    if "tokens" in batch:
        SCHEDULE.step(batch["tokens"])
    else:
        SCHEDULE.step(target=batch["targets"], losses=losses)
    tied = model.tok_embeddings.weight if model.tok_embeddings is not None else model.output.weight
    if BUG != "tie_unsynced":
        dist.all_reduce(tied.grad, group=SCHEDULE._stage.group)
    optimizer.step()
    optimizer.zero_grad()
    return torch.stack(losses).mean() if losses else None
