"""One symbolic capture per (model, tied), shared by every frontend test (captures take seconds)."""
import functools

import tv_ray.models as models
from tv_ray.frontend import capture


@functools.lru_cache(maxsize=None)
def symbolic(name: str, tied: bool):
    spec = models.get(name).with_dims(tied=tied)
    return spec, capture(spec)
