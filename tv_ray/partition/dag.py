"""The stage DAG: boundary inputs and stages as nodes, an edge from each claim a stage reads to the stage.

Stages kept in the instantiation map — mirrored ranks', microbatch copies —
are not nodes (they repeat their recorded stage's composition under
renaming); a recorded stage that reads such a claim has that claim's id as a
node without a stage (`Partition.representative` names the recorded stage it
stands for).

The DAG is the stages' reads, walked by hand: a graph library's nodes and
edges cost about a kilobyte each — llama3-405b at dp=64,tp=8,pp=16,mb=16
records 526,178 stages, and their networkx DiGraph took the run from 13 to
past 20 GiB. networkx names a cycle only.
"""
from __future__ import annotations

from typing import Callable, Hashable, Iterable

import networkx as nx

from tv_ray.errors import StageCycle


def reads_of(obligations, rename: Callable[[Hashable], Hashable] | None = None) -> dict:
    """Each stage id -> the claims it reads (each renamed by `rename`, when given)."""
    reads: dict = {}
    for ob in obligations:
        reads.setdefault(ob.id, set()).update(ob.reads if rename is None else map(rename, ob.reads))
    return reads


def size(boundary: Iterable, obligations) -> tuple[int, int]:
    """(nodes that are not boundary inputs, edges) of the DAG of `obligations` over `boundary`."""
    boundary = set(boundary)
    reads = reads_of(obligations)
    nodes = set(reads).union(*reads.values()) if reads else set()
    return len(nodes - boundary), sum(len(srcs) for srcs in reads.values())


def generations(reads: dict) -> dict:
    """Each stage's depth in dataflow (`reads`: stage -> what it reads; a read that is no stage is a source): a
    stage that reads no other stage is 0, any other one more than the deepest stage it reads. Raises `StageCycle`."""
    waiting, readers, stages = {}, {}, reads.keys()
    for cid, srcs in reads.items():
        inner = srcs & stages
        waiting[cid] = len(inner)
        for src in inner:
            readers.setdefault(src, []).append(cid)
    depth = {cid: 0 for cid, n in waiting.items() if n == 0}
    ready = list(depth)
    while ready:
        cid = ready.pop()
        for reader in readers.get(cid, ()):
            depth[reader] = max(depth.get(reader, 0), depth[cid] + 1)
            waiting[reader] -= 1
            if waiting[reader] == 0:
                ready.append(reader)
    stuck = [cid for cid, n in waiting.items() if n]       # never ready: on a cycle, or read from one
    if stuck:
        inner = nx.DiGraph((src, cid) for cid in stuck for src in reads[cid] & waiting.keys() if waiting[src])
        members = [u for u, _ in nx.find_cycle(inner)]
        raise StageCycle(f"the stage DAG has a cycle through {', '.join(map(str, members[:3]))}", members=members)
    return depth


def depths(obligations) -> dict:
    """Each stage's topological generation among the stages (`generations`), so a stage comes after every stage
    it reads. Raises naming a cycle. (By hand, not networkx's `topological_generations` on a subgraph view: that
    took 5 of the 9 s of merging llama3-70b's 16-layer pipeline shards.)"""
    return generations(reads_of(obligations))


__all__ = ["reads_of", "size", "generations", "depths"]
