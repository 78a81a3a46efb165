"""The registry of built-in models: name -> ModelSpec, and the `tv-ray models` table.

Dims defaults for the full-size models: batch 8, seq 8192 (Llama 3) and
batch 8, seq 1024 (GPT-2); change them with ``spec.with_dims(...)``.
"""
from __future__ import annotations

from tv_ray.errors import TvRayError
from tv_ray.models.deepseek import DeepSeek, DeepSeekConfig
from tv_ray.models.gpt2 import GPT2, GPT2Config
from tv_ray.models.llama import Llama, LlamaConfig
from tv_ray.models.spec import ModelSpec, probe_tables


def _llama(name: str, layers: int, d_model: int, heads: int, kv_heads: int, ffn: int, vocab: int,
           batch: int = 8, seq: int = 8192) -> ModelSpec:
    cfg = LlamaConfig(layers=layers, batch=batch, seq=seq, kv_heads=kv_heads, n_rep=heads // kv_heads,
                      head_dim=d_model // heads, ffn=ffn, vocab=vocab)
    return ModelSpec(name, cfg, Llama, f"Llama 3, {layers} layers, d_model {d_model}")


def _gpt2(name: str, layers: int, d_model: int, heads: int, ffn: int, vocab: int,
          batch: int = 8, seq: int = 1024) -> ModelSpec:
    cfg = GPT2Config(layers=layers, batch=batch, seq=seq, heads=heads, head_dim=d_model // heads,
                     ffn=ffn, vocab=vocab)
    return ModelSpec(name, cfg, GPT2, f"GPT-2, {layers} layers, d_model {d_model}")


def _deepseek(name: str, layers: int, d_model: int, heads: int, q_rank: int | None, ffn: int, moe_ffn: int,
              experts: int, topk: int, shared: int, dense_layers: int, vocab: int, v3: bool, routed_scale: float,
              aux_alpha: float, qk_rope: int = 64, batch: int = 8, seq: int = 4096) -> ModelSpec:
    """V3: sigmoid scores, the correction bias in selection, gates renormalised; V2: softmax scores, neither."""
    cfg = DeepSeekConfig(layers=layers, batch=batch, seq=seq, heads=heads, d_model=d_model, q_rank=q_rank or 1,
                         qk_rope=qk_rope, ffn=ffn, moe_ffn=moe_ffn,
                         experts=experts, vocab=vocab, topk=topk, shared=shared, dense_layers=dense_layers,
                         q_lora=q_rank is not None, scores="sigmoid" if v3 else "softmax", norm_topk=v3,
                         routed_scale=routed_scale, aux_alpha=aux_alpha)
    return ModelSpec(name, cfg, DeepSeek, f"DeepSeek-{'V3' if v3 else 'V2'}, {layers} layers, {experts} experts "
                                          f"top-{topk}, d_model {d_model}")


# The tiny models' dims are divisible by every dp/tp/pp/microbatch degree in {1, 2}.
_REGISTRY: dict[str, ModelSpec] = {spec.name: spec for spec in (
    _llama("llama3-tiny", 2, d_model=32, heads=4, kv_heads=2, ffn=64, vocab=128, batch=8, seq=16),
    _llama("llama3-8b", 32, d_model=4096, heads=32, kv_heads=8, ffn=14336, vocab=128256),
    _llama("llama3-70b", 80, d_model=8192, heads=64, kv_heads=8, ffn=28672, vocab=128256),
    _llama("llama3-405b", 126, d_model=16384, heads=128, kv_heads=8, ffn=53248, vocab=128256),
    # published shapes: the models' config.json (DeepSeek-V3, DeepSeek-V2, DeepSeek-V2-Lite)
    _deepseek("deepseek-tiny", 2, d_model=32, heads=4, q_rank=16, ffn=64, moe_ffn=16, experts=4, topk=2, shared=1,
              dense_layers=1, vocab=128, v3=True, routed_scale=1.0, aux_alpha=0.001, qk_rope=4, batch=8,
              seq=16),
    _deepseek("deepseek-v2-lite-16b", 27, d_model=2048, heads=16, q_rank=None, ffn=10944, moe_ffn=1408, experts=64,
              topk=6, shared=2, dense_layers=1, vocab=102400, v3=False, routed_scale=1.0, aux_alpha=0.001),
    _deepseek("deepseek-v2-236b", 60, d_model=5120, heads=128, q_rank=1536, ffn=12288, moe_ffn=1536, experts=160,
              topk=6, shared=2, dense_layers=1, vocab=102400, v3=False, routed_scale=16.0, aux_alpha=0.003),
    _deepseek("deepseek-v3-671b", 61, d_model=7168, heads=128, q_rank=1536, ffn=18432, moe_ffn=2048, experts=256,
              topk=8, shared=1, dense_layers=3, vocab=129280, v3=True, routed_scale=2.5, aux_alpha=0.0001),
    _gpt2("gpt2-tiny", 2, d_model=32, heads=4, ffn=128, vocab=128, batch=8, seq=16),
    _gpt2("gpt2-small", 12, d_model=768, heads=12, ffn=3072, vocab=50257),
)}


def get(name: str) -> ModelSpec:
    """The built-in model called `name`, e.g. ``get("llama3-8b").dims["ffn"] == 14336``."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise TvRayError(f"unknown model {name!r}; built-in models: {', '.join(list_models())}") from None


def list_models() -> list[str]:
    return list(_REGISTRY)


def cmd_models(args=None) -> int:
    """`tv-ray models`: one row per built-in model with its sizes and parameter count."""
    header = ("name", "layers", "d_model", "heads", "kv_heads", "ffn", "vocab", "params")
    rows = []
    for spec in _REGISTRY.values():
        cfg = spec.config
        rows.append((spec.name, cfg.layers, cfg.d_model, cfg.heads, cfg.kv_heads, cfg.ffn, cfg.vocab,
                     f"{spec.param_count():,}"))
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        print("  ".join(str(v).ljust(w) if i == 0 else str(v).rjust(w) for i, (v, w) in enumerate(zip(row, widths))))
    return 0


__all__ = ["DeepSeek", "DeepSeekConfig", "GPT2", "GPT2Config", "Llama", "LlamaConfig", "ModelSpec", "cmd_models", "get", "list_models",
           "probe_tables"]
