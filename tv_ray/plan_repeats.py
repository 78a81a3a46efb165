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
parsed ones it copies (`nodes_of`, `expand_entries`; llama3-405b loads in
16.5 s against 26.0 when the copies were parsed from JSON written out), so
what is checked and verified is the plan with every op written out — a repeat
is notation, never an assumption. The writer (`compact`) renames with the very
functions the loader uses (`renamed_node`, `Lineage.renamed`) and writes a
repeat only where that gives exactly the ops or entries it replaces, so a
saved plan loads as itself, and a microbatch that computes anything else stays
written out where it differs.
"""
from __future__ import annotations

import re
from typing import Any, Callable, Hashable, Sequence

from tv_ray.errors import PlanError
from tv_ray.ir import Node

FIELDS = ("repeat", "count", "mb")
_TAG = re.compile(r"@0(?![0-9])")
_ANY_TAG = re.compile(r"@([1-9][0-9]*)(?![0-9])")
MIN_RUN = 2          # shorter runs are written out: a repeat costs about what one op does


def rename(name: str, k: int) -> str:
    """`name` of microbatch 0 as microbatch k's: every tag `@0` as `@k`."""
    at = name.find("@0")
    if at < 0:                          # a weight, an input
        return name
    end = at + 2
    if (end == len(name) or not name[end].isdigit()) and "@0" not in name[end:]:    # one tag: most names
        return f"{name[:at]}@{k}{name[end:]}"
    return _TAG.sub(f"@{k}", name)


def renamed_node(node: Node, k: int) -> Node:
    """Op `node` of microbatch 0 as microbatch k's: its name and arguments renamed, a `meta.mb` of 0 as k."""
    meta = node.meta
    if ("mb", 0) in meta:               # meta keys are unique: one item to replace
        at = meta.index(("mb", 0))
        meta = (*meta[:at], ("mb", k), *meta[at + 1:])
    return node.renamed(rename(node.name, k), tuple(rename(a, k) for a in node.args), meta)


# -- reading ----------------------------------------------------------------------------------
def _repeat(item: dict, microbatches: int, path: str, ref: type) -> tuple[Any, int, int]:
    unknown = sorted(set(item) - set(FIELDS))
    if unknown:
        raise PlanError(f"{path}.{unknown[0]}: unknown field {unknown[0]!r} of a repeat (known: {', '.join(FIELDS)})")
    start, count, k = item.get("repeat"), item.get("count"), item.get("mb")
    if not isinstance(start, ref) or isinstance(start, bool) or (ref is int and start < 0):
        what = "the name of an earlier op" if ref is str else "the index of an earlier entry"
        raise PlanError(f"{path}.repeat: expected {what}, got {start!r}")
    if not isinstance(count, int) or isinstance(count, bool) or count < 1:
        raise PlanError(f"{path}.count: expected an integer >= 1, got {count!r}")
    if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k < microbatches:
        raise PlanError(f"{path}.mb: expected a microbatch in [1, {microbatches}), got {k!r}")
    return start, count, k


def _expand(items: list, path: str, microbatches: int, ref: type, first: Callable[[Any, str], int],
            copy: Callable[[Any, int, str], Any], record: Callable[[Any, int], None],
            literal: Callable[[Any, str], Any]) -> list:
    """`items` with each repeat written out: an item as `literal(item, its path)` parses it, a repeat as `copy`
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


def nodes_of(microbatches: int) -> Callable[[list, str], list[Node]]:
    """For `Graph.from_json`: a program's ops (JSON, repeats among them) as nodes — each op parsed, each node a
    repeat stands for made from the node it copies (`renamed_node`)."""
    def nodes(ops: list, path: str) -> list[Node]:
        place: dict[str, int] = {}

        def record(node: Node, at: int) -> None:
            place.setdefault(node.name, at)

        def first(name: str, where: str) -> int:
            if name not in place:
                raise PlanError(f"{where}.repeat: no op {name!r} before the repeat")
            return place[name]

        def copy(node: Node, k: int, where: str) -> Node:
            if not _TAG.search(node.name):
                raise PlanError(f"{where}: repeats op {node.name!r}, which has no microbatch tag @0 to rename")
            return renamed_node(node, k)

        return _expand(ops, path, microbatches, str, first, copy, record,
                       lambda op, where: Node.from_json(op, where, PlanError))
    return nodes


def expand_entries(entries: list, microbatches: int, path: str, parse: Callable[[Any, str], Any],
                   renamed: Callable[[Any, int], Any]) -> list:
    """Lineage `entries` (JSON, repeats among them) parsed (`parse(entry, its path)`), each entry a repeat stands
    for made from the entry it copies (`renamed(entry, k)`: `Lineage.renamed`)."""
    return _expand(entries, path, microbatches, int, lambda index, where: index,
                   lambda entry, k, where: renamed(entry, k), lambda entry, at: None, parse)


# -- writing ----------------------------------------------------------------------------------
def compact(items: Sequence, microbatches: int, named: Callable[[Any], tuple[str, Hashable]],
            renamed: Callable[[Any, int], Any], ref: Callable[[int], Any]) -> list[int | dict]:
    """`items` (a program's nodes, lineage entries; every one written out) as the indices of those written as
    they are and, for each run of microbatch k's items that is microbatch 0's renamed (`renamed`, the loader's
    own renaming), a repeat naming its first item by `ref(index)`. `named(item)`: its tensor's name and what else
    tells it from another item of that name (the entry's `where`)."""
    place = {}
    for i, item in enumerate(items):
        place.setdefault(named(item), i)
    out: list[int | dict] = []
    i = 0
    while i < len(items):
        name, rest = named(items[i])
        found = _ANY_TAG.search(name)
        at = place.get((name[:found.start()] + "@0" + name[found.end():], rest)) if found else None
        k = int(found.group(1)) if found else 0
        run = 0
        if at is not None and k < microbatches:
            while at + run < i and i + run < len(items) and renamed(items[at + run], k) == items[i + run]:
                run += 1
        if run >= MIN_RUN:
            out.append({"repeat": ref(at), "count": run, "mb": k})
            i += run
        else:
            out.append(i)
            i += 1
    return out


def compact_nodes(nodes: Sequence[Node], microbatches: int) -> list[int | dict]:
    """`compact` for a program's nodes: a repeat names the op its run starts at."""
    return compact(nodes, microbatches, lambda node: (node.name, None), renamed_node, lambda at: nodes[at].name)


__all__ = ["rename", "renamed_node", "nodes_of", "expand_entries", "compact", "compact_nodes",
           "MIN_RUN"]
