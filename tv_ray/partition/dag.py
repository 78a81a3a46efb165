"""The stage DAG: boundary inputs and stages as nodes, an edge from each claim a stage reads to the stage.

Stages kept in the instantiation map — mirrored ranks', microbatch copies —
are not nodes (they repeat their recorded stage's composition under
renaming); a recorded stage that reads such a claim has that claim's id as a
node without a stage (`Partition.representative` names the recorded stage it
stands for).
"""
from __future__ import annotations

from typing import Iterable

import networkx as nx

from tv_ray.errors import TvRayError


def stage_dag(boundary: Iterable[str], obligations) -> nx.DiGraph:
    """The DAG of `obligations` (each with `id` and `reads`) over the `boundary` input claims."""
    dag = nx.DiGraph()
    dag.add_nodes_from(boundary, kind="boundary")
    dag.add_nodes_from((ob.id for ob in obligations), kind="obligation")
    dag.add_edges_from((src, ob.id) for ob in obligations for src in ob.reads)
    return dag


def depths(obligations) -> dict[str, int]:
    """Each stage's depth in dataflow: its topological generation among the stages (a stage that reads no other
    stage is 0), so a stage comes after every stage it reads. Raises naming a cycle."""
    dag = stage_dag((), obligations)
    inner = dag.subgraph([ob.id for ob in obligations])
    try:
        return {cid: depth for depth, layer in enumerate(nx.topological_generations(inner)) for cid in layer}
    except nx.NetworkXUnfeasible:
        cycle = [u for u, _ in nx.find_cycle(inner)]
        raise TvRayError(f"the stage DAG has a cycle through {', '.join(map(str, cycle[:3]))}") from None


__all__ = ["stage_dag", "depths"]
