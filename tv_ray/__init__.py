"""tv_ray: prove that a distributed training plan computes what the single-device model computes.

Example::

    import tv_ray
    graph = tv_ray.capture_step("llama3-tiny", optim="adamw", clip=1.0)
    plan = tv_ray.parallelize(graph, "dp=2,tp=2,pp=2,mb=2", model="llama3-tiny", sp=True)
    result = tv_ray.simulate(plan, seed=0)
    proof = tv_ray.verify(plan, jobs=2)      # .proved, .counterexample, .save("out")
    traced = tv_ray.trace("docs/examples/dtensor_mlp.py", world_size=2)   # a torch.distributed script's plan
"""
__version__ = "0.1.0"

from tv_ray.errors import TvRayError  # noqa: E402
from tv_ray.parallel.spec import ParallelSpec  # noqa: E402
from tv_ray.plan import Plan  # noqa: E402
from tv_ray.simulate import simulate  # noqa: E402  (the function, not the module of the same name)

_API = ("Result", "capture", "capture_step", "parallelize", "trace", "verify")


def __getattr__(name: str):
    # the API (and torch behind it) is imported on first use: a solver actor importing tv_ray.engine needs
    # neither, and starts seconds sooner
    if name in _API:
        from tv_ray import api
        return getattr(api, name)
    raise AttributeError(f"module 'tv_ray' has no attribute {name!r}")


__all__ = ["ParallelSpec", "Plan", "Result", "TvRayError", "capture", "capture_step", "parallelize", "simulate",
           "trace", "verify"]
