"""Frontend: torch models -> logical graphs (forward, loss, backward, optimizer step).

Example::

    from tv_ray.frontend import capture, capture_step
    graph = capture(tv_ray.models.get("llama3-8b"))              # shapes over the named dims
    step = capture_step(tv_ray.models.get("llama3-tiny"), optim="adamw", clip=1.0)
"""
from tv_ray.frontend.capture import capture
from tv_ray.frontend.fit import instantiate
from tv_ray.frontend.optim import AdamW, SGD, append_optimizer, capture_step

__all__ = ["AdamW", "SGD", "append_optimizer", "capture", "capture_step", "instantiate"]
