"""Frontend: torch models -> logical graphs (forward, backward, optimizer step)."""
from tv_ray.frontend.capture import capture
from tv_ray.frontend.fit import instantiate

__all__ = ["capture", "instantiate"]
