"""megatron-core's own pipeline schedule on a pp × dp × tp mesh (8 ranks) — the language model of megatron_lm.py,
its output layer tied to its embedding, split into two stages (the embedding and MLP on the first, the output layer
and `vocab_parallel_cross_entropy` on the last) and run by megatron's `get_forward_backward_func()` (1F1B over two
microbatches, activations sent and received along pp), in its DistributedDataParallel, the schedule ending in
`finalize_model_grads`: the all-reduce over dp and the tied weight's copies' all-reduce over the first and last
stage (`pip install -e '.[megatron]'`):

    tv-ray trace docs/examples/megatron_pipeline.py --world-size 8 -o plan.json && tv-ray verify plan.json -o out

Activations cross the pipeline in megatron's [sequence, batch, hidden] layout (the schedule's buffers are
(seq_length, micro_batch_size, hidden_size)): the first stage transposes its output into it, the last back."""
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import megatron_lm  # noqa: E402
import megatron_tp  # noqa: E402
from megatron_lm import HIGHS, VOCAB, D, H, SEQ, optimizer  # noqa: E402,F401

MESH = {"pp": 2, "dp": 2, "tp": 2}
BATCH, MICROBATCHES = 8, 2


def model():
    """megatron_lm's single-device model, its output layer tied to its embedding."""
    lm = megatron_lm.model()
    lm.output.weight = lm.embedding.weight
    return lm


class Stage(torch.nn.Module):
    """This rank's pipeline stage of megatron-core's layers, with what megatron's schedule and `finalize_model_grads`
    ask of a model: `model_type`, `set_input_tensor`, `pre_process` / `post_process`, and the tied weight's copy
    (`share_embeddings_and_output_weights`, `shared_embedding_or_output_weight()`, marked as megatron's
    LanguageModule marks it)."""
    def __init__(self, config):
        super().__init__()
        from megatron.core import parallel_state
        from megatron.core.enums import ModelType
        from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
        init = torch.nn.init.zeros_
        self.model_type = ModelType.encoder_or_decoder
        self.pre_process = parallel_state.is_pipeline_first_stage()
        self.post_process = parallel_state.is_pipeline_last_stage()
        self.share_embeddings_and_output_weights = True
        self.input_tensor = None
        if self.pre_process:
            self.embedding = VocabParallelEmbedding(VOCAB, D, init_method=init, config=config)
            self.fc1 = ColumnParallelLinear(D, H, config=config, init_method=init, bias=False, gather_output=False)
            self.fc2 = RowParallelLinear(H, D, config=config, init_method=init, bias=False, input_is_parallel=True,
                                         skip_bias_add=False)
        if self.post_process:
            self.output = ColumnParallelLinear(D, VOCAB, config=config, init_method=init, bias=False,
                                               gather_output=False)
        weight = self.shared_embedding_or_output_weight()
        weight.shared_embedding = True
        weight.shared = not self.pre_process

    def set_input_tensor(self, tensors):
        self.input_tensor = tensors[0] if isinstance(tensors, (list, tuple)) else tensors

    def shared_embedding_or_output_weight(self):
        return self.embedding.weight if self.pre_process else self.output.weight

    def forward(self, tokens=None):
        if self.pre_process:
            h = self.embedding(tokens)
            x, _ = self.fc1(h)
            y, _ = self.fc2(F.silu(x))
            return (h + y).transpose(0, 1).contiguous()         # to the next stage as [s, b, h]
        logits, _ = self.output(self.input_tensor.transpose(0, 1))
        return logits


def parallelize(model, mesh):
    """megatron-core set up for the mesh, this rank's stage with `model`'s weights in its DistributedDataParallel;
    the schedule ends in `finalize_model_grads`."""
    from megatron.core.distributed import finalize_model_grads
    ddp = megatron_tp.megatron(model, mesh, Stage)
    ddp.config.finalize_model_grads_func = finalize_model_grads
    return ddp


def batch():
    return {"tokens": torch.randint(0, VOCAB, (BATCH, SEQ)), "targets": torch.randint(0, VOCAB, (BATCH, SEQ))}


def shard(batch, mesh):
    """This rank's rows (its data-parallel rank's share): the first stage reads the tokens, the last the targets."""
    rows = megatron_tp.shard(batch, mesh)
    stage, stages = mesh["pp"].get_local_rank(), mesh["pp"].size()
    return {name: t for name, t in rows.items() if (stage, name) in ((0, "tokens"), (stages - 1, "targets"))}


def loss(model, batch):
    return F.cross_entropy(model(batch["tokens"]).flatten(0, 1), batch["targets"].flatten(0, 1))


def step(model, optimizer, batch):
    """Megatron's training step: the gradient buffer zeroed, megatron's schedule (each microbatch's mean token loss,
    which the schedule divides by the microbatches; it returns what `loss_func` reports), the reduced `main_grad`
    handed to the optimizer. The loss on the last stage (the microbatches' mean), None on the first."""
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy
    parts = [dict(zip(batch, rows)) for rows in zip(*(t.chunk(MICROBATCHES) for t in batch.values()))]

    def forward_step(data, model):
        part = next(data)

        def loss_func(logits):
            value = vocab_parallel_cross_entropy(logits, part["targets"]).mean()
            return value, {"loss": value.detach().clone()}    # a copy: the schedule divides `value` in place
        return model(part.get("tokens")), loss_func

    model.zero_grad_buffer()
    losses = get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter(parts), model=[model],
                                         num_microbatches=MICROBATCHES, seq_length=SEQ,
                                         micro_batch_size=len(next(iter(parts[0].values()))), forward_only=False)
    for param in model.parameters():
        param.grad = param.main_grad
    optimizer.step()
    optimizer.zero_grad()
    return torch.stack([x["loss"] for x in losses]).mean() if losses else None
