"""megatron-core's vocabulary-parallel layers on a dp × tp mesh — a tiny language model: VocabParallelEmbedding, an
MLP of ColumnParallelLinear and RowParallelLinear, a ColumnParallelLinear output whose logits stay split over the
vocabulary, and `vocab_parallel_cross_entropy` — in megatron-core's DistributedDataParallel, traced and verified
(`pip install -e '.[megatron]'`):

    tv-ray trace docs/examples/megatron_lm.py --world-size 4 -o plan.json && tv-ray verify plan.json -o out

megatron-core's embedding masks the tokens outside its shard of the vocabulary and all-reduces the rows over tp;
its cross-entropy all-reduces the logits' maximum, the target's logit and the sum of exponentials over tp, and
writes its own backward (the softmax less the one-hot target, in place). It upcasts the logits with `.float()`:
the recorded program holds the cast, which the proof reads as the identity (real arithmetic)."""
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import megatron_tp  # noqa: E402

MESH = {"dp": 2, "tp": 2}
D, H, VOCAB, BATCH, SEQ = megatron_tp.D, megatron_tp.H, 8, 4, 4
HIGHS = {"tokens": VOCAB, "targets": VOCAB}


class LM(torch.nn.Module):
    """The single-device model."""
    def __init__(self):
        super().__init__()
        self.embedding = torch.nn.Embedding(VOCAB, D)
        self.fc1 = torch.nn.Linear(D, H, bias=False)
        self.fc2 = torch.nn.Linear(H, D, bias=False)
        self.output = torch.nn.Linear(D, VOCAB, bias=False)

    def forward(self, tokens):
        h = self.embedding(tokens)
        h = h + self.fc2(F.silu(self.fc1(h)))
        return self.output(h)


class ParallelLM(torch.nn.Module):
    """The same model of megatron-core's layers; `gather_output`: the output layer's (its logits whole on every rank
    when set)."""
    def __init__(self, config, gather_output=False):
        super().__init__()
        from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
        init = torch.nn.init.zeros_
        self.embedding = VocabParallelEmbedding(VOCAB, D, init_method=init, config=config)
        self.fc1 = ColumnParallelLinear(D, H, config=config, init_method=init, bias=False, gather_output=False)
        self.fc2 = RowParallelLinear(H, D, config=config, init_method=init, bias=False, input_is_parallel=True,
                                     skip_bias_add=False)
        self.output = ColumnParallelLinear(D, VOCAB, config=config, init_method=init, bias=False,
                                           gather_output=gather_output)

    def forward(self, tokens):
        h = self.embedding(tokens)
        x, _ = self.fc1(h)
        y, _ = self.fc2(F.silu(x))
        logits, _ = self.output(h + y)
        return logits


def model():
    return LM().double()


def parallelize(model, mesh):
    return megatron_tp.megatron(model, mesh, ParallelLM)


def optimizer(params):
    return torch.optim.SGD(params, lr=0.1)


def batch():
    return {"tokens": torch.randint(0, VOCAB, (BATCH, SEQ)), "targets": torch.randint(0, VOCAB, (BATCH, SEQ))}


shard = megatron_tp.shard


def loss(model, batch):
    return F.cross_entropy(model(batch["tokens"]).flatten(0, 1), batch["targets"].flatten(0, 1))


def parallel_loss(model, batch):
    """megatron-core's loss on the vocabulary-parallel logits: each token's cross-entropy, averaged."""
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy
    return vocab_parallel_cross_entropy(model(batch["tokens"]), batch["targets"]).mean()


def step(model, optimizer, batch):
    """megatron_tp.py's step with megatron-core's vocabulary-parallel loss."""
    return megatron_tp.step(model, optimizer, batch, parallel_loss)
