"""Obligation keys: the SHA-256 of an obligation's formula, with rank and slot numbers made relative.

Two obligations with the same key are the same formula up to a renaming of
variables — which rank, microbatch or slice they came from is gone — so one
solve serves all of them (soundness rule 2: the key covers everything the
formula is built from, because it is computed from the formula itself).
`relative_names` renames each slot's atoms to slot-free names (element
indices relative to the smallest used, tensors numbered in their logical
order), so every data-parallel rank, microbatch and layer of a stage yields
the same key.
Data elements keep their one-hot structure: ``onehot:tokens[3,1]=2/4``
becomes ``onehot:t0[0,0]=2/4`` in a formula whose first token element is [3,1].
"""
from __future__ import annotations

import hashlib
from typing import Iterable, Mapping

from tv_ray.partition.ids import Part
from tv_ray.terms import Kind, Term, postorder
from tv_ray.terms.atom import Atom

KEY_VERSION = b"tv-ray-key/3"


def _slot_free(base) -> str:
    """A free or opaque base's text without its rank or group: a partial claim's part on any slot sorts as
    the same part."""
    return f"{base.cid.tensor}#{base.p}" if isinstance(base, Part) else str(base)


def relative_names(names: Iterable, order: Mapping[str, int]) -> dict:
    """Slot-free names for a formula's variables (each an `Atom` or a plain name): each tensor's element indices
    shifted so the smallest index it uses on each dimension is 0; logical tensors numbered in their logical
    order (the formula's earliest tensor t0, the next t1, ...: the same in every layer); other bases (free splits of partial sums, opaque
    values) numbered in the order of their text without the rank or group; plain names kept behind "=".
    Injective. Each name maps to its relative text and, for a one-hot indicator, its data element's."""
    atoms_, low, out = [], {}, {}
    for name in names:
        if not isinstance(name, Atom):
            out[name] = ("=" + name, None)
            continue
        atoms_.append(name)
        base, idx = name.base, name.idx
        low[base] = idx if base not in low else tuple(map(min, low[base], idx))
    logical = sorted((b for b in low if isinstance(b, str) and b in order), key=order.__getitem__)
    others = sorted((b for b in low if not (isinstance(b, str) and b in order)), key=lambda b: (_slot_free(b), str(b)))
    label = {b: f"t{i}" for i, b in enumerate(logical)} | {b: f"f{i}" for i, b in enumerate(others)}
    for name in atoms_:
        element = f"{label[name.base]}[{','.join(str(i - j) for i, j in zip(name.idx, low[name.base]))}]"
        if name.onehot is None:
            out[name] = (element, None)
        else:
            out[name] = (f"onehot:{element}={name.onehot[0]}/{name.onehot[1]}", element)
    if len({text for text, _ in out.values()}) != len(out):       # a renaming that merged two variables: unsound
        raise AssertionError(f"relative names are not injective: {sorted(map(str, out.items()))[:4]}")
    return out


def formula_key(lhs: list[Term], rhs: list[Term], order: Mapping[str, int] | None = None) -> str:
    """The key of the obligation ``lhs[i] == rhs[i] for every i`` (hex SHA-256).

    Variables get `relative_names` (`order`: the logical tensors' positions), then are renamed by first
    occurrence in a traversal whose order inside sums and products follows digests of the relative form,
    so neither which slot (rank, microbatch) nor which layer a stage came from changes its key. Digests are
    recomputed bottom-up with summands and factors sorted — the terms' own order follows the original
    names. Equal keys mean equal formulas up to an injective renaming and the order of summands and factors
    (SHA-256 over the full structure, never a truncated hash). One-hot indicators stay grouped by data
    element (``onehot:d0=2/4``)."""
    roots: list[Term] = []
    for left, right in zip(lhs, rhs):
        roots += [left, right]
    nodes = postorder(*roots)
    relative = relative_names((n.payload for n in nodes if n.kind is Kind.VAR), order or {})
    first = content_digests(nodes, lambda name: relative[name][0])
    alpha = _first_occurrence(roots, first, relative)
    final = content_digests(nodes, alpha.__getitem__)
    h = hashlib.sha256(KEY_VERSION + len(roots).to_bytes(8, "big"))
    for r in roots:
        h.update(final[r])
    return h.hexdigest()


def content_digests(nodes: list[Term], name_of) -> dict[Term, bytes]:
    """Each node's SHA-256 over its kind, payload (variables named by `name_of`) and children, summands and
    factors sorted."""
    digest: dict[Term, bytes] = {}
    sha = hashlib.sha256
    for node in nodes:
        kind = node.kind
        if kind is Kind.VAR:
            payload = name_of(node.payload).encode()
        elif kind is Kind.CONST:
            payload = f"{node.payload.numerator}/{node.payload.denominator}".encode()
        elif kind is Kind.ADD or kind is Kind.MUL:
            payload = b""
        else:
            payload = str(node.payload).encode()
        children = [digest[a] for a in node.args]
        if kind is Kind.ADD or kind is Kind.MUL:
            children.sort()
        digest[node] = sha(b"%d|%d|" % (int(kind), len(payload)) + payload + b"|%d|" % len(children)
                           + b"".join(children)).digest()
    return digest


def _first_occurrence(roots: list[Term], digest: dict[Term, bytes], relative: dict) -> dict:
    """v0, v1, ... (one-hot indicators: d0, d1, ... per data element) in order of first occurrence, visiting
    summands and factors in digest order (equal digests are equal subterms: their order does not matter)."""
    names: dict[str, str] = {}
    elements: dict[str, str] = {}
    seen: set[Term] = set()
    stack = list(reversed(roots))
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        if node.kind is Kind.VAR:
            element = relative[node.payload][1]
            if element is not None:         # a one-hot indicator: numbered by its data element
                v, n = node.payload.onehot
                elements.setdefault(element, f"d{len(elements)}")
                names[node.payload] = f"onehot:{elements[element]}={v}/{n}"
            else:
                names[node.payload] = f"v{len(names)}"
            continue
        children = list(node.args)
        if node.kind is Kind.ADD or node.kind is Kind.MUL:
            children.sort(key=digest.__getitem__)
        stack.extend(reversed(children))
    return names


__all__ = ["formula_key", "relative_names", "KEY_VERSION"]
