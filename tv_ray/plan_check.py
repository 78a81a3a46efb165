"""Plan validation: every rule of docs/plan-format.md, checked per program and per lineage entry.

`check_plan(plan)` raises a one-line `PlanError` starting with the JSON path
of the first problem. Work is organised so a plan of 8,192 ranks costs about
what its ~16 distinct programs cost: programs are type-checked once each; lineage is
checked per (entry, program) pair, with the ranks an entry selects held as a
numpy mask; coverage of logical outputs is computed on intervals.
"""
from __future__ import annotations

import contextlib
from collections import defaultdict
from typing import Iterable, Iterator

import numpy as np

from tv_ray.errors import GraphError, PlanError, TvRayError
from tv_ray.ir import Expr, Graph, Node
from tv_ray.ir.ops import ATTRS, COMMUNICATION, RANK_DEPENDENT
from tv_ray.plan import Fixed, Lineage, Plan
from tv_ray.processes import Forked, gc_paused
from tv_ray.semantics import Context, check_graph

# Ops that name mesh axes; none of them may appear in the logical graph.
_MESH_OPS = COMMUNICATION | RANK_DEPENDENT
assert all("axes" in ATTRS[op] or "peer" in ATTRS[op] for op in _MESH_OPS)


class _Sizes:
    """Shape expressions evaluated at one dims table, memoised (a plan repeats a few hundred expressions)."""

    def __init__(self, dims: dict[str, int]):
        self.dims = dims
        self._memo: dict[Expr, int] = {}
        self._shapes: dict[int, tuple] = {}     # id(shape) -> (shape, its sizes): microbatch copies share a shape

    def __call__(self, expr: Expr, path: str) -> int:
        value = self._memo.get(expr)
        if value is None:
            try:
                value = expr.eval(self.dims)
            except TvRayError as err:
                raise _error(path, str(err)) from None
            self._memo[expr] = value
        return value

    def shape(self, shape: Iterable[Expr], path: str) -> tuple[int, ...]:
        known = self._shapes.get(id(shape))
        if known is not None and known[0] is shape:
            return known[1]
        sizes = tuple(self(d, f"{path}[{i}]") for i, d in enumerate(shape))
        if type(shape) is tuple:
            self._shapes[id(shape)] = shape, sizes       # the shape held, so its id is not reused
        return sizes


def check_plan(plan: Plan, dims: dict[str, int] | None = None) -> None:
    """Validate `plan` (at `dims`, default the plan's own); raises PlanError naming the JSON path.

    Works alike on a loaded plan and on one constructed from `Graph` objects
    (``check_plan(Plan(format=FORMAT, model=..., ...))``, see `tv_ray.plan`).
    """
    sizes = _Sizes(dict(plan.dims) if dims is None else dict(dims))
    with gc_paused():
        _check_graph(plan, plan.logical, "logical", sizes, logical=True)
        for name, program in plan.programs.items():
            _check_graph(plan, program, f"programs.{name}", sizes, logical=False)
        plan.rank_programs()   # every rank runs a program that exists
        _LineageCheck(plan, sizes).run()


@contextlib.contextmanager
def checked_beside(plan: Plan) -> Iterator[None]:
    """`check_plan` of a plan made or read unchecked, in a forked process while the body goes on with the plan (a
    70B plan's check: 4–7 s on a core that would wait). On leaving, the check is waited for and its `PlanError`
    raised — also in place of an exception the body raised, since an invalid plan may break what reads it. The plan
    is checked here where no process may be forked or the forked one died without answering."""
    job = Forked(check_plan, plan) if Forked.possible() else None
    try:
        yield
    except Exception:
        _checked(job, plan)
        raise
    except BaseException:
        if job is not None:
            job.stop()
        raise
    _checked(job, plan)


def _checked(job: Forked | None, plan: Plan) -> None:
    if job is not None:
        try:
            return job.result()
        except ChildProcessError:
            pass
    check_plan(plan)


# -- graphs -----------------------------------------------------------------------------------
def _check_graph(plan: Plan, graph: Graph, path: str, sizes: _Sizes, logical: bool) -> None:
    for i, spec in enumerate(graph.inputs):
        sizes.shape(spec.shape, f"{path}.inputs[{i}].shape")
        if spec.high is not None:
            high = sizes(spec.high, f"{path}.inputs[{i}].high")
            if spec.ignore is not None and 0 <= spec.ignore < high:
                raise _error(f"{path}.inputs[{i}].ignore", f"ignore {spec.ignore} of {spec.name!r} lies in [0, high): "
                                                           f"a value the loss ignores must be no valid one")
        elif logical and spec.dtype == "int":
            raise _error(f"{path}.inputs[{i}].high", f"int input {spec.name!r} needs `high` "
                                                     f"(its values lie in [0, high))")
    mesh = plan.axis_sizes
    for i, node in enumerate(graph.nodes):   # node shapes are evaluated by check_graph, which names the node
        if node.op not in _MESH_OPS:
            continue
        if logical:
            raise _error(f"{path}.ops[{i}].op", f"{node.op} belongs to rank programs; the logical graph "
                                                f"is one device's step")
        attrs = node.attr
        axes = attrs.get("axes", ())
        for axis in axes + tuple(axis for axis, _ in attrs.get("peer", ())):
            if axis not in mesh:
                key = "axes" if axis in axes else "peer"
                raise _error(f"{path}.ops[{i}].attrs.{key}", f"axis {axis!r} is not in the mesh "
                                                             f"({', '.join(plan.axes)})")
        if len(set(axes)) != len(axes):
            raise _error(f"{path}.ops[{i}].attrs.axes", "an axis is listed twice")
    _check_nodes(plan, graph, path, sizes.dims, logical)


def _check_nodes(plan: Plan, graph: Graph, path: str, dims: dict[str, int], logical: bool) -> None:
    try:
        check_graph(graph, dims=dims, ctx=Context(plan.axis_sizes, {}), allow_comm=not logical)
    except GraphError as err:
        # an error about one op names it in `node`; a `check_names` error carries its own path in the message
        where = path if err.node is None or err.path is not None else \
            f"{path}.ops[{next(i for i, n in enumerate(graph.nodes) if n.name == err.node)}]"
        raise PlanError(f"{where}: {err}", path=where, node=err.node) from None
    except TvRayError as err:   # an input shape that does not evaluate at these dims, an op without rules
        raise _error(path, str(err)) from None


def _error(path: str, message: str) -> PlanError:
    """The one-line error of plan validation: ``<JSON path>: <message>``, the path also as a field."""
    return PlanError(f"{path}: {message}", path=path)


def _check_peers(plan: Plan) -> None:
    """Every send/recv peer offset lands inside the mesh for every rank that runs the program."""
    names, ids = plan.rank_programs()
    table, axes, mesh = plan.coord_table(), plan.axes, plan.axis_sizes
    for pid, name in enumerate(names):
        ranks = np.flatnonzero(ids == pid)
        if not len(ranks):
            continue
        for i, node in enumerate(plan.programs[name].nodes):
            for axis, offset in node.attr.get("peer", ()):
                target = table[ranks, axes.index(axis)] + offset
                outside = (target < 0) | (target >= mesh[axis])
                if outside.any():
                    rank = int(ranks[np.argmax(outside)])
                    raise _error(f"programs.{name}.ops[{i}].attrs.peer",
                                 f"{plan.describe(rank)} has no peer at {axis}{offset:+d} "
                                 f"({axis} has {mesh[axis]} positions)")


# -- lineage ------------------------------------------------------------------------------------
class _LineageCheck:
    """The lineage rules, per entry and per (entry, program); masks over ranks instead of rank loops."""

    def __init__(self, plan: Plan, sizes: _Sizes):
        self.plan, self.sizes = plan, sizes
        self.names, self.ids = plan.rank_programs()
        self.logical_shapes: dict[str, tuple[int, ...]] = {}
        for i, spec in enumerate(plan.logical.inputs):
            self.logical_shapes[spec.name] = sizes.shape(spec.shape, f"logical.inputs[{i}].shape")
        for out, value in plan.logical.outputs:
            self.logical_shapes.setdefault(out, sizes.shape(plan.logical.shape_of(value), f"logical.outputs.{out}"))
        self.logical_inputs = {spec.name: spec for spec in plan.logical.inputs}
        self.logical_outputs = dict(plan.logical.outputs)
        self._programs_of_where: dict[tuple, list[int]] = {}
        self._local: dict[tuple, tuple[int, ...]] = {}      # (where, logical shape, slice, partial) -> `split`

    def run(self) -> None:
        _check_peers(self.plan)
        by_tensor: dict[str, list[int]] = defaultdict(list)
        for i, entry in enumerate(self.plan.lineage):
            self.entry(f"lineage[{i}]", entry, self.logical_shapes)
            by_tensor[entry.tensor].append(i)
        self.inputs_have_one_entry(by_tensor)
        self.outputs_covered()
        if self.plan.interior:
            shapes = dict(self.logical_shapes)
            for node in self.plan.logical.nodes:
                shapes.setdefault(node.name, self.sizes.shape(node.shape, f"logical.ops: {node.name}.shape"))
            for i, entry in enumerate(self.plan.interior):
                self.entry(f"interior[{i}]", entry, shapes)

    def programs_selected(self, entry: Lineage) -> list[int]:
        if entry.where not in self._programs_of_where:
            self._programs_of_where[entry.where] = [int(p) for p in np.unique(self.ids[self.plan.selects(entry)])]
        return self._programs_of_where[entry.where]

    def entry(self, path: str, entry: Lineage, logical_shapes: dict[str, tuple[int, ...]]) -> None:
        check = self.entry_in_program if path.startswith("lineage") else self.interior_in_program
        if entry.logical in logical_shapes:
            # what is checked before the programs depends on these alone: a frontier plan's half million
            # intermediate entries have a few thousand of them
            key = (entry.where, logical_shapes[entry.logical], entry.slice, entry.partial)
            local = self._local.get(key)
            if local is None:
                local = self._local[key] = self.split(path, entry, logical_shapes)
        else:
            local = self.split(path, entry, logical_shapes)     # raises, naming it
        for pid in self.programs_selected(entry):
            check(path, entry, pid, local)

    def split(self, path: str, entry: Lineage, logical_shapes: dict[str, tuple[int, ...]]) -> tuple[int, ...]:
        """The shape of each rank's slice, once the entry's coordinates, split factors and partial axes are
        checked against the mesh and its logical tensor's shape."""
        plan, mesh = self.plan, self.plan.axis_sizes
        axes_text = ", ".join(plan.axes)
        for axis, coord in entry.where:
            if axis not in mesh:
                raise _error(f"{path}.where.{axis}", f"axis {axis!r} is not in the mesh ({axes_text})")
            if not 0 <= coord < mesh[axis]:
                raise _error(f"{path}.where.{axis}", f"coordinate {coord} is outside the mesh "
                                                     f"({axis} has {mesh[axis]} positions)")
        if entry.logical not in logical_shapes:
            what = "is not a tensor" if logical_shapes is not self.logical_shapes else \
                "is neither an input nor an output"
            raise _error(f"{path}.logical", f"{entry.logical!r} {what} of the logical graph")
        used: list[str] = []
        shape = list(logical_shapes[entry.logical])
        for j, (dim, factors) in enumerate(entry.slice):
            where = f"{path}.slice[{j}]"
            if dim >= len(shape):
                raise _error(f"{where}.dim", f"{entry.logical!r} has {len(shape)} dimensions, no dim {dim}")
            if any(d == dim for d, _ in entry.slice[:j]):
                raise _error(f"{where}.dim", f"dim {dim} is sliced twice")
            for k, factor in enumerate(factors):
                if isinstance(factor, str) and factor not in mesh:
                    raise _error(f"{where}.split[{k}]", f"axis {factor!r} is not in the mesh ({axes_text})")
                used += [factor] if isinstance(factor, str) else []
            chunks = plan.chunks(factors)
            if shape[dim] % chunks:
                raise _error(f"{where}.split", f"dim {dim} of {entry.logical!r} has size {shape[dim]}, "
                                               f"which does not split into {chunks} equal chunks")
            shape[dim] //= chunks
        for axis in entry.partial:
            if axis not in mesh:
                raise _error(f"{path}.partial", f"axis {axis!r} is not in the mesh ({axes_text})")
            if any(a == axis for a, _ in entry.where):
                raise _error(f"{path}.partial", f"axis {axis!r} is pinned by `where`; a partial group spans "
                                                f"the whole axis")
        used += list(entry.partial)
        for axis in set(used):
            if used.count(axis) > 1:
                raise _error(path, f"axis {axis!r} is used twice in the slice and partial axes")
        return tuple(shape)

    def interior_in_program(self, path: str, entry: Lineage, pid: int, local: tuple[int, ...]) -> None:
        """Intermediate lineage names a float op of the program, shaped like its slice."""
        name = self.names[pid]
        program = self.plan.programs[name]
        node = program.value(entry.tensor) if entry.tensor in program else None
        if not isinstance(node, Node):
            rank = int(np.argmax(self.plan.selects(entry) & (self.ids == pid)))
            raise _error(f"{path}.tensor", f"{self.plan.describe(rank)} runs {name!r}, which has no op "
                                           f"{entry.tensor!r}")
        have = self.sizes.shape(node.shape, f"programs.{name}: {entry.tensor}.shape")
        if have != local or node.dtype != "float" or self.plan.logical.dtype_of(entry.logical) != "float":
            raise _error(path, f"{entry.tensor!r} in program {name!r} is {node.dtype} {_fmt(have)}, but its "
                               f"slice of {entry.logical!r} is {self.plan.logical.dtype_of(entry.logical)} "
                               f"{_fmt(local)}")

    def entry_in_program(self, path: str, entry: Lineage, pid: int, local: tuple[int, ...]) -> None:
        name = self.names[pid]
        program = self.plan.programs[name]
        is_input = any(spec.name == entry.tensor for spec in program.inputs)
        if is_input:
            if entry.logical not in self.logical_inputs:
                raise _error(f"{path}.logical", f"program input {entry.tensor!r} of {name!r} must come from a "
                                                f"logical input; {entry.logical!r} is a logical output")
            if entry.partial:
                raise _error(f"{path}.partial", f"program input {entry.tensor!r} of {name!r} is a whole value, "
                                                f"not a partial sum")
            if entry.scale != 1:
                raise _error(f"{path}.scale", f"program input {entry.tensor!r} of {name!r} is its slice of "
                                              f"{entry.logical!r} itself, not a multiple of it")
            value = program.value(entry.tensor)
        elif entry.tensor in program.output_map:
            value = program.value(program.output_map[entry.tensor])
        else:
            rank = int(np.argmax(self.plan.selects(entry) & (self.ids == pid)))
            raise _error(f"{path}.tensor", f"{self.plan.describe(rank)} runs {name!r}, which has no input or "
                                           f"output {entry.tensor!r}")
        have = self.sizes.shape(value.shape, f"programs.{name}: {entry.tensor}.shape")
        if have != local:
            raise _error(path, f"{entry.tensor!r} in program {name!r} has shape {_fmt(have)}, but its slice of "
                               f"{entry.logical!r} has shape {_fmt(local)}")
        logical_dtype = (self.logical_inputs[entry.logical].dtype if entry.logical in self.logical_inputs
                         else self.plan.logical.dtype_of(self.logical_outputs[entry.logical]))
        if value.dtype != logical_dtype:
            raise _error(path, f"{entry.tensor!r} in program {name!r} is {value.dtype}, but "
                               f"{entry.logical!r} is {logical_dtype}")

    def inputs_have_one_entry(self, by_tensor: dict[str, list[int]]) -> None:
        """Every program input on every rank running the program has exactly one entry."""
        lineage = self.plan.lineage
        counted: dict[tuple, np.ndarray] = {}
        for pid, name in enumerate(self.names):
            runs = self.ids == pid
            if not runs.any():
                continue
            for k, spec in enumerate(self.plan.programs[name].inputs):
                entries = by_tensor.get(spec.name, [])
                key = (pid, tuple(sorted(lineage[i].where for i in entries)))
                if key not in counted:
                    count = np.zeros(self.plan.num_ranks, dtype=np.int64)
                    for i in entries:
                        count += self.plan.selects(lineage[i])
                    counted[key] = count
                bad = runs & (counted[key] != 1)
                if bad.any():
                    rank = int(np.argmax(bad))
                    coords = self.plan.coords(rank)
                    found = [f"lineage[{i}]" for i in entries
                             if all(coords[a] == c for a, c in lineage[i].where)]
                    what = "no lineage entry" if not found else f"{len(found)} lineage entries ({', '.join(found)})"
                    raise _error(f"programs.{name}.inputs[{k}]",
                                 f"{self.plan.describe(rank)} has {what} for input {spec.name!r}; "
                                 f"each program input needs exactly one")

    def outputs_covered(self) -> None:
        """Each logical output is covered, element by element, by the output slices of some ranks."""
        by_logical: dict[str, list[Lineage]] = defaultdict(list)
        for entry in self.plan.lineage:
            if entry.logical in self.logical_outputs and entry.logical not in self.logical_inputs:
                by_logical[entry.logical].append(entry)
        for out in self.logical_outputs:
            shape = self.logical_shapes[out]
            gap = _first_gap(self.plan, shape, by_logical.get(out, []))
            if gap is not None:
                held = "no output lineage entry names it" if not by_logical.get(out) else \
                    f"no rank holds {out}[{', '.join(f'{a}:{b}' for a, b in gap)}]"
                raise _error(f"logical.outputs.{out}", f"not covered by output lineage ({held}); "
                                                       f"shape {_fmt(shape)}")


def _fmt(shape: tuple[int, ...]) -> str:
    return "(" + ", ".join(map(str, shape)) + ("," if len(shape) == 1 else "") + ")"


def _chunk_indices(plan: Plan, entry: Lineage, factors: tuple) -> np.ndarray:
    """The chunk indices of one split dimension over all ranks `entry` selects (mixed radix)."""
    pinned = dict(entry.where)
    index = np.zeros(1, dtype=np.int64)
    for factor in factors:
        if isinstance(factor, Fixed):
            values = np.array([factor.index])
        elif factor in pinned:
            values = np.array([pinned[factor]])
        else:
            values = np.arange(plan.axis_sizes[factor])
        index = (index[:, None] * plan.factor_size(factor) + values[None, :]).ravel()
    return index


def _first_gap(plan: Plan, shape: tuple[int, ...], entries: list[Lineage]) -> tuple | None:
    """The first box of `shape` that no entry's slices cover, or None if all is covered.

    Each entry covers a Cartesian product of per-dimension chunk sets (its axes
    are distinct and the mesh is a full grid), so coverage is decided on the
    grid of elementary intervals cut by every entry's chunk boundaries.
    """
    if any(size == 0 for size in shape):
        return None
    if not entries:
        return tuple((0, size) for size in shape)
    cuts = [{0, size} for size in shape]
    per_entry = []
    for entry in entries:
        split = dict(entry.slice)
        intervals = []
        for dim, size in enumerate(shape):
            if dim in split:
                chunk = size // plan.chunks(split[dim])
                starts = _chunk_indices(plan, entry, split[dim]) * chunk
                cuts[dim].update(starts.tolist())
                cuts[dim].update((starts + chunk).tolist())
                intervals.append((starts, starts + chunk))
            else:
                intervals.append((np.array([0]), np.array([size])))
        per_entry.append(intervals)
    edges = [np.array(sorted(c)) for c in cuts]
    covered = np.zeros(tuple(len(e) - 1 for e in edges), dtype=bool)
    for intervals in per_entry:
        masks = []
        for dim, (starts, stops) in enumerate(intervals):
            cells = edges[dim][:-1]
            masks.append(((cells[:, None] >= starts[None, :]) & (cells[:, None] < stops[None, :])).any(axis=1))
        covered[np.ix_(*masks)] = True
    if covered.all():
        return None
    cell = np.unravel_index(int(np.argmin(covered)), covered.shape)
    return tuple((int(edges[d][c]), int(edges[d][c + 1])) for d, c in enumerate(cell))
