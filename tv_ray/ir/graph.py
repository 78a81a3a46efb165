"""Graph and Node: the immutable SSA tensor-op graph shared by logical graphs and rank programs.

A `Graph` is a list of typed inputs, a topologically ordered tuple of `Node`s,
and named outputs. The logical graph (one training step on one device) and
each rank's program in a plan are both `Graph`s; only the ops they may use
differ (communication appears in programs only).
"""
from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Mapping

from tv_ray.errors import GraphError, TvRayError
from tv_ray.ir.dims import Expr
from tv_ray.ir.ops import ARITY, ATTRS, DTYPES, Op

Shape = tuple[Expr, ...]
ROLES = ("data", "param", "state", "step", "activation", "gradient", "const")


def _error(cls: type[TvRayError], path: str, message: str, node: str | None = None) -> TvRayError:
    """`cls` (GraphError, or PlanError when decoding a plan) at JSON `path`, about `node` if one."""
    return cls(f"{path}: {message}" if path else message, path=path or None, node=node)


# -- attribute values ----------------------------------------------------------
def _float_from_json(value: Any, where: str, cls) -> float:
    if isinstance(value, str) and value in ("inf", "-inf", "nan"):
        return float(value)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    raise _error(cls, where, f"expected a number, got {value!r}")


def _float_to_json(value: float) -> float | str:
    return str(value) if math.isinf(value) or math.isnan(value) else value


# -- fast decoding ---------------------------------------------------------------------
# A plan repeats a few hundred shapes and attribute values across ~10^6 ops, and JSON
# gives every occurrence a fresh object, so values are decoded by table lookup. Only
# exact ints and strs are used as keys: True == 1 == 1.0 would otherwise let a bool
# or a float share an int's entry and skip its error. A value the fast path does not
# recognise returns _MISS and goes through `decode_attr`, which owns the error messages.
_MISS = object()
_KEY_TYPES = frozenset({int, str})
_EXPR_CACHE: dict[int | str, Expr] = {}
_EXPRS_CACHE: dict[tuple, tuple[Expr, ...]] = {}
_CACHE_LIMIT = 1 << 16   # distinct values kept; a plan has hundreds, so this only bounds odd inputs


def _fast_expr(value: Any) -> Any:
    if type(value) is not int and type(value) is not str:
        return _MISS
    expr = _EXPR_CACHE.get(value)
    if expr is None:
        try:
            expr = Expr.of(value)
        except TvRayError:
            return _MISS
        if len(_EXPR_CACHE) >= _CACHE_LIMIT:
            _EXPR_CACHE.clear()
        _EXPR_CACHE[value] = expr
    return expr


def _fast_exprs(value: Any) -> Any:
    if type(value) is not list:
        return _MISS
    key = tuple(value)
    if not set(map(type, key)) <= _KEY_TYPES:
        return _MISS
    exprs = _EXPRS_CACHE.get(key)
    if exprs is None:
        exprs = tuple(_fast_expr(v) for v in key)
        if _MISS in exprs:
            return _MISS
        if len(_EXPRS_CACHE) >= _CACHE_LIMIT:
            _EXPRS_CACHE.clear()
        _EXPRS_CACHE[key] = exprs   # equal shapes also share one tuple in memory
    return exprs


def _fast_int(value: Any) -> Any:
    return value if type(value) is int else _MISS


def _fast_float(value: Any) -> Any:
    kind = type(value)
    return value if kind is float else float(value) if kind is int else _MISS


def _fast_bool(value: Any) -> Any:
    return value if type(value) is bool else _MISS


def _fast_str(value: Any) -> Any:
    return value if type(value) is str else _MISS


def _fast_ints(value: Any) -> Any:
    if type(value) is not list:
        return _MISS
    key = tuple(value)
    return key if not key or set(map(type, key)) == {int} else _MISS


def _fast_axes(value: Any) -> Any:
    if type(value) is not list or not value:
        return _MISS
    key = tuple(value)
    return key if set(map(type, key)) == {str} else _MISS


_FAST_DECODE = {"int": _fast_int, "float": _fast_float, "bool": _fast_bool, "str": _fast_str,
                "expr": _fast_expr, "exprs": _fast_exprs, "ints": _fast_ints, "axes": _fast_axes,
                "peer": lambda value: _MISS}


def decode_attr(kind: str, value: Any, where: str, cls=GraphError) -> Any:
    """Turn a JSON attribute value into its in-memory form, checking its kind."""
    fast = _FAST_DECODE.get(kind)
    if fast is not None:
        decoded = fast(value)
        if decoded is not _MISS:
            return decoded
    try:
        if kind == "int":
            if isinstance(value, int) and not isinstance(value, bool):
                return value
        elif kind == "float":
            return _float_from_json(value, where, cls)
        elif kind == "bool":
            if isinstance(value, bool):
                return value
        elif kind == "str":
            if isinstance(value, str):
                return value
        elif kind == "expr":
            if isinstance(value, (int, str)) and not isinstance(value, bool):
                return Expr.of(value)
        elif kind == "exprs":
            if isinstance(value, list):
                return tuple(decode_attr("expr", v, f"{where}[{i}]", cls) for i, v in enumerate(value))
        elif kind == "ints":
            if isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
                return tuple(value)
        elif kind == "axes":
            if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
                return tuple(value)
        elif kind == "peer":
            if isinstance(value, dict) and value and all(
                    isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool) for k, v in value.items()):
                return tuple(sorted(value.items()))
        else:
            raise AssertionError(f"unknown attribute kind {kind}")
    except TvRayError as err:
        if isinstance(err, cls):
            raise
        raise _error(cls, where, str(err)) from None
    raise _error(cls, where, f"expected {kind}, got {value!r}")


def encode_attr(kind: str, value: Any) -> Any:
    if kind == "float":
        return _float_to_json(value)
    if kind == "expr":
        return value.to_json()
    if kind == "exprs":
        return [v.to_json() for v in value]
    if kind in ("ints", "axes"):
        return list(value)
    if kind == "peer":
        return dict(value)
    return value


def _attr_value(kind: str, value: Any) -> Any:
    """Normalise a Python attribute value (as a capture or recipe writes it) to its stored form."""
    if kind == "expr":
        return Expr.of(value)
    if kind == "exprs":
        return tuple(Expr.of(v) for v in value)
    if kind in ("ints", "axes"):
        return tuple(value)
    if kind == "peer":
        return tuple(sorted(dict(value).items()))
    if kind == "float":
        return float(value)
    return value


# -- values ------------------------------------------------------------------------
@dataclass(frozen=True)
class TensorSpec:
    """A graph input: name, shape, dtype and role (data, param, state, step, …)."""

    name: str
    shape: Shape
    dtype: str = "float"
    role: str = "activation"
    high: Expr | None = None      # int tensors: values lie in [0, high) (token ids < vocab)
    positive: bool = False        # float tensors: values are > 0 (AdamW's exp_avg_sq, the step)
    ignore: int | None = None     # int tensors: a value they may hold besides: the loss's ignore_index (a masked target)

    def to_json(self) -> dict:
        out = {"name": self.name, "shape": [d.to_json() for d in self.shape],
               "dtype": self.dtype, "role": self.role}
        if self.high is not None:
            out["high"] = self.high.to_json()
        if self.positive:
            out["positive"] = True
        if self.ignore is not None:
            out["ignore"] = self.ignore
        return out

    @staticmethod
    def from_json(obj: Any, path: str, cls=GraphError) -> "TensorSpec":
        if not isinstance(obj, dict):
            raise _error(cls, path, f"expected an object with name, shape, dtype, role; got {obj!r}")
        unknown = set(obj) - {"name", "shape", "dtype", "role", "high", "positive", "ignore"}
        if unknown:
            raise _error(cls, path, f"unknown field {sorted(unknown)[0]!r}")
        name = obj.get("name")
        if not isinstance(name, str) or not name:
            raise _error(cls, f"{path}.name", "expected a non-empty string")
        shape = decode_attr("exprs", obj.get("shape"), f"{path}.shape", cls)
        dtype = obj.get("dtype", "float")
        if dtype not in DTYPES:
            raise _error(cls, f"{path}.dtype", f"unknown dtype {dtype!r}; one of {', '.join(DTYPES)}")
        role = obj.get("role", "activation")
        if role not in ROLES:
            raise _error(cls, f"{path}.role", f"unknown role {role!r}; one of {', '.join(ROLES)}")
        high = obj.get("high")
        if high is not None:
            high = decode_attr("expr", high, f"{path}.high", cls)
        positive = obj.get("positive", False)
        if not isinstance(positive, bool):
            raise _error(cls, f"{path}.positive", f"expected true or false, got {positive!r}")
        ignore = obj.get("ignore")
        if ignore is not None and (isinstance(ignore, bool) or not isinstance(ignore, int) or dtype != "int"):
            raise _error(cls, f"{path}.ignore", f"expected an integer on an int input (the value a loss ignores), "
                                                f"got {ignore!r} on a {dtype} input")
        return TensorSpec(name, shape, dtype, role, high, positive, ignore)


@dataclass(frozen=True)
class Node:
    """One SSA op: ``name = op(*args; attrs) : shape dtype``.

    `meta` carries provenance that does not change the op's meaning: the
    module path, the phase (fwd / bwd / optim), the microbatch, the logical
    node a physical op realises.
    """

    name: str
    op: Op
    args: tuple[str, ...]
    attrs: tuple[tuple[str, Any], ...]
    shape: Shape
    dtype: str = "float"
    meta: tuple[tuple[str, Any], ...] = ()

    @staticmethod
    def make(name: str, op: Op | str, args: Iterable[str], attrs: Mapping[str, Any] | None = None,
             shape: Iterable = (), dtype: str = "float", meta: Mapping[str, Any] | None = None) -> "Node":
        """Build a node from plain Python values, normalising attributes by the op's schema."""
        op = Op.parse(op) if isinstance(op, str) else op
        schema = ATTRS.get(op, {})
        norm = []
        for key, value in (attrs or {}).items():
            if key not in schema:
                raise GraphError(f"node {name}: op {op} takes no attribute {key!r}", node=name)
            norm.append((key, _attr_value(schema[key][0], value)))
        return Node(name, op, tuple(args), tuple(sorted(norm)), tuple(Expr.of(d) for d in shape),
                    dtype, tuple(sorted((meta or {}).items())))

    @property
    def attr(self) -> dict[str, Any]:
        return dict(self.attrs)

    def get_meta(self, key: str, default: Any = None) -> Any:
        for name, value in self.meta:       # a few items: no dict built
            if name == key:
                return value
        return default

    def renamed(self, name: str, args: tuple[str, ...], meta: tuple[tuple[str, Any], ...]) -> "Node":
        """This op as `name`, reading `args`, with `meta` (a plan's microbatch copies and pipeline stage programs:
        hundreds of thousands, so not through the frozen dataclass's `__init__` — its fields set at once)."""
        made = object.__new__(Node)
        made.__dict__.update(name=name, op=self.op, args=args, attrs=self.attrs, shape=self.shape, dtype=self.dtype,
                             meta=meta)
        return made

    def with_meta(self, **extra: Any) -> "Node":
        merged = dict(self.meta)
        merged.update(extra)
        return Node(self.name, self.op, self.args, self.attrs, self.shape, self.dtype,
                    tuple(sorted(merged.items())))

    def to_json(self) -> dict:
        out: dict[str, Any] = {"out": self.name, "op": self.op._value_, "args": list(self.args)}
        if self.attrs:
            schema = ATTRS[self.op]
            out["attrs"] = {k: encode_attr(schema[k][0], v) for k, v in self.attrs}
        out["shape"] = [d.to_json() for d in self.shape]
        if self.dtype != "float":
            out["dtype"] = self.dtype
        if self.meta:
            out["meta"] = dict(self.meta)
        return out

    @staticmethod
    def from_json(obj: Any, path: str, cls=GraphError) -> "Node":
        node = _node_fast(obj)
        return node if node is not None else Node._from_json_checked(obj, path, cls)

    @staticmethod
    def _from_json_checked(obj: Any, path: str, cls=GraphError) -> "Node":
        """The reference decoder: every check in order, each naming its JSON path."""
        if not isinstance(obj, dict):
            raise _error(cls, path, f"expected an op object, got {type(obj).__name__}")
        unknown = set(obj) - {"out", "op", "args", "attrs", "shape", "dtype", "meta"}
        if unknown:
            raise _error(cls, path, f"unknown field {sorted(unknown)[0]!r}")
        name = obj.get("out")
        if not isinstance(name, str) or not name:
            raise _error(cls, f"{path}.out", "expected the result's name (a non-empty string)")
        opname = obj.get("op")
        if not isinstance(opname, str):
            raise _error(cls, f"{path}.op", f"expected an op name, got {opname!r}")
        try:
            op = Op.parse(opname)
        except TvRayError as err:
            raise _error(cls, f"{path}.op", str(err)) from None
        args = obj.get("args", [])
        if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
            raise _error(cls, f"{path}.args", f"expected a list of tensor names, got {args!r}")
        arity = ARITY[op]
        if (arity is None and not args) or (arity is not None and len(args) not in arity):
            want = "at least 1" if arity is None else " or ".join(map(str, arity))
            raise _error(cls, f"{path}.args", f"{op} takes {want} tensor argument(s), got {len(args)}")
        raw_attrs = obj.get("attrs", {})
        if not isinstance(raw_attrs, dict):
            raise _error(cls, f"{path}.attrs", "expected an object")
        schema = ATTRS.get(op, {})
        attrs = []
        for key, value in raw_attrs.items():
            if key not in schema:
                allowed = ", ".join(schema) or "none"
                raise _error(cls, f"{path}.attrs.{key}", f"{op} takes no attribute {key!r} (it takes: {allowed})")
            attrs.append((key, decode_attr(schema[key][0], value, f"{path}.attrs.{key}", cls)))
        for key, (_, required) in schema.items():
            if required and key not in raw_attrs:
                raise _error(cls, f"{path}.attrs", f"{op} needs attribute {key!r}")
        if "shape" not in obj:
            raise _error(cls, f"{path}.shape", "missing: every op states its result shape")
        shape = decode_attr("exprs", obj["shape"], f"{path}.shape", cls)
        dtype = obj.get("dtype", "float")
        if dtype not in DTYPES:
            raise _error(cls, f"{path}.dtype", f"unknown dtype {dtype!r}; one of {', '.join(DTYPES)}")
        meta = obj.get("meta", {})
        if not isinstance(meta, dict):
            raise _error(cls, f"{path}.meta", "expected an object")
        return Node(name, op, tuple(args), tuple(sorted(attrs)), shape, dtype,
                    tuple(sorted((k, v if not isinstance(v, list) else tuple(v)) for k, v in meta.items())))


_NODE_FIELDS = frozenset({"out", "op", "args", "attrs", "shape", "dtype", "meta"})
_OP_OF_NAME = {op.value: op for op in Op}
_REQUIRED = {op: frozenset(k for k, (_, required) in ATTRS.get(op, {}).items() if required) for op in Op}
_KIND = {op: {k: _FAST_DECODE[kind] for k, (kind, _) in ATTRS.get(op, {}).items()} for op in Op}
_DTYPE_SET = frozenset(DTYPES)
_META_SCALARS = frozenset({str, int, float, bool, type(None)})   # stored as they are (lists become tuples)
_EMPTY: dict = {}


def _node_fast(obj: Any) -> Node | None:
    """`Node.from_json` for a well-formed op object, or None to take the checked path.

    Accepts exactly what the checked path accepts (or defers to it) and builds the same
    Node; it only replaces per-field isinstance ladders with type tests and lookups.
    """
    if type(obj) is not dict or not obj.keys() <= _NODE_FIELDS:
        return None
    name, opname, args = obj.get("out"), obj.get("op"), obj.get("args", [])
    if type(name) is not str or not name or type(opname) is not str or type(args) is not list:
        return None
    op = _OP_OF_NAME.get(opname)
    if op is None:
        return None
    args = tuple(args)
    if args and set(map(type, args)) != {str}:
        return None
    arity = ARITY[op]
    if (not args) if arity is None else (len(args) not in arity):
        return None
    raw_attrs = obj.get("attrs", _EMPTY)
    if type(raw_attrs) is not dict or not _REQUIRED[op] <= raw_attrs.keys():
        return None
    attrs: tuple = ()
    if raw_attrs:
        decoders = _KIND[op]
        pairs = []
        for key, value in raw_attrs.items():
            decode = decoders.get(key)
            if decode is None:
                return None
            value = decode(value)
            if value is _MISS:
                return None
            pairs.append((key, value))
        pairs.sort()
        attrs = tuple(pairs)
    shape = _fast_exprs(obj.get("shape"))
    dtype = obj.get("dtype", "float")
    if shape is _MISS or type(dtype) is not str or dtype not in _DTYPE_SET:
        return None
    meta = obj.get("meta", _EMPTY)
    if type(meta) is not dict or not set(map(type, meta.values())) <= _META_SCALARS:
        return None
    return Node(name, op, args, attrs, shape, dtype, tuple(sorted(meta.items())))


def describe(node: Node) -> str:
    """How errors name a node: ``mm_3 = mm(view_2, t_1)``."""
    return f"{node.name} = {node.op}({', '.join(node.args)})"


@dataclass(frozen=True)
class Graph:
    """An immutable SSA graph: inputs, nodes in topological order, named outputs.

    `outputs` maps an output name (``loss``, ``grad/<param>``, ``new/<param>``,
    or a program's boundary tensor) to the input or node name holding it.
    """

    inputs: tuple[TensorSpec, ...]
    nodes: tuple[Node, ...]
    outputs: tuple[tuple[str, str], ...]
    name: str = "graph"
    _index: dict = field(default=None, compare=False, repr=False, hash=False)  # type: ignore[assignment]

    def __post_init__(self):
        index: dict[str, TensorSpec | Node] = {}
        for spec in self.inputs:
            index[spec.name] = spec
        for node in self.nodes:
            index[node.name] = node
        object.__setattr__(self, "_index", index)

    def __iter__(self) -> Iterator[Node]:
        return iter(self.nodes)

    def __len__(self) -> int:
        return len(self.nodes)

    def __contains__(self, name: str) -> bool:
        return name in self._index

    def value(self, name: str) -> TensorSpec | Node:
        """The input or node called `name`."""
        try:
            return self._index[name]
        except KeyError:
            raise GraphError(f"{self.name}: no input or node named {name!r}", program=self.name) from None

    def shape_of(self, name: str) -> Shape:
        return self.value(name).shape

    def dtype_of(self, name: str) -> str:
        return self.value(name).dtype

    @property
    def output_map(self) -> dict[str, str]:
        return dict(self.outputs)

    def users(self) -> dict[str, list[str]]:
        """For each value name, the names of the nodes that read it."""
        out: dict[str, list[str]] = {name: [] for name in self._index}
        for node in self.nodes:
            for arg in node.args:
                if arg in out:
                    out[arg].append(node.name)
        return out

    def ops_used(self) -> set[Op]:
        return {node.op for node in self.nodes}

    # -- serialisation -------------------------------------------------------
    def to_json(self, ops: list | None = None) -> dict:
        """`ops`: what to write for the ops, if not each node's JSON (a plan's microbatch repeats)."""
        return {"inputs": [s.to_json() for s in self.inputs],
                "ops": [n.to_json() for n in self.nodes] if ops is None else ops,
                "outputs": dict(self.outputs)}

    @staticmethod
    def from_json(obj: Any, path: str = "", name: str = "graph", cls=GraphError,
                  nodes_of: Callable[[list, str], Iterable[Node]] | None = None) -> "Graph":
        """`nodes_of(ops, path of ops)`: the nodes of the `ops` list, if not each op parsed (a plan's microbatch
        repeats, `tv_ray.plan_repeats`)."""
        if not isinstance(obj, dict):
            raise _error(cls, path, f"expected an object with inputs, ops, outputs; got {type(obj).__name__}")
        unknown = set(obj) - {"inputs", "ops", "outputs"}
        if unknown:
            raise _error(cls, path, f"unknown field {sorted(unknown)[0]!r} (a program has inputs, ops, outputs)")
        for key in ("inputs", "ops", "outputs"):
            if key not in obj:
                raise _error(cls, f"{path}.{key}" if path else key, "missing")
        if not isinstance(obj["inputs"], list):
            raise _error(cls, f"{path}.inputs", "expected a list")
        if not isinstance(obj["ops"], list):
            raise _error(cls, f"{path}.ops", "expected a list")
        if not isinstance(obj["outputs"], dict) or not all(isinstance(v, str) for v in obj["outputs"].values()):
            raise _error(cls, f"{path}.outputs", "expected an object mapping output names to tensor names")
        inputs = tuple(TensorSpec.from_json(o, f"{path}.inputs[{i}]", cls) for i, o in enumerate(obj["inputs"]))
        if nodes_of is None:
            nodes = tuple(_node_fast(o) or Node._from_json_checked(o, f"{path}.ops[{i}]", cls)
                          for i, o in enumerate(obj["ops"]))
        else:
            nodes = tuple(nodes_of(obj["ops"], f"{path}.ops"))
        graph = Graph(inputs, nodes, tuple(obj["outputs"].items()), name)
        check_names(graph, path, cls)
        return graph

    def content_hash(self) -> str:
        """SHA-256 of the canonical JSON form (stable across processes)."""
        text = json.dumps(self.to_json(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()


def check_names(graph: Graph, path: str = "", cls=GraphError) -> None:
    """SSA discipline: unique names, every argument defined before use, outputs defined."""
    defined: set[str] = set()
    for i, spec in enumerate(graph.inputs):
        if spec.name in defined:
            raise _error(cls, f"{path}.inputs[{i}].name", f"input {spec.name!r} is declared twice")
        defined.add(spec.name)
    for i, node in enumerate(graph.nodes):
        if not defined.issuperset(node.args):   # one set test per node; the loop only names the culprit
            for arg in node.args:
                if arg not in defined:
                    raise _error(cls, f"{path}.ops[{i}].args",
                                 f"{node.name} = {node.op}(...) reads {arg!r}, which is not an input "
                                 f"nor the result of an earlier op", node.name)
        if node.name in defined:
            raise _error(cls, f"{path}.ops[{i}].out", f"{node.name!r} is defined twice (SSA: one definition per name)",
                         node.name)
        defined.add(node.name)
    for out, value in graph.outputs:
        if value not in defined:
            raise _error(cls, f"{path}.outputs.{out}", f"output {out!r} names {value!r}, which is not defined")
