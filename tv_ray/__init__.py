"""tv_ray: prove that a distributed training plan computes what the single-device model computes."""
__version__ = "0.1.0"
