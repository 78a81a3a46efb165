"""Hash-consed immutable scalar terms: the one node type tiers 0 and 1 reason about.

A `Term` is a rational constant, a variable, an n-ary sum or product, an
integer power, or an uninterpreted function application (`exp`, `log`,
`rsqrt`, `max`, ...). Terms are interned: two structurally equal terms are
the same object, so `==` is identity and dictionaries keyed by terms are
cheap. Each term carries `digest`, the SHA-256 of its canonical
serialization (kind, payload, and the digests of its arguments — a Merkle
hash), so the same term has the same digest in every process.

Constructors normalise cheaply and soundly over the reals: they flatten
nested sums and products, sort the arguments of `+` and `·` by digest, fold
constants, and drop the neutral elements. They do not combine like terms or
expand products (that is the normaliser's job), and they never reorder the
arguments of `max` (commutativity of max is an axiom the normaliser records).

Every walker is iterative (explicit stack and memo): terms of 10⁴ nested
levels are ordinary.

    >>> x, y = var("x"), var("y")
    >>> add(x, y) is add(y, x)
    True
    >>> add(x, const(2), const(-2)) is x
    True
"""
from __future__ import annotations

import enum
import hashlib
import itertools
import weakref
from fractions import Fraction
from typing import Callable, Iterable, TypeVar

from tv_ray.errors import TermError
from tv_ray.terms.atom import Atom


class Kind(enum.IntEnum):
    CONST = 0   # payload: Fraction
    VAR = 1     # payload: name
    ADD = 2     # args: two or more summands, sorted by digest
    MUL = 3     # args: two or more factors, sorted by digest
    POW = 4     # payload: int exponent (not 0 or 1); args: (base,)
    APP = 5     # payload: function name; args: in call order


class Term:
    """One interned scalar term. Build terms with the constructors of this module, never directly."""

    __slots__ = ("kind", "payload", "args", "digest", "_hash", "__weakref__")

    kind: Kind
    payload: object
    args: tuple["Term", ...]
    digest: bytes

    def __setattr__(self, name, value):
        raise AttributeError(f"terms are immutable (tried to set {name!r}); build a new term instead")

    def __delattr__(self, name):
        raise AttributeError("terms are immutable")

    # Identity equality (interning) and a digest-derived hash, so that set and
    # dict iteration orders are the same in every process.
    def __eq__(self, other):
        return self is other

    def __ne__(self, other):
        return self is not other

    def __hash__(self):
        return self._hash

    @property
    def key(self) -> str:
        """The stable content hash as hex (SHA-256 of the canonical serialization)."""
        return self.digest.hex()

    @property
    def name(self) -> "str | Atom":
        """The variable name (a str or an Atom) or function name (VAR and APP only)."""
        if self.kind not in (Kind.VAR, Kind.APP):
            raise TermError(f"a {self.kind.name} term has no name", term=self)
        return self.payload  # type: ignore[return-value]

    @property
    def value(self) -> Fraction:
        if self.kind is not Kind.CONST:
            raise TermError(f"a {self.kind.name} term has no constant value", term=self)
        return self.payload  # type: ignore[return-value]

    @property
    def exponent(self) -> int:
        if self.kind is not Kind.POW:
            raise TermError(f"a {self.kind.name} term has no exponent", term=self)
        return self.payload  # type: ignore[return-value]

    def __repr__(self) -> str:
        return f"Term({to_str(self, max_chars=120)})"

    def __str__(self) -> str:
        return to_str(self, max_chars=100_000)  # a DAG with much sharing prints exponentially long

    def __reduce__(self):
        # A flat table, so pickling a 10⁴-deep chain does not recurse.
        return (from_table, (to_table(self),))

    # operator sugar, so tests and rules read like the maths
    def __add__(self, other):
        return add(self, _lift(other))

    def __radd__(self, other):
        return add(_lift(other), self)

    def __sub__(self, other):
        return sub(self, _lift(other))

    def __rsub__(self, other):
        return sub(_lift(other), self)

    def __mul__(self, other):
        return mul(self, _lift(other))

    def __rmul__(self, other):
        return mul(_lift(other), self)

    def __truediv__(self, other):
        return div(self, _lift(other))

    def __rtruediv__(self, other):
        return div(_lift(other), self)

    def __neg__(self):
        return neg(self)

    def __pow__(self, n):
        return pow_(self, n)


# -- interning ---------------------------------------------------------------------------------

class _Ref(weakref.ref):
    """A weak reference that knows its key (like `weakref.KeyedRef`, whose Python-level constructor was a fifth
    of the time spent building llama3-8b's logical terms)."""

    __slots__ = ("key",)


def _drop(ref: _Ref) -> None:
    if _TABLE.get(ref.key) is ref:
        del _TABLE[ref.key]


_TABLE: dict[bytes, _Ref] = {}      # digest -> the one live Term with it (weakly: unused terms are freed)
_TAGS = {k: bytes([k.value]) for k in Kind}


def _payload_bytes(kind: Kind, payload) -> bytes:
    if kind is Kind.CONST:
        return f"{payload.numerator}/{payload.denominator}".encode()
    if kind is Kind.POW:
        return str(payload).encode()
    if kind is Kind.APP:
        return payload.encode()
    if kind is Kind.VAR:
        # an Atom by its text; a plain name behind a NUL, which no Atom's text has: the two never share a digest
        return str(payload).encode() if isinstance(payload, Atom) else b"\x00" + payload.encode()
    return b""


def _make(kind: Kind, payload, args: tuple[Term, ...]) -> Term:
    p = _payload_bytes(kind, payload)
    h = hashlib.sha256(_TAGS[kind])
    h.update(len(p).to_bytes(4, "big"))
    h.update(p)
    h.update(len(args).to_bytes(4, "big"))
    for a in args:
        h.update(a.digest)  # fixed 32 bytes each: the serialization is unambiguous
    return _intern(kind, payload, args, h.digest())


# the slots' own setters (`Term.__setattr__` refuses): half the time of `object.__setattr__`, which looks each
# name up again, in building a term
_new = object.__new__
_set_kind, _set_payload, _set_args, _set_digest, _set_hash = \
    (getattr(Term, slot).__set__ for slot in ("kind", "payload", "args", "digest", "_hash"))


def _intern(kind: Kind, payload, args: tuple[Term, ...], digest: bytes) -> Term:
    """The one live term with `digest`, made if there is none."""
    ref = _TABLE.get(digest)
    if ref is not None:
        found = ref()
        if found is not None:
            return found
    t = _new(Term)
    _set_kind(t, kind)
    _set_payload(t, payload)
    _set_args(t, args)
    _set_digest(t, digest)
    _set_hash(t, int.from_bytes(digest[:8], "big", signed=True))
    ref = _TABLE[digest] = _Ref(t, _drop)
    ref.key = digest
    return t


def _lift(x) -> Term:
    return x if isinstance(x, Term) else const(x)


# -- constructors ------------------------------------------------------------------------------

def const(value) -> Term:
    """A rational constant; ints, Fractions, decimal strings ("0.125") and floats (their exact binary value)."""
    if isinstance(value, bool) or not isinstance(value, (int, Fraction, float, str)):
        raise TermError(f"constant {value!r} is not a number; pass an int, Fraction, float or decimal string")
    try:
        q = Fraction(value)
    except (ValueError, OverflowError) as e:
        raise TermError(f"constant {value!r} is not a finite rational: {e}") from None
    return _make(Kind.CONST, q, ())


ZERO = const(0)
ONE = const(1)
MINUS_ONE = const(-1)


def var(name: "str | Atom") -> Term:
    """A real-valued variable, named by a non-empty string or by an `Atom` (one element of a tensor)."""
    if not isinstance(name, Atom) and (not isinstance(name, str) or not name):
        raise TermError(f"variable name {name!r} must be an Atom or a non-empty string")
    return _make(Kind.VAR, name, ())


def atom_vars(base, indices: Iterable[tuple[int, ...]]) -> list[Term]:
    """`var(Atom(base, idx))` for each index, the text of `base` formatted once (a tensor's atoms)."""
    head = f"{base}[".encode()
    return _atom_vars(base, ((idx, head + ",".join(map(str, idx)).encode() + b"]") for idx in indices))


def grid_vars(base, shape: tuple[int, ...], offsets: tuple[int, ...] | None = None) -> list[Term]:
    """`atom_vars(base, np.ndindex(shape))`: every element of a tensor of `shape` in row-major order, each index's
    text made from its row's once (`offsets`: the elements of that region of a larger tensor, by their index
    there)."""
    if not shape:
        return atom_vars(base, [()])
    offsets = offsets or (0,) * len(shape)
    last = [(j, f"{j}]".encode()) for j in range(offsets[-1], offsets[-1] + shape[-1])]
    rows = ((row, f"{base}[{''.join(f'{i},' for i in row)}".encode())
            for row in itertools.product(*(range(o, o + n) for o, n in zip(offsets[:-1], shape[:-1]))))
    return _atom_vars(base, ((row + (j,), head + text) for row, head in rows for j, text in last))


_VAR_HASH, _NO_ARGS = hashlib.sha256(bytes([Kind.VAR.value])), (0).to_bytes(4, "big")


def _atom_vars(base, texts: Iterable[tuple[tuple[int, ...], bytes]]) -> list[Term]:
    """`var(Atom(base, idx))` for each (idx, `str(Atom(base, idx))` encoded): the digest `_make` gives it."""
    out, copy, new = [], _VAR_HASH.copy, tuple.__new__       # an `Atom` from its fields, past its constructor
    for idx, text in texts:
        h = copy()
        h.update(len(text).to_bytes(4, "big") + text + _NO_ARGS)
        out.append(_intern(Kind.VAR, new(Atom, (base, idx, None)), (), h.digest()))
    return out


def add(*args: Term) -> Term:
    """n-ary sum: nested sums flattened, constants folded, zero dropped, summands sorted by digest."""
    flat: list[Term] = []
    c = Fraction(0)
    for a in args:
        for b in (a.args if a.kind is Kind.ADD else (a,)):
            if b.kind is Kind.CONST:
                c += b.payload
            else:
                flat.append(b)
    if c != 0 or not flat:
        flat.append(const(c))
    if len(flat) == 1:
        return flat[0]
    flat.sort(key=_digest)
    return _make(Kind.ADD, None, tuple(flat))


def mul(*args: Term) -> Term:
    """n-ary product: nested products flattened, constants folded, one dropped, factors sorted by digest.

    A zero factor makes the product zero: the identity 0·t = 0 holds wherever t is defined.
    """
    flat: list[Term] = []
    c = Fraction(1)
    for a in args:
        for b in (a.args if a.kind is Kind.MUL else (a,)):
            if b.kind is Kind.CONST:
                c *= b.payload
            else:
                flat.append(b)
    if c == 0:
        return ZERO
    if c != 1 or not flat:
        flat.append(const(c))
    if len(flat) == 1:
        return flat[0]
    flat.sort(key=_digest)
    return _make(Kind.MUL, None, tuple(flat))


def pow_(base: Term, n: int) -> Term:
    """base^n for an integer n; (b^m)^n folds to b^(m·n), constant bases fold unless 0^negative."""
    if isinstance(n, bool) or not isinstance(n, int):
        if isinstance(n, Fraction) and n.denominator == 1:
            n = n.numerator
        else:
            raise TermError(f"exponent {n!r} is not an integer; non-integer powers are uninterpreted "
                            f"functions (use app('sqrt', x) or app('pow', x, const(e)))")
    if n == 0:
        return ONE
    if n == 1:
        return base
    if base.kind is Kind.CONST and (base.payload != 0 or n > 0):
        return const(base.payload ** n)
    if base.kind is Kind.POW:
        return pow_(base.args[0], base.payload * n)
    return _make(Kind.POW, n, (base,))


def app(name: str, *args: Term) -> Term:
    """An uninterpreted function application name(args...) (exp, log, rsqrt, sigmoid, max, ...)."""
    if not isinstance(name, str) or not name:
        raise TermError(f"function name {name!r} must be a non-empty string")
    for a in args:
        if not isinstance(a, Term):
            raise TermError(f"argument {a!r} of {name} is not a Term")
    return _make(Kind.APP, name, tuple(args))


def neg(a: Term) -> Term:
    return mul(MINUS_ONE, a)


def sub(a: Term, b: Term) -> Term:
    return add(a, neg(b))


def div(a: Term, b: Term) -> Term:
    return mul(a, pow_(b, -1))


def sum_(terms: Iterable[Term]) -> Term:
    return add(*terms)


def prod(terms: Iterable[Term]) -> Term:
    return mul(*terms)


def exp(a: Term) -> Term:
    return app("exp", a)


def log(a: Term) -> Term:
    return app("log", a)


def max_(*args: Term) -> Term:
    """max(args) in the order given; the normaliser flattens and sorts (recording max associativity/commutativity)."""
    if not args:
        raise TermError("max of no arguments")
    return app("max", *args)


def fn(name: str) -> Callable[..., Term]:
    """A builder for applications of `name`: fn("sigmoid")(x) == app("sigmoid", x)."""
    return lambda *args: app(name, *args)


def _digest(t: Term) -> bytes:
    return t.digest


# -- walkers (iterative) -----------------------------------------------------------------------

def postorder(*roots: Term) -> list[Term]:
    """Every distinct node reachable from `roots`, each after all of its arguments."""
    seen: set[Term] = set()
    out: list[Term] = []
    stack: list[tuple[Term, bool]] = [(r, False) for r in reversed(roots)]
    while stack:
        node, done = stack.pop()
        if done:
            out.append(node)
            continue
        if node in seen:
            continue
        seen.add(node)
        stack.append((node, True))
        for a in reversed(node.args):
            if a not in seen:
                stack.append((a, False))
    return out


R = TypeVar("R")


def fold(root: Term, visit: Callable[[Term, list], R], memo: dict | None = None,
         keep: Callable[[Term], bool] | None = None) -> R:
    """Bottom-up evaluation: visit(node, [results of its args]) once per distinct node; `memo` may be shared. In a
    fold from terms to terms, a node for which `keep` holds is its own result, and nothing under it is visited."""
    memo = {} if memo is None else memo
    stack: list[tuple[Term, bool]] = [(root, False)]
    while stack:                      # postorder that stops at nodes the shared memo already holds
        node, done = stack.pop()
        if node in memo:
            continue
        if done:
            memo[node] = visit(node, [memo[a] for a in node.args])
            continue
        if keep is not None and keep(node):
            memo[node] = node
            continue
        stack.append((node, True))
        stack.extend((a, False) for a in reversed(node.args) if a not in memo)
    return memo[root]


def rebuild(node: Term, args: list[Term]) -> Term:
    """`node` with new arguments, through the normalising constructors."""
    k = node.kind
    if k in (Kind.CONST, Kind.VAR):
        return node
    if k is Kind.ADD:
        return add(*args)
    if k is Kind.MUL:
        return mul(*args)
    if k is Kind.POW:
        return pow_(args[0], node.payload)
    return app(node.payload, *args)


def substitute(root: Term, mapping: dict[Term, Term], memo: dict | None = None,
               keep: Callable[[Term], bool] | None = None) -> Term:
    """`root` with every variable in `mapping` replaced by its image (one simultaneous pass); a node for which
    `keep` holds (one with no such variable under it) is left as it is, unvisited."""
    def visit(node: Term, args: list[Term]) -> Term:
        if node.kind is Kind.VAR:
            return mapping.get(node, node)
        return node if all(a is b for a, b in zip(args, node.args)) else rebuild(node, args)
    return fold(root, visit, memo, keep)


def size(*roots: Term) -> int:
    """Number of distinct nodes in the DAG under `roots` (`postorder`'s length, counted without ordering them)."""
    seen: set[Term] = set()
    stack = list(roots)
    while stack:
        node = stack.pop()
        if node not in seen:
            seen.add(node)
            stack.extend(node.args)
    return len(seen)


def depth(root: Term) -> int:
    return fold(root, lambda n, ds: 1 + max(ds, default=0))


def variables(*roots: Term) -> list[Term]:
    """The variables of the terms, sorted by name."""
    return sorted((n for n in postorder(*roots) if n.kind is Kind.VAR), key=lambda v: str(v.payload))


def to_str(root: Term, max_chars: int | None = None) -> str:
    """Infix text of the term (shared subterms printed at each use); with `max_chars`, cut and ended with '…'.

    Written piece by piece from an explicit stack, so a 10⁴-deep chain prints in linear time.
    """
    out: list[str] = []
    length = 0
    stack: list[Term | str] = [root]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            out.append(item)
            length += len(item)
            if max_chars is not None and length > max_chars:
                break
            continue
        stack.extend(reversed(_pieces(item)))
    text = "".join(out)
    if max_chars is not None and len(text) > max_chars:
        text = text[: max_chars - 1] + "…"
    return text


def _pieces(node: Term) -> list:
    """The text of one node as a list of strings and argument terms, in reading order."""
    k = node.kind
    if k is Kind.CONST:
        q = node.payload
        s = str(q.numerator) if q.denominator == 1 else f"{q.numerator}/{q.denominator}"
        return [f"({s})" if q < 0 or q.denominator != 1 else s]
    if k is Kind.VAR:
        return [str(node.payload)]
    if k is Kind.POW:
        base = node.args[0]
        wrap = base.kind in (Kind.ADD, Kind.MUL, Kind.POW)
        return ["(", base, f")^{node.payload}"] if wrap else [base, f"^{node.payload}"]
    parts: list = [f"{node.payload}("] if k is Kind.APP else []
    sep = {Kind.ADD: " + ", Kind.MUL: " * ", Kind.APP: ", "}[k]
    for i, a in enumerate(node.args):
        if i:
            parts.append(sep)
        parts.extend(["(", a, ")"] if k is Kind.MUL and a.kind is Kind.ADD else [a])
    if k is Kind.APP:
        parts.append(")")
    return parts


# -- flat serialization (shipping terms between processes) ------------------------------------

def to_table(*roots: Term) -> dict:
    """A flat node table to pickle: {"nodes": [[kind, payload, [arg indices]], ...], "roots": [...]} (a variable's
    payload is its name: a str or an `Atom`)."""
    index: dict[Term, int] = {}
    nodes: list[list] = []
    for node in postorder(*roots):
        payload = node.payload
        if node.kind is Kind.CONST:
            payload = f"{payload.numerator}/{payload.denominator}"
        index[node] = len(nodes)
        nodes.append([int(node.kind), payload, [index[a] for a in node.args]])
    return {"nodes": nodes, "roots": [index[r] for r in roots]}


def from_table(table: dict) -> Term | tuple[Term, ...]:
    """Inverse of `to_table`; one root gives a Term, several a tuple. Rebuilt through the constructors' interning."""
    built: list[Term] = []
    try:
        for i, (kind, payload, arg_ids) in enumerate(table["nodes"]):
            kind = Kind(kind)
            if any(not 0 <= j < i for j in arg_ids):
                raise TermError(f"node {i} of the term table refers to a later or missing node {arg_ids}")
            args = tuple(built[j] for j in arg_ids)
            if kind is Kind.CONST:
                payload = Fraction(payload)
            built.append(_make(kind, payload, args))
        roots = tuple(built[j] for j in table["roots"])
    except (KeyError, ValueError, TypeError, IndexError) as e:
        raise TermError(f"malformed term table: {e!r}") from None
    return roots[0] if len(roots) == 1 else roots


__all__ = [
    "Term", "Kind", "TermError", "const", "var", "add", "mul", "pow_", "app", "neg", "sub", "div",
    "sum_", "prod", "exp", "log", "max_", "fn", "ZERO", "ONE", "MINUS_ONE", "postorder", "fold",
    "size", "depth", "variables", "to_str", "to_table", "from_table", "rebuild", "substitute",
]
