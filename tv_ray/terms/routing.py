"""Routing indicators: whether element p of a row is among its k largest, as an uninterpreted application.

A mixture-of-experts router picks each token's top-k experts from a row of
scores. Over the reals that choice is a step function of the whole row; the
symbolic domain writes it as the application ``topk_mask[k]:p(s0, …, sn-1)``
— one function per (k, p), of the row in order — so two sides that compute
equal rows (however they got them: a replicated router, scores gathered over
ranks) pick equal experts by congruence alone, for every row. Nothing else
about the function is assumed in a proof. The random-point refuter evaluates
it as the real top-k (the lower position first among equal values, as the
concrete rule), so its counterexamples route as the model does.
"""
from __future__ import annotations

import re
from typing import Sequence

from tv_ray.terms.term import Term, app

_NAME = re.compile(r"topk_mask\[(\d+)\]:(\d+)")


def selected(k: int, p: int, row: Sequence[Term]) -> Term:
    """δ(row[p] is among the k largest of `row`)."""
    return app(f"topk_mask[{k}]:{p}", *row)


def parse(name: str) -> tuple[int, int] | None:
    """(k, p) of a routing indicator's function name, else None."""
    found = _NAME.fullmatch(name)
    return (int(found[1]), int(found[2])) if found else None


def evaluate(k: int, p: int, values: Sequence) -> int:
    """1 if values[p] is among the k largest (ties: the lower position first), else 0."""
    order = sorted(range(len(values)), key=lambda i: (-values[i], i))
    return int(p in order[:k])


__all__ = ["selected", "parse", "evaluate"]
