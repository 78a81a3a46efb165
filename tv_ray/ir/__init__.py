"""The tensor-op IR: shape expressions, the closed op set, immutable SSA graphs."""
from tv_ray.ir.dims import Dims, Expr, evaluate, parse
from tv_ray.ir.graph import Graph, Node, TensorSpec, check_names, describe
from tv_ray.ir.ops import Op

__all__ = ["Dims", "Expr", "Graph", "Node", "Op", "TensorSpec", "check_names", "describe", "evaluate", "parse"]
