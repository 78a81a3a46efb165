"""The DeepSeek-V2/V3 family as a plain torch module: multi-head latent attention and mixture-of-experts layers.

Written for capture, like `tv_ray.models.llama`:

- Multi-head latent attention (MLA): queries through a low-rank projection
  (``q_a_proj`` → RMSNorm → ``q_b_proj``; or one ``q_proj`` when the model has
  no query rank), keys and values through a shared latent (``kv_a_proj``: the
  latent and one rotary key head; RMSNorm → ``kv_b_proj``: per-head keys
  without position and values), the decoupled rotary key shared by every head.
- The first ``dense_layers`` blocks have a SwiGLU MLP; the others a
  mixture of experts: shared experts (one SwiGLU of ``shared`` × ``moe_ffn``
  columns) on every token, plus ``experts`` routed experts stacked in three
  tensors (``experts.w_gate``/``w_up``: (experts, moe_ffn, d_model),
  ``w_down``: (experts, d_model, moe_ffn)), each token weighted by its router
  gate on its top-k experts.
- Routing: scores are ``sigmoid`` (V3) or ``softmax`` (V2) of the router's
  logits; the top-k are chosen on the scores plus a correction bias (V3's
  ``e_score_correction_bias``, a buffer: it steers selection only and has no
  gradient); the gate is the score on the chosen experts, normalised over
  them (V3), times ``routed_scale``. The choice is a 0/1 mask,
  ``zeros.scatter(-1, topk(...).indices, 1)``, which the capture records as
  one ``topk_mask`` op (`tv_ray.terms.routing`).
- Dropless dispatch, written densely: every routed expert runs on every token
  and its output is weighted by the token's gate, which is 0 where the token
  did not choose it. Over the reals this is exactly dropless top-k routing —
  an expert's output times a zero gate adds nothing — with static shapes,
  which is what a capture and a plan need (docs/moe.md says what is proved).
- The sequence-wise auxiliary balance loss (both V2 and V3 use it):
  ``alpha · mean over sequences of Σ_e f_e · P_e``, f the fraction of the
  sequence's choices that went to expert e (times experts / k), P the mean
  normalised score; added to the cross-entropy for every MoE layer.

Not modelled: node-limited (group) routing of V2/V3, YaRN's scaled rotary
embedding, multi-token prediction, capacity-limited routing (tokens dropped
past a capacity factor: tv_ray's MoE is dropless, which is what V3 trains with).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from tv_ray.models.llama import RMSNorm, SwiGLU, apply_rope, causal_mask, lm_loss, rope_tables


@dataclass(frozen=True)
class DeepSeekConfig:
    """Named dims (DIMS) plus structure. ``q_rank`` is unused when ``q_lora`` is off (V2-Lite).

    MLA's per-head sizes are multiples of the rotary head ``qk_rope`` (every published V2/V3 model: rotary
    64, keys without position 128, values 128, latent 512), so that a query head (``qk_nope + qk_rope``)
    and the latent plus its rotary key (``kv_rank + qk_rope``) are products of named dims, as the capture's
    shape fit needs."""

    DIMS: ClassVar[tuple[str, ...]] = ("batch", "seq", "heads", "d_model", "q_rank", "qk_rope", "ffn", "moe_ffn",
                                       "experts", "vocab")
    EVEN_DIMS: ClassVar[tuple[str, ...]] = ("qk_rope",)      # rotate-half splits the rotary head in two

    layers: int
    batch: int
    seq: int
    heads: int
    d_model: int
    q_rank: int
    qk_rope: int
    ffn: int                 # the dense layers' MLP width
    moe_ffn: int             # one expert's width
    experts: int             # routed experts per MoE layer
    vocab: int
    nope_per_rope: int = 2   # qk_nope = 2 · qk_rope
    v_per_rope: int = 2      # v_head = 2 · qk_rope
    kv_per_rope: int = 8     # kv_rank = 8 · qk_rope
    topk: int = 2            # experts chosen per token
    shared: int = 1          # shared experts (their widths add up)
    dense_layers: int = 1    # the first blocks have a dense MLP
    q_lora: bool = True
    scores: str = "sigmoid"  # "sigmoid" (V3) or "softmax" (V2)
    norm_topk: bool = True   # gates renormalised over the chosen experts (V3)
    routed_scale: float = 1.0
    aux_alpha: float = 0.0001
    tied: bool = False
    eps: float = 1e-6
    rope_theta: float = 10000.0

    @property
    def qk_nope(self) -> int:
        return self.nope_per_rope * self.qk_rope

    @property
    def v_head(self) -> int:
        return self.v_per_rope * self.qk_rope

    @property
    def kv_rank(self) -> int:
        return self.kv_per_rope * self.qk_rope

    @property
    def kv_heads(self) -> int:
        return self.heads     # MLA: every head has its own keys and values (from the shared latent)

    @property
    def moe_layers(self) -> int:
        return max(0, self.layers - self.dense_layers)

    @property
    def repeats_from(self) -> int:
        """The first layer whose twin (the layer before) is the same: past the dense layers (layer extrapolation)."""
        return max(2, self.dense_layers + 1)

    @property
    def min_dims(self) -> dict[str, int]:
        """Lower bounds a probe table must keep: a top-k needs more experts than k."""
        return {"experts": self.topk + 1}


class LatentAttention(nn.Module):
    """Multi-head latent attention with the decoupled rotary key."""

    def __init__(self, cfg: DeepSeekConfig):
        super().__init__()
        self.cfg = cfg
        q_dim = cfg.heads * (cfg.qk_nope + cfg.qk_rope)
        if cfg.q_lora:
            self.q_a_proj = nn.Linear(cfg.d_model, cfg.q_rank, bias=False)
            self.q_a_norm = RMSNorm(cfg.q_rank, cfg.eps)
            self.q_b_proj = nn.Linear(cfg.q_rank, q_dim, bias=False)
        else:
            self.q_proj = nn.Linear(cfg.d_model, q_dim, bias=False)
        self.kv_a_proj = nn.Linear(cfg.d_model, cfg.kv_rank + cfg.qk_rope, bias=False)
        self.kv_a_norm = RMSNorm(cfg.kv_rank, cfg.eps)
        self.kv_b_proj = nn.Linear(cfg.kv_rank, cfg.heads * (cfg.qk_nope + cfg.v_head), bias=False)
        self.o_proj = nn.Linear(cfg.heads * cfg.v_head, cfg.d_model, bias=False)

    def forward(self, x, cos, sin, mask):
        cfg = self.cfg
        b, s, _ = x.shape
        h = self.q_b_proj(self.q_a_norm(self.q_a_proj(x))) if cfg.q_lora else self.q_proj(x)
        q = h.view(b, s, -1, cfg.qk_nope + cfg.qk_rope).transpose(1, 2)
        q_nope, q_rope = q.split([cfg.qk_nope, cfg.qk_rope], dim=-1)
        latent, k_rope = self.kv_a_proj(x).split([cfg.kv_rank, cfg.qk_rope], dim=-1)
        kv = self.kv_b_proj(self.kv_a_norm(latent)).view(b, s, -1, cfg.qk_nope + cfg.v_head).transpose(1, 2)
        k_nope, v = kv.split([cfg.qk_nope, cfg.v_head], dim=-1)
        heads = q.shape[1]
        q_rope = apply_rope(q_rope, cos, sin)
        k_rope = apply_rope(k_rope.view(b, 1, s, cfg.qk_rope), cos, sin).expand(b, heads, s, cfg.qk_rope)
        q = torch.cat([q_nope, q_rope], dim=-1)
        k = torch.cat([k_nope, k_rope], dim=-1)
        scores = q @ k.transpose(-2, -1) * ((cfg.qk_nope + cfg.qk_rope) ** -0.5) + mask
        out = torch.softmax(scores, dim=-1) @ v
        return self.o_proj(out.transpose(1, 2).reshape(b, s, heads * cfg.v_head))


class Router(nn.Module):
    """Scores, the top-k choice (on scores plus the correction bias) and the gates."""

    def __init__(self, cfg: DeepSeekConfig):
        super().__init__()
        self.cfg = cfg
        self.weight = nn.Parameter(torch.empty(cfg.experts, cfg.d_model))
        nn.init.kaiming_uniform_(self.weight, a=5 ** 0.5)
        self.register_buffer("bias", torch.zeros(cfg.experts))     # V3's e_score_correction_bias

    def forward(self, x):
        """x (tokens, d_model) -> gates (tokens, experts), choice mask (tokens, experts), scores."""
        cfg = self.cfg
        logits = x @ self.weight.t()
        scores = logits.sigmoid() if cfg.scores == "sigmoid" else logits.softmax(dim=-1)
        chosen = torch.topk(scores.detach() + self.bias, cfg.topk, dim=-1).indices
        mask = torch.zeros_like(scores).scatter(-1, chosen, 1.0)
        gates = scores * mask
        if cfg.norm_topk:
            gates = gates / gates.sum(dim=-1, keepdim=True)
        return gates * cfg.routed_scale, mask, scores


class Experts(nn.Module):
    """The routed experts, stacked: every expert on every token (the gate zeroes the ones not chosen)."""

    def __init__(self, cfg: DeepSeekConfig):
        super().__init__()
        e, f, d = cfg.experts, cfg.moe_ffn, cfg.d_model
        self.w_gate = nn.Parameter(torch.empty(e, f, d))
        self.w_up = nn.Parameter(torch.empty(e, f, d))
        self.w_down = nn.Parameter(torch.empty(e, d, f))
        for w in (self.w_gate, self.w_up, self.w_down):
            nn.init.normal_(w, std=w.shape[-1] ** -0.5)

    def forward(self, x, gates):
        """x (tokens, d_model), gates (tokens, experts) -> Σ_e gate_e · expert_e(x), (tokens, d_model)."""
        xs = x.unsqueeze(0).expand(self.w_gate.shape[0], *x.shape)
        h = F.silu(xs @ self.w_gate.transpose(1, 2)) * (xs @ self.w_up.transpose(1, 2))
        out = h @ self.w_down.transpose(1, 2)                                # (experts, tokens, d_model)
        return (out * gates.t().unsqueeze(-1)).sum(dim=0)


class MoE(nn.Module):
    def __init__(self, cfg: DeepSeekConfig):
        super().__init__()
        self.cfg = cfg
        self.gate = Router(cfg)
        self.experts = Experts(cfg)
        self.shared_experts = SwiGLU(cfg.d_model, cfg.shared * cfg.moe_ffn)

    def forward(self, x):
        """x (batch, seq, d_model) -> (output, auxiliary balance loss)."""
        cfg = self.cfg
        b, s, d = x.shape
        flat = x.reshape(b * s, d)
        gates, mask, scores = self.gate(flat)
        out = self.shared_experts(flat) + self.experts(flat, gates)     # (laid out as the shared output)
        share = scores / scores.sum(dim=-1, keepdim=True) if cfg.scores == "sigmoid" else scores
        load = mask.view(b, s, -1).sum(dim=1) * (cfg.experts / (s * cfg.topk))     # f_e per sequence
        aux = (load * share.view(b, s, -1).mean(dim=1)).sum(dim=-1).mean() * cfg.aux_alpha
        return out.view(b, s, d), aux


class Block(nn.Module):
    def __init__(self, cfg: DeepSeekConfig, moe: bool):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model, cfg.eps)
        self.attn = LatentAttention(cfg)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.eps)
        self.mlp = MoE(cfg) if moe else SwiGLU(cfg.d_model, cfg.ffn)

    def forward(self, x, cos, sin, mask):
        x = x + self.attn(self.attn_norm(x), cos, sin, mask)
        out = self.mlp(self.mlp_norm(x))
        if isinstance(out, tuple):
            return x + out[0], out[1]
        return x + out, None


class DeepSeek(nn.Module):
    """forward(tokens, targets) -> mean cross-entropy over batch*seq plus every MoE layer's balance loss."""

    def __init__(self, cfg: DeepSeekConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab, cfg.d_model)
        self.layers = nn.ModuleList(Block(cfg, moe=i >= cfg.dense_layers) for i in range(cfg.layers))
        self.norm = RMSNorm(cfg.d_model, cfg.eps)
        self.lm_head = None if cfg.tied else nn.Linear(cfg.d_model, cfg.vocab, bias=False)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        s = tokens.shape[1]
        x = self.embed(tokens)
        cos, sin = rope_tables(s, self.cfg.qk_rope, self.cfg.rope_theta, like=x)
        mask = causal_mask(s, like=x)
        aux = []
        for layer in self.layers:
            x, layer_aux = layer(x, cos, sin, mask)
            if layer_aux is not None:
                aux.append(layer_aux)
        loss = lm_loss(self.norm(x), self.embed.weight, self.lm_head, targets)
        for a in aux:
            loss = loss + a
        return loss
