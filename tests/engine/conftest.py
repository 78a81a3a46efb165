import sys
from pathlib import Path

import pytest

from tv_ray import api

sys.path.insert(0, str(Path(__file__).resolve().parent))
from certificates import GRID_SUBSET  # noqa: E402


@pytest.fixture(scope="session")
def grid_local(tmp_path_factory):
    """`grid_local(i)` -> (plan, certificate dir) of `GRID_SUBSET[i]` verified by the local executor, built once
    per session: the certificate every engine must reproduce."""
    root, made = tmp_path_factory.mktemp("grid-local"), {}

    def get(i: int):
        if i not in made:
            model, parallel, flags, optim, tied, shards = GRID_SUBSET[i]
            plan = api.parallelize(api.capture_step(model, optim=optim, clip=1.0, tied=tied), parallel, model=model,
                                   **flags)
            result = api.verify(plan, engine="local", progress=False, shards=shards)
            assert result.proved, (result.report["headline"], result.report.get("problems"))
            result.save(root / str(i))
            made[i] = plan, root / str(i)
        return made[i]
    return get
