"""The Llama 3 family as a plain torch module: RMSNorm, RoPE, GQA, SwiGLU, cross-entropy.

Written for capture: every size comes from the input's shape or the config's
named dims, every constant (RoPE angles, the causal mask) is made in forward
on the input's device, and the forward returns the scalar training loss.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class LlamaConfig:
    """Named dims (DIMS) plus structure; heads = kv_heads*n_rep, d_model = heads*head_dim."""

    DIMS: ClassVar[tuple[str, ...]] = ("batch", "seq", "kv_heads", "n_rep", "head_dim", "ffn", "vocab")
    EVEN_DIMS: ClassVar[tuple[str, ...]] = ("head_dim",)   # rotate-half splits head_dim in two

    layers: int
    batch: int
    seq: int
    kv_heads: int
    n_rep: int
    head_dim: int
    ffn: int
    vocab: int
    tied: bool = False
    eps: float = 1e-5
    rope_theta: float = 500000.0

    @property
    def heads(self) -> int:
        return self.kv_heads * self.n_rep

    @property
    def d_model(self) -> int:
        return self.heads * self.head_dim


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rope_tables(seq: int, head_dim: int, theta: float, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotary angles, (seq, head_dim), on `like`'s device and dtype."""
    exponent = torch.arange(0, head_dim, 2, device=like.device, dtype=like.dtype) / head_dim
    inv_freq = theta ** (-exponent)
    positions = torch.arange(seq, device=like.device, dtype=like.dtype)
    angles = positions[:, None] * inv_freq[None, :]
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE on (batch, heads, seq, head_dim)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def causal_mask(seq: int, like: torch.Tensor) -> torch.Tensor:
    return torch.full((seq, seq), float("-inf"), device=like.device, dtype=like.dtype).triu(1)


def lm_loss(x: torch.Tensor, embed_weight: torch.Tensor, lm_head: nn.Module | None,
            targets: torch.Tensor) -> torch.Tensor:
    """Logits through the untied head (or the tied embedding), then mean cross-entropy over batch*seq."""
    b, s = targets.shape
    logits = x @ embed_weight.t() if lm_head is None else lm_head(x)
    return F.cross_entropy(logits.reshape(b * s, -1), targets.reshape(b * s))


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.kv_heads, self.n_rep, self.head_dim = cfg.kv_heads, cfg.n_rep, cfg.head_dim
        kv_dim = cfg.kv_heads * cfg.head_dim
        self.q_proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.k_proj = nn.Linear(cfg.d_model, kv_dim, bias=False)
        self.v_proj = nn.Linear(cfg.d_model, kv_dim, bias=False)
        self.o_proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)

    def _repeat_kv(self, x: torch.Tensor) -> torch.Tensor:
        """(b, kv, s, hd) -> (b, kv*n_rep, s, hd): each kv head serves n_rep query heads."""
        b, kv, s, hd = x.shape
        return x[:, :, None].expand(b, kv, self.n_rep, s, hd).reshape(b, kv * self.n_rep, s, hd)

    def forward(self, x, cos, sin, mask):
        b, s, _ = x.shape
        heads = self.kv_heads * self.n_rep
        q = self.q_proj(x).view(b, s, heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        k, v = self._repeat_kv(k), self._repeat_kv(v)
        scores = q @ k.transpose(-2, -1) * (self.head_dim ** -0.5) + mask
        out = torch.softmax(scores, dim=-1) @ v
        return self.o_proj(out.transpose(1, 2).reshape(b, s, heads * self.head_dim))


class SwiGLU(nn.Module):
    def __init__(self, d_model: int, ffn: int):
        super().__init__()
        self.gate_proj = nn.Linear(d_model, ffn, bias=False)
        self.up_proj = nn.Linear(d_model, ffn, bias=False)
        self.down_proj = nn.Linear(ffn, d_model, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model, cfg.eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.eps)
        self.mlp = SwiGLU(cfg.d_model, cfg.ffn)

    def forward(self, x, cos, sin, mask):
        x = x + self.attn(self.attn_norm(x), cos, sin, mask)
        return x + self.mlp(self.mlp_norm(x))


class Llama(nn.Module):
    """forward(tokens, targets) -> mean cross-entropy over batch*seq."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab, cfg.d_model)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.norm = RMSNorm(cfg.d_model, cfg.eps)
        self.lm_head = None if cfg.tied else nn.Linear(cfg.d_model, cfg.vocab, bias=False)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        s = tokens.shape[1]
        x = self.embed(tokens)
        cos, sin = rope_tables(s, self.cfg.head_dim, self.cfg.rope_theta, like=x)
        mask = causal_mask(s, like=x)
        for layer in self.layers:
            x = layer(x, cos, sin, mask)
        return lm_loss(self.norm(x), self.embed.weight, self.lm_head, targets)
