"""Recording one rank's training step as it runs: its local ATen ops and collectives, as a plan program.

A `Recorder` is a `TorchDispatchMode` active around one warm training step
(forward, loss, backward, gradient clipping, optimizer step) of one rank of
a torch.distributed job. It sees every local ATen op the rank runs and every
collective it issues: it answers ``NotImplemented`` to DTensor, so DTensor
desugars under it into local ops and functional collectives (the trick
``CommDebugMode`` uses), and it drops the fake-tensor ops of DTensor's
sharding propagation. Each op becomes a node of an FX graph, functionalised
as it is recorded:

- an in-place op (``add_``, ``mul_``, ``lerp_``, an optimizer's ``addcdiv_``)
  becomes its out-of-place twin, and the tensor it changed reads the new node
  from then on; a tensor that shares memory with the one changed (a view of
  it, or its base) is stale from then on, and reading it is an error — never a
  silently wrong value;
- a ``_foreach_*`` op becomes one op per list element;
- a functional collective (``_c10d_functional.all_reduce``, ``all_gather_into_tensor``,
  ``reduce_scatter_tensor``) is kept with its process group resolved to mesh
  axes; ``wait_tensor`` and ``_wrap_tensor_autograd`` are aliases; what a
  backend runs while a collective is waited for (`Work.wait`) is not recorded:
  the collective was, when issued;
- a send (``c10d.send``) and a receive (``c10d.recv_``: its buffer written
  whole) become the plan's send and recv, the peer a step along the one mesh
  axis the process group spans (a pipeline's activations and gradients);
- FSDP2's own ops are recorded as what they compute: ``all_gather_copy_in``
  (the shards concatenated into this rank's slice of the all-gather buffer),
  ``split_with_sizes_copy`` (the gathered buffer into the unsharded
  parameters), ``chunk_cat`` (the gradients into the reduce-scatter's input),
  and a contiguous ``as_strided`` window (a sharded gradient) as a slice;
- a tensor no op made but whose memory is exactly that of one holding a
  value (the same storage, offset, size and dtype, both contiguous) is that
  value reshaped: FSDP2's flat shard of a parameter, its unsharded parameter;
  a view of memory with no value yet (a buffer re-allocated outside the step)
  has none until an op writes it whole; writing one window of a buffer leaves
  the windows that do not overlap it readable; a view with its dims permuted
  (a transposed weight autograd saved, its memory written again by FSDP2) is
  read off the memory and permuted back. Memory is a storage, not an address
  (an address freed is reused by tensors that share nothing).

A tensor the step reads that no recorded op made is a program input: a
parameter's local shard, an optimizer state, a batch tensor (named by the
caller); any other is an error naming its shape. A value read into Python
(``.item()``, ``aten._local_scalar_dense``) would be baked into the program as
a constant, so it is an error too. The graph is converted to a `Graph` by the
capture's converters (`tv_ray.frontend.aten`), the collectives by those here.
"""
from __future__ import annotations

import functools
import operator
import re
import sys
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map

from tv_ray.errors import CaptureError
from tv_ray.frontend.aten import CONVERTERS, Converter, dtype_name
from tv_ray.frontend.trace import DECOMPOSITIONS
from tv_ray.ir import Expr, Graph, Node, Op, TensorSpec

aten = torch.ops.aten
c10d = torch.ops._c10d_functional
c10d_ = torch.ops.c10d

ALIASES = {c10d.wait_tensor.default, c10d._wrap_tensor_autograd.default}
IGNORED = {torch.ops.profiler._record_function_enter_new.default,
           torch.ops.profiler._record_function_exit._RecordFunction}
# an in-place op's out-of-place twin where its name without the trailing underscore is not one
FUNCTIONAL = {aten.lerp_.Scalar: aten.lerp.Scalar, aten.addcmul_.default: aten.addcmul.default,
              aten.addcdiv_.default: aten.addcdiv.default}
REDUCE_OPS = {"sum": "sum", "avg": "avg", "max": "max"}
LIFTS = {aten.lift_fresh.default, aten.lift_fresh_copy.default}
UNINITIALISED = {aten.empty.memory_format, aten.empty_strided.default, aten.new_empty_strided.default,
                 aten.new_empty.default, aten.empty_like.default}
FILLS = {aten.zero_.default, aten.fill_.Scalar}     # in-place ops whose result does not read the tensor
IN_PLACE_COLLECTIVES = {c10d_.allreduce_.default, c10d_.allreduce_coalesced_.default, c10d_._allgather_base_.default,
                        c10d_._reduce_scatter_base_.default}
P2P = {c10d_.send.default, c10d_.recv_.default}       # torch.distributed's send and (i)recv: point to point
FSDP_OPS = {"fsdp::all_gather_copy_in": "_all_gather_copy_in", "fsdp::split_with_sizes_copy": "_split_with_sizes_copy",
            "fsdp::chunk_cat": "_chunk_cat"}      # FSDP2's own ops (torch.distributed.fsdp), by the handler


class Value:
    """What a recorded node holds: its shape and dtype (what the converters read of an FX node's ``val``)."""

    __slots__ = ("shape", "dtype")

    def __init__(self, tensor: torch.Tensor):
        self.shape, self.dtype = tuple(tensor.shape), tensor.dtype


@dataclass
class Recording:
    """One rank's step as an FX graph: inputs by placeholder, what each op was recorded in, and the groups."""

    gm: torch.fx.GraphModule
    inputs: dict[str, tuple[str, str]]              # placeholder -> (input name, role)
    outputs: list[tuple[str, str]]                  # (output name, node)
    provenance: dict[str, tuple[str, str]]          # node -> (module path, phase)
    groups: dict[str, tuple[str, ...]] = field(default_factory=dict)    # process group name -> mesh axes
    sources: dict[str, str] = field(default_factory=dict)     # node -> "file:line" of the user's code that ran it

    # `Converter` reads these of a capture's joint graph
    @functools.cached_property
    def params(self) -> dict[str, str]:
        return {p: name for p, (name, role) in self.inputs.items() if role == "param"}


class Recorder(TorchDispatchMode):
    """The dispatch mode (module docstring). `inputs`: the tensors the step may read without making them, by
    identity → (name, role); `axes`: a process group's name → the mesh axes it spans (None: none)."""

    def __init__(self, inputs: dict[int, tuple[torch.Tensor, str, str]],
                 axes: Callable[[str], tuple[str, ...] | None]):
        super().__init__()
        self.graph = torch.fx.Graph()
        self.known = inputs
        self.axes = axes
        self.node: dict[int, torch.fx.Node] = {}        # id(tensor) -> the node holding its current value
        self.alive: list[torch.Tensor] = []             # every tensor seen, held so that no id is reused
        self.sharing: dict[int, list[torch.Tensor]] = {}  # storage address -> the tensors seen on it (`_changed`)
        self.stale: dict[int, str] = {}                  # id(tensor) -> the in-place op that made it stale
        self.written: dict[int, list[tuple[int, int]]] = {}  # id(stale tensor) -> the bytes written since its value
        self.placeholders: dict[str, tuple[str, str]] = {}
        self.provenance: dict[str, tuple[str, str]] = {}
        self.groups: dict[str, tuple[str, ...]] = {}
        self.module: list[str] = []                     # the module path stack (forward hooks)
        self.backward_seen = False
        self.marked: dict[str, torch.fx.Node] = {}
        self.empty: dict[int, str] = {}                  # id(tensor) -> the op that made it uninitialised
        self.sources: dict[str, str] = {}                # node -> the line of the script's code that ran it
        self.module_at: dict[str, str] = {}              # a forward line -> the module its first op ran in
        self.entered = 0                                 # `with self` depth (`__enter__`)
        for tensor, _, _ in inputs.values():             # a write through an alias makes an input stale too
            self._hold(tensor)

    def __enter__(self):
        """The mode, and `Work.wait` run outside it: a backend completing a collective recorded when it was issued
        (gloo's reduce-scatter copies its result into the output as it is waited for) runs ops of its own."""
        from torch.distributed.distributed_c10d import Work
        if self.entered == 0:
            wait = self.wait = Work.wait

            def quiet(work, *args, **kwargs):
                with torch.utils._python_dispatch._disable_current_modes():
                    return wait(work, *args, **kwargs)
            Work.wait = quiet
        self.entered += 1
        return super().__enter__()

    def __exit__(self, *exc):
        from torch.distributed.distributed_c10d import Work
        self.entered -= 1
        if self.entered == 0:
            Work.wait = self.wait
        return super().__exit__(*exc)

    # -- what the step runs -----------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented
        kwargs = kwargs or {}
        if func in DECOMPOSITIONS:       # the capture's decompositions: the same ops as the logical graph's
            with self:
                return DECOMPOSITIONS[func](*args, **kwargs)
        out = func(*args, **kwargs)
        if func in IGNORED or _fake(args, kwargs, out):
            return out
        if func is aten._local_scalar_dense.default:
            raise CaptureError(f"{self._where()}: the step reads a tensor's value into Python ({func}: .item(), "
                               f"a Python branch or an optimizer's step count read as a float); the program would "
                               f"hold it as a constant")
        if func in ALIASES:
            self._bind(out, self._read(args[0], func))
            return out
        if func in LIFTS and id(args[0]) not in self.node and args[0].dim() == 0:
            self._bind(out, self._constant(args[0]))       # a scalar constant the code made: torch.tensor(3)
            return out
        if func in UNINITIALISED or func.is_view and self._unvalued(args[0]):
            made = self.empty.get(id(args[0]), str(func)) if args else str(func)
            for tensor in tree_leaves(out):     # no value until an op writes all of it (`copy_`, a collective)
                self._hold(tensor)
                self.empty[id(tensor)] = made
            return out
        if func in IN_PLACE_COLLECTIVES:
            self._in_place_collective(func, args)
            return out
        if func in P2P:
            self._p2p(func, args)
            return out
        if func.namespace in ("c10d", "_c10d_functional") and func not in COLLECTIVES:
            raise CaptureError(f"{self._where()}: {func}: a collective the recorder does not know (it records "
                               f"{', '.join(sorted(str(f) for f in (*IN_PLACE_COLLECTIVES, *COLLECTIVES, *P2P)))})")
        if func._schema.name in FSDP_OPS:
            getattr(self, FSDP_OPS[func._schema.name])(func, args, kwargs, out)
            return out
        if func is aten.as_strided.default:
            self._as_strided(func, args, out)
            return out
        if func in FILLS:           # written whole, whatever it held (megatron's gradient buffer zeroed, a fill)
            value = 0 if func is aten.zero_.default else args[1]
            node = self._op(aten.full.default, (list(args[0].shape), value), {"dtype": args[0].dtype}, args[0])
            self._changed(args[0], func)
            self._bind(args[0], node)
            return out
        if func is aten.copy_.default and args[0].shape == args[1].shape and args[0].dtype == args[1].dtype:
            self._changed(args[0], func)           # self is overwritten whole: it holds src from now on
            self._bind(args[0], self._read(args[1], func))
            return out
        name = func._schema.name.split("::")[-1]
        if name.startswith("_foreach_"):
            self._foreach(func, name, args, kwargs, out)
            return out
        if func._schema.is_mutable:
            self._in_place(func, name, args, kwargs)
            return out
        self._bind(out, self._op(func, args, kwargs, out))
        return out

    def _op(self, func, args, kwargs, out) -> torch.fx.Node:
        read = lambda x: self._read(x, func) if isinstance(x, torch.Tensor) else x   # noqa: E731
        node = self.graph.call_function(func, tree_map(read, tuple(args)), tree_map(read, dict(kwargs)))
        node.meta["val"] = tree_map(lambda t: Value(t) if isinstance(t, torch.Tensor) else t, out)
        # after a backward, an op of a module's forward before the gradients are read, or one whose value autograd
        # will differentiate, is still forward (a pipeline's next microbatch); the others (gradient syncs, clipping,
        # the optimizer) are the step's
        forward = not self.backward_seen or (self.module and not self.marked) or \
            any(isinstance(t, torch.Tensor) and t.requires_grad for t in tree_leaves(out))
        phase = "bwd" if torch._C._current_graph_task_id() != -1 else "fwd" if forward else "optim"
        self.backward_seen |= phase == "bwd"
        module, source = self.module[-1] if self.module else "", _source()
        if source:
            self.sources[node.name] = source
            if phase == "fwd" and module:
                self.module_at.setdefault(source, module)
            elif phase == "bwd" and not module:      # autograd's op: the module of the forward op it differentiates
                module = self.module_at.get(source, "")
        self.provenance[node.name] = (module, phase)
        if node.target in COLLECTIVES:          # the functional collectives converted below: their group's axes
            group = args[-1]
            axes = self.axes(group)
            if axes is None:
                raise CaptureError(f"{self._where()}: {func} on process group {group!r}, whose ranks are no group "
                                   f"along an axis of the device mesh")
            self.groups[group] = axes
        return node

    def _constant(self, scalar: torch.Tensor) -> torch.fx.Node:
        """A 0-d constant as a recorded `full`."""
        value = scalar.item()
        return self._op(aten.full.default, ([], value), {"dtype": scalar.dtype}, scalar)

    def _in_place_collective(self, func, args) -> None:
        """`torch.distributed`'s in-place collectives (``dist.all_reduce(t)``: ``c10d.allreduce_``, the base all-gather
        and reduce-scatter) as their functional twins; what they write reads the new node."""
        from torch.distributed import ProcessGroup
        if func in (c10d_.allreduce_.default, c10d_.allreduce_coalesced_.default):    # each tensor all-reduced
            tensors, group, reduce_op = args[0], ProcessGroup.unbox(args[1]).group_name, _reduce_name(args[2])
            for tensor in tensors:
                node = self._op(c10d.all_reduce.default, (tensor, reduce_op, group), {}, tensor)
                self._changed(tensor, func)
                self._bind(tensor, node)
            return
        output, tensor, group = args[0], args[1], ProcessGroup.unbox(args[2])
        if func is c10d_._allgather_base_.default:
            node = self._op(c10d.all_gather_into_tensor.default, (tensor, group.size(), group.group_name), {}, output)
        else:
            node = self._op(c10d.reduce_scatter_tensor.default,
                            (tensor, _reduce_name(args[3]), group.size(), group.group_name), {}, output)
        self._changed(output, func)
        self._bind(output, node)

    def _p2p(self, func, args) -> None:
        """A send (each tensor's value as it is issued) or a receive (each tensor written whole by it), its peer a
        step along the one mesh axis its process group spans (`send`, `recv`). Recorded when issued: a received
        tensor read before its wait would hold no value, which the recorder cannot see."""
        from torch.distributed import ProcessGroup
        tensors, group, peer, tag = args[0], ProcessGroup.unbox(args[1]), int(args[2]), int(args[3])
        axes = self.axes(group.group_name)
        if axes is None or len(axes) != 1:
            raise CaptureError(f"{self._where()}: {func} on process group {group.group_name!r}, whose ranks are no "
                               f"group along one axis of the device mesh")
        where = (axes[0], peer - group.rank(), tag)
        for tensor in tensors:
            if func is c10d_.send.default:
                self._op(send, (tensor, *where), {}, tensor)
            else:
                node = self._op(recv, where, {}, tensor)
                self._changed(tensor, func)
                self._bind(tensor, node)

    def _flat(self, tensor: torch.Tensor, shape: list[int]) -> torch.fx.Node:
        return self._op(aten.view.default, (tensor, shape), {}, tensor.reshape(shape))

    def _all_gather_copy_in(self, func, args, kwargs, out) -> None:
        """FSDP2's copy of this rank's parameter shards into its slice of the all-gather buffer: the slice is their
        concatenation, flattened; the rest of the buffer has no value until the all-gather writes it."""
        inputs, buffer = args[0], args[1]
        slice_, whole = out
        node = self._op(aten.cat.default, ([self._flat(t, [-1]) for t in inputs], 0), {}, slice_)
        for tensor in {id(buffer): buffer, id(whole): whole}.values():
            self._hold(tensor)
            self._changed(tensor, func)
            self.node.pop(id(tensor), None)
            self.empty[id(tensor)] = str(func)
        self._bind(slice_, node)

    def _split_with_sizes_copy(self, func, args, kwargs, out) -> None:
        """FSDP2's copy of the all-gathered buffer into the unsharded parameters: each `out` tensor written whole."""
        gathered, sizes = args[0], args[1]
        dim = args[2] if len(args) > 2 else kwargs.get("dim", 0)
        targets = kwargs["out"]
        parts = gathered.split(list(sizes), dim)
        if [p.shape for p in parts] != [t.shape for t in targets]:
            raise CaptureError(f"{self._where()}: {func} into tensors of other shapes than its parts")
        node = self._op(aten.split_with_sizes.default, (gathered, list(sizes), dim), {}, parts)
        for target in targets:
            self._changed(target, func)
        self._bind(tuple(targets), node)

    def _chunk_cat(self, func, args, kwargs, out) -> None:
        """FSDP2's gradients into the reduce-scatter's input: each split into `chunks` along `dim`, chunk k of every
        one flattened and concatenated into row k (`out` written whole)."""
        tensors, dim, chunks = args[0], args[1], args[2]
        target = kwargs["out"]
        if any(t.shape[dim] % chunks for t in tensors):
            raise CaptureError(f"{self._where()}: {func} of a tensor whose dim {dim} is not a multiple of {chunks} "
                               f"(padded shards are not recorded)")
        rows = [self._flat(t, [*t.shape[:dim], chunks, -1]) for t in tensors]
        node = self._op(aten.cat.default, (rows, dim + 1), {}, target)
        self._changed(target, func)
        self._bind(target, node)

    def _as_strided(self, func, args, out) -> None:
        """A window of contiguous memory with a value (FSDP2's sharded gradients on the reduce-scatter's output), its
        dims in order or permuted, read off that memory (`_same_memory`); any other striding is refused."""
        if self._same_memory(out) is None:
            raise CaptureError(f"{self._where()}: {func} with strides {tuple(out.stride())} (only a window of "
                               f"contiguous memory, or one with its dims permuted, is recorded)")

    def _in_place(self, func, name: str, args, kwargs) -> None:
        """An in-place op (or one writing its `out=` tensor: ``torch.exp(x, out=y)``) as its out-of-place twin; the
        tensor changed reads the new node, its aliases go stale."""
        if func._overloadname == "out" and isinstance(kwargs.get("out"), torch.Tensor):
            functional, target = _out_twin(func), kwargs["out"]
            kwargs = {k: v for k, v in kwargs.items() if k != "out"}
        else:
            functional, target = FUNCTIONAL.get(func) or _overload(name.rstrip("_"), func._overloadname), args[0]
        if functional is None:
            raise CaptureError(f"{self._where()}: in-place {func} has no out-of-place twin to record it as")
        node = self._op(functional, args, kwargs, target)
        self._changed(target, func)
        self._bind(target, node)

    def _foreach(self, func, name: str, args, kwargs, out) -> None:
        """A `_foreach_` op as one op per element (its lists zipped, a scalar or tensor operand shared)."""
        base = name[len("_foreach_"):]
        in_place = base.endswith("_")
        base = base.rstrip("_")
        single = aten.linalg_vector_norm.default if base == "norm" else \
            _overload(base, {"List": "Tensor", "ScalarList": "Scalar"}.get(func._overloadname, func._overloadname))
        if single is None:
            raise CaptureError(f"{self._where()}: {func} has no single-tensor op to record it as")
        size = len(args[0])
        for i in range(size):
            each = tuple(a[i] if isinstance(a, (list, tuple)) and len(a) == size else a for a in args)
            target = args[0][i]
            result = target if in_place else out[i]
            node = self._op(single, each, kwargs, result)
            if in_place:
                self._changed(target, func)
            self._bind(result, node)

    # -- tensors and nodes ------------------------------------------------------------------
    def _read(self, tensor: torch.Tensor, func) -> torch.fx.Node:
        key = id(tensor)
        node = self.node.get(key) if key not in self.stale else None
        if node is not None:
            return node
        known = self.known.get(key)
        if known is None or known[0] is not tensor or key in self.stale:
            node = self._same_memory(tensor)
            if node is not None:
                return node
        if key in self.stale:
            raise CaptureError(f"{self._where()}: {func} reads a tensor {tuple(tensor.shape)} after {self.stale[key]} "
                               f"changed memory it shares; a program cannot hold that aliasing")
        if key in self.empty:
            raise CaptureError(f"{self._where()}: {func} reads a {_describe(tensor)} made by {self.empty[key]} that no "
                               f"op wrote whole")
        if known is None or known[0] is not tensor:
            raise CaptureError(f"{self._where()}: {func} reads a {_describe(tensor)} that no recorded op made and "
                               f"that is no parameter, optimizer state or batch tensor of the step")
        _, name, role = known
        node = self.graph.placeholder(_identifier(name))
        node.meta["val"] = Value(tensor)
        self.placeholders[node.name] = (name, role)
        self._bind(tensor, node)
        return node

    def _unvalued(self, tensor) -> bool:
        """A tensor with no value yet: made uninitialised, or from outside the step and no input (FSDP2's unsharded
        parameter buffers, re-allocated for each all-gather) — a view of it has none either."""
        key = id(tensor)
        if not isinstance(tensor, torch.Tensor) or key in self.stale or key in self.node:
            return False
        if key in self.empty:
            return True
        return self.known.get(key, (None,))[0] is not tensor and self._same_memory(tensor) is None

    def _same_memory(self, tensor: torch.Tensor) -> torch.fx.Node | None:
        """`tensor` read off the memory it lies on, where every part of it is held by a tensor with a value there
        (the same storage and dtype, contiguous): FSDP's flat shard of a parameter, its unsharded parameter on the
        all-gather's output, megatron-core's `main_grad` windows of its gradient buffer and the buffer itself once
        each window was written, a `.data` alias. A tensor gone stale still holds its value where nothing wrote
        since. The parts, each the longest such from where the last ended, are concatenated; None if some byte has
        no holder. A tensor whose dims are a dense tensor's permuted (a transposed weight autograd saved) is that
        tensor read so, permuted back."""
        if not tensor.is_contiguous():
            order = sorted(range(tensor.dim()), key=lambda d: -tensor.stride(d))
            dense = tensor.permute(order)
            if not dense.is_contiguous() or self._same_memory(dense) is None:
                return None
            node = self._op(aten.permute.default, (dense, sorted(range(tensor.dim()), key=order.__getitem__)), {},
                            tensor)
            self._bind(tensor, node)
            return node
        lo, hi = _span(tensor)
        size = tensor.element_size()
        holders = []
        for other in self.sharing.get(_storage(tensor), ()):
            key = id(other)
            if other.dtype == tensor.dtype and other.is_contiguous() and key not in self.empty and \
                    (key in self.node or self.known.get(key, (None,))[0] is other and key not in self.stale) and \
                    other.untyped_storage().nbytes() >= _span(other)[1]:      # not freed since (FSDP2 frees its own)
                holders.append((other, _span(other), self.written.get(key, [])))   # only a stale one has writes
        pieces, at = [], lo
        while at < hi:
            best = None
            for other, (a, b), written in holders:
                if not a <= at < b or any(w0 <= at < w1 for w0, w1 in written):
                    continue
                end = min([b, hi] + [w0 for w0, w1 in written if w0 > at])
                if best is None or end > best[1]:
                    best = (other, end, a)
            if best is None:
                return None
            other, end, a = best
            pieces.append((other, (at - a) // size, (end - at) // size))
            at = end
        if len(pieces) == 1 and pieces[0][1] == 0 and pieces[0][2] == pieces[0][0].numel():
            node = self._op(aten.view.default, (self._held(pieces[0][0]), list(tensor.shape)), {}, tensor)
        else:
            parts = [self._op(aten.slice.Tensor, (self._op(aten.view.default, (self._held(o), [-1]), {}, o.reshape(-1)),
                                                  0, start, start + n), {}, o.reshape(-1)[start:start + n])
                     for o, start, n in pieces]
            flat = parts[0] if len(parts) == 1 else self._op(aten.cat.default, (parts, 0), {}, tensor.reshape(-1))
            node = self._op(aten.view.default, (flat, list(tensor.shape)), {}, tensor)
        self._bind(tensor, node)
        return node

    def _held(self, tensor: torch.Tensor):
        """The node a holder's value is (its own, stale or not), or the tensor to read (an input not read yet)."""
        return self.node.get(id(tensor), tensor)

    def _bind(self, value, node: torch.fx.Node) -> None:
        """The tensor(s) `value` hold `node` (a list or tuple of tensors: one getitem each)."""
        if isinstance(value, torch.Tensor):
            self._hold(value)
            self.node[id(value)] = node
            self.stale.pop(id(value), None)
            self.written.pop(id(value), None)
            self.empty.pop(id(value), None)
        elif isinstance(value, (list, tuple)):
            for i, item in enumerate(value):
                if isinstance(item, torch.Tensor):
                    part = self.graph.call_function(operator.getitem, (node, i))
                    part.meta["val"] = Value(item)
                    self.provenance[part.name] = self.provenance.get(node.name, ("", "fwd"))
                    self._bind(item, part)

    def _hold(self, tensor: torch.Tensor) -> None:
        self.alive.append(tensor)
        storage = _storage(tensor)
        if storage is not None:
            self.sharing.setdefault(storage, []).append(tensor)

    def _changed(self, tensor: torch.Tensor, func) -> None:
        """Every other tensor seen sharing `tensor`'s memory is stale (one on another part of the same storage is
        not: FSDP2's sharded gradients are windows of one reduce-scatter output)."""
        span = _span(tensor)
        for other in self.sharing.get(_storage(tensor), ()):
            if other is not tensor:
                lo, hi = _span(other)
                if lo < span[1] and span[0] < hi:
                    self.stale[id(other)] = str(func)
                    self.written.setdefault(id(other), []).append(span)

    def _where(self) -> str:
        return f"module {self.module[-1]!r}" if self.module and self.module[-1] else "the step"

    # -- module paths -----------------------------------------------------------------------
    def watch(self, model: torch.nn.Module) -> list:
        """Forward hooks that keep the module path stack; returns their handles."""
        handles = []
        for path, sub in model.named_modules():
            if path:
                handles.append(sub.register_forward_pre_hook(lambda _m, _a, path=path: self.module.append(path)))
                handles.append(sub.register_forward_hook(lambda _m, _a, _o: self.module.pop() and None))
        return handles

    def holding(self, tensor: torch.Tensor) -> torch.fx.Node:
        """The node holding `tensor`'s value now."""
        return self._read(tensor, "a value the caller reads")

    def mark(self, name: str, tensor: torch.Tensor) -> None:
        """Output `name` is `tensor`'s value now (a gradient as backward made it, before clipping changed it); marked
        again, the later value."""
        self.marked[name] = self._read(tensor, f"output {name}")

    def recording(self, outputs: list[tuple[str, torch.Tensor]]) -> Recording:
        """The graph with the outputs marked, then `outputs` (name, tensor) read at their current values."""
        ends = list(self.marked.items()) + [(name, self._read(tensor, f"output {name}")) for name, tensor in outputs]
        self.graph.output(tuple(node for _, node in ends))
        return Recording(torch.fx.GraphModule(torch.nn.Module(), self.graph), dict(self.placeholders),
                         [(name, node.name) for name, node in ends], dict(self.provenance), dict(self.groups),
                         dict(self.sources))


def _collective(op: Op, **attrs) -> Callable:
    """A collective over its group's mesh axes; over a group of this rank alone (megatron's data-parallel group
    without dp), its input."""
    def convert(cv: Converter, x, *args):          # (reduce op,) (group size,) group
        reduce = {}
        if op is not Op.ALL_GATHER:
            if args[0] not in REDUCE_OPS:
                raise cv.error(f"{op.value} with {args[0]!r} (only {', '.join(REDUCE_OPS)})")
            reduce = {"reduce": REDUCE_OPS[args[0]]}
        axes = cv.joint.groups[args[-1]]
        if not axes:
            return cv.alias(cv.arg(x))
        return cv.emit(op, [cv.arg(x)], {"axes": list(axes), **attrs, **reduce})
    return convert


def send(x: torch.Tensor, axis: str, step: int, tag: int) -> None:
    """The recorded graph's send: `x` to the rank `step` along mesh `axis` (an FX target; nothing runs it)."""


def recv(axis: str, step: int, tag: int) -> torch.Tensor:
    """The recorded graph's receive: from the rank `step` along mesh `axis` (an FX target; nothing runs it)."""


def _send(cv: Converter, x, axis: str, step: int, tag: int):
    node = cv.fx
    cv.nodes.append(Node.make(node.name, Op.SEND, [cv.arg(x)], {"peer": {axis: step}, "tag": tag}, (), "token",
                              cv._meta(node)))


def _recv(cv: Converter, axis: str, step: int, tag: int):
    val = cv.fx.meta["val"]
    return cv.emit(Op.RECV, [], {"peer": {axis: step}, "tag": tag, "size": [int(s) for s in val.shape],
                                 "dtype": dtype_name(val.dtype, cv.fx.name)})


COLLECTIVES: dict[Any, Callable] = {
    c10d.all_reduce.default: _collective(Op.ALL_REDUCE),
    c10d.all_gather_into_tensor.default: _collective(Op.ALL_GATHER, dim=0),
    c10d.reduce_scatter_tensor.default: _collective(Op.REDUCE_SCATTER, dim=0),
}


class RankConverter(Converter):
    """`Converter` for a `Recording`: its inputs by role, its outputs as recorded, and the collectives."""

    converters = {**CONVERTERS, **COLLECTIVES, send: _send, recv: _recv}

    def run(self) -> Graph:
        return Graph(tuple(self._walk()), tuple(self.nodes), tuple(self._outputs()), name="rank")

    def _outputs(self) -> list[tuple[str, str]]:
        return [(name, self.names[node]) for name, node in self.joint.outputs]

    def _meta(self, node: torch.fx.Node) -> dict:
        source = self.joint.sources.get(node.name)
        return {**super()._meta(node), **({"source": source} if source else {})}

    def _input(self, node: torch.fx.Node) -> TensorSpec:
        name, role = self.joint.inputs[node.name]
        self.names[node.name] = name
        val = node.meta["val"]
        return TensorSpec(name, tuple(Expr.const(int(s)) for s in val.shape), dtype_name(val.dtype, name), role,
                          positive=role == "state" and name.startswith("exp_avg_sq/"))


def _reduce_name(op) -> str:
    """A c10d ReduceOp script object's reduction, as the functional collectives name it."""
    from torch.distributed import ReduceOp
    kinds = {int(ReduceOp.RedOpType.SUM): "sum", int(ReduceOp.RedOpType.AVG): "avg",
             int(ReduceOp.RedOpType.MAX): "max", int(ReduceOp.RedOpType.MIN): "min",
             int(ReduceOp.RedOpType.PRODUCT): "product"}
    code = int(op.op())
    return kinds.get(code, f"reduce op {code}")


_LIBRARY = tuple(str(Path(p).resolve()) for p in {sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["purelib"],
                                                   sysconfig.get_paths()["platlib"], Path(__file__).parents[1]})


def _source() -> str | None:
    """"file:line" of the innermost frame of the user's own code (outside the standard library, installed packages and
    tv_ray) that is running the current op — a custom autograd function's backward included; an op of autograd's own
    backward takes its forward op's line (`_forward_source`)."""
    frame = sys._getframe(2)
    while frame is not None:
        if _users(frame.f_code.co_filename):
            return f"{frame.f_code.co_filename}:{frame.f_lineno}"
        if frame.f_code.co_name == "_engine_run_backward":
            return _forward_source()
        frame = frame.f_back
    return None


def _forward_source() -> str | None:
    """The user's line of the forward op whose backward autograd is running (anomaly mode keeps each op's stack)."""
    node = torch._C._current_autograd_node()
    stack = node.metadata.get("traceback_") if node is not None else None
    for entry in reversed(stack or ()):
        found = _FRAME.match(entry)
        if found and _users(found.group(1)):
            return f"{found.group(1)}:{found.group(2)}"
    return None


_FRAME = re.compile(r'\s*File "(.+)", line (\d+)')


@functools.lru_cache(maxsize=None)
def _users(path: str) -> bool:
    return not path.startswith("<") and not str(Path(path).resolve()).startswith(_LIBRARY)


def _overload(name: str, overload: str):
    packet = getattr(aten, name, None)
    return getattr(packet, overload, None) if packet is not None else None


@functools.lru_cache(maxsize=None)
def _out_twin(func):
    """The functional overload an `out=` overload writes the result of: the one taking the same arguments but `out`
    (mul.out → mul.Tensor, not mul.default, which multiplies two scalars)."""
    def signature(schema):
        return [(a.name, str(a.type)) for a in schema.arguments if not a.is_out]
    packet = getattr(aten, func._schema.name.split("::")[1])
    twins = (getattr(packet, o) for o in packet.overloads())
    return next((op for op in twins if not any(a.is_out for a in op._schema.arguments)
                 and signature(op._schema) == signature(func._schema)), None)


def _fake(args, kwargs, out) -> bool:
    return any(isinstance(t, FakeTensor) for t in tree_leaves((args, kwargs, out)))


def _storage(tensor: torch.Tensor):
    """The storage a tensor lies on, by identity (not by address: memory freed — FSDP2 frees its unsharded
    parameters' — is reused by tensors that share nothing with the ones that had it; every tensor seen is held,
    so no storage is freed while recording)."""
    try:
        return tensor.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError):
        return None


def _span(tensor: torch.Tensor) -> tuple[int, int]:
    """The bytes of its storage a tensor may touch: [first, last + 1) (a strided tensor's whole extent)."""
    size = tensor.element_size()
    first = tensor.storage_offset() * size
    if tensor.numel() == 0:
        return first, first
    extent = 1 + sum((n - 1) * abs(s) for n, s in zip(tensor.shape, tensor.stride()))
    return first, first + extent * size


def _describe(tensor: torch.Tensor) -> str:
    return f"tensor of shape {tuple(tensor.shape)} and dtype {tensor.dtype}"


def _identifier(name: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in name)
