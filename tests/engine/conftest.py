import pytest

from tv_ray import api


@pytest.fixture(scope="session")
def tiny_dp2_plan():
    graph = api.capture_step("llama3-tiny", optim="adamw", clip=1.0)
    return api.parallelize(graph, "dp=2", model="llama3-tiny")
