"""Captures shared by every frontend test (captures take seconds), and the real module they are checked against."""
import functools

import torch

import tv_ray.models as models
from tv_ray.frontend import capture


@functools.lru_cache(maxsize=None)
def symbolic(name: str, tied: bool):
    spec = models.get(name).with_dims(tied=tied)
    return spec, capture(spec)


@functools.lru_cache(maxsize=None)
def deep(name: str, layers: int, extrapolate: bool = True):
    """A built-in model at another depth, captured with or without layer extrapolation."""
    spec = models.get(name).with_dims(layers=layers)
    return spec, capture(spec, extrapolate=extrapolate)


def real_module(spec, seed=1):
    """The float64 module with random weights, its data, the graph inputs holding both, and the generator."""
    module = spec.build(device="cpu", dtype=torch.float64)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64) * 0.3)
    tokens, targets = spec.example_inputs(seed=seed)
    inputs = {n: p.detach().numpy().copy() for n, p in module.named_parameters()}
    inputs.update(tokens=tokens.numpy(), targets=targets.numpy())
    return module, tokens, targets, inputs, gen
