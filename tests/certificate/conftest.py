"""What the certificate tests share."""
import pytest

from tv_ray import api


@pytest.fixture(scope="session")
def normalised(tmp_path_factory):
    """A certificate with keys the normaliser proved (llama3-tiny dp=2,tp=2, AdamW, clip 1.0: sums over tp), which
    a check re-proves by another method, SMT — or, with none, refuses."""
    graph = api.capture_step("llama3-tiny", optim="adamw", clip=1.0)
    result = api.verify(api.parallelize(graph, "dp=2,tp=2", model="llama3-tiny"), progress=False, engine="local",
                        jobs=1)
    assert result.proved, result.report["headline"]
    out = tmp_path_factory.mktemp("normalised")
    result.save(out)
    return out
