"""A user's torch.distributed training script, run on every rank and recorded into a plan.

The script is a Python file (or module) that says what the user's training
script does, as functions tv_ray calls on each rank:

    MESH = {"tp": 2}                     # device mesh axes and sizes, outer to inner (their product: the world size)
    def model(): ...                     # the single-device model (torch is seeded alike before, on every rank)
    def parallelize(model, mesh): ...    # what the training script does to it (DTensor, FSDP2, ...); returns it
    def optimizer(params): ...           # torch.optim.SGD (AdamW: see below)
    def batch(): ...                     # one step's global batch: {name: tensor}
    def shard(batch, mesh): ...          # optional: this rank's part of it (default: all of it)
    def loss(model, batch): ...          # forward and loss on a batch
    def step(model, optimizer, batch): ...   # optional: the training step as the script runs it (a context around
                                         # the loss and its backward, a pipeline schedule, its own clipping);
                                         # returns the loss (None on a rank that computes none: a pipeline's
                                         # stages before the last)
    CLIP = 1.0                           # optional: clip_grad_norm_'s max norm (the default step clips so)
    HIGHS = {"tokens": 128}              # integer batch tensors: values lie in [0, high)

Each rank runs as a gloo process on CPU (`world_size` = the mesh's size,
forked from one process that has imported torch and the script):
it builds the mesh (`init_device_mesh`), the model, its parallelization and
optimizer, runs one warm step (optimizer state and DTensor's caches made;
two under torch's DistributedDataParallel, which rebuilds its gradient
buckets as the second step begins),
then records one more (`tv_ray.frontend.record`): loss, backward,
clipping, optimizer step. Its program's boundary lineage is read off the
tensors themselves — a parameter's, gradient's and updated parameter's
slice from its DTensor placements (`compute_local_shape_and_global_offset`;
a replicated plain tensor: all of it), a batch tensor's by finding its value
in the global batch (a buffer's, in the single-device model's buffer: an
input of any value to the proof), the loss's by comparing each rank's warm-step loss with
the single-device one (`_loss_relation`: each data-parallel rank's mean over
its own rows is a partial sum of dp times the loss) — each stated for that rank alone
(``where`` pins every mesh coordinate but a partial sum's axes). The logical
graph is the single-device model's step captured as `tv-ray plan` captures
one (`capture_step`): the same loss function, optimizer and clipping.
Programs equal across ranks are stored once.

The gradients are what the step first reads of them: as clipping takes their
norm (`torch.nn.utils.get_total_norm`, which `clip_grad_norm_` calls), else as
the optimizer's step begins — after backward, a pipeline schedule's division
by its microbatches, megatron-core's reductions into `main_grad`, and before
clipping changes them (clipping that takes no such norm is read as the
gradients). Pipelines (torch.distributed.pipelining, or any code that sends
and receives along one mesh axis) are recorded as they run: every
microbatch's ops in the order issued, sends and receives with their peer
along the axis. A parameter a pipeline's stages each hold a copy of (an output
layer tied to the embedding) is named as the single-device model names the one
parameter; the single-device step sums its gradient over its uses. Where the
gradient as the last backward left it is k times the one the step reads (a
schedule's sum over its microbatches, divided after), the plan states so as
interior lineage (found by value, proved like any claim): it names the
multiple that backward's activation gradients are of their logical slices.

The optimizer is torch.optim.SGD (plain: one learning rate) or AdamW (Adam
with decoupled weight decay, or none; no amsgrad). AdamW's state (``exp_avg``,
``exp_avg_sq`` and the step count, made by the warm step) are program inputs
whose lineage is the parameter's; its step is recorded on torch's capturable
path, where the step count stays a tensor (the default path reads it into
Python, so the program would hold one step's bias corrections as constants):
the same formulas, and so a proof for every step count.
"""
from __future__ import annotations

import importlib.util
import inspect
import itertools
import json
import math
import multiprocessing
import multiprocessing.connection
import multiprocessing.forkserver
import os
import signal
import socket
import sys
import tempfile
import time
import traceback
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from tv_ray.errors import CaptureError, TraceFailed
from tv_ray.frontend.optim import SGD, AdamW, capture_step
from tv_ray.frontend.record import RankConverter, Recorder
from tv_ray.ir import Graph
from tv_ray.plan import FORMAT, Fixed, Lineage, Plan, RankMap

SEED = 0
REQUIRED = ("MESH", "model", "parallelize", "optimizer", "batch", "loss")


def load_script(path: str | Path) -> ModuleType:
    """The script as a module (a `CaptureError` naming what it lacks)."""
    path = Path(path)
    if not path.is_file():
        raise CaptureError(f"{path}: no such script")
    spec = importlib.util.spec_from_file_location(f"tv_ray_traced_{path.stem}", path)
    script = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = script
    spec.loader.exec_module(script)
    missing = [name for name in REQUIRED if not hasattr(script, name)]
    if missing:
        raise CaptureError(f"{path}: defines no {', '.join(missing)} (a traced script defines {', '.join(REQUIRED)}; "
                           f"see tv_ray.frontend.traced)")
    mesh = script.MESH
    if not isinstance(mesh, dict) or not mesh or not all(isinstance(k, str) and isinstance(v, int) and v >= 1
                                                          for k, v in mesh.items()):
        raise CaptureError(f"{path}: MESH must map mesh axis names to sizes, e.g. {{'dp': 2, 'tp': 2}}; got {mesh!r}")
    return script


def trace(script: str | Path, world_size: int | None = None) -> Plan:
    """The plan of `script` (module docstring), its ranks run as `world_size` gloo processes."""
    loaded = load_script(script)
    mesh = dict(loaded.MESH)
    size = 1
    for n in mesh.values():
        size *= n
    if world_size is not None and world_size != size:
        raise CaptureError(f"{script}: MESH {mesh} has {size} ranks, but --world-size is {world_size}")
    with tempfile.TemporaryDirectory(prefix="tv-ray-trace-") as out:
        _run_ranks(str(Path(script).resolve()), size, out)
        ranks = [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(size)]
    return _plan(loaded, mesh, ranks)


# -- the ranks ---------------------------------------------------------------------------------
def _run_ranks(script: str, world_size: int, out: str) -> None:
    """Run every rank as a process forked from one launcher (`_launch`), itself forked from this process's fork
    server, which has imported torch and tv_ray once for every trace; the first rank that fails stops the others
    and raises `TraceFailed` with its traceback. The launcher leads a process group of its own, so the ranks end
    with it however the trace ends (a failure, ^C)."""
    launcher = _LAUNCHERS.Process(target=_launch, args=(world_size, script, _free_port(), out),
                                  name=f"tv-ray trace {script}")
    with _main_hidden():
        launcher.start()
    try:
        launcher.join()
    finally:
        launcher.kill()
        try:
            os.killpg(launcher.pid, signal.SIGKILL)
        except ProcessLookupError:      # every rank has ended (or none had begun)
            pass
        launcher.join()
    if launcher.exitcode == 0:
        return
    errors = {r: Path(out, f"rank{r}.error") for r in range(world_size) if Path(out, f"rank{r}.error").exists()}
    why = Path(out, "launcher.error")
    if not errors or why.exists():
        raise TraceFailed(f"the launcher of {world_size} ranks failed:\n"
                          f"{why.read_text().rstrip() if why.exists() else f'exit code {launcher.exitcode}'}")
    rank = min(errors, key=lambda r: errors[r].stat().st_mtime_ns)    # the others often fail after it, at a
    raise TraceFailed(f"rank {rank} of {world_size} failed:\n{errors[rank].read_text().rstrip()}")  # collective it left


@contextmanager
def _main_hidden():
    """The caller's `__main__` out of sight while a launcher starts: multiprocessing would import it again in the
    fork server and the launcher (which need nothing of it), and a script calling `trace` at its top level, with
    no ``if __name__ == "__main__"`` guard, would trace again there."""
    main = sys.modules["__main__"]
    sys.modules["__main__"] = ModuleType("__main__")
    try:
        yield
    finally:
        sys.modules["__main__"] = main


def _launch(world_size: int, script: str, port: int, out: str) -> None:
    """Load the script, then fork the ranks from this process; exit 1 as soon as one of them fails (the others
    killed), 0 when all have written their records."""
    os.setsid()
    try:
        loaded = load_script(script)
    except BaseException:   # noqa: BLE001 — reported by the parent, with the traceback
        Path(out, "launcher.error").write_text(traceback.format_exc())
        raise SystemExit(1)
    fork = multiprocessing.get_context("fork")
    ranks = [fork.Process(target=_rank_main, args=(rank, world_size, loaded, port, out), name=f"rank{rank}")
             for rank in range(world_size)]
    for rank in ranks:
        rank.start()
    running = {rank.sentinel: rank for rank in ranks}
    while running:
        for sentinel in multiprocessing.connection.wait(list(running)):
            rank = running.pop(sentinel)
            rank.join()
            if rank.exitcode != 0:
                _blame(ranks, rank, list(running.values()), out)
                raise SystemExit(1)


def _blame(ranks: list, first, running: list, out: str) -> None:
    """The others killed once `first` has failed; the failure `launcher.error` names when it is not a rank's
    traceback: a rank killed from outside (SIGKILL: the OOM killer, a person) — its peers fail at the collective
    it left, often before the launcher sees it end, so the ranks ending within `SETTLE_S` are looked at too —,
    else `first` if it left none (a signal, or C++ code ending the process)."""
    deadline = time.monotonic() + SETTLE_S
    for other in running:
        other.join(timeout=max(0.0, deadline - time.monotonic()))
    ended = [first] + [other for other in running if other.exitcode is not None]     # before any is killed here
    for other in running:
        other.kill()
    untold = [r for r in ended if not Path(out, f"rank{ranks.index(r)}.error").exists()]
    killed = [r for r in untold if r.exitcode == -signal.SIGKILL]
    silent = killed[0] if killed else first if first in untold else None
    if silent is not None:
        Path(out, "launcher.error").write_text(f"rank {ranks.index(silent)} ended with exit code {silent.exitcode} "
                                               f"and left no traceback")


SETTLE_S = 2.0      # how long the other ranks get to end on their own once one has failed (then they are killed)

# a trace's launcher is forked from this server: it has imported torch and tv_ray once, for every trace of the process
_LAUNCHERS = multiprocessing.get_context("forkserver")
multiprocessing.forkserver.set_forkserver_preload([__name__])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, world_size: int, script: ModuleType, port: int, out: str) -> None:
    try:
        record = _record_rank(rank, world_size, script, port)
    except BaseException:   # noqa: BLE001 — reported by the parent, with the traceback
        Path(out, f"rank{rank}.error").write_text(traceback.format_exc())
        raise SystemExit(1)
    Path(out, f"rank{rank}.json").write_text(json.dumps(record))


def _record_rank(rank: int, world_size: int, script: ModuleType, port: int) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", rank=rank, world_size=world_size, init_method=f"tcp://127.0.0.1:{port}")
    try:
        names, sizes = zip(*script.MESH.items())
        mesh = init_device_mesh("cpu", sizes, mesh_dim_names=names)
        torch.manual_seed(SEED)
        single = script.model()
        first: dict[int, str] = {}      # a parameter held under several paths (tied) is named by its first
        names_before = {name: first.setdefault(id(p), name)
                        for name, p in single.named_parameters(remove_duplicate=False)}
        buffers_before = {name: b.detach().clone() for name, b in single.named_buffers()}
        model = script.parallelize(single, mesh)
        optimizer = script.optimizer(model.parameters())
        _optimizer(optimizer)
        torch.manual_seed(SEED + 1)
        whole = script.batch()
        batch = script.shard(whole, mesh) if hasattr(script, "shard") else whole
        clip = getattr(script, "CLIP", None)
        warm = _step(script, model, optimizer, batch, clip)   # warm: optimizer state, DTensor's caches
        if any(isinstance(m, torch.nn.parallel.DistributedDataParallel) for m in model.modules()):
            _step(script, model, optimizer, batch, clip)    # DDP rebuilds its buckets as the second step begins
        params = {_unwrapped(name, names_before): p for name, p in model.named_parameters()}
        states = _states(optimizer, params)
        known = {id(_local(p)): (_local(p), name, "param") for name, p in params.items()}
        known |= {id(t): (t, name, "data") for name, t in batch.items()}
        buffers, single_names = {}, {n: n for n in buffers_before}
        for name, b in model.named_buffers():   # the single-device model's, by its names (frameworks' own: no inputs)
            name = _unwrapped(name, single_names)
            if name in buffers_before:
                buffers[name] = _local(b)
        known |= {id(t): (t, name, "data") for name, t in buffers.items()}
        known |= {id(_local(t)): (_local(t), name, "step" if name.startswith("step/") else "state")
                  for name, (t, _) in states.items()}
        recorder = Recorder(known, _group_axes(mesh, names))
        grads: dict[str, Any] = {}
        read_values: dict[str, torch.Tensor] = {}
        accumulated: dict[str, tuple[Any, torch.Tensor]] = {}

        def read(*_) -> None:      # the gradients as the step first reads them (`_reading_gradients`)
            if not grads:
                for name, p in params.items():
                    if p.grad is not None:
                        grads[name] = p.grad
                        recorder.mark(f"grad/{name}", _local(p.grad))
                        read_values[name] = _copy(_local(p.grad))

        def left(param, name: str) -> None:     # a gradient as each backward leaves it: the last one's is kept
            accumulated[name] = (recorder.holding(_local(param.grad)), _copy(_local(param.grad)))
        hooks = [optimizer.register_step_pre_hook(read), *recorder.watch(model),
                 *(p.register_post_accumulate_grad_hook(lambda p, name=name: left(p, name))
                   for name, p in params.items())]
        try:
            # anomaly mode keeps each forward op's stack: a backward op's source line is its forward op's
            with torch.autograd.set_detect_anomaly(True, check_nan=False), _tensor_step(optimizer), \
                    _reading_gradients(read), recorder:
                loss = _step(script, model, optimizer, batch, clip)
        finally:
            for hook in hooks:
                hook.remove()
        ends = [("loss", loss)] * (loss is not None) + [(f"new/{n}", p) for n, p in params.items()] + \
            [(f"new/{n}", t) for n, (t, _) in states.items() if not n.startswith("step/")]
        converter = RankConverter(recorder.recording([(name, _local(t)) for name, t in ends]))
        program = converter.run()
        multiples = {}
        for name, (node, value) in accumulated.items():
            k = _multiple(value, read_values.get(name))
            if k is not None:
                multiples[converter.names[node.name]] = {"logical": f"grad/{name}", "scale": k,
                                                         **_box(grads[name], mesh, params[name])}
        coords = dict(zip(names, (int(c) for c in mesh.get_coordinate())))
        return {"program": program.to_json(), "coords": coords,
                "loss": None if warm is None else float(_local(warm).detach()),
                "boxes": {**{name: _box(t, mesh) for name, t in [*params.items(), ("loss", loss)] if t is not None},
                          **{f"grad/{n}": _box(g, mesh, params[n]) for n, g in grads.items()},
                          **{f"new/{n}": _box(p, mesh) for n, p in params.items()},
                          **{n: _box(t, mesh, like) for n, (t, like) in states.items()},
                          **{f"new/{n}": _box(t, mesh, like) for n, (t, like) in states.items()
                             if not n.startswith("step/")}},
                "batch": {**{name: _found(t, whole[name], name) for name, t in batch.items()},
                          **{name: _found(t, buffers_before[name], name, "buffer") for name, t in buffers.items()}},
                "interior": multiples}
    finally:
        dist.destroy_process_group()


def _copy(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of a tensor's value now, made outside the recorder (no op of the step)."""
    with torch.utils._python_dispatch._disable_current_modes():
        return tensor.detach().clone()


def _multiple(accumulated: torch.Tensor, read: torch.Tensor | None) -> int | None:
    """k ≥ 2 where the gradient as the last backward left it is k times the one the step reads (a pipeline schedule's
    sum over its microbatches, divided after: `scale_grads`); None otherwise. Found by value; what the plan states
    of it is interior lineage, proved like any claim — it names the multiple that backward's activation gradients
    are of their logical slices (each microbatch's mean loss), so that claims are matched there."""
    if read is None or accumulated.shape != read.shape or not read.abs().max() > 0:
        return None
    big = read.abs() > 1e-6 * read.abs().max()
    ratio = (accumulated[big] / read[big]).double()
    k = round(float(ratio.mean()))
    return k if k >= 2 and torch.allclose(ratio, torch.full_like(ratio, k), rtol=1e-9, atol=0) else None


WRAPPERS = ("module", "_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module")   # DDPs', compile's, ...


def _unwrapped(name: str, single: dict[str, str]) -> str:
    """A parallel model's parameter by the single-device model's name for it: without the wrappers' segments
    (megatron-core's and torch's DistributedDataParallel hold the model as `module`) where that is one; a tied
    parameter's copy (a pipeline's last stage holding the output layer tied to the first's embedding) by the name
    the capture gives the one parameter (`single`: every path → the first path of its parameter)."""
    if name not in single:
        bare = ".".join(part for part in name.split(".") if part not in WRAPPERS)
        name = bare if bare in single else name
    return single.get(name, name)


def _group_axes(mesh, names):
    """A process group's name → the mesh axis whose group on this rank has the same ranks in the same order (the
    mesh's own groups, or ones the code made alike: megatron-core's tensor-parallel group); no axes: a group of this
    rank alone (megatron-core's data-parallel group on a mesh without dp); None: no axis."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _resolve_process_group
    by_ranks = {tuple(dist.get_process_group_ranks(mesh.get_group(i))): (name,) for i, name in enumerate(names)}
    by_ranks[(dist.get_rank(),)] = ()
    return lambda group: by_ranks.get(tuple(dist.get_process_group_ranks(_resolve_process_group(group))))


def _step(script, model, optimizer, batch, clip):
    """The script's own `step`, else: the loss, its backward, clipping, the optimizer step."""
    if hasattr(script, "step"):
        return script.step(model, optimizer, batch)
    loss = script.loss(model, batch)
    loss.backward()
    if clip is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    optimizer.step()
    optimizer.zero_grad()
    return loss


def _optimizer(optimizer) -> SGD | AdamW:
    """The torch optimizer as tv_ray's (`tv_ray.frontend.optim`), or a `CaptureError` saying what is not recorded."""
    groups = optimizer.param_groups
    kind = type(optimizer).__name__
    hyper = {k: [g.get(k) for g in groups] for k in ("lr", "betas", "eps", "weight_decay")}
    differing = [k for k, values in hyper.items() if any(v != values[0] for v in values)]
    if differing:
        raise CaptureError(f"optimizer {kind} with parameter groups of different {', '.join(differing)}: one of each "
                           f"is recorded")
    group = groups[0]
    if group.get("maximize") or group.get("fused") or group.get("differentiable"):
        raise CaptureError(f"optimizer {kind} with maximize, fused or differentiable: not recorded")
    if type(optimizer) is torch.optim.SGD:
        extra = {k: group[k] for k in ("momentum", "weight_decay", "dampening") if group.get(k)}
        if extra or group.get("nesterov"):
            raise CaptureError(f"optimizer SGD with {extra or 'nesterov'}: only plain SGD (lr) is recorded")
        return SGD(lr=group["lr"])
    if isinstance(optimizer, torch.optim.Adam) and type(optimizer) in (torch.optim.Adam, torch.optim.AdamW):
        if group["amsgrad"]:
            raise CaptureError(f"optimizer {kind} with amsgrad: not recorded")
        if group["weight_decay"] and not group.get("decoupled_weight_decay"):
            raise CaptureError("optimizer Adam with (L2) weight_decay: only decoupled weight decay (AdamW) is recorded")
        if any(isinstance(v, torch.Tensor) for v in (group["lr"], *group["betas"])):
            raise CaptureError(f"optimizer {kind} with a tensor lr or betas: not recorded")
        return AdamW(lr=group["lr"], betas=tuple(group["betas"]), eps=group["eps"], weight_decay=group["weight_decay"])
    raise CaptureError(f"optimizer {kind}: torch.optim.SGD and AdamW are recorded")


def _states(optimizer, params: dict) -> dict[str, tuple[Any, Any]]:
    """The optimizer state the recorded step reads, by input name → (tensor, its parameter)."""
    states = {}
    for name, p in params.items():
        state = optimizer.state.get(p, {})
        for key in ("exp_avg", "exp_avg_sq", "step"):
            if key in state:
                states[f"{key}/{name}"] = (state[key], p if key != "step" else None)
    return states


@contextmanager
def _reading_gradients(read):
    """`read` called as the step takes its gradients' norm (`torch.nn.utils.get_total_norm`, which `clip_grad_norm_`
    calls): the gradients are what the step first reads of them — clipping's norm, else the optimizer's step (its
    pre-hook) — after backward, a pipeline schedule's division by its microbatches, megatron-core's reductions into
    `main_grad`, and before clipping changes them. Clipping that takes no such norm is read as the gradients."""
    import torch.nn.utils as utils
    import torch.nn.utils.clip_grad as clipping
    norm = clipping._get_total_norm

    def first(*args, **kwargs):
        read()
        return norm(*args, **kwargs)
    utils.get_total_norm = clipping._get_total_norm = first
    try:
        yield
    finally:
        utils.get_total_norm = clipping._get_total_norm = norm


@contextmanager
def _tensor_step(optimizer):
    """Adam's step on its capturable path (the step count a tensor, not a Python float), allowed on CPU."""
    import torch.optim.adam as adam
    if not isinstance(optimizer, torch.optim.Adam):
        yield
        return
    devices, flags = adam._get_capturable_supported_devices, [g["capturable"] for g in optimizer.param_groups]
    adam._get_capturable_supported_devices = lambda: [*devices(), "cpu"]
    for group in optimizer.param_groups:
        group["capturable"] = True
    try:
        yield
    finally:
        adam._get_capturable_supported_devices = devices
        for group, flag in zip(optimizer.param_groups, flags):
            group["capturable"] = flag


def _local(tensor):
    """A DTensor's local shard, the very tensor its ops run on (`to_local()` would make an alias of it)."""
    from torch.distributed.tensor import DTensor
    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor


def _box(tensor, mesh, like=None) -> dict:
    """Where a tensor lies in its logical tensor: per dim (offset, local size, global size), and its partial axes —
    from its DTensor placements, else from megatron-core's partition attributes of the parameter it is (or is
    `like`: a gradient or an updated parameter) on the mesh's "tp" axis, else all of it."""
    from torch.distributed.tensor import DTensor
    if isinstance(tensor, DTensor):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
        shape, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
        if any(p.is_partial() and getattr(p, "reduce_op", "sum") != "sum" for p in tensor.placements):
            raise CaptureError(f"a tensor partial by {tensor.placements}: only sums are lineage")
        partial = [tensor.device_mesh.mesh_dim_names[i] for i, p in enumerate(tensor.placements) if p.is_partial()]
        return {"dims": [[int(o), int(s), int(n)] for o, s, n in zip(offset, shape, tensor.shape)],
                "partial": partial}
    dims = [[0, n, n] for n in tensor.shape]
    owner = tensor if like is None else like
    if getattr(owner, "tensor_model_parallel", False):
        d, stride = owner.partition_dim, getattr(owner, "partition_stride", 1)
        if stride != 1:
            raise CaptureError(f"a parameter partitioned with stride {stride}: only stride 1 is lineage")
        tp = mesh["tp"]
        n = tensor.shape[d]
        dims[d] = [tp.get_local_rank() * n, n, n * tp.size()]
    return {"dims": dims, "partial": []}


def _found(local: torch.Tensor, whole: torch.Tensor, name: str, what: str = "batch tensor") -> dict:
    """A batch tensor's box in the global batch (a buffer's in the single-device model's buffer, `what`), found by
    value: all of it, or the one block of equal chunks along
    the dims where they differ that equals it (a sequence-parallel rank's part of its data-parallel rows: two dims;
    two blocks equal to it — repeated rows of token ids — leave which one the rank read unknown: an error, never a
    guess, since input lineage is assumed)."""
    if local.shape == whole.shape and torch.equal(local, whole):
        return {"dims": [[0, n, n] for n in whole.shape], "partial": []}
    of = "the global batch's" if what == "batch tensor" else "the single-device model's"
    split = [d for d, (n, m) in enumerate(zip(local.shape, whole.shape)) if n != m]
    found = []
    if local.dim() == whole.dim() and split and all(whole.shape[d] % local.shape[d] == 0 for d in split):
        for chunks in itertools.product(*(range(whole.shape[d] // local.shape[d]) for d in split)):
            part = whole
            for d, k in zip(split, chunks):
                part = part.narrow(d, k * local.shape[d], local.shape[d])
            if torch.equal(part, local):
                found.append(tuple(zip(split, chunks)))
    if len(found) > 1:
        listed = [f[0] if len(f) == 1 else f for f in found]
        raise CaptureError(f"{what} {name!r} {tuple(local.shape)} on this rank equals {len(found)} chunks of "
                           f"{of} {tuple(whole.shape)} (dim, chunk: {listed})" +
                           ("; make batch() draw distinct rows" if what == "batch tensor" else ""))
    if not found:
        raise CaptureError(f"{what} {name!r} {tuple(local.shape)} on this rank is no chunk of {of} "
                           f"{tuple(whole.shape)}" + (": shard() must return slices of batch()'s tensors"
                                                      if what == "batch tensor" else " (changed by the step?)"))
    box = [[0, s, s] for s in whole.shape]
    for d, k in found[0]:
        box[d] = [k * local.shape[d], local.shape[d], whole.shape[d]]
    return {"dims": box, "partial": []}


# -- the plan -----------------------------------------------------------------------------------
def _plan(script: ModuleType, mesh: dict[str, int], ranks: list[dict]) -> Plan:
    logical, loss = _logical(script)
    partial, scale = _loss_relation(mesh, ranks, loss)
    programs: dict[str, Graph] = {}
    by_json: dict[str, str] = {}
    chosen = []
    for r, record in enumerate(ranks):
        text = json.dumps(record["program"], sort_keys=True)
        if text not in by_json:
            by_json[text] = f"rank{r}"
            programs[f"rank{r}"] = Graph.from_json(record["program"], f"programs.rank{r}", name=f"rank{r}")
        chosen.append(by_json[text])
    overrides = tuple((r, name) for r, name in enumerate(chosen) if name != chosen[0])
    lineage = []
    for record in ranks:
        if "loss" in record["boxes"] and not record["boxes"]["loss"]["partial"]:
            record["boxes"]["loss"] |= {"partial": list(partial), "scale": scale}
        for tensor, box in {**record["boxes"], **record["batch"]}.items():
            lineage.append(_entry(record["coords"], tensor, box))
    value = dict(logical.outputs)       # interior lineage names a logical value (an output's: the node it is)
    interior = tuple(dict.fromkeys(_entry(record["coords"], tensor, box, value[box["logical"]])
                                   for record in ranks for tensor, box in record["interior"].items()))
    return Plan(format=FORMAT, model=Path(script.__file__).stem, dims={}, mesh=tuple(mesh.items()),
                microbatches=1, schedule="none", logical=logical, programs=programs,
                ranks=RankMap(chosen[0], overrides), lineage=tuple(dict.fromkeys(lineage)), interior=interior)


def _entry(coords: dict[str, int], tensor: str, box: dict, logical: str | None = None) -> Lineage:
    """`tensor` on the rank at `coords` is its box of the logical tensor of the same name (or `logical`)."""
    cuts = []
    for d, (offset, size, whole) in enumerate(box["dims"]):
        if size != whole:
            if whole % size or offset % size:
                raise CaptureError(f"{tensor}: a chunk of {size} at {offset} of {whole} along dim {d} is no equal "
                                   f"split (uneven shards are not lineage)")
            cuts.append((d, (Fixed(offset // size, whole // size),)))
    where = tuple((axis, c) for axis, c in coords.items() if axis not in box["partial"])
    if logical is None:     # every parameter's step count: the one step
        logical = "step" if tensor.startswith("step/") else tensor
    return Lineage(where, tensor, logical, tuple(cuts), tuple(box["partial"]), box.get("scale", 1))


def _loss_relation(mesh: dict[str, int], ranks: list[dict], loss: float) -> tuple[tuple[str, ...], int]:
    """How each rank's loss (of the warm step, at the weights the single-device model starts from) relates to the
    single-device `loss`, found by value: equal (no axes), else summed over the ranks of the fewest mesh axes,
    equal to it or to the group's size times it (each rank's mean over its own samples). Neither: the mean over its
    own samples along the axes where the ranks' losses differ (so that the report compares the group's loss with the
    single-device one: "physical = logical + 0.693147 (= log 2)") — the loss's stage is refuted where it differs; the
    relation is output lineage, proved, never assumed. Ranks whose step returns no loss (a pipeline's stages before
    the last) have none."""
    close = lambda a, b: abs(a - b) <= 1e-6 * max(1.0, abs(b))     # noqa: E731 — a float32 loss (megatron upcasts)
    holding = [r for r in ranks if r["loss"] is not None]
    if not holding:
        raise CaptureError("no rank's step returned a loss (step() returns it on the ranks that compute it)")
    if all(close(r["loss"], loss) for r in holding):
        return (), 1
    axes = [a for a in mesh if len({r["coords"][a] for r in holding}) == mesh[a] > 1]
    for k in range(1, len(axes) + 1):
        for subset in itertools.combinations(axes, k):
            sums: dict[tuple, float] = {}
            for r in holding:
                group = tuple((a, c) for a, c in r["coords"].items() if a not in subset)
                sums[group] = sums.get(group, 0.0) + r["loss"]
            size = math.prod(mesh[a] for a in subset)
            for scale in (1, size):
                if all(close(s, scale * loss) for s in sums.values()):
                    return subset, scale
    differ = tuple(a for a in axes if any(
        not close(r["loss"], q["loss"]) for r in holding for q in holding
        if all(r["coords"][b] == q["coords"][b] for b in mesh if b != a)))
    return differ, math.prod(mesh[a] for a in differ)


class _Step(torch.nn.Module):
    """The single-device model with the script's loss, its forward taking the batch tensors by name."""

    def __init__(self, model: torch.nn.Module, loss, names: list[str]):
        super().__init__()
        self.model, self.loss_fn, self.names = model, loss, names

    def forward(self, *tensors):
        return self.loss_fn(self.model, dict(zip(self.names, tensors)))


def _logical(script: ModuleType) -> tuple[Graph, float]:
    """The single-device step: the script's model and loss captured, its optimizer and clipping appended; and its
    loss at the initial weights."""
    torch.manual_seed(SEED)
    model = script.model()
    optimizer = _optimizer(script.optimizer(model.parameters()))
    torch.manual_seed(SEED + 1)
    whole = script.batch()
    names = list(whole)
    step = _Step(model, script.loss, names)
    step.forward.__func__.__signature__ = inspect.Signature(
        [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)] +
        [inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD) for n in names])
    with torch.no_grad():
        loss = float(step(*(whole[n] for n in names)))
    graph = capture_step(step, tuple(whole[n] for n in names), optim=optimizer, step_before=True,
                         clip=getattr(script, "CLIP", None), int_highs=getattr(script, "HIGHS", None))
    return _without_prefix(graph, "model."), loss


def _without_prefix(graph: Graph, prefix: str) -> Graph:
    """The graph with `prefix` dropped from every parameter's and buffer's name, alone or after a role (``grad/``,
    ``exp_avg/``, ``new/exp_avg/``), in inputs, args and outputs."""
    params = {s.name: s.name[len(prefix):] for s in graph.inputs if s.name.startswith(prefix)}

    def rename(name: str) -> str:
        head, sep, tail = name.rpartition("/")
        return head + sep + params.get(tail, tail)
    from dataclasses import replace
    return Graph(tuple(replace(s, name=rename(s.name)) for s in graph.inputs),
                 tuple(replace(n, args=tuple(rename(a) for a in n.args)) for n in graph.nodes),
                 tuple((rename(name), rename(value)) for name, value in graph.outputs), graph.name)


