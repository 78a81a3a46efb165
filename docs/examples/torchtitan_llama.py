"""torchtitan's own Llama3 parallelised by torchtitan's own `parallelize_llama` on a dp × tp mesh (4 ranks):
tensor and sequence parallelism (torchtitan's sharding configs; its "partial_dtensor" SPMD backend: DTensor on tp,
FSDP2 on dp), torchtitan's CrossEntropyLoss (summed, divided by the global token count, loss-parallel over the
vocabulary), torchtitan's clip_grad_norm_, AdamW with torchtitan's defaults — traced and verified:

    pip install --no-deps -r requirements-torchtitan.txt
    tv-ray trace docs/examples/torchtitan_llama.py --world-size 4 -o plan.json && tv-ray verify plan.json -o out

torchtitan 0.3.0 on CPU takes five workarounds, each marked WORKAROUND below: three for a machine without GPUs or
triton (a triton-importing module stubbed, torchtitan's device type set to cpu, SDPA's math kernel as attention),
one for float64 (a mixed-precision dtype torchtitan's table lacks), and one for what tv_ray cannot hold yet: complex
tensors (Llama3's ComplexRoPE replaced by torchtitan's real CosSinRoPE; its cos/sin cache is a buffer, which the
proof takes as an input of any value).
"""
import sys
import types

import torch

# WORKAROUND 1 (CPU, no triton): torchtitan.models.common.token_dispatcher imports the MoE expert-parallel
# triton kernels at import time (torchtitan/distributed/minimal_async_ep/kernels.py does `import triton`).
# A dense Llama never calls them: stub the module with its eight names.
_kernels = types.ModuleType("torchtitan.distributed.minimal_async_ep.kernels")


def _no_triton(*_, **__):
    raise RuntimeError("triton kernel stub: MoE expert parallelism is not available on CPU")


for _name in ("copy_full_counts_to_peers_kernel", "copy_rows_to_peers_kernel", "expand_topk_grad_kernel",
              "fill_combine_metadata_kernel", "fill_dispatch_metadata_kernel", "invert_flat_indices_kernel",
              "reduce_topk_slots_kernel", "topk_scores_grad_kernel"):
    setattr(_kernels, _name, _no_triton)
sys.modules.setdefault(_kernels.__name__, _kernels)

import torchtitan.config as tt_config                                   # noqa: E402
import torchtitan.distributed.parallel_dims as tt_parallel_dims         # noqa: E402
from torchtitan.components.loss import CrossEntropyLoss                 # noqa: E402
from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig   # noqa: E402
from torchtitan.distributed import ParallelDims                         # noqa: E402
from torchtitan.distributed import utils as dist_utils                  # noqa: E402
from torchtitan.models.common import CosSinRoPE, Embedding, Linear, RMSNorm   # noqa: E402
from torchtitan.models.common.attention import ScaledDotProductAttention        # noqa: E402
from torchtitan.models.llama3 import (Llama3Model, _build_llama3_layers, _EMBEDDING_INIT, _NORM_INIT,  # noqa: E402
                                      _output_linear_init, parallelize_llama)
from torchtitan.models.llama3.sharding import set_llama3_sharding_config       # noqa: E402

# WORKAROUND 2 (CPU): torchtitan picks its device type at import (`_get_available_device_type() or "cuda"`) and
# ParallelDims.build_mesh calls init_device_mesh(device_type, ...): on a machine without GPUs that is "cuda".
tt_parallel_dims.device_type = "cpu"

# WORKAROUND 3 (float64): parallelize_llama hands FSDP2 a MixedPrecisionPolicy from
# TORCH_DTYPE_MAP[training.mixed_precision_param / _reduce], which knows float16/32 and bfloat16 only; float32
# would down-cast a float64 model's parameters in every forward. A float64 entry keeps FSDP a no-op cast. (With
# a float64 reduce dtype FSDP2 also takes its SUM-then-divide path instead of ReduceOp.PREMUL_SUM, which gloo
# lacks: torchtitan sets gradient_divide_factor=1.0, and for float32 FSDP2 would reduce with PREMUL_SUM(1.0).)
tt_config.TORCH_DTYPE_MAP.setdefault("float64", torch.float64)

MESH = {"dp": 2, "tp": 2}
DIM, HEADS, LAYERS, VOCAB, HIDDEN = 8, 4, 2, 16, 16
BATCH, SEQ = 4, 4
CLIP = 1.0
HIGHS = {"tokens": VOCAB, "targets": VOCAB}

PARALLELISM = ParallelismConfig(data_parallel_shard_degree=MESH["dp"], tensor_parallel_degree=MESH["tp"],
                                enable_sequence_parallel=True, spmd_backend="partial_dtensor")
TRAINING = TrainingConfig(local_batch_size=BATCH // MESH["dp"], seq_len=SEQ, max_norm=CLIP,
                          mixed_precision_param="float64", mixed_precision_reduce="float64")
LOSS = CrossEntropyLoss(CrossEntropyLoss.Config(global_vocab_size=VOCAB))


def config() -> Llama3Model.Config:
    """A tiny Llama3 built as torchtitan's llama3 flavours are (`_debugmodel` shrunk)."""
    cfg = Llama3Model.Config(
        dim=DIM, vocab_size=VOCAB,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM, param_init=_EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=DIM, param_init=_NORM_INIT),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB, param_init=_output_linear_init(DIM)),
        layers=_build_llama3_layers(
            fuse_qkv=True, n_layers=LAYERS, dim=DIM, n_heads=HEADS, hidden_dim=HIDDEN,
            # WORKAROUND 5 (tv_ray has no complex dtype): Llama3's ComplexRoPE (view_as_complex, a complex64
            # cache) -> torchtitan's real CosSinRoPE (rotate-half convention; it has no "llama" frequency scaling).
            rope=CosSinRoPE.Config(dim=DIM // HEADS, max_seq_len=SEQ, theta=500000),
            attn_backend="flex"))
    # WORKAROUND 4 (CPU eager): torchtitan's language-model attention backends are FlexAttention (always
    # torch.compile'd with inductor/triton max-autotune) and varlen (CUDA flash, bf16). Use torchtitan's own
    # ScaledDotProductAttention inner attention (causal via is_causal; no masks needed, no positions given).
    for layer in cfg.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    set_llama3_sharding_config(cfg, enable_sp=PARALLELISM.enable_sequence_parallel)   # as update_from_config does
    return cfg


# the SDPA math backend: plain ATen ops (the CPU flash kernel is one opaque op)
ScaledDotProductAttention.sdpa_backends = [torch.nn.attention.SDPBackend.MATH]


def model():
    m = config().build()
    m.init_states()             # torchtitan's initialisation (trunc_normal_, depth-scaled, ...)
    return m.double()


PARALLEL_DIMS = None


def parallelize(model, mesh):
    """torchtitan's parallelize_llama, with the ParallelDims the trainer builds. `mesh` (tv_ray's dp × tp mesh)
    is not passed on: ParallelDims builds its own from the world (pp, batch, cp, tp / dp_replicate, fsdp, tp ...),
    whose groups have the same ranks as tv_ray's dp and tp groups."""
    global PARALLEL_DIMS
    dist_utils.set_spmd_backend(PARALLELISM.spmd_backend)
    PARALLEL_DIMS = ParallelDims.from_config(PARALLELISM, world_size=mesh.size())
    PARALLEL_DIMS.build_mesh()
    return parallelize_llama(model, parallel_dims=PARALLEL_DIMS, training=TRAINING, parallelism=PARALLELISM,
                             compile_config=CompileConfig(), ac_config=None, dump_folder="/tmp")


def optimizer(params):
    # torchtitan's default_adamw: lr 8e-4, betas (0.9, 0.95), eps 1e-8, weight decay 0.1 (for-loop implementation)
    return torch.optim.AdamW(params, lr=8e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def batch():
    return {"tokens": torch.randint(0, VOCAB, (BATCH, SEQ)), "targets": torch.randint(0, VOCAB, (BATCH, SEQ))}


def shard(batch, mesh):
    """This rank's rows: its dp rank's share (every tp rank reads them), as torchtitan's dataloader gives."""
    rank, size = mesh["dp"].get_local_rank(), mesh["dp"].size()
    return {name: tensor.chunk(size)[rank] for name, tensor in batch.items()}


def loss(model, batch):
    """torchtitan's loss: the summed cross-entropy over the rank's tokens / the global batch's token count (the
    trainer all-reduces the local valid-token counts; every target is valid here, so it is BATCH * SEQ)."""
    value, _ = LOSS(model(batch["tokens"]), batch["targets"], global_valid_tokens=BATCH * SEQ)
    return value


def step(model, optimizer, batch):
    """Trainer.train_step without pp / grad accumulation: forward, backward, torchtitan's clip_grad_norm_, AdamW."""
    value = loss(model, batch)
    value.backward()
    dist_utils.clip_grad_norm_(list(model.parameters()), CLIP, foreach=True, pp_mesh=None)
    optimizer.step()
    optimizer.zero_grad()
    return value
