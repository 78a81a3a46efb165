"""Claims: which logical slice (or partial sum) each physical tensor holds — boundary lineage, or inferred at a random point.

A claim says ``physical tensor t on rank r == logical T[offsets : offsets + t.shape]``,
or, with `partial` axes, that the sum of t over the rank's group along those
axes equals that slice. Program inputs and outputs take their claims from the
plan's boundary lineage. Every other float tensor is matched by value: the
plan and the logical graph run once, concretely, on the same random inputs
(float64, at the reduced dims), and a physical tensor that equals a slice of
a logical tensor — or whose group sum does — is claimed to. A claim found
this way is only a guess: it becomes an obligation and is proved like any
other. Tensors with no claim are interior to a stage.

Where the plan states intermediate lineage (``interior``, written by the
built-in parallelizer for every op output it laid out), those claims are
taken as stated (`given`) instead of matched — still only cut points: each is
proved like any other, and a false one is reported where it is false.

Matching prefers the logical node the physical op says it realises (meta
``realises``), then the earliest equal value in logical order (later equal
values are copies of it). With microbatch symmetry (`Blocks`), an op of
microbatch k ≥ 1 paired with one of microbatch 0 (`counterparts`) is first
offered that op's claim moved to block k, taken where it holds in every run
— the claim stage generation renames its stage by; else it is matched by
search like any other.
"""
from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass, field
from fractions import Fraction
from functools import partial
from typing import TYPE_CHECKING, Callable

import numpy as np

from tv_ray.errors import TvRayError
from tv_ray.execute import Scheduler, Stacked
from tv_ray.ir import Node, Op
from tv_ray.ir.ops import COMMUNICATION, VIEWS
from tv_ray.partition.layers import layer_counterparts, layer_images
from tv_ray.partition.microbatches import counterparts
from tv_ray.plan import Plan
from tv_ray.semantics import run_graph
from tv_ray.simulate import draw_inputs, masked, rank_inputs

if TYPE_CHECKING:
    from tv_ray.partition.symmetry import Blocks

RTOL = 1e-9
MOVES = VIEWS | COMMUNICATION | {Op.CLONE, Op.CAT, Op.CAST}     # ops that move values, computing none
ATOL = 1e-12
INPUT_SCALE = 0.25
CLAMP_SCALES = (0.5, 1.0, 2.0, 4.0, 8.0)    # the input scales `clamping_point` tries, in turn


@dataclass(frozen=True)
class Claim:
    """``tensor == scale · logical[offsets:offsets+shape]`` (summed over the group along `partial` axes)."""

    logical: str
    offsets: tuple[int, ...]
    shape: tuple[int, ...]
    partial: tuple[str, ...] = ()
    boundary: bool = False      # from the plan's lineage (an input: assumed; an output: required)
    given: bool = False         # from the plan's intermediate lineage (required, like an output)
    scale: Fraction | int = 1   # what the tensor (or its group's sum) carries: a rank's mean loss, dp × its part

    @staticmethod
    def of(plan: Plan, entry, rank: int, logical: str, shape: tuple[int, ...], **flags) -> "Claim":
        """The claim a lineage entry makes for `rank` on `logical` (of int `shape`)."""
        return Claim(logical, *region(plan, entry, rank, shape), scale=entry.scale, **flags)

    def shifted(self, dim: int, by: int) -> "Claim":
        """The same claim `by` elements further along `dim` (`dataclasses.replace`, without its cost: a
        mirrored run moves every claim of every mirrored rank, a renamed microbatch each of its cuts' — so not
        even a frozen dataclass's `__init__`, one `object.__setattr__` a field: its fields set at once)."""
        moved = object.__new__(Claim)
        moved.__dict__.update(self.__dict__)
        moved.__dict__["offsets"] = self.offsets[:dim] + (self.offsets[dim] + by,) + self.offsets[dim + 1:]
        return moved

    def on(self, logical: str) -> "Claim":
        """The same slice of the logical tensor `logical` (set at once, as `shifted`: a frontier plan's
        intermediate lineage makes millions)."""
        made = object.__new__(Claim)
        made.__dict__.update(self.__dict__)
        made.__dict__["logical"] = logical
        return made

    def slices(self) -> tuple:
        """The index of the slice (0-d tensors included: the result stays an array)."""
        return tuple(slice(o, o + n) for o, n in zip(self.offsets, self.shape)) + (Ellipsis,)

    def describe(self, full_shape: tuple[int, ...] | None = None) -> str:
        if full_shape is not None and tuple(self.shape) == tuple(full_shape):
            where = self.logical
        else:
            where = f"{self.logical}[{', '.join(f'{o}:{o + n}' for o, n in zip(self.offsets, self.shape))}]"
        where = where if self.scale == 1 else f"{self.scale} × {where}"
        return f"{where} (sum over {'×'.join(self.partial)})" if self.partial else where

    def to_json(self) -> dict:
        out = {"logical": self.logical, "offsets": list(self.offsets), "shape": list(self.shape)}
        if self.partial:
            out["partial"] = list(self.partial)
        if self.scale != 1:
            out["scale"] = str(self.scale)
        return out

    def value(self, full: np.ndarray) -> np.ndarray:
        """The claimed value, given the logical tensor's."""
        part = full[self.slices()]
        return part if self.scale == 1 else part * float(self.scale)


@dataclass
class ConcreteRun:
    """Every value of one concrete run: logical tensors by name, each rank's tensors, and the execution order."""

    dims: dict[str, int]
    logical: dict[str, np.ndarray]
    ranks: list[Mapping[str, np.ndarray]]          # one per rank (a `RunValues` of stacked runs)
    order: list[tuple[int, str]] = field(default_factory=list)   # (rank, tensor) as produced


def region(plan: Plan, entry, rank: int, shape: tuple[int, ...]) -> tuple[tuple, tuple, tuple]:
    """(offsets, shape, partial) of the slice a lineage entry gives `rank` of a logical tensor of `shape`."""
    bounds = plan.slice_bounds(entry, rank, shape)
    return tuple(a for a, _ in bounds), tuple(b - a for a, b in bounds), tuple(entry.partial)


def _on(selected: np.ndarray, ranks: np.ndarray | None) -> np.ndarray:
    return selected if ranks is None else selected & ranks


def input_claims(plan: Plan, logical_shapes: dict[str, tuple[int, ...]],
                 ranks: np.ndarray | None = None) -> dict[tuple[int, str], Claim]:
    """The claims the plan's input lineage makes, keyed by (rank, program input) (on `ranks`, a mask: all)."""
    names, ids = plan.rank_programs()
    claims: dict[tuple[int, str], Claim] = {}
    inputs = {name: {spec.name for spec in plan.programs[name].inputs} for name in names}
    for entry in plan.lineage:
        for rank in (int(r) for r in np.flatnonzero(_on(plan.selects(entry), ranks))):
            if entry.tensor in inputs[names[ids[rank]]]:
                claims[rank, entry.tensor] = Claim.of(plan, entry, rank, entry.logical, logical_shapes[entry.logical],
                                                      boundary=True)
    return claims


def output_claims(plan: Plan, logical_shapes: dict[str, tuple[int, ...]],
                  ranks: np.ndarray | None = None) -> dict[tuple[int, str], Claim]:
    """The claims the plan's output lineage requires, keyed by (rank, program tensor) (on `ranks`: all)."""
    names, ids = plan.rank_programs()
    out: dict[tuple[int, str], Claim] = {}
    value_of = plan.logical.output_map
    inputs = {name: {spec.name for spec in plan.programs[name].inputs} for name in names}
    outputs = {name: plan.programs[name].output_map for name in names}
    for entry in plan.lineage:
        tensor_name = value_of.get(entry.logical, entry.logical)
        for rank in (int(r) for r in np.flatnonzero(_on(plan.selects(entry), ranks))):
            name = names[ids[rank]]
            if entry.tensor in inputs[name]:
                continue
            tensor = outputs[name][entry.tensor]
            out[rank, tensor] = Claim.of(plan, entry, rank, tensor_name, logical_shapes[tensor_name], boundary=True)
    return out


def interior_claims(plan: Plan, logical_shapes: dict[str, tuple[int, ...]],
                    ranks: np.ndarray | None = None) -> dict[tuple[int, str], Claim]:
    """The claims the plan's intermediate lineage states, keyed by (rank, program tensor) (on `ranks`: all)."""
    return _Stated(plan, logical_shapes, ranks, None).made


class _Stated:
    """The claims of the plan's intermediate lineage (`made`), but for the entries of microbatch k's ops whose claim
    on every rank is their counterpart's moved to block k (with `blocks`): those are left to `Claims` (`moved`:
    program -> op of microbatch k -> (its counterpart, k); `unmade`: how many (rank, op) keys they stand for)."""

    def __init__(self, plan: Plan, logical_shapes, ranks: np.ndarray | None, blocks: "Blocks | None"):
        self.plan, self.shapes, self.ranks, self.blocks = plan, logical_shapes, ranks, blocks
        self.made: dict[tuple[int, str], Claim] = {}
        self.moved: dict[str, dict[str, tuple[str, int]]] = {}
        self.unmade = 0
        # a frontier plan's entries repeat a few splits (every layer's and microbatch's): each split's regions once,
        # as the ranks' region numbers and a claim on each region; an entry makes one claim per region (`Claim.on`,
        # shared by the ranks holding it: the tensor-parallel ranks of a replicated activation), not one per rank.
        # A split by its `where`, its slice (by identity: a loaded plan holds each distinct slice once, a plan built
        # here each region's once), partial axes and the logical shape.
        self.regions: dict[tuple, tuple[list[tuple[int, int]], list[Claim]]] = {}
        self.alike: dict[tuple, bool] = {}      # (slice of microbatch 0's entry, split of k's, k, tag) -> moved alike
        if blocks is not None:
            names, ids = plan.rank_programs()
            self.program_of = [names[i] for i in ids]
            self.pairs = {name: _pairs(plan.programs[name]) for name in set(names)}
            self.programs: dict[tuple, tuple[str, ...]] = {}     # an entry's `where` -> the programs of its ranks
            self.count = Counter(entry.tensor for entry in plan.interior)       # a tensor's entries
            self.entry_of = {entry.tensor: entry for entry in plan.interior}
        for entry in plan.interior:
            split = self._key(entry)
            where, slices = self._split(entry, split)
            if blocks is not None and self._moves(entry, split, where):
                continue
            made = [claim.on(entry.logical) for claim in slices]
            tensor = entry.tensor
            for rank, number in where:
                self.made[rank, tensor] = made[number]
        if blocks is not None:
            self._unstated()

    def _key(self, entry) -> tuple:
        return entry.where, id(entry.slice), entry.partial, entry.scale, self.shapes[entry.logical]

    def _split(self, entry, split: tuple) -> tuple[list[tuple[int, int]], list[Claim]]:
        found = self.regions.get(split)
        if found is None:
            plan, shape = self.plan, split[-1]
            where = [int(r) for r in np.flatnonzero(_on(plan.selects(entry), self.ranks))]
            places: dict[tuple, int] = {}
            numbers = [places.setdefault(region(plan, entry, rank, shape), len(places)) for rank in where]
            found = self.regions[split] = list(zip(where, numbers)), [Claim("", *place, given=True, scale=entry.scale)
                                                                for place in places]
        return found

    def _moves(self, entry, split: tuple, where: list[tuple[int, int]]) -> bool:
        """Is the entry, of an op of microbatch k, on every rank it selects its counterpart's entry moved to block k
        (then noted in `moved`)? Both must be their tensors' only entries, on the same logical tensor, ranks and
        partial axes, their regions moved alike (checked once per pair of splits)."""
        programs = self.programs.get(entry.where)
        if programs is None:
            programs = self.programs[entry.where] = tuple({self.program_of[rank]: None for rank, _ in where})
        if len(programs) != 1:
            paired = {self.pairs[name].get(entry.tensor) for name in programs}
            pair = paired.pop() if len(paired) == 1 else None
        else:
            pair = self.pairs[programs[0]].get(entry.tensor)
        if pair is None or self.count[entry.tensor] != 1:
            return False
        base, k = pair
        first = self.entry_of.get(base)
        if first is None or self.count[base] != 1 or first.logical != entry.logical or first.where != entry.where or \
                first.partial != entry.partial or first.scale != entry.scale:
            return False
        tag = self.blocks.tags.get(entry.logical)      # what moving reads of the logical tensor
        before = self._key(first)
        key = (before[1], split, k, tag)
        alike = self.alike.get(key)
        if alike is None:
            (where0, slices0), slices = self._split(first, before), self._split(entry, split)[1]
            on = entry.logical
            alike = self.alike[key] = [r for r, _ in where0] == [r for r, _ in where] and all(
                self.blocks.moves_to(slices0[n0].on(on), k, slices[n].on(on)) for (_, n0), (_, n) in zip(where0, where))
        if not alike:
            return False
        for name in programs:
            self.moved.setdefault(name, {})[entry.tensor] = pair
        self.unmade += len(where)
        return True

    def _unstated(self) -> None:
        """Microbatch k's ops that no entry states a claim for, nor their counterparts: none either way."""
        for name, pairs in self.pairs.items():
            moved = self.moved.setdefault(name, {})
            for op, pair in pairs.items():
                if op not in self.count and pair[0] not in self.count:
                    moved[op] = pair


def _pairs(program) -> dict[str, tuple[str, int]]:
    """Each float op of a microbatch k ≥ 1 → (its counterpart among microbatch 0's ops, k) (`counterparts`)."""
    mb = {node.name: node.get_meta("mb") for node in program.nodes if node.dtype == "float"}
    return {op: (base, mb[op]) for op, base in counterparts(program).items() if op in mb}


class Claims(MutableMapping):
    """Claims by (rank, program tensor), microbatch k's stated ones made when asked.

    A frontier plan's intermediate lineage states a claim for every op of every microbatch on every rank that is
    not mirrored (llama3-70b at dp=16,tp=8,pp=4,mb=32: 5 M), and microbatch k's entries are microbatch 0's renamed
    (`tv_ray.plan_repeats`). Where an entry gives every rank it selects exactly its counterpart's claim moved to
    block k (`Blocks.move`, checked once per pair of splits: `_Stated`), the claim is not made: `moved` maps the
    program's op to (its counterpart, k) and `get` moves the counterpart's claim when asked. Every other claim is
    in `made`. The table is the one made in full — `dict(claims)` makes it (tests/partition/test_claims.py) — and
    an op in `moved` holds, on every rank of its program, its counterpart's claim moved (no claim for both alike):
    what stage generation otherwise checks op by op (`Renamed._renamed_run`)."""

    def __init__(self, made: dict[tuple[int, str], Claim], moved: dict[str, dict[str, tuple[str, int]]] | None = None,
                 plan: Plan | None = None, blocks: "Blocks | None" = None, unmade: int = 0):
        self.made, self.moved, self.blocks, self.unmade = made, moved or {}, blocks, unmade
        self.program_of: list[str] = []
        self._of_rank = None            # rank -> its program's `moved`
        self._memo: dict[tuple[int, int], Claim] = {}     # (id of a claim in `made`, k) -> it moved to block k
        if self.moved:
            names, ids = plan.rank_programs()
            self.program_of = [names[i] for i in ids]
            self._of_rank = [self.moved.get(name, {}) for name in self.program_of]

    def __getstate__(self) -> dict:
        # the memo goes by object ids, which another process does not share; each rank's map is its program's
        return {**self.__dict__, "_memo": {}, "_of_rank": None}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        if self.moved:
            self._of_rank = [self.moved.get(name, {}) for name in self.program_of]

    def get(self, key: tuple[int, str], default=None):
        claim = self.made.get(key)
        if claim is not None or self._of_rank is None:
            return default if claim is None else claim
        pair = self._of_rank[key[0]].get(key[1])
        first = self.made.get((key[0], pair[0])) if pair is not None else None
        if first is None:
            return default
        memo = id(first), pair[1]               # a claim shared by ranks (a region's) is moved once
        claim = self._memo.get(memo)
        if claim is None:
            claim = self._memo[memo] = self.blocks.move(first, pair[1])
        return claim

    def __getitem__(self, key: tuple[int, str]) -> Claim:
        claim = self.get(key)
        if claim is None:
            raise KeyError(key)
        return claim

    def __contains__(self, key) -> bool:
        return self.get(key) is not None

    def __iter__(self):
        yield from self.made
        for rank, moved in enumerate(self._of_rank or ()):
            for op, (base, _) in moved.items():
                if (rank, base) in self.made:
                    yield rank, op

    def __len__(self) -> int:
        return len(self.made) + self.unmade

    def all_moved(self, program: str, ops) -> bool:
        """Does every op of `ops` (of `program`) hold its counterpart's claim moved, on every rank?"""
        moved = self.moved.get(program)
        return moved is not None and all(op in moved for op in ops)

    def kinds(self) -> Counter:
        """How many claims are boundary, stated (intermediate lineage) or inferred (matched by value)."""
        made = Counter("boundary" if c.boundary else "stated" if c.given else "inferred" for c in self.made.values())
        if self.unmade:
            made["stated"] += self.unmade
        return made

    def partial_axes(self) -> set[str]:
        """Every mesh axis some claim is a partial sum over (a moved claim's are its counterpart's)."""
        return {axis for claim in self.made.values() for axis in claim.partial}

    def __setitem__(self, key: tuple[int, str], claim: Claim) -> None:
        """Set a claim; the claims moved from the one it replaces, or beside it, stay as they were."""
        self.make_around([key])
        self._memo.clear()              # by the ids of claims in `made`: one of them may go
        self.made[key] = claim

    def __delitem__(self, key: tuple[int, str]) -> None:
        if self.pop(key) is None:
            raise KeyError(key)

    def pop(self, key: tuple[int, str], default=None):
        """Take a claim out (a refuted guess); the claims moved from it, or beside it, stay as they were."""
        self.make_around([key])
        self._memo.clear()
        return self.made.pop(key, default)

    def make_around(self, keys) -> None:
        """Make, and keep made, the moved claims of the ops of `keys` and of the ops moved from them, on every rank
        of their programs: a claim set or taken there by key must not change theirs."""
        if self._of_rank is None:
            return
        bases: dict[str, set[str]] = {}     # program -> the ops its moved ops are moved from
        for rank, tensor in keys:
            name = self.program_of[rank]
            moved = self.moved.get(name, {})
            if name not in bases:
                bases[name] = {base for base, _ in moved.values()}
            if tensor in moved:
                self._make(name, tensor)
            if tensor in bases[name]:
                for op in [op for op, (base, _) in moved.items() if base == tensor]:
                    self._make(name, op)

    def _make(self, program: str, op: str) -> None:
        base, k = self.moved[program].pop(op)
        for rank, name in enumerate(self.program_of):
            first = self.made.get((rank, base)) if name == program else None
            if first is not None:
                self.made[rank, op] = self.blocks.move(first, k)
                self.unmade -= 1


def stated_claims(plan: Plan, logical_shapes: dict[str, tuple[int, ...]], ranks: np.ndarray | None = None,
                  blocks: "Blocks | None" = None) -> Claims:
    """The claims of the plan's lineage alone, boundary and intermediate (on `ranks`: all); with `blocks`, microbatch
    k's intermediate ones made when asked where they are their counterparts' moved (`Claims`)."""
    inputs, outputs = input_claims(plan, logical_shapes, ranks), output_claims(plan, logical_shapes, ranks)
    stated = _Stated(plan, logical_shapes, ranks, blocks)
    claims = Claims(stated.made, stated.moved, plan, blocks, stated.unmade)
    claims.make_around(itertools.chain(inputs, outputs))     # a boundary claim overrides a stated one
    claims.made = {**inputs, **claims.made, **outputs}          # none asked for yet: no moved claim to forget
    return claims


def token_data(shape: tuple[int, ...], high: int, rng: np.random.Generator, digit: int | None) -> np.ndarray:
    """Integer data for claim runs: along the last axis each row steps from its own start modulo `high` (by a
    step coprime to `high`: no two of a row's first `high` positions hold equal ids — equal ids make some
    gradients exactly zero, and a zero tensor matches any slice). Random starts and random steps: a row's ids
    spread over the range, so a vocabulary split into contiguous shards has some in each (a vocabulary-parallel
    rank's partial embedding is not the whole one). A row longer than `high` repeats itself, so positions `high`
    apart hold equal ids in such a run. Digit runs, for `digit` k:

    - k = 0: every element holds its number modulo `high` — all elements distinct ids when there are no more of
      them than ids;
    - k ≥ 1: a row is cut into blocks of `high` positions, numbered through the whole tensor, and each block steps
      by 1 from the (k-1)-th base-`high` digit of its number: over k = 1, ..., D (D digits number every block)
      every two positions of a block differ, and so do every two blocks at the same position; k = D + 1 (every
      block's digit 0) tells positions apart.

    So every two elements differ in some run, and no slice of tokens matches another by value in every run (a
    context-parallel chunk of flattened tokens matched the rows `high` positions on), while in every run a row's
    first `high` positions hold distinct ids (runs numbering elements by digits alone had rows of one id: their
    attention gradients vanished, and llama3-tiny dp=4's lost 374 of its 2,438 claims at seq 2 and vocab 2)."""
    rows = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
    n = shape[-1] if shape else 1
    if digit == 0:
        return (np.arange(rows * n) % high).reshape(shape)
    if digit is not None:
        position = np.arange(n)
        block = np.arange(rows)[:, None] * -(-n // high) + position[None, :] // high
        return ((position[None, :] + block // high ** (digit - 1)) % high).reshape(shape)
    starts = rng.integers(0, high, size=rows)
    steps = rng.integers(1, max(high, 2), size=rows)
    while high > 1 and (bad := np.gcd(steps, high) != 1).any():
        steps[bad] = rng.integers(1, high, size=int(bad.sum()))
    return ((starts[:, None] + steps[:, None] * np.arange(n)[None, :]) % high).reshape(shape)


def digit_runs(shape: tuple[int, ...], high: int) -> int:
    """How many digit runs `token_data` needs for int data of this shape: 1 + D (+ 1 where a row holds more than
    one block)."""
    high = max(2, high)
    n = shape[-1] if shape else 1
    blocks, needed = int(np.prod(shape[:-1])) * -(-n // high), 1
    while high ** needed < blocks:
        needed += 1
    return 1 + needed + (n > high)


def logical_inputs(plan: Plan, dims: dict[str, int], seed: int = 0, digit: int | None = None, mask: bool = False,
                   scale: float = INPUT_SCALE) -> dict[str, np.ndarray]:
    """One random point of the logical step's inputs: int data from `token_data` (with `mask` a quarter of a
    masked target's elements ignored), floats drawn by `draw_inputs` times `scale` (small by default, so no
    softmax saturates and no gradient vanishes to 1e-19)."""
    rng = np.random.default_rng(seed)
    inputs = draw_inputs(plan.logical, dims, rng)
    for spec in plan.logical.inputs:
        if spec.dtype == "float" and not spec.positive and spec.role != "step":
            inputs[spec.name] = inputs[spec.name] * scale
        if spec.dtype == "int" and spec.high is not None and spec.role != "step":
            high = spec.high.eval(dims) if hasattr(spec.high, "eval") else int(spec.high)
            inputs[spec.name] = token_data(inputs[spec.name].shape, high, rng, digit)
            if mask and spec.ignore is not None:
                inputs[spec.name] = masked(inputs[spec.name], spec.ignore, rng)
    return inputs


def logical_point(plan: Plan, dims: dict[str, int], seed: int = 0, digit: int | None = None, mask: bool = False,
                  scale: float = INPUT_SCALE) -> dict[str, np.ndarray]:
    """The logical graph's every value at one random point (`logical_inputs`)."""
    return run_graph(plan.logical, dims, logical_inputs(plan, dims, seed, digit, mask, scale), keep=True)


def run_concrete(plan: Plan, dims: dict[str, int], seed: int = 0, digit: int | None = None,
                 mask: bool = False, scale: float = INPUT_SCALE,
                 logical: dict[str, np.ndarray] | None = None) -> tuple[ConcreteRun, dict[tuple[int, str], Claim]]:
    """Run the logical graph and every rank on one random point (`logical_point`), keeping all values; with
    `logical`, the logical graph's values at a point already run (the ranks take their inputs from them)."""
    if logical is None:
        logical = logical_point(plan, dims, seed, digit, mask, scale)
    in_claims = input_claims(plan, {name: value.shape for name, value in logical.items()})
    scheduler = Scheduler(plan, dims, rank_inputs(plan, logical), keep=True)
    scheduler.run()
    return ConcreteRun(dims, logical, [r.env for r in scheduler.ranks], scheduler.order), in_claims


def run_points(plan: Plan, dims: dict[str, int], points: list[dict[str, np.ndarray]]) -> list[ConcreteRun]:
    """`run_concrete` at each of several points (the logical graph's values there), every rank stepped once for all
    of them (`Stacked`); where that fails, run by run, so a failing plan's error is its run's own."""
    try:
        scheduler = Stacked(plan, dims, [rank_inputs(plan, logical) for logical in points], keep=True)
        scheduler.run()
    except (TvRayError, ArithmeticError, ValueError, IndexError, TypeError):
        return [run_concrete(plan, dims, logical=logical)[0] for logical in points]
    return [ConcreteRun(dims, logical, scheduler.unstacked(run), scheduler.order) for run, logical in enumerate(points)]


def clamps_passing(plan: Plan, values: dict[str, np.ndarray]) -> int:
    """How many of the logical step's clamps pass some element through at these logical values."""
    return sum(bool(((values[n.args[0]] < n.attr.get("max", np.inf)) &
                     (values[n.args[0]] > n.attr.get("min", -np.inf))).any())
               for n in plan.logical.nodes if n.op is Op.CLAMP)


def clamping_point(plan: Plan, dims: dict[str, int], seed: int,
                   default: dict[str, np.ndarray]) -> tuple[float, dict[str, np.ndarray]] | None:
    """The input scale (of `CLAMP_SCALES`, the smallest of those that do it for the most clamps) at which each of
    the logical step's clamps passes some element through, with the logical values there (seed `seed`) — where
    one clamps every element at the small default inputs (`default`: the logical values of a run made there):
    gradient clipping's coefficient min(1, max_norm / norm) is 1 while the gradients are small, so nothing before
    it shows at the outputs. None where the step has no clamp, or each passes something already, or none does at
    any of these scales."""
    clamps = sum(n.op is Op.CLAMP for n in plan.logical.nodes)
    if not clamps or (most := clamps_passing(plan, default)) == clamps:
        return None
    best = None
    for scale in CLAMP_SCALES:
        values = logical_point(plan, dims, seed, scale=scale)
        if (n := clamps_passing(plan, values)) > most:
            best, most = (scale, values), n
        if most == clamps:
            break
    return best


def group_value(run: ConcreteRun, members: tuple[int, ...], tensor: str) -> np.ndarray | None:
    """A tensor's value on one rank, or its sum over a group of ranks (None if a member lacks it)."""
    values = [run.ranks[m].get(tensor) for m in members]
    if any(v is None or v.shape != values[0].shape for v in values):
        return None
    return values[0] if len(values) == 1 else np.sum(values, axis=0)


class LogicalIndex:
    """Find logical tensors containing a value: all float logical elements sorted once (by value, then by tensor
    in `eligible` order and position)."""

    def __init__(self, values: dict[str, np.ndarray], eligible: list[str]):
        self.names = eligible
        self.values = values
        chunks = [values[name].astype(np.float64, copy=False).reshape(-1) for name in eligible]
        self.starts = np.cumsum([0] + [chunk.size for chunk in chunks])      # tensor i's elements from starts[i]
        allv = np.concatenate(chunks) if chunks else np.zeros(0)
        self.order = np.argsort(allv, kind="stable")
        self.sorted = allv[self.order]

    def near(self, x: float) -> list[tuple[str, int]]:
        """The (tensor, flat index) of up to 64 elements equal to `x` within the matching tolerance."""
        tol = RTOL * max(1.0, abs(x))
        lo = np.searchsorted(self.sorted, x - tol, "left")
        hi = np.searchsorted(self.sorted, x + tol, "right")
        at = self.order[lo:min(hi, lo + 64)]
        owners = np.searchsorted(self.starts, at, "right") - 1
        return [(self.names[i], int(k - self.starts[i])) for i, k in zip(owners.tolist(), at.tolist())]


def _anchor(value: np.ndarray) -> int | None:
    """The flat index of a distinctive element (not 0, ±1 or an integer), or None for a constant-looking tensor
    (or one without floats)."""
    if value.dtype.kind != "f" or value.size == 0:
        return None
    flat = value.reshape(-1)
    finite = np.isfinite(flat)
    ok = finite & (np.abs(np.where(finite, flat, 0) - np.round(np.where(finite, flat, 0))) > 1e-6)
    if not ok.any():
        return None
    candidates = np.flatnonzero(ok)
    return int(candidates[np.argmax(np.abs(flat[candidates]))])


def runs_for(plan: Plan, dims: dict[str, int], seed: int = 0) -> tuple[list[ConcreteRun], dict]:
    """One random run and enough digit runs (`token_data`) that every two elements of int data differ in one of
    them: the elements numbered, the digits of the blocks' numbers, and one more where a row holds more than one
    block; where targets are masked, one more random run with a quarter of them ignored (a fault that shows only
    on ignored targets is confirmed there, not left unknown); where a clamp of the step clamps every element at
    the small inputs (gradient clipping's coefficient), one more at larger inputs where it passes them
    (`clamping_point`: a fault on the clipping path changes the outputs there, so it is confirmed, not left
    unknown)."""
    first = logical_point(plan, dims, seed)
    digits = 0
    for spec in plan.logical.inputs:
        if spec.dtype == "int" and spec.high is not None:
            high = spec.high.eval(dims) if hasattr(spec.high, "eval") else int(spec.high)
            digits = max(digits, digit_runs(first[spec.name].shape, high))
    points = [first] + [logical_point(plan, dims, seed + 1 + k, digit=k) for k in range(digits)]
    if any(spec.ignore is not None for spec in plan.logical.inputs):
        points.append(logical_point(plan, dims, seed + 1 + digits, mask=True))
    if (clamping := clamping_point(plan, dims, seed + 2 + digits, first)) is not None:
        points.append(clamping[1])
    return run_points(plan, dims, points), input_claims(plan, {name: value.shape for name, value in first.items()})


def candidates(value: np.ndarray, at: int, index: LogicalIndex, only: str | None = None,
               scale: Fraction | int = 1) -> list[Claim]:
    """Every slice of a logical tensor (`only` that one) equal to `value` (at this run's point) — `scale` times it —,
    found by its element `at` (`_anchor`)."""
    pos = np.unravel_index(at, value.shape)
    found: list[Claim] = []
    for name, flat in index.near(float(value.reshape(-1)[at]) / float(scale)):
        if only is not None and name != only:
            continue
        full = index.values[name]
        if full.ndim != value.ndim:
            continue
        fpos = np.unravel_index(flat, full.shape)
        offsets = tuple(int(a - b) for a, b in zip(fpos, pos))
        if any(o < 0 or o + n > m for o, n, m in zip(offsets, value.shape, full.shape)):
            continue
        claim = Claim(name, offsets, tuple(value.shape), scale=scale)
        if _equal(claim.value(full), value):
            found.append(claim)
    return found


def _equal(a: np.ndarray, b: np.ndarray) -> bool:
    """`np.allclose(a, b, rtol=RTOL, atol=ATOL)` (equal infinities close, NaN never) at a third of its cost."""
    if a.shape != b.shape:
        return False
    with np.errstate(invalid="ignore"):
        return bool(((np.abs(a - b) <= ATOL + RTOL * np.abs(b)) & np.isfinite(b) | (a == b)).all())


class _Matcher:
    """Claims that hold in every run: the first run proposes, the others (other data) confirm.

    Reduced shapes make coincidences common (with a vocabulary of 2, batch rows
    that start with the same token are equal at position 0); a slice that is
    equal in runs with different data is the real correspondence.

    A value equal to no slice may be a multiple of one, in a plan whose lineage
    states such multiples (a data-parallel rank's mean loss: `_scales`); the
    plain claims are looked for first.
    """

    def __init__(self, plan: Plan, runs: list[ConcreteRun], eligible: list[str]):
        self.plan, self.runs = plan, runs
        self.scales = _scales(plan)
        self.index = [LogicalIndex(run.logical, eligible) for run in runs]
        self.order = {name: i for i, name in enumerate([s.name for s in plan.logical.inputs] +
                                                       [n.name for n in plan.logical.nodes])}
        self.nodes = {n.name: n for n in plan.logical.nodes}
        # (rank, tensor) whose values matched several claims, or in some run had no distinctive element
        self.ambiguous: set[tuple[int, str]] = set()

    def best(self, members: tuple[int, ...], tensor: str, prefer: str | None, node: Node | None = None,
             read: frozenset[str] = frozenset()) -> Claim | None:
        """The claim that holds in every run, proposed by any run (in some runs a value is degenerate: equal
        tokens make some gradients exactly zero for that data). Of several, the one on the tensor the op realises
        (`prefer`), else on a tensor the logical graph makes from more of the tensors the op's arguments are
        claims on (`read`), by the same op (`node`'s) — a clipped gradient equals the gradient itself wherever the
        clipping coefficient is 1, in every run for small gradients, but only the clipped one is a product of the
        gradient and the coefficient —, else the earliest."""
        values = [group_value(run, members, tensor) for run in self.runs]
        if any(v is None for v in values):
            return None
        anchors = [_anchor(v) for v in values]
        # replicas summed are the group's size times each: a multiple of a slice, but no split of one into parts
        plain = len(members) > 1 and self._replicas(members, tensor)
        # a claim on the tensor the op realises outranks any other: look there first
        best = self._found(values, anchors, prefer, plain) if prefer is not None else []
        if not best:
            found = self._found(values, anchors, plain=plain)
            if not found:
                if None in anchors:     # a run with nothing to match by: unsure
                    self.ambiguous.update((m, tensor) for m in members)
                return None
            rank = lambda c: (c.logical == prefer, *self._alike(c.logical, node, read),   # noqa: E731
                              -self.order.get(c.logical, -1))
            top = max(rank(c) for c in found)
            best = [c for c in found if rank(c) == top]
        if len(best) == 1:
            return best[0]
        self.ambiguous.update((m, tensor) for m in members)   # still ambiguous: leave it interior
        return None

    def _alike(self, logical: str, node: Node | None, read: frozenset[str]) -> tuple[int, bool]:
        """How like the physical `node` reading claims on `read` the logical tensor is: for an op that moves data
        (a view, a copy, a collective), whether it is one of those; for any other, how many of those its op reads;
        then whether it is the same op."""
        made = self.nodes.get(logical)
        if node is None:
            return 0, False
        if node.op in MOVES:
            return int(logical in read), made is not None and made.op == node.op
        if made is None:
            return 0, False
        return len(read.intersection(made.args)), made.op == node.op

    def holds(self, members: tuple[int, ...], tensor: str, claim: Claim) -> bool:
        """Does `claim` hold in every run?"""
        values = [group_value(run, members, tensor) for run in self.runs]
        return all(v is not None for v in values) and self._holds(values, claim)

    def _holds(self, values: list[np.ndarray], claim: Claim) -> bool:
        return all(_equal(claim.value(run.logical[claim.logical]), v) for run, v in zip(self.runs, values))

    def _replicas(self, members: tuple[int, ...], tensor: str) -> bool:
        """Do the members hold the same value in every run?"""
        for run in self.runs:
            first = run.ranks[members[0]].get(tensor)
            if not all(np.array_equal(run.ranks[m].get(tensor), first) for m in members[1:]):
                return False
        return True

    def _found(self, values: list[np.ndarray], anchors: list[int | None], only: str | None = None,
               plain: bool = False) -> list[Claim]:
        """The slices (of logical tensor `only`) some run proposes that hold in every run: plain ones, else (unless
        `plain`) the smallest multiple's."""
        for scale in (1,) if plain else (1, *self.scales):
            proposed: set[Claim] = set()
            for index, value, at in zip(self.index, values, anchors):
                if at is not None:
                    proposed.update(candidates(value, at, index, only, scale))
            found = [c for c in proposed if self._holds(values, c)]
            if found:
                return found
        return []


def _scales(plan: Plan) -> list[Fraction | int]:
    """The multiples a value may be of a slice: every divisor above 1 of a scale the plan's lineage states, or of
    a product of two (of its numerator; of its denominator, as a reciprocal) — `dp` for a rank's mean loss, the
    `dp / k` left of a gradient pre-divided by k, `dp × microbatches` for a pipeline's activation gradients (each
    microbatch's mean loss on each data-parallel rank). None in a plan that states none. Ints where they are (as
    lineage holds them)."""
    stated = {entry.scale for entry in (*plan.lineage, *plan.interior)} - {1}
    scales: set[Fraction | int] = set()
    for scale in stated | {a * b for a in stated for b in stated}:
        scale = Fraction(scale)
        scales.update(d for d in range(2, scale.numerator + 1) if scale.numerator % d == 0)
        scales.update(Fraction(1, d) for d in range(2, scale.denominator + 1) if scale.denominator % d == 0)
    return sorted(scales, key=lambda s: (abs(s - 1), s))


def _read(claims: dict[tuple[int, str], Claim], rank: int, node: Node) -> frozenset[str]:
    """The logical tensors an op's arguments on `rank` are claims on (those it has)."""
    return frozenset(c.logical for a in node.args if (c := claims.get((rank, a))) is not None)


def infer_claims(plan: Plan, runs: list[ConcreteRun], fixed: dict[tuple[int, str], Claim],
                 eligible: list[str], ranks: np.ndarray | None = None,
                 blocks: "Blocks | None" = None) -> dict[tuple[int, str], Claim]:
    """Claims for every float tensor a rank produces: boundary ones as given, others matched by value — on
    `ranks` (a mask; None: all), and for the groups those ranks are in.

    An op with a counterpart settled before it is first offered its counterpart's claim moved (`_Guides`):
    microbatch k's op microbatch 0's moved to block k (`blocks`: one block per microbatch, of dp rank 0, on every
    rank in `ranks`), layer j's op (microbatch 0's, or of none) the neighbouring layer's on the tensor at the same
    place (`tv_ray.partition.layers.layer_images`). A guess that holds in every run is the claim; one that does
    not is searched for alone, as any other op. An op whose counterpart has no claim is not searched, nor
    one whose counterpart's claim is whole over groups: it is left interior like its counterpart (microbatches
    and a transformer's layers compute alike: what the search did not find in one it does not find in the
    next)."""
    matcher = _Matcher(plan, runs, eligible)
    names, ids = plan.rank_programs()
    nodes: dict[str, dict[str, Node]] = {n: {node.name: node for node in plan.programs[n].nodes} for n in names}
    guides = _Guides(plan, names, blocks, runs[0].logical)
    claims = dict(fixed)
    unmatched: list[tuple[int, str]] = []
    follows: dict[tuple[int, str], tuple] = {}     # (rank, op) -> its counterpart and the move, looked at first
    settled: set[tuple[int, str]] = set()           # (rank, op) whose claim, or none, was decided alone
    for rank, tensor in runs[0].order:
        if (rank, tensor) in claims or (ranks is not None and not ranks[rank]):
            continue
        name = names[ids[rank]]
        node = nodes[name][tensor]
        if node.dtype != "float" or tensor not in runs[0].ranks[rank]:
            continue
        guide = guides.of(name, node)
        settled.add((rank, tensor))
        if guide is not None and (rank, guide[0]) in settled and (rank, guide[0]) not in matcher.ambiguous:
            follows[rank, tensor] = guide
            first = claims.get((rank, guide[0]))
            if first is None:           # unmatched alone: a group's part, maybe, like its counterpart's
                unmatched.append((rank, tensor))
                continue
            moved = guide[1](first)
            if not first.partial and moved is not None and matcher.holds((rank,), tensor, moved):
                claims[rank, tensor] = moved
                continue
        claim = matcher.best((rank,), tensor, node.get_meta("realises"), node, _read(claims, rank, node))
        if claim is not None:
            claims[rank, tensor] = claim
        else:
            unmatched.append((rank, tensor))
    axes = [a for a, n in plan.mesh if n > 1]
    subsets = [s for k in range(1, len(axes) + 1) for s in itertools.combinations(axes, k)]
    tried: set[tuple] = set()
    for rank, tensor in unmatched:
        if (rank, tensor) in claims:
            continue
        node = nodes[names[ids[rank]]][tensor]
        guide = follows.get((rank, tensor))
        if guide is not None and (rank, guide[0]) not in matcher.ambiguous:
            first = claims.get((rank, guide[0]))
            if first is None or not first.partial:
                continue                # interior, like its counterpart (or its claim moved did not hold)
            members = tuple(plan.group(rank, first.partial))
            moved = guide[1](first)
            if moved is not None and not any((m, tensor) in claims for m in members) and \
                    matcher.holds(members, tensor, moved):
                for m in members:
                    claims[m, tensor] = moved
                continue
        for subset in subsets:
            members = tuple(plan.group(rank, subset))
            if (members, tensor) in tried or any((m, tensor) in claims for m in members):
                continue
            tried.add((members, tensor))
            claim = matcher.best(members, tensor, node.get_meta("realises"), node, _read(claims, rank, node))
            if claim is not None:
                for m in members:
                    claims[m, tensor] = Claim(claim.logical, claim.offsets, claim.shape, subset, scale=claim.scale)
                break
    return claims


class _Guides:
    """The counterpart an op's claim is first guessed from, and the move making the guess of that one's claim:
    microbatch 0's op for microbatch k's (`counterparts`; the claim moved to block k), else the neighbouring
    layer's op (`layer_counterparts`; the same slice of the tensor at the same place in the op's layer — of a
    tensor outside the layers, the very claim; only to a tensor of the same shape, given the `logical` values of a
    run)."""

    def __init__(self, plan: Plan, names: list[str], blocks: "Blocks | None", logical: dict[str, np.ndarray]):
        self.blocks = blocks
        self.microbatches = {n: counterparts(plan.programs[n]) for n in names} if blocks is not None else {}
        self.layers = {n: layer_counterparts(plan.programs[n]) for n in names}
        placed, images = layer_images(plan.logical)
        images = {x: y for x, y in images.items() if x in logical and y in logical and
                  logical[x].shape == logical[y].shape}
        self.images = {-1: images, 1: {y: x for x, y in images.items()}}    # by the counterpart's layer offset
        self.placed = placed

    def of(self, program: str, node: Node) -> tuple[str, Callable] | None:
        """(the counterpart, the move of its claim) of an op of `program`, or None for an op without one."""
        base = self.microbatches[program].get(node.name) if self.microbatches else None
        if base is not None:
            return base, partial(self.blocks.move, k=node.get_meta("mb"))
        paired = self.layers[program].get(node.name)
        return None if paired is None else (paired[0], partial(self._layer_move, self.images[paired[1]]))

    def _layer_move(self, images: dict[str, str], claim: Claim) -> Claim | None:
        if claim.logical not in self.placed:
            return claim                # a tensor outside the layers: every layer's
        image = images.get(claim.logical)
        return None if image is None else claim.on(image)


__all__ = ["Claim", "Claims", "stated_claims", "ConcreteRun", "run_concrete", "infer_claims", "output_claims", "interior_claims",
           "LogicalIndex", "candidates", "group_value"]
