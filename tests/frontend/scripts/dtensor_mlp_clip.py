"""The DTensor MLP clipped hard enough that every run clips (the global norm of its gradients is about 0.03), by
its own step: `get_total_norm` over the gradients, then `clip_grads_with_norm_`. BUG = "norm_drops_one" leaves the
last parameter's gradient out of the norm while still clipping it (B27: Megatron-LM #7452, item 8)."""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "docs" / "examples"))
from dtensor_mlp import MESH, batch, loss, model, optimizer, parallelize  # noqa: E402,F401

CLIP = 0.01
BUG = None


def step(model, optimizer, batch):
    value = loss(model, batch)
    value.backward()
    params = list(model.parameters())
    counted = params[:-1] if BUG == "norm_drops_one" else params
    total = torch.nn.utils.get_total_norm([p.grad for p in counted])
    torch.nn.utils.clip_grads_with_norm_(params, CLIP, total)
    optimizer.step()
    optimizer.zero_grad()
    return value
