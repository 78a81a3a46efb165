"""The closed set of tensor ops, their named groups and their attribute schemas.

Every op that may appear in a logical graph or in a rank's program is listed
here, once, with the attributes it takes. Nothing outside this table is an op:
`Op.parse` names the unknown op and lists the known ones.
"""
from __future__ import annotations

import enum
from typing import Mapping

from tv_ray.errors import UnknownOpError


class Op(str, enum.Enum):
    # inputs and constants
    FULL = "full"                  # attrs: size, value
    FULL_LIKE = "full_like"        # (x) attrs: value
    ARANGE = "arange"              # attrs: start, end, step
    TRIU = "triu"                  # (x) attrs: diagonal
    # matrix products
    MM = "mm"
    BMM = "bmm"
    ADDMM = "addmm"                # (bias, a, b)
    # layout
    VIEW = "view"                  # attrs: size
    PERMUTE = "permute"            # attrs: dims
    TRANSPOSE = "transpose"        # attrs: dim0, dim1
    EXPAND = "expand"              # attrs: size
    UNSQUEEZE = "unsqueeze"        # attrs: dim
    SQUEEZE = "squeeze"            # attrs: dim
    CLONE = "clone"
    SLICE = "slice"                # attrs: dim, start, end, step
    SLICE_BACKWARD = "slice_backward"  # (grad) attrs: input_size, dim, start, end, step
    SELECT = "select"              # attrs: dim, index
    CAT = "cat"                    # (*xs) attrs: dim
    # elementwise, unary
    NEG = "neg"
    RSQRT = "rsqrt"
    SQRT = "sqrt"
    RECIPROCAL = "reciprocal"
    EXP = "exp"
    LOG = "log"
    SIGMOID = "sigmoid"
    SILU = "silu"
    GELU = "gelu"                  # attrs: approximate ("none" | "tanh")
    TANH = "tanh"
    COS = "cos"
    SIN = "sin"
    ABS = "abs"
    CAST = "cast"                  # attrs: dtype
    # elementwise, binary (a tensor and a tensor, or a tensor and the scalar attr `other`)
    ADD = "add"                    # attrs: alpha? other?
    SUB = "sub"                    # attrs: alpha? other?
    MUL = "mul"                    # attrs: other?
    DIV = "div"                    # attrs: other?
    POW = "pow"                    # (x) attrs: exponent | (x) attrs: base
    MAXIMUM = "maximum"
    MINIMUM = "minimum"
    CLAMP = "clamp"                # attrs: min?, max?
    EQ = "eq"                      # attrs: other?
    NE = "ne"                      # attrs: other?
    LT = "lt"                      # attrs: other?
    GE = "ge"                      # attrs: other?
    LOGICAL_AND = "logical_and"
    LOGICAL_OR = "logical_or"
    WHERE = "where"                # (cond, a, b)
    # reductions
    SUM = "sum"                    # attrs: dims, keepdim
    MEAN = "mean"                  # attrs: dims, keepdim
    AMAX = "amax"                  # attrs: dims, keepdim
    # softmax and loss
    SOFTMAX = "_softmax"                          # attrs: dim
    SOFTMAX_BACKWARD = "_softmax_backward_data"   # (grad, out) attrs: dim
    LOG_SOFTMAX = "_log_softmax"                  # attrs: dim
    LOG_SOFTMAX_BACKWARD = "_log_softmax_backward_data"  # (grad, out) attrs: dim
    NLL_LOSS = "nll_loss"                         # (logp, target) attrs: reduction, ignore_index
    NLL_LOSS_TOTAL_WEIGHT = "nll_loss_total_weight"  # (target) attrs: ignore_index -> float scalar
    NLL_LOSS_BACKWARD = "nll_loss_backward"       # (grad, logp, target, total_weight) attrs: reduction, ignore_index
    # indexing
    EMBEDDING = "embedding"                       # (weight, indices)
    EMBEDDING_BACKWARD = "embedding_dense_backward"  # (grad, indices) attrs: num_weights
    GATHER = "gather"                             # (x, index) attrs: dim
    SCATTER = "scatter"                           # (x, index, src) attrs: dim
    SCATTER_ADD = "scatter_add"                   # (x, index, src) attrs: dim
    INDEX_SELECT = "index_select"                 # (x, index) attrs: dim
    INDEX_ADD = "index_add"                       # (x, index, src) attrs: dim
    TOPK_VALUES = "topk_values"                   # (x) attrs: k, dim
    TOPK_INDICES = "topk_indices"                 # (x) attrs: k, dim
    TOPK_MASK = "topk_mask"                       # (x) attrs: k, dim -> float 1 at each of the k largest, else 0
    # rank-local views of the mesh
    AXIS_INDEX = "axis_index"                     # () attrs: axes -> the rank's coordinate (int scalar)
    LOCAL_CHUNK = "local_chunk"                   # (x) attrs: dim, axes -> this rank's chunk of x
    # communication
    ALL_REDUCE = "all_reduce"                     # attrs: axes, reduce
    ALL_GATHER = "all_gather"                     # attrs: axes, dim
    REDUCE_SCATTER = "reduce_scatter"             # attrs: axes, dim, reduce
    ALL_TO_ALL = "all_to_all"                     # attrs: axes, split_dim, concat_dim
    BROADCAST = "broadcast"                       # attrs: axes, root
    SEND = "send"                                 # (x) attrs: peer -> no value
    RECV = "recv"                                 # () attrs: peer, size, dtype

    @staticmethod
    def parse(name: str) -> "Op":
        try:
            return Op(name)
        except ValueError:
            known = ", ".join(sorted(o.value for o in Op))
            raise UnknownOpError(f"unknown op {name!r}; known ops: {known}", op=name) from None

    def __str__(self) -> str:
        return self.value


def registrar(table: dict, what: str):
    """A decorator factory filling a rule table keyed by op; an op registered twice is an error."""
    def register(*ops: Op):
        def wrap(fn):
            for op in ops:
                if op in table:
                    raise AssertionError(f"{what} for {op} registered twice")
                table[op] = fn
            return fn
        return wrap
    return register


# -- named groups ------------------------------------------------------------
UNARY = frozenset({Op.NEG, Op.RSQRT, Op.SQRT, Op.RECIPROCAL, Op.EXP, Op.LOG, Op.SIGMOID,
                   Op.SILU, Op.GELU, Op.TANH, Op.COS, Op.SIN, Op.ABS, Op.CAST, Op.CLONE})
BINARY = frozenset({Op.ADD, Op.SUB, Op.MUL, Op.DIV, Op.POW, Op.MAXIMUM, Op.MINIMUM, Op.EQ,
                    Op.NE, Op.LT, Op.GE, Op.LOGICAL_AND, Op.LOGICAL_OR})
ELEMENTWISE = UNARY | BINARY | frozenset({Op.WHERE, Op.CLAMP})
REDUCTIONS = frozenset({Op.SUM, Op.MEAN, Op.AMAX})
VIEWS = frozenset({Op.VIEW, Op.PERMUTE, Op.TRANSPOSE, Op.EXPAND, Op.UNSQUEEZE, Op.SQUEEZE,
                   Op.SLICE, Op.SELECT})
COLLECTIVES = frozenset({Op.ALL_REDUCE, Op.ALL_GATHER, Op.REDUCE_SCATTER, Op.ALL_TO_ALL,
                         Op.BROADCAST})
P2P = frozenset({Op.SEND, Op.RECV})
COMMUNICATION = COLLECTIVES | P2P
RANK_DEPENDENT = frozenset({Op.AXIS_INDEX, Op.LOCAL_CHUNK})
REDUCE_KINDS = ("sum", "avg", "max")
DTYPES = ("float", "int", "bool", "token")  # token: the no-value result of send


# -- attribute schemas ---------------------------------------------------------
# Kinds: int, float (number; "inf"/"-inf"/"nan" as text in JSON), bool, str,
# expr (shape expression), exprs (list of them), ints (list of ints),
# axes (list of mesh axis names), peer (mapping axis -> relative offset).
AttrKind = str
REQUIRED = True
OPTIONAL = False

_REDUCE_ATTRS = {"dims": ("ints", REQUIRED), "keepdim": ("bool", REQUIRED)}
_SCALAR_OTHER = {"other": ("float", OPTIONAL), "alpha": ("float", OPTIONAL)}

ATTRS: Mapping[Op, Mapping[str, tuple[AttrKind, bool]]] = {
    Op.FULL: {"size": ("exprs", REQUIRED), "value": ("float", REQUIRED), "dtype": ("str", OPTIONAL)},
    Op.FULL_LIKE: {"value": ("float", REQUIRED), "dtype": ("str", OPTIONAL)},
    Op.ARANGE: {"start": ("expr", REQUIRED), "end": ("expr", REQUIRED), "step": ("expr", REQUIRED),
                "dtype": ("str", OPTIONAL)},
    Op.TRIU: {"diagonal": ("int", REQUIRED)},
    Op.VIEW: {"size": ("exprs", REQUIRED)},
    Op.PERMUTE: {"dims": ("ints", REQUIRED)},
    Op.TRANSPOSE: {"dim0": ("int", REQUIRED), "dim1": ("int", REQUIRED)},
    Op.EXPAND: {"size": ("exprs", REQUIRED)},
    Op.UNSQUEEZE: {"dim": ("int", REQUIRED)},
    Op.SQUEEZE: {"dim": ("int", REQUIRED)},
    Op.SLICE: {"dim": ("int", REQUIRED), "start": ("expr", REQUIRED), "end": ("expr", REQUIRED),
               "step": ("int", REQUIRED)},
    Op.SLICE_BACKWARD: {"input_size": ("exprs", REQUIRED), "dim": ("int", REQUIRED),
                        "start": ("expr", REQUIRED), "end": ("expr", REQUIRED), "step": ("int", REQUIRED)},
    Op.SELECT: {"dim": ("int", REQUIRED), "index": ("expr", REQUIRED)},
    Op.CAT: {"dim": ("int", REQUIRED)},
    Op.GELU: {"approximate": ("str", REQUIRED)},
    Op.CAST: {"dtype": ("str", REQUIRED)},
    Op.ADD: _SCALAR_OTHER,
    Op.SUB: _SCALAR_OTHER,
    Op.MUL: {"other": ("float", OPTIONAL)},
    Op.DIV: {"other": ("float", OPTIONAL)},
    Op.POW: {"exponent": ("float", OPTIONAL), "base": ("float", OPTIONAL)},
    Op.CLAMP: {"min": ("float", OPTIONAL), "max": ("float", OPTIONAL)},
    Op.EQ: {"other": ("float", OPTIONAL)},
    Op.NE: {"other": ("float", OPTIONAL)},
    Op.LT: {"other": ("float", OPTIONAL)},
    Op.GE: {"other": ("float", OPTIONAL)},
    Op.SUM: _REDUCE_ATTRS,
    Op.MEAN: _REDUCE_ATTRS,
    Op.AMAX: _REDUCE_ATTRS,
    Op.SOFTMAX: {"dim": ("int", REQUIRED)},
    Op.SOFTMAX_BACKWARD: {"dim": ("int", REQUIRED)},
    Op.LOG_SOFTMAX: {"dim": ("int", REQUIRED)},
    Op.LOG_SOFTMAX_BACKWARD: {"dim": ("int", REQUIRED)},
    Op.NLL_LOSS: {"reduction": ("str", REQUIRED), "ignore_index": ("int", REQUIRED)},
    Op.NLL_LOSS_TOTAL_WEIGHT: {"ignore_index": ("int", REQUIRED)},
    Op.NLL_LOSS_BACKWARD: {"reduction": ("str", REQUIRED), "ignore_index": ("int", REQUIRED)},
    Op.EMBEDDING_BACKWARD: {"num_weights": ("expr", REQUIRED)},
    Op.GATHER: {"dim": ("int", REQUIRED)},
    Op.SCATTER: {"dim": ("int", REQUIRED)},
    Op.SCATTER_ADD: {"dim": ("int", REQUIRED)},
    Op.INDEX_SELECT: {"dim": ("int", REQUIRED)},
    Op.INDEX_ADD: {"dim": ("int", REQUIRED)},
    Op.TOPK_VALUES: {"k": ("expr", REQUIRED), "dim": ("int", REQUIRED)},
    Op.TOPK_INDICES: {"k": ("expr", REQUIRED), "dim": ("int", REQUIRED)},
    Op.TOPK_MASK: {"k": ("expr", REQUIRED), "dim": ("int", REQUIRED)},
    Op.AXIS_INDEX: {"axes": ("axes", REQUIRED)},
    Op.LOCAL_CHUNK: {"dim": ("int", REQUIRED), "axes": ("axes", REQUIRED)},
    Op.ALL_REDUCE: {"axes": ("axes", REQUIRED), "reduce": ("str", REQUIRED)},
    Op.ALL_GATHER: {"axes": ("axes", REQUIRED), "dim": ("int", REQUIRED)},
    Op.REDUCE_SCATTER: {"axes": ("axes", REQUIRED), "dim": ("int", REQUIRED), "reduce": ("str", REQUIRED)},
    Op.ALL_TO_ALL: {"axes": ("axes", REQUIRED), "split_dim": ("int", REQUIRED), "concat_dim": ("int", REQUIRED)},
    Op.BROADCAST: {"axes": ("axes", REQUIRED), "root": ("int", REQUIRED)},
    Op.SEND: {"peer": ("peer", REQUIRED), "tag": ("int", OPTIONAL)},
    Op.RECV: {"peer": ("peer", REQUIRED), "size": ("exprs", REQUIRED), "dtype": ("str", REQUIRED),
              "tag": ("int", OPTIONAL)},
}

# Number of tensor arguments each op takes; None = variadic (at least one).
ARITY: Mapping[Op, tuple[int, ...] | None] = {
    **{op: (1,) for op in UNARY | VIEWS | REDUCTIONS},
    **{op: (1, 2) for op in BINARY},
    Op.POW: (1, 2),
    Op.WHERE: (3,), Op.CLAMP: (1,),
    Op.FULL: (0,), Op.ARANGE: (0,), Op.FULL_LIKE: (1,), Op.TRIU: (1,),
    Op.MM: (2,), Op.BMM: (2,), Op.ADDMM: (3,),
    Op.SLICE_BACKWARD: (1,), Op.CAT: None,
    Op.SOFTMAX: (1,), Op.LOG_SOFTMAX: (1,), Op.SOFTMAX_BACKWARD: (2,), Op.LOG_SOFTMAX_BACKWARD: (2,),
    Op.NLL_LOSS: (2,), Op.NLL_LOSS_TOTAL_WEIGHT: (1,), Op.NLL_LOSS_BACKWARD: (4,),
    Op.EMBEDDING: (2,), Op.EMBEDDING_BACKWARD: (2,),
    Op.GATHER: (2,), Op.SCATTER: (3,), Op.SCATTER_ADD: (3,), Op.INDEX_SELECT: (2,), Op.INDEX_ADD: (3,),
    Op.TOPK_VALUES: (1,), Op.TOPK_INDICES: (1,), Op.TOPK_MASK: (1,),
    Op.AXIS_INDEX: (0,), Op.LOCAL_CHUNK: (1,),
    **{op: (1,) for op in COLLECTIVES},
    Op.SEND: (1,), Op.RECV: (0,),
}

assert set(ARITY) == set(Op), f"ops without an arity: {set(Op) - set(ARITY)}"
