"""The plan: a distributed training step — device mesh, rank programs, rank→program map, boundary lineage.

The file format is `docs/plan-format.md` (`tv-ray-plan/1`). `Plan.load` and
`Plan.from_json` parse and validate a plan completely (`tv_ray.plan_check`);
every error is a `PlanError` whose message starts with the JSON path::

    >>> plan = Plan.load("llama3-tiny.plan.json")
    >>> plan.num_ranks, plan.program_of(5), plan.coords(5)
    (8, 'stage1', {'pp': 1, 'dp': 0, 'tp': 1})
    >>> plan.group(5, ["tp"])
    [4, 5]

A parallelizer builds a plan from objects, with no JSON round trip, and then
validates it with the same checks `Plan.load` runs::

    >>> plan = Plan(format=FORMAT, model="llama3-8b", dims={"batch": 512, "seq": 8192},
    ...             mesh=(("pp", 4), ("dp", 16), ("tp", 8)), microbatches=32, schedule="1f1b",
    ...             logical=logical_graph, programs={"stage0": g0, "stage1": g1, "stage2": g2, "stage3": g3},
    ...             ranks=RankMap("stage{pp}"), lineage=(Lineage((), "x", "x", ((0, ("dp",)),)), ...))
    >>> check_plan(plan)          # from tv_ray.plan_check; raises PlanError naming the JSON path
    >>> plan.save("llama3-8b.plan.json")

`dims` is a dict, `mesh` a tuple of (axis, size) pairs in rank order, `programs`
a dict of name → `Graph`, `lineage` a tuple of `Lineage`. Error paths name the
programs as the JSON file would (``programs.stage1.ops[12]``), and a plan that
passes `check_plan` saves to a file that `Plan.load` accepts.

Reading, checking and writing pause Python's cyclic garbage collector
(`gc_paused`); a caller building a plan of ~10^6 ops can do the same.

Ranks are numbered row-major over the mesh axes in their listed order (the
last axis varies fastest). Mesh-wide questions (which program each rank runs,
which ranks an entry selects) are answered with numpy arrays over all ranks,
so a plan of 8,192 ranks is validated per program and per lineage entry, not
per rank.
"""
from __future__ import annotations

import contextlib
import gzip
import io
import itertools
import json
import shutil
import string
import zlib
from dataclasses import dataclass, field, replace
from fractions import Fraction
from functools import lru_cache, reduce
from json.encoder import c_make_encoder, encode_basestring_ascii
from operator import mul
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

import numpy as np

from tv_ray.errors import PlanError
from tv_ray.ir import Graph, Node
from tv_ray.processes import gc_paused
from tv_ray.plan_repeats import compact, compact_nodes, expand_entries, nodes_of, rename

FORMAT = "tv-ray-plan/1"
GZIP_MAGIC = b"\x1f\x8b"
GZIP_LEVEL = 6          # llama3-8b dp=16,tp=8,pp=4,mb=32: see README "Benchmarks"
_FIELDS = ("format", "model", "dims", "mesh", "microbatches", "schedule", "logical", "programs", "ranks",
           "lineage", "interior", "recipe")
_OPTIONAL = {"microbatches": 1, "schedule": "none", "interior": [], "recipe": None}
_HEAD = ("format", "model", "dims", "mesh", "microbatches", "schedule", "recipe")     # written first (`Plan.header`)
RECIPE_FIELDS = ("optim", "clip", "tied", "masked", "parallel")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class Fixed:
    """A split factor at a fixed position: chunk `index` of `of` (``{"index": 0, "of": 2}``)."""

    index: int
    of: int


Factor = str | Fixed   # a mesh axis name (the rank's coordinate on it) or a fixed position


@dataclass(frozen=True)
class Lineage:
    """One boundary lineage entry: ``scale · logical[slice(rank)] == tensor`` (or the sum over `partial`).

    `where` selects ranks by mesh coordinates (empty = all ranks); `slice` lists
    the split dimensions as (dim, factors outer to inner); `partial` names the
    mesh axes whose group sums to the slice; `scale` (a positive rational, 1
    unless given) is the factor the tensor (or its group's sum) carries: a
    data-parallel rank's mean loss over its own samples is a partial sum over
    dp of `dp · loss`, its gradients before a pre-divided reduction likewise.
    """

    where: tuple[tuple[str, int], ...]
    tensor: str
    logical: str
    slice: tuple[tuple[int, tuple[Factor, ...]], ...] = ()
    partial: tuple[str, ...] = ()
    scale: Fraction | int = 1       # an int where it is one: a frontier plan hashes millions of entries' keys

    def to_json(self) -> dict:
        out: dict[str, Any] = {"where": dict(self.where), "tensor": self.tensor, "logical": self.logical}
        if self.slice:
            out["slice"] = [{"dim": dim, "split": [f if isinstance(f, str) else {"index": f.index, "of": f.of}
                                                   for f in factors]} for dim, factors in self.slice]
        if self.partial:
            out["partial"] = list(self.partial)
        if self.scale != 1:
            out["scale"] = int(self.scale) if self.scale.denominator == 1 else str(self.scale)
        return out

    def renamed(self, k: int, microbatches: int) -> "Lineage":
        """This entry of microbatch 0's tensor as microbatch k's (a repeat, `tv_ray.plan_repeats`): its tensor
        renamed, each fixed split factor {index 0, of `microbatches`} at index k."""
        return Lineage(self.where, rename(self.tensor, k), self.logical, _renamed_slice(self.slice, k, microbatches),
                       self.partial, self.scale)

    @staticmethod
    def from_json(obj: Any, path: str) -> "Lineage":
        if not isinstance(obj, dict):
            raise PlanError(f"{path}: expected an object with where, tensor, logical, slice, partial, scale")
        _no_unknown(obj, ("where", "tensor", "logical", "slice", "partial", "scale"), path)
        where = obj.get("where", {})
        if not isinstance(where, dict) or not all(_is_int(v) for v in where.values()):
            raise PlanError(f"{path}.where: expected an object mapping mesh axes to coordinates")
        for key in ("tensor", "logical"):
            if not isinstance(obj.get(key), str) or not obj[key]:
                raise PlanError(f"{path}.{key}: expected a tensor name")
        raw_slice = obj.get("slice", [])
        if not isinstance(raw_slice, list):
            raise PlanError(f"{path}.slice: expected a list of {{dim, split}} objects")
        cuts = tuple(_cut_from_json(cut, f"{path}.slice[{i}]") for i, cut in enumerate(raw_slice))
        partial = obj.get("partial", [])
        if not isinstance(partial, list) or not all(isinstance(a, str) for a in partial):
            raise PlanError(f"{path}.partial: expected a list of mesh axis names")
        return Lineage(tuple(where.items()), obj["tensor"], obj["logical"], cuts, tuple(partial),
                       _scale_from_json(obj.get("scale", 1), f"{path}.scale"))


def _scale_from_json(raw: Any, path: str) -> Fraction | int:
    """A lineage scale: a positive integer or a "p/q" string."""
    try:
        if isinstance(raw, bool) or not isinstance(raw, (int, str)):
            raise ValueError
        scale = Fraction(raw)
    except (ValueError, ZeroDivisionError):
        raise PlanError(f"{path}: expected a positive integer or a fraction \"p/q\", got {raw!r}") from None
    if scale <= 0:
        raise PlanError(f"{path}: expected a positive scale, got {raw!r}")
    return int(scale) if scale.denominator == 1 else scale


@lru_cache(maxsize=1 << 16)     # a frontier plan's half million entries share a few hundred slices
def _renamed_slice(cuts: tuple, k: int, microbatches: int) -> tuple:
    """`Lineage.renamed`'s slice: each fixed split factor {index 0, of `microbatches`} at index k."""
    mb = Fixed(0, microbatches)
    return tuple((dim, tuple(Fixed(k, microbatches) if f == mb else f for f in factors)) for dim, factors in cuts)


def _cut_from_json(obj: Any, path: str) -> tuple[int, tuple[Factor, ...]]:
    if not isinstance(obj, dict):
        raise PlanError(f"{path}: expected {{\"dim\": d, \"split\": [...]}}")
    _no_unknown(obj, ("dim", "split"), path)
    if not _is_int(obj.get("dim")) or obj["dim"] < 0:
        raise PlanError(f"{path}.dim: expected a dimension number >= 0, got {obj.get('dim')!r}")
    split = obj.get("split")
    if not isinstance(split, list) or not split:
        raise PlanError(f"{path}.split: expected a non-empty list of mesh axes or {{index, of}} objects")
    factors: list[Factor] = []
    for j, factor in enumerate(split):
        where = f"{path}.split[{j}]"
        if isinstance(factor, str):
            factors.append(factor)
        elif isinstance(factor, dict) and set(factor) == {"index", "of"} and _is_int(factor["index"]) \
                and _is_int(factor["of"]):
            if not 0 <= factor["index"] < factor["of"]:
                raise PlanError(f"{where}: index {factor['index']} is not in [0, {factor['of']})")
            factors.append(Fixed(factor["index"], factor["of"]))
        else:
            raise PlanError(f"{where}: expected a mesh axis name or {{\"index\": i, \"of\": n}}, got {factor!r}")
    return obj["dim"], tuple(factors)


@dataclass(frozen=True)
class RankMap:
    """Which program each rank runs: a template over mesh coordinates, plus per-rank overrides."""

    template: str
    overrides: tuple[tuple[int, str], ...] = ()

    def fields(self) -> list[str]:
        """The mesh axes the template names (``"stage{pp}"`` → ``["pp"]``)."""
        return [name for _, name, _, _ in string.Formatter().parse(self.template) if name is not None]

    def to_json(self) -> dict:
        out: dict[str, Any] = {"program": self.template}
        if self.overrides:
            out["overrides"] = {str(rank): name for rank, name in self.overrides}
        return out


def _no_unknown(obj: dict, known: Iterable[str], path: str) -> None:
    unknown = sorted(set(obj) - set(known))
    if unknown:
        where = f"{path}.{unknown[0]}" if path else unknown[0]
        raise PlanError(f"{where}: unknown field {unknown[0]!r} (known: {', '.join(known)})")


@dataclass(frozen=True)
class Plan:
    """A distributed training step (see docs/plan-format.md).

    Read with `Plan.load` / `Plan.from_json` (parsed and validated), or construct
    from objects with the keyword call in the module docstring and then run
    `tv_ray.plan_check.check_plan(plan)`; the constructor itself checks nothing.
    """

    format: str
    model: str
    dims: dict[str, int]
    mesh: tuple[tuple[str, int], ...]
    microbatches: int
    schedule: str
    logical: Graph
    programs: dict[str, Graph]
    ranks: RankMap
    lineage: tuple[Lineage, ...]
    interior: tuple[Lineage, ...] = ()     # intermediate lineage: optional, proved like any claim, never assumed
    recipe: dict | None = None             # how the logical graph was captured from the built-in `model`, if it was
    _cache: dict = field(default_factory=dict, init=False, compare=False, repr=False)  # not copied by replace

    # -- the mesh ----------------------------------------------------------------
    @property
    def axes(self) -> tuple[str, ...]:
        return tuple(axis for axis, _ in self.mesh)

    @property
    def axis_sizes(self) -> dict[str, int]:
        return dict(self.mesh)

    @property
    def num_ranks(self) -> int:
        return reduce(mul, (size for _, size in self.mesh), 1)

    def stride(self, axis: str) -> int:
        """How far apart in rank number two ranks are whose `axis` coordinates differ by one (the rest alike)."""
        return int(np.prod([size for a, size in self.mesh][self.axes.index(axis) + 1:]))

    def coord_table(self) -> np.ndarray:
        """Every rank's mesh coordinates: an int array of shape (ranks, axes)."""
        if "coords" not in self._cache:
            sizes = [size for _, size in self.mesh]
            table = np.stack(np.unravel_index(np.arange(self.num_ranks), sizes), axis=1) if sizes \
                else np.zeros((1, 0), dtype=np.int64)
            table.setflags(write=False)
            self._cache["coords"] = table
        return self._cache["coords"]

    def coords(self, rank: int) -> dict[str, int]:
        """The mesh coordinates of `rank`, in mesh order (a new dict: the caller may change it)."""
        table = self._cache.get("coord_dicts")
        if table is None:
            table = self._cache["coord_dicts"] = [dict(zip(self.axes, map(int, row))) for row in self.coord_table()]
        if type(rank) is not int or not 0 <= rank < len(table):
            self._check_rank(rank)
            rank = int(rank)
        return dict(table[rank])

    def rank_of(self, coords: Mapping[str, int]) -> int:
        """The rank at `coords` (every mesh axis given)."""
        rank = 0
        for axis, size in self.mesh:
            if axis not in coords:
                raise PlanError(f"coordinates {dict(coords)} do not give mesh axis {axis!r}")
            if not 0 <= coords[axis] < size:
                raise PlanError(f"coordinate {axis}={coords[axis]} is outside the mesh ({axis} has {size})")
            rank = rank * size + coords[axis]
        return rank

    def describe(self, rank: int) -> str:
        """``rank 5 (pp=1, dp=0, tp=1)``: how messages name a rank."""
        return f"rank {rank} ({', '.join(f'{a}={c}' for a, c in self.coords(rank).items())})"

    def group(self, rank: int, axes: Iterable[str]) -> list[int]:
        """The ranks of `rank`'s group along `axes`, in group order (the first axis outermost)."""
        axes = tuple(axes)
        groups = self._cache.setdefault("groups", {})
        found = groups.get((rank, axes))
        if found is None:
            found = groups[rank, axes] = tuple(self._group(rank, axes))
        return list(found)

    def _group(self, rank: int, axes: tuple[str, ...]) -> list[int]:
        sizes = self.axis_sizes
        for axis in axes:
            if axis not in sizes:
                raise PlanError(f"axis {axis!r} is not in the mesh ({', '.join(self.axes)})")
        base = self.coords(rank)
        members = []
        for position in np.ndindex(*(sizes[a] for a in axes)):
            base.update(zip(axes, position))
            members.append(self.rank_of(base))
        return members

    def group_position(self, rank: int, axes: Iterable[str]) -> int:
        """`rank`'s position in its group along `axes` (mixed radix, first axis outermost)."""
        coords, sizes = self.coords(rank), self.axis_sizes
        position = 0
        for axis in axes:
            position = position * sizes[axis] + coords[axis]
        return position

    def _check_rank(self, rank: int) -> None:
        is_int = _is_int(rank) or isinstance(rank, np.integer)
        if not is_int or not 0 <= rank < self.num_ranks:
            raise PlanError(f"rank {rank} is not in the mesh (ranks 0..{self.num_ranks - 1})")

    # -- programs ------------------------------------------------------------------
    def rank_programs(self) -> tuple[tuple[str, ...], np.ndarray]:
        """(program names, index into them for every rank), resolving the template and the overrides.

        Raises PlanError naming the first rank whose program is not in `programs`.
        """
        if "programs" not in self._cache:
            self._cache["programs"] = self._resolve_programs()
        return self._cache["programs"]

    def _resolve_programs(self) -> tuple[tuple[str, ...], np.ndarray]:
        fields, sizes, axes = self.ranks.fields(), self.axis_sizes, self.axes
        for name in fields:
            if name not in sizes:
                raise PlanError(f"ranks.program: template field {{{name}}} is not a mesh axis "
                                f"({', '.join(axes)})")
        # One name per combination of the template's axes, not one format() per rank.
        combos = list(np.ndindex(*(sizes[f] for f in fields)))
        names = [self.ranks.template.format(**dict(zip(fields, combo))) for combo in combos]
        table = self.coord_table()
        combo_of_rank = np.zeros(self.num_ranks, dtype=np.int64)
        for name in fields:
            combo_of_rank = combo_of_rank * sizes[name] + table[:, axes.index(name)]
        missing = [i for i, name in enumerate(names) if name not in self.programs]
        overridden = np.zeros(self.num_ranks, dtype=bool)
        overridden[[rank for rank, _ in self.ranks.overrides]] = True
        bad = np.isin(combo_of_rank, missing) & ~overridden
        if bad.any():
            rank = int(np.argmax(bad))
            raise PlanError(f"ranks.program: {self.describe(rank)} runs {names[combo_of_rank[rank]]!r}, "
                            f"which is not in programs")
        for rank, name in self.ranks.overrides:
            if name not in self.programs:
                raise PlanError(f"ranks.overrides.{rank}: program {name!r} is not in programs")
        program_names = tuple(self.programs)
        index = {name: i for i, name in enumerate(program_names)}
        combo_ids = np.array([index.get(name, -1) for name in names], dtype=np.int64)
        ids = combo_ids[combo_of_rank]
        for rank, name in self.ranks.overrides:
            ids[rank] = index[name]
        ids.setflags(write=False)
        return program_names, ids

    def program_of(self, rank: int) -> str:
        """The name of the program `rank` runs."""
        self._check_rank(rank)
        names, ids = self.rank_programs()
        return names[ids[rank]]

    # -- lineage ---------------------------------------------------------------------
    def selects(self, entry: Lineage) -> np.ndarray:
        """Boolean mask over ranks: the ranks `entry.where` selects."""
        key = ("where", entry.where)
        if key not in self._cache:
            table, axes = self.coord_table(), self.axes
            mask = np.ones(self.num_ranks, dtype=bool)
            for axis, coord in entry.where:
                mask &= table[:, axes.index(axis)] == coord
            mask.setflags(write=False)
            self._cache[key] = mask
        return self._cache[key]

    def lineage_for(self, rank: int) -> tuple[Lineage, ...]:
        """The lineage entries whose `where` selects `rank`."""
        coords = self.coords(rank)
        return tuple(e for e in self.lineage if all(coords.get(a) == c for a, c in e.where))

    def factor_size(self, factor: Factor) -> int:
        return factor.of if isinstance(factor, Fixed) else self.axis_sizes[factor]

    def chunks(self, factors: Iterable[Factor]) -> int:
        """How many chunks a dimension split by `factors` is cut into."""
        return reduce(mul, (self.factor_size(f) for f in factors), 1)

    def slice_bounds(self, entry: Lineage, rank: int, shape: Iterable[int]) -> tuple[tuple[int, int], ...]:
        """(start, stop) per dimension of the logical tensor (of int `shape`) that `entry` gives `rank`."""
        coords = self.coords(rank)
        bounds = [(0, size) for size in shape]
        for dim, factors in entry.slice:
            index = 0
            for factor in factors:
                index = index * self.factor_size(factor) + (factor.index if isinstance(factor, Fixed)
                                                             else coords[factor])
            chunk = bounds[dim][1] // self.chunks(factors)
            bounds[dim] = (index * chunk, (index + 1) * chunk)
        return tuple(bounds)

    # -- JSON ----------------------------------------------------------------------------
    def to_json(self) -> dict:
        with gc_paused():
            return {**self._head_json(), "logical": self.logical.to_json(),
                    "programs": {name: graph.to_json() for name, graph in self.programs.items()},
                    "ranks": self.ranks.to_json(), "lineage": [e.to_json() for e in self.lineage],
                    **self._interior_json()}

    @staticmethod
    def from_json(obj: Any, check: bool = True) -> "Plan":
        """Parse a plan object and (unless `check=False`) validate all of it; raises PlanError."""
        with gc_paused():
            plan = _parse(obj)
            if check:
                from tv_ray.plan_check import check_plan
                check_plan(plan)
        return plan

    @staticmethod
    def load(path: str | Path, check: bool = True) -> "Plan":
        """Read and validate a plan file, plain or gzip-compressed (`save` to a name ending in `.gz`). Errors:
        ``plan.json: not valid JSON at line 3 column 9: …``. `check=False`: parsed only, validated by the caller
        (`tv_ray.plan_check.checked_beside`)."""
        try:
            raw = Path(path).read_bytes()
            text = (gzip.decompress(raw) if raw[:2] == GZIP_MAGIC else raw).decode()
        except OSError as err:
            raise PlanError(f"{path}: cannot read: {err.strerror or err}") from None
        except (EOFError, zlib.error, UnicodeDecodeError) as err:
            raise PlanError(f"{path}: not a plan file (neither JSON text nor gzip-compressed JSON): {err}") from None
        del raw
        with gc_paused():
            try:
                obj = json.loads(text)
            except json.JSONDecodeError as err:
                raise PlanError(f"{path}: not valid JSON at line {err.lineno} column {err.colno}: "
                                f"{err.msg}") from None
            del text
            return Plan.from_json(obj, check)

    def save(self, path: str | Path, repeats: bool = True) -> None:
        """Write the plan as JSON with one input, op or lineage entry per line (readable diffs); gzip-compressed
        when `path` ends in `.gz`. Each run of microbatch k's ops (and intermediate lineage) that is microbatch
        0's renamed is written as a repeat (`tv_ray.plan_repeats`; `repeats=False`: every op written out):
        llama3-405b at dp=64,tp=8,pp=16,mb=16 is 41 MB of JSON (219 MB written out), 2.2 MB compressed. The same plan
        gives the same bytes either way (no time stamp).

        The text is `dumps(...)` of `to_json()` with its repeats, written program by program.
        """
        with gc_paused(), open(path, "wb") as raw:
            sink = gzip_writer(raw) if str(path).endswith(".gz") else raw
            with io.TextIOWrapper(sink, encoding="utf-8", newline="") as out:
                out.writelines(_pieces(self._json_fields(repeats)))

    def _json_fields(self, repeats: bool) -> dict:
        """`to_json` with each program left as a function making its JSON, for `_pieces` to write one at a
        time."""
        def program(graph: Graph) -> Callable[[], dict]:
            def made() -> dict:
                if not repeats:
                    return graph.to_json()
                return graph.to_json(_written(graph.nodes, compact_nodes(graph.nodes, self.microbatches), Node.to_json))
            return made
        interior = None
        if repeats and self.interior:
            interior = _written(self.interior, compact(
                self.interior, self.microbatches, lambda e: (e.tensor, e.where),
                lambda e, k: e.renamed(k, self.microbatches), lambda at: at), Lineage.to_json)
        return {**self._head_json(), "logical": self.logical.to_json,
                "programs": {name: program(graph) for name, graph in self.programs.items()},
                "ranks": self.ranks.to_json(), "lineage": [e.to_json() for e in self.lineage],
                **self._interior_json(interior)}

    def _head_json(self) -> dict:
        """The fields written first, one line each, before the logical graph: what `header` reads."""
        head = {"format": self.format, "model": self.model, "dims": dict(self.dims), "mesh": dict(self.mesh),
                "microbatches": self.microbatches, "schedule": self.schedule}
        return head | ({"recipe": dict(self.recipe)} if self.recipe is not None else {})

    def _interior_json(self, interior: list | None = None) -> dict:
        """The intermediate lineage's JSON field, if the plan has any (`interior`: its JSON, if made already)."""
        if not self.interior:
            return {}
        return {"interior": interior if interior is not None else [e.to_json() for e in self.interior]}

    @staticmethod
    def header(path: str | Path) -> dict:
        """The fields a plan file writes before its logical graph (format, model, dims, mesh, microbatches,
        schedule, and the recipe where there is one), read without the rest of the file and as the plan reads
        them (a recipe's defaults filled in): what a fresh capture of the model needs, begun while the plan is
        read. {} where the file does not start so (an older or hand-written plan, not a plan at all) or those
        fields are not a plan's; the plan read in full is the one to trust, so callers compare."""
        try:
            with open(path, "rb") as raw:
                gzipped = raw.read(2) == GZIP_MAGIC
            lines = []
            with (gzip.open(path, "rt", encoding="utf-8") if gzipped else open(path, encoding="utf-8")) as text:
                if text.readline() != "{\n":
                    return {}
                for line in itertools.islice(text, len(_HEAD) + 1):      # the head, then the logical graph
                    if line.startswith(' "logical": '):
                        head = json.loads("{" + "".join(lines).rstrip().rstrip(",") + "}")
                        break
                    lines.append(line)
                else:
                    return {}
            _positive_ints(head.get("dims", {}), "dims", "dimension")
            if "recipe" in head:                # as the plan read in full has it (defaults filled in)
                head["recipe"] = _parse_recipe(head["recipe"])
        except (OSError, EOFError, zlib.error, UnicodeDecodeError, json.JSONDecodeError, PlanError):
            return {}
        return head


def gzip_writer(raw) -> gzip.GzipFile:
    """A gzip stream into the binary file `raw` with no file name or time stamp in its header: the same plan
    text, the same bytes (certificates and checkpoints name the plan by its hash)."""
    return gzip.GzipFile(fileobj=raw, mode="wb", compresslevel=GZIP_LEVEL, filename="", mtime=0)


def pack(source: str | Path, target: str | Path) -> None:
    """Copy the plan file `source` to `target` gzip-compressed (as it is, if it is already)."""
    with open(source, "rb") as src, open(target, "wb") as raw:
        packed = src.read(2) == GZIP_MAGIC
        src.seek(0)
        with contextlib.nullcontext(raw) if packed else gzip_writer(raw) as out:
            shutil.copyfileobj(src, out)


# -- parsing -------------------------------------------------------------------------------
def _parse(obj: Any) -> Plan:
    if not isinstance(obj, dict):
        raise PlanError(f"plan: expected a JSON object, got {type(obj).__name__}")
    _no_unknown(obj, _FIELDS, "")
    for key in _FIELDS:
        if key not in obj and key not in _OPTIONAL:
            raise PlanError(f"{key}: missing")
    if obj["format"] != FORMAT:
        raise PlanError(f"format: expected {FORMAT!r}, got {obj['format']!r}")
    if not isinstance(obj["model"], str):
        raise PlanError(f"model: expected a label (string), got {obj['model']!r}")
    dims = _positive_ints(obj["dims"], "dims", "dimension")
    mesh = _positive_ints(obj["mesh"], "mesh", "mesh axis")
    if not mesh:
        raise PlanError("mesh: expected at least one axis")
    microbatches = obj.get("microbatches", _OPTIONAL["microbatches"])
    if not _is_int(microbatches) or microbatches < 1:
        raise PlanError(f"microbatches: expected an integer >= 1, got {microbatches!r}")
    schedule = obj.get("schedule", _OPTIONAL["schedule"])
    if not isinstance(schedule, str):
        raise PlanError(f"schedule: expected a label (string), got {schedule!r}")
    logical = Graph.from_json(obj["logical"], "logical", "logical", PlanError)
    if not isinstance(obj["programs"], dict) or not obj["programs"]:
        raise PlanError("programs: expected an object mapping program names to programs")
    repeats = nodes_of(microbatches)
    programs = {name: Graph.from_json(prog, f"programs.{name}", name, PlanError, repeats)
                for name, prog in obj["programs"].items()}
    ranks = _parse_ranks(obj["ranks"], reduce(mul, mesh.values(), 1))
    if not isinstance(obj["lineage"], list):
        raise PlanError("lineage: expected a list of lineage entries")
    lineage = tuple(Lineage.from_json(e, f"lineage[{i}]") for i, e in enumerate(obj["lineage"]))
    raw_interior = obj.get("interior", _OPTIONAL["interior"])
    if not isinstance(raw_interior, list):
        raise PlanError("interior: expected a list of lineage entries")
    # each distinct slice parsed held once (a renamed one is, by `_renamed_slice`'s cache): a frontier plan's 10^5
    # entries repeat a few slices, and what reads them may key a slice by its identity (`tv_ray.partition.claims`)
    shared: dict[tuple, tuple] = {}

    def parsed(raw: Any, where: str) -> Lineage:
        entry = Lineage.from_json(raw, where)
        kept = shared.setdefault(entry.slice, entry.slice)
        return entry if kept is entry.slice else replace(entry, slice=kept)
    interior = tuple(expand_entries(raw_interior, microbatches, "interior", parsed,
                                    lambda entry, k: entry.renamed(k, microbatches)))
    return Plan(FORMAT, obj["model"], dims, tuple(mesh.items()), microbatches, schedule, logical, programs,
                ranks, lineage, interior, _parse_recipe(obj.get("recipe", _OPTIONAL["recipe"])))


def _parse_recipe(obj: Any) -> dict | None:
    if obj is None:
        return None
    if not isinstance(obj, dict):
        raise PlanError("recipe: expected an object with optim, clip, tied, parallel")
    _no_unknown(obj, RECIPE_FIELDS, "recipe")
    if not isinstance(obj.get("optim"), str):
        raise PlanError(f"recipe.optim: expected an optimizer name (sgd, adamw), got {obj.get('optim')!r}")
    clip = obj.get("clip")
    if clip is not None and (isinstance(clip, bool) or not isinstance(clip, (int, float)) or clip <= 0):
        raise PlanError(f"recipe.clip: expected a positive number or null, got {clip!r}")
    if obj.get("tied") not in (None, True, False):
        raise PlanError(f"recipe.tied: expected true, false or null, got {obj.get('tied')!r}")
    if obj.get("masked", False) not in (True, False):
        raise PlanError(f"recipe.masked: expected true or false, got {obj['masked']!r}")
    if not isinstance(obj.get("parallel", ""), str):
        raise PlanError(f"recipe.parallel: expected a parallel spec (text), got {obj['parallel']!r}")
    return {"optim": obj["optim"], "clip": clip, "tied": obj.get("tied"), "masked": obj.get("masked", False),
            "parallel": obj.get("parallel", "")}


def _positive_ints(obj: Any, path: str, what: str) -> dict[str, int]:
    if not isinstance(obj, dict):
        raise PlanError(f"{path}: expected an object mapping {what} names to sizes")
    for name, value in obj.items():
        if not name.isidentifier():
            raise PlanError(f"{path}.{name}: {what} name {name!r} is not an identifier")
        if not _is_int(value) or value < 1:
            raise PlanError(f"{path}.{name}: expected an integer >= 1, got {value!r}")
    return dict(obj)


def _parse_ranks(obj: Any, num_ranks: int) -> RankMap:
    if not isinstance(obj, dict):
        raise PlanError("ranks: expected {\"program\": template, \"overrides\": {rank: program}}")
    _no_unknown(obj, ("program", "overrides"), "ranks")
    template = obj.get("program")
    if not isinstance(template, str) or not template:
        raise PlanError("ranks.program: expected a program name or a template such as \"stage{pp}\"")
    try:
        RankMap(template).fields()
    except ValueError as err:
        raise PlanError(f"ranks.program: not a valid template: {err}") from None
    overrides = obj.get("overrides", {})
    if not isinstance(overrides, dict):
        raise PlanError("ranks.overrides: expected an object mapping rank numbers to program names")
    parsed = []
    for key, name in overrides.items():
        if not key.isdecimal() or not int(key) < num_ranks:
            raise PlanError(f"ranks.overrides.{key}: {key!r} is not a rank of the mesh (ranks 0..{num_ranks - 1})")
        if not isinstance(name, str):
            raise PlanError(f"ranks.overrides.{key}: expected a program name, got {name!r}")
        parsed.append((int(key), name))
    return RankMap(template, tuple(sorted(parsed)))


# -- writing --------------------------------------------------------------------------------
# How many levels of each top-level field are laid out one item per line; deeper is compact.
_EXPAND = {"logical": 2, "programs": 3, "lineage": 1, "interior": 1}


def dumps(obj: dict) -> str:
    """Plan JSON with one top-level field, input, op, output or lineage entry per line."""
    return "".join(_pieces(obj))


def _written(items: Sequence, plan: list[int | dict], to_json: Callable[[Any], dict]) -> list:
    """`items` as `compact` plans them: an index as that item's JSON (only those: most are repeats), a repeat as
    it is."""
    return [to_json(items[x]) if isinstance(x, int) else x for x in plan]


def _pieces(obj: dict) -> Iterator[str]:
    """The text of `dumps(obj)` in pieces. A value may be a function making it, called only when reached, so
    `Plan.save` never holds more than one program's JSON form."""
    compact = _compact_encoder()
    yield "{\n"
    for i, (key, value) in enumerate(obj.items()):
        yield (",\n " if i else " ") + compact(key) + ": "
        yield from _layout(value, _EXPAND.get(key, 0), 1, compact)
    yield "\n}\n"


def _layout(value: Any, depth: int, indent: int, compact: Callable[[Any], str]) -> Iterator[str]:
    if callable(value):
        value = value()
    if depth == 0 or not isinstance(value, (dict, list)) or not value:
        yield compact(value)
        return
    pad = ",\n" + " " * (indent + 1)
    if depth == 1:   # leaves: one string per list or object, not one per item
        if isinstance(value, dict):
            yield "{\n" + pad[2:] + pad.join(f"{compact(k)}: {compact(v)}" for k, v in value.items()) + "}"
        else:
            yield "[\n" + pad[2:] + pad.join(map(compact, value)) + "]"
        return
    if isinstance(value, dict):
        yield "{\n"
        for i, (k, v) in enumerate(value.items()):
            yield f"{pad if i else pad[2:]}{compact(k)}: "
            yield from _layout(v, depth - 1, indent + 1, compact)
        yield "}"
    else:
        yield "["
        for i, v in enumerate(value):
            yield pad if i else "\n" + pad[2:]
            yield from _layout(v, depth - 1, indent + 1, compact)
        yield "]"


def _compact_encoder() -> Callable[[Any], str]:
    """``json.dumps(value, separators=(", ", ": "))`` for one write: the C encoder made once,
    not per op (a fifth of the cost of json.dumps on a plan's 10^6 small objects)."""
    encoder = json.JSONEncoder(separators=(", ", ": "))
    if c_make_encoder is None:
        return encoder.encode
    encode = c_make_encoder({}, encoder.default, encode_basestring_ascii, None, encoder.key_separator,
                            encoder.item_separator, False, False, True)
    return lambda value: "".join(encode(value, 0))
