"""GPT-2 as a plain torch module: LayerNorm, tanh-GELU, learned positions, biased linears.

The position table has `seq` rows (GPT-2 small: seq = n_positions = 1024), so
it scales with the sequence dim like every other size. The forward returns the
mean cross-entropy over batch*seq.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from tv_ray.models.llama import causal_mask, lm_loss


@dataclass(frozen=True)
class GPT2Config:
    """Named dims (DIMS) plus structure; d_model = heads*head_dim."""

    DIMS: ClassVar[tuple[str, ...]] = ("batch", "seq", "heads", "head_dim", "ffn", "vocab")

    layers: int
    batch: int
    seq: int
    heads: int
    head_dim: int
    ffn: int
    vocab: int
    tied: bool = True
    eps: float = 1e-5

    @property
    def kv_heads(self) -> int:
        return self.heads

    @property
    def d_model(self) -> int:
        return self.heads * self.head_dim


class Attention(nn.Module):
    def __init__(self, cfg: GPT2Config):
        super().__init__()
        self.heads, self.head_dim = cfg.heads, cfg.head_dim
        self.c_attn = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.c_proj = nn.Linear(cfg.d_model, cfg.d_model)

    def forward(self, x, mask):
        b, s, d = x.shape
        q, k, v = (t.view(b, s, self.heads, self.head_dim).transpose(1, 2)
                   for t in self.c_attn(x).split(d, dim=-1))
        scores = q @ k.transpose(-2, -1) * (self.head_dim ** -0.5) + mask
        out = torch.softmax(scores, dim=-1) @ v
        return self.c_proj(out.transpose(1, 2).reshape(b, s, d))


class MLP(nn.Module):
    def __init__(self, cfg: GPT2Config):
        super().__init__()
        self.c_fc = nn.Linear(cfg.d_model, cfg.ffn)
        self.c_proj = nn.Linear(cfg.ffn, cfg.d_model)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, cfg: GPT2Config):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.d_model, eps=cfg.eps)
        self.attn = Attention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.d_model, eps=cfg.eps)
        self.mlp = MLP(cfg)

    def forward(self, x, mask):
        x = x + self.attn(self.ln_1(x), mask)
        return x + self.mlp(self.ln_2(x))


class GPT2(nn.Module):
    """forward(tokens, targets) -> mean cross-entropy over batch*seq."""

    def __init__(self, cfg: GPT2Config):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab, cfg.d_model)
        self.wpe = nn.Embedding(cfg.seq, cfg.d_model)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.d_model, eps=cfg.eps)
        self.lm_head = None if cfg.tied else nn.Linear(cfg.d_model, cfg.vocab, bias=False)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        s = tokens.shape[1]
        positions = torch.arange(s, device=tokens.device)
        x = self.wte(tokens) + self.wpe(positions)
        mask = causal_mask(s, like=x)
        for layer in self.layers:
            x = layer(x, mask)
        return lm_loss(self.ln_f(x), self.wte.weight, self.lm_head, targets)
