"""Any torch module whose forward returns the loss can be captured, parallelized and simulated."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import tv_ray
from tv_ray.errors import CaptureError


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.up_proj = nn.Linear(8, 12)     # column parallel under tp (matched by name)
        self.down_proj = nn.Linear(12, 8)   # row parallel
        self.out = nn.Linear(8, 16)

    def forward(self, tokens, targets):
        h = self.emb(tokens)
        h = h + self.down_proj(torch.tanh(self.up_proj(h)))
        return F.cross_entropy(self.out(h).view(-1, 16), targets.view(-1))


@pytest.fixture(scope="module")
def step():
    torch.manual_seed(0)
    tokens, targets = torch.randint(0, 16, (4, 6)), torch.randint(0, 16, (4, 6))
    return tv_ray.capture_step(TinyLM().double(), (tokens, targets), optim="adamw", clip=1.0,
                               int_highs={"tokens": 16, "targets": 16})


@pytest.mark.parametrize("spec", ["dp=2,mb=2", "dp=2,tp=2"])
def test_user_module_plans_match_its_step(step, spec):
    plan = tv_ray.parallelize(step, spec)
    assert max(tv_ray.simulate(plan, seed=0).deviation.values()) <= 1e-9


def test_integer_inputs_need_a_range():
    tokens, targets = torch.randint(0, 16, (4, 6)), torch.randint(0, 16, (4, 6))
    with pytest.raises(CaptureError) as err:
        tv_ray.capture_step(TinyLM().double(), (tokens, targets))
    assert str(err.value) == ("integer input 'tokens' needs its range: pass int_highs={'tokens': N} "
                              "(values lie in [0, N))")
