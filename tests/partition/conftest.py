"""Shared fixtures: the llama3-tiny training step, and a plan of it with its reduced dims and claims."""
from __future__ import annotations

import pytest

from tv_ray import api
from tv_ray.partition.derive import claims_for
from tv_ray.reduce import reduce_plan


@pytest.fixture(scope="session")
def step():
    return api.capture_step("llama3-tiny", optim="adamw", clip=1.0)


@pytest.fixture(scope="session")
def claimed(step):
    """`claimed(spec)` -> (plan, reduced dims, claims) for llama3-tiny at `spec`."""
    def make(spec: str):
        plan = api.parallelize(step, spec, model="llama3-tiny")
        dims = reduce_plan(plan).reduced
        return plan, dims, claims_for(plan, dims)[1]
    return make
