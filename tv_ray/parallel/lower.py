"""SPMD lowering: one rank's program from a logical graph, its input layouts and the sharding rules.

Walks the logical graph once, in order. For each node it asks the sharding
rule which layouts the inputs must have, converts each input with the
communication that gets it there (all_reduce, reduce_scatter, all_gather,
local_chunk; across microbatch copies: sums, concatenation, slices), and
emits the local op with local shapes. Microbatches are the mesh axis ``mb``
unrolled inside the program: a value cut or partial over ``mb`` exists as one
copy per microbatch, and reducing over ``mb`` is gradient accumulation.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Mapping

from tv_ray.errors import ParallelConfigError
from tv_ray.ir.dims import Expr
from tv_ray.ir.graph import Graph, Node, TensorSpec
from tv_ray.ir.ops import BINARY, UNARY, Op
from tv_ray.parallel.layout import Factor, Layout, axis_product, canonical, check_divides
from tv_ray.parallel.rules import Env, decide

MB = "mb"


def _base(name: str) -> str:
    """A local name without its copy suffixes (``~k`` a remade value, ``@m`` a microbatch's): what a new op on it
    is named after."""
    return name.split("~")[0].split("@")[0]


DISPATCH_AXES = frozenset({"ep"})      # axes an all_to_all moves between dims (`Lowering._moves`)
SHAPE_ATTR = {Op.VIEW: "size", Op.EXPAND: "size", Op.FULL: "size", Op.SLICE_BACKWARD: "input_size"}


@dataclass(frozen=True)
class Local:
    """A logical value as a rank holds it: its layout and its local name (one per microbatch copy)."""

    layout: Layout
    names: tuple[str, ...]
    dtype: str = "float"

    def name(self, mb: int) -> str:
        return self.names[mb] if len(self.names) > 1 else self.names[0]


def _same(a: Layout, b: Layout) -> bool:
    return Layout.make(a.dims, a.partial) == Layout.make(b.dims, b.partial)


def refine(a: tuple[Factor, ...], b: tuple[Factor, ...], dims: Mapping[str, int]):
    """Split factors of two layouts of one dim at each other's boundaries (axes stay on the outer part)."""
    a, b = list(a), list(b)
    out_a, out_b = [], []
    while a and b:
        fa, fb = a.pop(0), b.pop(0)
        va, vb = fa.size.eval(dims), fb.size.eval(dims)
        if va == vb:
            out_a.append(fa)
            out_b.append(fb)
        elif va < vb:
            if vb % va:
                return None
            out_a.append(fa)
            out_b.append(Factor(fa.size, fb.axes))
            b.insert(0, Factor(fb.size / fa.size))
        else:
            if va % vb:
                return None
            out_b.append(fb)
            out_a.append(Factor(fb.size, fa.axes))
            a.insert(0, Factor(fa.size / fb.size))
    if a or b:
        return None
    return out_a, out_b


class Lowering:
    """Builds one program: call `input`, then `node` for each logical node, then `output`."""

    def __init__(self, sizes: Mapping[str, int], dims: Mapping[str, int]):
        self.sizes = dict(sizes)
        self.dims = dims
        self.microbatches = self.sizes.get(MB, 1)
        self.inputs: list[TensorSpec] = []
        self.nodes: list[Node] = []
        self.outputs: dict[str, str] = {}
        self.output_layouts: dict[str, Layout] = {}
        self.values: dict[str, Local] = {}
        self._cache: dict[tuple, Local] = {}
        self._counts: dict[str, int] = {}      # base name -> how many fresh names it has given
        self._shapes: dict[Layout, tuple[Expr, ...]] = {}
        # what each local name holds: (logical tensor, layout, microbatch copy or None) — intermediate lineage
        self.holds: dict[str, tuple[str, Layout, int | None]] = {}
        self._mb: dict[str, int] = {}         # name -> the microbatch whose copy it is (meta `mb`)
        self.shapes: dict[str, tuple[Expr, ...]] = {}   # every local name's shape
        self._made: dict[str, Node] = {}       # local name -> the op that made it
        self._constant: dict[tuple[str, int], bool] = {}

    # -- building blocks ---------------------------------------------------------------
    def _fresh(self, base: str) -> str:
        """A new name `base~n`, numbered per base: microbatch k's copy of an op is named as microbatch 0's with
        the tag `@0` read `@k` (`embedding@0~1`, `embedding@1~1`), which lets a plan file write microbatch k's
        ops as a repeat of microbatch 0's (`tv_ray.plan_repeats`)."""
        n = self._counts[base] = self._counts.get(base, 0) + 1
        return f"{base}~{n}"

    def _hold(self, local: Local, logical: str | None) -> Local:
        if logical is not None:
            many = len(local.names) > 1
            for m, name in enumerate(local.names):
                self.holds.setdefault(name, (logical, local.layout, m if many else None))
        return local

    def _emit(self, name: str, op: Op, args, attrs: Mapping[str, Any], shape, dtype: str, meta) -> str:
        """An op on one microbatch's copies alone (a collective, a view converting them) is that microbatch's
        too (meta `mb`): microbatch k's ops then pair with microbatch 0's one for one, collectives included
        (`tv_ray.partition.microbatches.counterparts`)."""
        meta = dict(meta)
        copies = {self._mb.get(a) for a in args}
        if "mb" not in meta and len(copies) == 1 and None not in copies:
            meta["mb"] = copies.pop()
        if "mb" in meta:
            self._mb[name] = meta["mb"]
        self._append(Node.make(name, op, args, attrs, shape, dtype, meta))
        return name

    def _append(self, node: Node) -> None:
        self.nodes.append(node)
        self.shapes[node.name] = node.shape
        self._made[node.name] = node

    def local_shape(self, layout: Layout) -> tuple[Expr, ...]:
        shape = self._shapes.get(layout)
        if shape is None:
            shape = self._shapes[layout] = layout.local_shape(self.sizes)
        return shape

    def copies(self, layout: Layout) -> int:
        return self.microbatches if MB in layout.axes() else 1

    def input(self, spec: TensorSpec, layout: Layout) -> Local:
        """Declare a program input holding `spec` laid out as `layout` (one input per microbatch copy)."""
        for d, dim in enumerate(layout.dims):
            for f in dim:
                if f.axes:
                    check_divides(f.size, axis_product(f.axes, self.sizes), self.dims,
                                  f"input {spec.name} dim {d}")
        n = self.copies(layout)
        names = tuple(spec.name if n == 1 else f"{spec.name}@{m}" for m in range(n))
        for name in names:
            self.inputs.append(replace(spec, name=name, shape=self.local_shape(layout)))
            self.shapes[name] = self.local_shape(layout)
        local = Local(layout, names, spec.dtype)
        self.values[spec.name] = self._hold(local, spec.name)
        return local

    # -- conversions ----------------------------------------------------------------------
    def convert(self, v: Local, dst: Layout, meta) -> Local:
        if _same(v.layout, dst):
            return v
        key = (v.names, Layout.make(dst.dims, dst.partial))
        if key in self._cache:
            return self._cache[key]
        cur = v
        extra = set(dst.partial) - set(v.layout.partial)
        if extra:
            raise ParallelConfigError(f"cannot make {v.names[0]} partial over {sorted(extra)}")
        drop = [(a, k) for a, k in v.layout.partial if (a, k) not in dst.partial]
        for kind in sorted({k for _, k in drop}):
            axes = [a for a, k in drop if k == kind]
            if MB in axes:
                cur = self._mb_reduce(cur, kind, meta)
                axes.remove(MB)
            scatter = [a for a in axes if self._scatter_dim(cur.layout, dst, a) is not None]
            gather = [a for a in axes if a not in scatter]
            if gather:
                cur = self._collective(cur, Op.ALL_REDUCE, {"axes": gather, "reduce": kind},
                                       self._drop_partial(cur.layout, gather), meta)
            for a in scatter:
                d = self._scatter_dim(cur.layout, dst, a)
                first = cur.layout.dims[d][0]
                check_divides(first.size, axis_product(first.axes + (a,), self.sizes), self.dims,
                              f"reduce-scattering {v.names[0]} dim {d} over {a}")
                dims = list(cur.layout.dims)
                dims[d] = (Factor(first.size, first.axes + (a,)),) + dims[d][1:]
                lay = Layout(tuple(dims), cur.layout.partial).with_partial(
                    {x: k for x, k in cur.layout.partial if x != a})
                cur = self._collective(cur, Op.REDUCE_SCATTER, {"axes": [a], "dim": d, "reduce": kind}, lay, meta)
        for axis, i, j in self._moves(cur.layout, dst):
            lay = cur.layout.with_dim(i, [Factor(cur.layout.dims[i][0].size, cur.layout.dim_axes(i)[:-1])])
            cur = self._collective(cur, Op.ALL_TO_ALL, {"axes": [axis], "split_dim": j, "concat_dim": i},
                                   lay.with_dim(j, dst.dims[j]), meta)
        # all gathers before any chunk: an axis may cut only one dim at a time
        for gather in (True, False):
            for d in range(dst.rank):
                cur = self._redistribute(cur, d, dst.dims[d], gather, meta)
        if not _same(cur.layout, dst):
            raise ParallelConfigError(f"internal: converting {v.names[0]} to {dst} ended at {cur.layout}")
        self._cache[key] = self._hold(cur, self._logical_of(v))
        return cur

    def _logical_of(self, v: Local) -> str | None:
        held = self.holds.get(v.names[0])
        return held[0] if held else None

    @staticmethod
    def _moves(src: Layout, dst: Layout) -> list[tuple[str, int, int]]:
        """Expert-parallel axes that leave dim i for dim j, (axis, i, j): one all_to_all each (split j, concat i),
        not a gather of i and a chunk of j — an expert layer's dispatch, each ep peer sent the tokens for its
        experts. Only where both dims are one factor, the axis innermost on i in `src` and added innermost on j
        in `dst`. (Other axes keep the gather and chunk: a ZeRO-3 weight moving its dp cut stays as before.)"""
        moves = []
        for axis in sorted(src.axes() & dst.axes() & DISPATCH_AXES - {a for a, _ in src.partial}):
            i, j = src.sharded_dim(axis), dst.sharded_dim(axis)
            if i == j or j is None or src.dim_axes(j) + (axis,) != dst.dim_axes(j):
                continue
            single = len(src.dims[i]) == len(src.dims[j]) == len(dst.dims[j]) == 1
            if single and src.dim_axes(i)[-1] == axis and src.dims[j][0].size == dst.dims[j][0].size:
                moves.append((axis, i, j))
        return moves

    def _scatter_dim(self, src: Layout, dst: Layout, axis: str) -> int | None:
        """The dim where `dst` cuts `axis` on the first factor just inside `src`'s cuts (a reduce_scatter)."""
        d = dst.sharded_dim(axis)
        if d is None or axis in src.dim_axes(d) or axis == MB:
            return None
        s, t = src.dims[d][0], dst.dims[d][0]
        if s.size == t.size and t.axes == s.axes + (axis,):
            return d
        return None

    @staticmethod
    def _drop_partial(layout: Layout, axes) -> Layout:
        return layout.with_partial({a: k for a, k in layout.partial if a not in axes})

    def _collective(self, v: Local, op: Op, attrs: dict, out: Layout, meta) -> Local:
        names = []
        shape = self.local_shape(out)
        for name in v.names:
            names.append(self._emit(self._fresh(name.split("~")[0]), op, [name], attrs, shape, v.dtype, meta))
        return self._hold(Local(out, tuple(names), v.dtype), self._logical_of(v))

    def _mb_reduce(self, v: Local, kind: str, meta) -> Local:
        out = self._drop_partial(v.layout, [MB])
        shape = self.local_shape(out)
        op = Op.ADD if kind == "sum" else Op.MAXIMUM
        acc = v.names[0]
        for name in v.names[1:]:
            acc = self._emit(self._fresh(v.names[0].split("@")[0]), op, [acc, name], {}, shape, v.dtype, meta)
        # the accumulated value holds the logical value (summed over the axes still partial): a cut point
        return self._hold(Local(out, (acc,), v.dtype), self._logical_of(v))

    def _redistribute(self, v: Local, d: int, want: tuple[Factor, ...], gather: bool, meta) -> Local:
        have = v.layout.dims[d]
        if canonical(have) == canonical(want):
            return v
        pair = refine(have, want, self.dims)
        if pair is None:
            raise ParallelConfigError(f"cannot redistribute {v.names[0]} dim {d} from "
                                      f"{[str(f.size) for f in have]} to {[str(f.size) for f in want]}")
        have_f, want_f = pair
        cur = Local(Layout(v.layout.dims[:d] + (tuple(have_f),) + v.layout.dims[d + 1:], v.layout.partial),
                    v.names, v.dtype)
        if gather:
            for i in reversed(range(len(have_f))):      # inner factors first
                src_axes, dst_axes = cur.layout.dims[d][i].axes, want_f[i].axes
                keep = 0
                while keep < min(len(src_axes), len(dst_axes)) and src_axes[keep] == dst_axes[keep]:
                    keep += 1
                for axis in reversed(src_axes[keep:]):
                    cur = self._factor_op(cur, d, i, axis, gather=True, meta=meta)
            return cur
        for i in range(len(have_f)):
            src_axes, dst_axes = cur.layout.dims[d][i].axes, want_f[i].axes
            if dst_axes[:len(src_axes)] != src_axes:
                raise ParallelConfigError(f"internal: chunking {v.names[0]} dim {d} from {src_axes} to {dst_axes}")
            for axis in dst_axes[len(src_axes):]:
                cur = self._factor_op(cur, d, i, axis, gather=False, meta=meta)
        return cur

    def _factor_op(self, v: Local, d: int, i: int, axis: str, gather: bool, meta) -> Local:
        """Gather or chunk factor `i` of dim `d` over `axis` (the factor's innermost axis)."""
        factors = v.layout.dims[d]
        f = factors[i]
        new_axes = f.axes[:-1] if gather else f.axes + (axis,)
        new_factors = factors[:i] + (Factor(f.size, new_axes),) + factors[i + 1:]
        out = Layout(v.layout.dims[:d] + (new_factors,) + v.layout.dims[d + 1:], v.layout.partial)
        multi = len(factors) > 1 and i > 0
        local_out = self.local_shape(out)

        def split_dims(layout: Layout) -> list[Expr]:
            shape = list(self.local_shape(layout))
            subs = [g.size / axis_product(g.axes, self.sizes) for g in layout.dims[d]]
            return shape[:d] + subs + shape[d + 1:]

        def around(names: tuple[str, ...], body) -> tuple[str, ...]:
            if not multi:
                return body(names, d)
            split_in = [self._emit(self._fresh(n.split("~")[0]), Op.VIEW, [n], {"size": split_dims(v.layout)},
                                   split_dims(v.layout), v.dtype, meta) for n in names]
            done = body(tuple(split_in), d + i)
            return tuple(self._emit(self._fresh(n.split("~")[0]), Op.VIEW, [n], {"size": local_out},
                                    local_out, v.dtype, meta) for n in done)

        sub_shape = split_dims(out) if multi else list(local_out)

        def body(names: tuple[str, ...], dim: int) -> tuple[str, ...]:
            base = _base(names[0])
            if axis == MB and gather:
                return (self._emit(self._fresh(base), Op.CAT, list(names), {"dim": dim}, sub_shape, v.dtype, meta),)
            if axis == MB:
                (name,) = names
                length = sub_shape[dim]
                return tuple(self._emit(self._fresh(base), Op.SLICE, [name],
                                        {"dim": dim, "start": length * m, "end": length * (m + 1), "step": 1},
                                        sub_shape, v.dtype, meta) for m in range(self.microbatches))
            if not gather:
                return tuple(self._chunk(n, dim, axis, sub_shape, v.dtype, meta) for n in names)
            return tuple(self._emit(self._fresh(base), Op.ALL_GATHER, [n], {"axes": [axis], "dim": dim}, sub_shape,
                                    v.dtype, meta) for n in names)

        if not gather:
            check_divides(f.size, axis_product(new_axes, self.sizes), self.dims,
                          f"cutting {v.names[0]} dim {d} by {'.'.join(new_axes)}")
        return Local(out, around(v.names, body), v.dtype)

    def _chunk(self, name: str, dim: int, axis: str, shape, dtype: str, meta) -> str:
        """This rank's chunk of `name` along `dim` over `axis`. A value the same all along `dim` (the mean's
        gradient, broadcast over the samples) is made again at the chunk's size from what it was broadcast from:
        every chunk is the same, so nothing reads the rank's coordinate and a dp rank stays a mirror of dp rank 0
        (`tv_ray.partition.symmetry`)."""
        if self._constant_along(name, dim):
            return self._rebuilt(name, dim, shape[dim])
        return self._emit(self._fresh(_base(name)), Op.LOCAL_CHUNK, [name],
                          {"dim": dim, "axes": [axis]}, shape, dtype, meta)

    def _rebuilt(self, name: str, dim: int, size: Expr) -> str:
        """`name` (constant along `dim`) computed again with `dim` of size `size`: the ops back to the broadcast."""
        made = self._made[name]
        shape = tuple(size if d == dim else s for d, s in enumerate(made.shape))
        attrs = dict(made.attrs)
        args = []
        for arg, at in self._arg_dims(made, dim):
            args.append(arg if at is None else self._rebuilt(arg, at, size))
        if made.op == Op.EXPAND:
            attrs["size"] = list(shape)
        meta = {k: v for k, v in made.meta if k != "realises"}
        return self._emit(self._fresh(_base(name)), made.op, args, attrs, shape, made.dtype, meta)

    def _arg_dims(self, made: Node, dim: int) -> list[tuple[str, int | None]]:
        """Each argument of `made` with the dim of it that becomes `made`'s `dim` (an unsqueeze's input: the dim
        past the new one shifted; an elementwise op's or an expand's: right-aligned), None where the argument is
        broadcast along it (absent, or of size 1)."""
        if made.op == Op.UNSQUEEZE:
            d = made.attr["dim"] % len(made.shape)
            return [(made.args[0], None if dim == d else dim - (dim > d))]
        out = []
        for arg in made.args:
            at = dim - (len(made.shape) - len(self.shapes[arg]))
            out.append((arg, None if at < 0 or self.shapes[arg][at] == Expr.of(1) else at))
        return out

    def _constant_along(self, name: str, dim: int) -> bool:
        """Is every slice of `name` along `dim` the same? Made by a broadcast there (an expand that adds the dim
        or grows it from 1), through unsqueezes and elementwise ops whose operands are each such or size 1."""
        key = (name, dim)
        if key not in self._constant:
            self._constant[key] = False         # a cycle cannot occur; this only bounds the walk
            made = self._made.get(name)
            found = made is not None and (made.op in (Op.UNSQUEEZE, Op.EXPAND) or made.op in UNARY | BINARY) \
                and all(at is None or self._constant_along(arg, at) for arg, at in self._arg_dims(made, dim))
            self._constant[key] = found
        return self._constant[key]

    # -- nodes ------------------------------------------------------------------------------
    def reduced(self, v: Local) -> Local:
        """A partial value that some op has already reduced: reuse the reduced copy (no second all_reduce)."""
        if v.layout.partial:
            done = self._cache.get((v.names, Layout.make(v.layout.dims)))
            if done is not None:
                return done
        return v

    def node(self, node: Node, env: Env, force: Layout | None = None) -> Local:
        ins = [self.reduced(self.values[a]) for a in node.args]
        try:
            dec = decide(node, [x.layout for x in ins], env)
        except ParallelConfigError as err:
            raise ParallelConfigError(f"{err} (while lowering {node.name} = {node.op}({', '.join(node.args)}))") from None
        meta = dict(node.meta)
        args = [self.convert(x, req, meta) for x, req in zip(ins, dec.inputs)]
        out = dec.out
        n = self.copies(out)
        shape = self.local_shape(out)
        attrs = dict(node.attrs)
        if node.op in SHAPE_ATTR:
            attrs[SHAPE_ATTR[node.op]] = list(shape)
        if node.op == Op.EMBEDDING_BACKWARD:
            attrs["num_weights"] = shape[0]
        names = []
        first = Node.make(node.name, node.op, [a.name(0) for a in args], attrs, shape, node.dtype,
                          dict(meta, realises=node.name))
        for m in range(n):
            name = f"{node.name}@{m}" if n > 1 else node.name
            # copies differ only in names and the microbatch: reuse the normalised attributes
            mmeta = first.meta if n == 1 else tuple(sorted({**dict(first.meta), "mb": m}.items()))
            self._append(Node(name, node.op, tuple(a.name(m) for a in args), first.attrs, first.shape,
                              node.dtype, mmeta))
            if n > 1:
                self._mb[name] = m
            if dec.divide_by > 1:
                name = self._emit(self._fresh(name), Op.DIV, [name], {"other": float(dec.divide_by)},
                                  shape, node.dtype, dict(mmeta))
            names.append(name)
        local = self._hold(Local(out, tuple(names), node.dtype), node.name)
        if force is not None:
            local = self.convert(local, force, meta)
        self.values[node.name] = local
        return local

    def output(self, name: str, value: str, layout: Layout | None) -> Local:
        v = self.values[value]
        if layout is None:
            layout = self._drop_partial(v.layout, [MB])
        v = self.convert(v, layout, {})
        if len(v.names) > 1:
            raise ParallelConfigError(f"output {name} still varies by microbatch: {v.layout}")
        self.outputs[name] = v.names[0]
        self.output_layouts[name] = v.layout
        return v

    def graph(self, name: str) -> Graph:
        """The program: every op some output reads (a value made again at a chunk's size leaves its full-size
        original unread)."""
        live = set(self.outputs.values())
        for node in reversed(self.nodes):
            if node.name in live:
                live.update(node.args)
        nodes = tuple(n for n in self.nodes if n.name in live)
        return Graph(tuple(self.inputs), nodes, tuple(self.outputs.items()), name)
