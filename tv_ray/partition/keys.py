"""Obligation keys: the SHA-256 of an obligation's formula, with rank and slot numbers made relative.

Two obligations with the same key are the same formula up to a renaming of
variables — which rank, microbatch or slice they came from is gone — so one
solve serves all of them (soundness rule 2: the key covers everything the
formula is built from, because it is computed from the formula itself).
`relative_names` renames each slot's atoms to slot-free names (element
indices relative to the smallest used, tensors by relative logical order), so
every data-parallel rank and microbatch of a stage yields the same key.
Data elements keep their one-hot structure: ``onehot:tokens[3,1]=2/4``
becomes ``onehot:t0[0,0]=2/4`` in a formula whose first token element is [3,1].
"""
from __future__ import annotations

import functools
import hashlib
import re
from typing import Iterable, Mapping

from tv_ray.terms import Kind, Term, postorder
from tv_ray.terms.onehot import PREFIX, is_indicator, parse

KEY_VERSION = b"tv-ray-key/2"


_ATOM = re.compile(r"^(?P<pre>onehot:)?(?P<base>.*)\[(?P<idx>\d+(?:,\d+)*)?\](?P<post>=\d+/\d+)?$")
_SLOT = re.compile(r"^(?:[rg][\d,]+/)")        # the rank / group prefix of a free or opaque atom's base


@functools.lru_cache(maxsize=1 << 20)
def _parse(name: str) -> tuple[str, str, tuple[int, ...], str] | None:
    m = _ATOM.match(name)
    if m is None:
        return None
    idx = tuple(int(i) for i in m["idx"].split(",")) if m["idx"] else ()
    return m["pre"] or "", m["base"], idx, m["post"] or ""


def relative_names(names: Iterable[str], order: Mapping[str, int]) -> dict[str, str]:
    """Slot-free names for a formula's variables: each tensor's element indices shifted so the smallest index
    it uses on each dimension is 0; logical tensors numbered by their logical order relative to the earliest
    one the formula reads; other bases (free splits of partial sums, opaque values) numbered in the order of
    their names without the rank or group prefix; other names kept behind "=". Injective."""
    parsed, low, out = {}, {}, {}
    for name in names:
        p = _parse(name)
        if p is None:
            out[name] = "=" + name
            continue
        parsed[name] = p
        base, idx = p[1], p[2]
        low[base] = idx if base not in low else tuple(map(min, low[base], idx))
    logical = [b for b in low if b in order]
    first = min((order[b] for b in logical), default=0)
    others = sorted((b for b in low if b not in order), key=lambda b: (_SLOT.sub("", b), b))
    label = {b: f"t{order[b] - first}" for b in logical} | {b: f"f{i}" for i, b in enumerate(others)}
    for name, (pre, base, idx, post) in parsed.items():
        out[name] = f"{pre}{label[base]}[{','.join(str(i - j) for i, j in zip(idx, low[base]))}]{post}"
    if len(set(out.values())) != len(out):       # a renaming that merged two variables would be unsound
        raise AssertionError(f"relative names are not injective: {sorted(out.items())[:4]}")
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
    first = content_digests(nodes, relative.__getitem__)
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


def _first_occurrence(roots: list[Term], digest: dict[Term, bytes], relative: dict[str, str]) -> dict[str, str]:
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
            name = relative[node.payload]
            if is_indicator(name):
                element, v, n = parse(name)
                elements.setdefault(element, f"d{len(elements)}")
                names[node.payload] = f"{PREFIX}{elements[element]}={v}/{n}"
            else:
                names[node.payload] = f"v{len(names)}"
            continue
        children = list(node.args)
        if node.kind is Kind.ADD or node.kind is Kind.MUL:
            children.sort(key=digest.__getitem__)
        stack.extend(reversed(children))
    return names


__all__ = ["formula_key", "relative_names", "KEY_VERSION"]
