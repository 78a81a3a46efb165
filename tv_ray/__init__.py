"""tv_ray: prove that a distributed training plan computes what the single-device model computes.

Example::

    import tv_ray
    graph = tv_ray.capture_step("llama3-tiny", optim="adamw", clip=1.0)
    plan = tv_ray.parallelize(graph, "dp=2,tp=2,pp=2,mb=2", model="llama3-tiny", sp=True)
    result = tv_ray.simulate(plan, seed=0)
    proof = tv_ray.verify(plan, jobs=2)      # .proved, .counterexample, .save("out")
"""
__version__ = "0.1.0"

from tv_ray.api import (ParallelSpec, Plan, Result, capture, capture_step, parallelize, simulate,  # noqa: E402
                        verify)
from tv_ray.errors import TvRayError  # noqa: E402

__all__ = ["ParallelSpec", "Plan", "Result", "TvRayError", "capture", "capture_step", "parallelize", "simulate",
           "verify"]
