"""Obligation keys: the SHA-256 of an obligation's formula, with its variables renamed by first occurrence.

Two obligations with the same key are the same formula up to a renaming of
variables — which rank, microbatch or slice they came from is gone — so one
solve serves all of them (soundness rule 2: the key covers everything the
formula is built from, because it is computed from the formula itself). Data
elements keep their one-hot structure: ``onehot:tokens[3,1]=2/4`` becomes
``onehot:d0=2/4``.
"""
from __future__ import annotations

import hashlib

from tv_ray.terms import Kind, Term, postorder
from tv_ray.terms.onehot import PREFIX, is_indicator, parse

KEY_VERSION = b"tv-ray-key/1"


def formula_key(lhs: list[Term], rhs: list[Term]) -> str:
    """The key of the obligation ``lhs[i] == rhs[i] for every i`` (hex SHA-256)."""
    roots: list[Term] = []
    for left, right in zip(lhs, rhs):
        roots += [left, right]
    index: dict[Term, int] = {}
    names: dict[str, str] = {}
    bases: dict[str, str] = {}
    h = hashlib.sha256(KEY_VERSION)
    h.update(len(roots).to_bytes(8, "big"))
    for node in postorder(*roots):
        index[node] = len(index)
        payload = node.payload
        if node.kind is Kind.VAR:
            payload = _renamed(payload, names, bases)
        elif node.kind is Kind.CONST:
            payload = f"{payload.numerator}/{payload.denominator}"
        text = f"{int(node.kind)}|{payload}|{','.join(str(index[a]) for a in node.args)}\n"
        h.update(text.encode())
    h.update(",".join(str(index[r]) for r in roots).encode())
    return h.hexdigest()


def _renamed(name: str, names: dict[str, str], bases: dict[str, str]) -> str:
    if is_indicator(name):
        base, v, n = parse(name)
        if base not in bases:
            bases[base] = f"d{len(bases)}"
        return f"{PREFIX}{bases[base]}={v}/{n}"
    if name not in names:
        names[name] = f"v{len(names)}"
    return names[name]


__all__ = ["formula_key", "KEY_VERSION"]
