"""Microbatch repeats in a plan file: microbatch k's ops, and their intermediate lineage, written as microbatch 0's.

A plan unrolls its microbatches: every program holds each microbatch's copy of
the forward and backward ops, and the intermediate lineage one entry per copy,
so a frontier plan's file grew with the microbatches (llama3-405b at
dp=64,tp=8,pp=16,mb=16: 224 MB of JSON). In a file, a run of microbatch k's
ops that is microbatch 0's renamed is one *repeat* (docs/plan-format.md):

    {"repeat": "embedding.ids1@0", "count": 66, "mb": 3}          (in a program's ops)
    {"repeat": 1204, "count": 40, "mb": 3}                        (in interior)

The first stands for the `count` ops that start at the op named
`embedding.ids1@0` (an earlier op of the same program) renamed to microbatch
3: in its `out` and in every name of its `args`, each microbatch tag `@0` (an
`@0` not followed by a digit) reads `@3`, and a `meta.mb` of 0 reads 3. The
second stands for the `count` entries from index 1204 of the list (counting
what earlier repeats stood for), each with its tensor renamed so and each
fixed split factor ``{"index": 0, "of": M}`` (M the plan's microbatches) at
index 3. Everything else is copied as it is.

A loaded plan holds every op and entry a repeat stands for, made from the
parsed ones it copies (`nodes_of`, `expand_entries`: the same plan as parsing
the JSON that `expand` writes out, without that JSON; llama3-405b loads in
16.5 s against 26.0), so what is checked and verified is the plan with every
op written out — a repeat is notation, never an assumption. `compact` writes one only where its expansion is exactly
the ops or entries it replaces, so a microbatch that computes anything else
stays written out where it differs.
"""
from __future__ import annotations

import re
from typing import Any, Callable

from tv_ray.errors import PlanError
from tv_ray.ir import Node

FIELDS = ("repeat", "count", "mb")
_TAG = re.compile(r"@0(?![0-9])")
_ANY_TAG = re.compile(r"@([1-9][0-9]*)(?![0-9])")
MIN_RUN = 2          # shorter runs are written out: a repeat costs about what one op does


def rename(name: str, k: int) -> str:
    """`name` of microbatch 0 as microbatch k's: every tag `@0` as `@k`."""
    return _TAG.sub(f"@{k}", name)


def copy_op(op: dict, k: int) -> dict:
    """Op `op` (JSON) of microbatch 0 as microbatch k's."""
    out = dict(op)
    out["out"] = rename(op["out"], k)
    out["args"] = [rename(a, k) for a in op["args"]]
    meta = op.get("meta")
    if meta is not None and meta.get("mb") == 0:
        out["meta"] = {**meta, "mb": k}
    return out


def copy_entry(entry: dict, k: int, microbatches: int) -> dict:
    """Lineage entry `entry` (JSON) of microbatch 0's tensor as microbatch k's."""
    out = dict(entry)
    out["tensor"] = rename(entry["tensor"], k)
    if "slice" in entry:
        out["slice"] = [{**cut, "split": [{"index": k, "of": f["of"]} if _is_mb_factor(f, microbatches) else f
                                          for f in cut["split"]]} for cut in entry["slice"]]
    return out


def _is_mb_factor(factor: Any, microbatches: int) -> bool:
    return isinstance(factor, dict) and factor.get("index") == 0 and factor.get("of") == microbatches


# -- reading ----------------------------------------------------------------------------------
def expand(obj: Any) -> Any:
    """The plan object `obj` with every repeat written out (`obj` itself if it has none; else a copy, `obj`
    unchanged). Raises PlanError naming a malformed repeat by its place in the file."""
    if not isinstance(obj, dict):
        return obj
    microbatches = obj.get("microbatches", 1)
    out = obj
    programs = obj.get("programs")
    if isinstance(programs, dict):
        for name, program in programs.items():
            if isinstance(program, dict) and isinstance(program.get("ops"), list) and has_repeat(program["ops"]):
                if out is obj:
                    out = {**obj, "programs": dict(programs)}
                ops = _expand_ops(program["ops"], microbatches, f"programs.{name}.ops")
                out["programs"][name] = {**program, "ops": ops}
    interior = obj.get("interior")
    if isinstance(interior, list) and has_repeat(interior):
        out = {**out, "interior": expand_entries(interior, microbatches, "interior")}
    return out


def has_repeat(items: Any) -> bool:
    """Does the list `items` (a program's ops, interior lineage) hold a repeat?"""
    return isinstance(items, list) and any(isinstance(item, dict) and "repeat" in item for item in items)


def _repeat(item: dict, microbatches: Any, path: str, ref: type) -> tuple[Any, int, int]:
    unknown = sorted(set(item) - set(FIELDS))
    if unknown:
        raise PlanError(f"{path}.{unknown[0]}: unknown field {unknown[0]!r} of a repeat (known: {', '.join(FIELDS)})")
    start, count, k = item.get("repeat"), item.get("count"), item.get("mb")
    if not isinstance(start, ref) or isinstance(start, bool) or (ref is int and start < 0):
        what = "the name of an earlier op" if ref is str else "the index of an earlier entry"
        raise PlanError(f"{path}.repeat: expected {what}, got {start!r}")
    if not isinstance(count, int) or isinstance(count, bool) or count < 1:
        raise PlanError(f"{path}.count: expected an integer >= 1, got {count!r}")
    if not isinstance(k, int) or isinstance(k, bool) or not (isinstance(microbatches, int) and 1 <= k < microbatches):
        raise PlanError(f"{path}.mb: expected a microbatch in [1, {microbatches}), got {k!r}")
    return start, count, k


def _expand(items: list, path: str, microbatches: Any, ref: type, first: Callable[[Any, str], int],
            copy: Callable[[Any, int, str], Any], record: Callable[[Any, int], None],
            literal: Callable[[Any, str], Any] = lambda item, where: item) -> list:
    """`items` with each repeat written out: an item as `literal(item, its path)` makes it, a repeat as `copy`
    makes each item it copies (`first`: where the copied run starts; `record`: each item as it is placed)."""
    out: list = []
    for i, item in enumerate(items):
        if not (isinstance(item, dict) and "repeat" in item):
            item = literal(item, f"{path}[{i}]")
            record(item, len(out))
            out.append(item)
            continue
        where = f"{path}[{i}]"
        start, count, k = _repeat(item, microbatches, where, ref)
        at = first(start, where)
        if at + count > len(out):
            raise PlanError(f"{where}.count: {count} from {start!r} runs past what comes before the repeat "
                            f"({len(out) - at} there)")
        for source in out[at:at + count]:
            made = copy(source, k, where)
            record(made, len(out))
            out.append(made)
    return out


def _expand_ops(ops: list, microbatches: Any, path: str) -> list:
    def copy(op: Any, k: int, where: str) -> dict:
        if not (isinstance(op, dict) and isinstance(op.get("out"), str) and isinstance(op.get("args"), list)
                and all(isinstance(a, str) for a in op["args"])):
            raise PlanError(f"{where}: repeats an op that is not {{out, op, args, ...}}: {op!r}")
        _tagged(op["out"], where)
        return copy_op(op, k)

    first, record = _places(lambda op: op.get("out") if isinstance(op, dict) else None)
    return _expand(ops, path, microbatches, str, first, copy, record)


def nodes_of(microbatches: Any) -> Callable[[list, str], list[Node]]:
    """For `Graph.from_json`: a program's ops (JSON, repeats among them) as nodes — each op parsed, each node a
    repeat stands for made from the node it copies, renamed (`_expand_ops` then parsing, without the JSON)."""
    def nodes(ops: list, path: str) -> list[Node]:
        def copy(node: Node, k: int, where: str) -> Node:
            _tagged(node.name, where)
            meta = node.meta
            if ("mb", 0) in meta:
                meta = tuple((key, k) if key == "mb" and value == 0 else (key, value) for key, value in meta)
            return Node(rename(node.name, k), node.op, tuple(rename(a, k) for a in node.args), node.attrs,
                        node.shape, node.dtype, meta)
        first, record = _places(lambda node: node.name)
        return _expand(ops, path, microbatches, str, first, copy, record,
                       literal=lambda op, where: Node.from_json(op, where, PlanError))
    return nodes


def _places(name_of: Callable[[Any], str | None]) -> tuple[Callable, Callable]:
    """(`first`, `record`) of `_expand` for ops: where the op a repeat names was placed."""
    place: dict[str, int] = {}

    def record(op: Any, at: int) -> None:
        name = name_of(op)
        if isinstance(name, str):
            place.setdefault(name, at)

    def first(name: str, where: str) -> int:
        if name not in place:
            raise PlanError(f"{where}.repeat: no op {name!r} before the repeat")
        return place[name]
    return first, record


def _tagged(name: str, where: str) -> None:
    if not _TAG.search(name):
        raise PlanError(f"{where}: repeats op {name!r}, which has no microbatch tag @0 to rename")


def expand_entries(entries: list, microbatches: Any, path: str, literal: Callable[[Any, str], Any] | None = None,
                    rename_entry: Callable[[Any, int], Any] | None = None) -> list:
    """`entries` with each repeat written out; `literal` and `rename_entry` make and copy parsed entries (the
    default: JSON entries, `copy_entry`)."""
    def copy(entry: Any, k: int, where: str) -> Any:
        if rename_entry is not None:
            return rename_entry(entry, k)
        cuts = entry.get("slice", []) if isinstance(entry, dict) else None
        if not (isinstance(entry.get("tensor") if cuts is not None else None, str) and isinstance(cuts, list)
                and all(isinstance(cut, dict) and isinstance(cut.get("split"), list) for cut in cuts)):
            raise PlanError(f"{where}: repeats an entry that is not {{where, tensor, logical, slice}}: {entry!r}")
        return copy_entry(entry, k, microbatches)

    return _expand(entries, path, microbatches, int, lambda index, where: index, copy, lambda entry, at: None,
                   literal or (lambda entry, where: entry))


# -- writing ----------------------------------------------------------------------------------
def compact_ops(ops: list[dict], microbatches: int) -> list[dict]:
    """`ops` (JSON, every op written out) with each run of microbatch k's ops that is microbatch 0's renamed
    (`copy_op`) written as a repeat."""
    place = {op["out"]: i for i, op in enumerate(ops)}

    def base(i: int) -> tuple[int, int] | None:
        found = _ANY_TAG.search(ops[i]["out"])
        if found is None:
            return None
        k = int(found.group(1))
        at = place.get(ops[i]["out"][:found.start()] + "@0" + ops[i]["out"][found.end():])
        return None if at is None or k >= microbatches else (at, k)

    return _compact(ops, base, copy_op, lambda at: ops[at]["out"])


def compact_entries(entries: list[dict], microbatches: int) -> list[dict]:
    """Intermediate lineage entries (JSON) with each run that is microbatch 0's renamed (`copy_entry`) written as
    a repeat."""
    place = {(e["tensor"], tuple(sorted(e.get("where", {}).items()))): i for i, e in enumerate(entries)}

    def base(i: int) -> tuple[int, int] | None:
        entry = entries[i]
        found = _ANY_TAG.search(entry["tensor"])
        if found is None:
            return None
        k = int(found.group(1))
        tensor = entry["tensor"][:found.start()] + "@0" + entry["tensor"][found.end():]
        at = place.get((tensor, tuple(sorted(entry.get("where", {}).items()))))
        return None if at is None or k >= microbatches else (at, k)

    return _compact(entries, base, lambda e, k: copy_entry(e, k, microbatches), lambda at: at)


def _compact(items: list[dict], base: Callable[[int], tuple[int, int] | None], copy: Callable[[dict, int], dict],
             ref: Callable[[int], Any]) -> list[dict]:
    out: list[dict] = []
    i = 0
    while i < len(items):
        found = base(i)
        run = 0
        if found is not None:
            at, k = found
            while at + run < i and i + run < len(items) and copy(items[at + run], k) == items[i + run]:
                run += 1
        if run >= MIN_RUN:
            out.append({"repeat": ref(at), "count": run, "mb": k})
            i += run
        else:
            out.append(items[i])
            i += 1
    return out


__all__ = ["expand", "has_repeat", "nodes_of", "expand_entries", "compact_ops", "compact_entries", "rename", "copy_op", "copy_entry", "MIN_RUN"]
