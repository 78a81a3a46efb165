"""Tier 2 encoding: an equation between two scalar terms as a deterministic SMT-LIB 2 query.

The query is satisfiable exactly when the two sides differ somewhere both are
defined:

    guards ∧ lemmas ∧ ¬(lhs = rhs)

- variables are `Real` constants `x0, x1, …` (numbered by variable name);
- every application other than `max` is an uninterpreted `Real → Real`
  function `f0, f1, …` (numbered by name/arity); each application node is
  named by a constant `aK` with `(= aK (f args))`, so a model gives its value;
- `max` is a chain of `ite`; integer powers are products, negative ones a
  division `(/ 1.0 …)`, and every denominator `d` adds the guard
  `(not (= d 0.0))` — the obligation holds "wherever both sides are defined";
- optional ground lemmas (pairs of terms) are asserted as equalities, never
  as quantified axioms;
- every interior node is one `define-fun tK` (K its position in a post-order
  walk), so shared subterms are written once and the text is linear in the DAG.

The text depends only on the terms (comments name the variables and
functions), so `Encoding.key`, its SHA-256, can key a cache.

    >>> from tv_ray.terms import var, div
    >>> x = var("x")
    >>> enc = encode(div(x, x), x ** 0)
    >>> "(assert (not (= x0 0.0)))" in enc.text
    True
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Iterable

from tv_ray.errors import TvRayError
from tv_ray.terms.term import Kind, Term, postorder

# Applications the semantics treats as the real functions: a solver model gives
# them arbitrary values, so a model involving them cannot be replayed exactly.
INTERPRETED = frozenset({"exp", "log"})


class EncodeError(TvRayError):
    """A term cannot be encoded as a meaningful SMT query (e.g. a constant zero denominator)."""


@dataclass(frozen=True)
class Encoding:
    """One SMT-LIB query and the maps needed to read a model back.

    `text` holds set-logic, declarations and assertions only (no check-sat): each
    backend adds the commands it needs. `variables` maps symbol -> variable name;
    `applications` maps symbol -> the application node it names.
    """

    text: str
    logic: str
    variables: dict[str, str]
    applications: dict[str, Term]
    guards: tuple[str, ...]
    claim: bool
    lemma_count: int = 0
    key: str = field(default="")

    @property
    def value_symbols(self) -> tuple[str, ...]:
        """The declared constants a model must give values for, in declaration order."""
        return tuple(self.variables) + tuple(self.applications)


def real_literal(q: Fraction) -> str:
    """An exact SMT-LIB Real literal: 3.0, (- 3.0), (/ 1.0 3.0), (- (/ 1.0 3.0))."""
    q = Fraction(q)
    mag = abs(q)
    text = f"{mag.numerator}.0" if mag.denominator == 1 else f"(/ {mag.numerator}.0 {mag.denominator}.0)"
    return f"(- {text})" if q < 0 else text


def encode(lhs: Term, rhs: Term, lemmas: Iterable[tuple[Term, Term]] = (), claim: bool = True) -> Encoding:
    """The query `guards ∧ lemmas ∧ ¬(lhs = rhs)`; with `claim=False` only `guards ∧ lemmas`.

    The second form is the consistency check of the assumptions: if it is unsat,
    an unsat claim would be a vacuous proof.
    """
    lemmas = tuple((a, b) for a, b in lemmas)
    for a, b in lemmas:
        if not isinstance(a, Term) or not isinstance(b, Term):
            raise EncodeError(f"lemma ({a!r}, {b!r}) is not a pair of Terms")
    roots = (lhs, rhs) + tuple(t for pair in lemmas for t in pair)
    nodes = postorder(*roots)
    index = {n: i for i, n in enumerate(nodes)}

    var_names = sorted({n.payload for n in nodes if n.kind is Kind.VAR})
    var_sym = {name: f"x{i}" for i, name in enumerate(var_names)}
    fun_keys = sorted({(n.payload, len(n.args)) for n in nodes if n.kind is Kind.APP and n.payload != "max"})
    fun_sym = {k: f"f{i}" for i, k in enumerate(fun_keys)}

    ref: dict[Term, str] = {}           # how a node is written where it is used
    lines: list[str] = []               # definitions, in post-order
    applications: dict[str, Term] = {}
    guards: list[str] = []
    guard_seen: set[str] = set()
    nonlinear = False

    for node in nodes:
        k = node.kind
        i = index[node]
        if k is Kind.CONST:
            ref[node] = real_literal(node.payload)
            continue
        if k is Kind.VAR:
            ref[node] = var_sym[node.payload]
            continue
        args = [ref[a] for a in node.args]
        if k is Kind.ADD:
            body = f"(+ {' '.join(args)})"
        elif k is Kind.MUL:
            if sum(1 for a in node.args if a.kind is not Kind.CONST) >= 2:
                nonlinear = True
            body = f"(* {' '.join(args)})"
        elif k is Kind.POW:
            base = node.args[0]
            n = node.payload
            if base.kind is Kind.CONST:
                if base.payload == 0 and n < 0:
                    raise EncodeError("a side divides by the constant 0: it is defined nowhere, "
                                      "so any claim about it would be vacuous")
            else:
                nonlinear = True
            power = args[0] if abs(n) == 1 else f"(* {' '.join([args[0]] * abs(n))})"
            if n < 0:
                guard = f"(not (= {args[0]} 0.0))"
                if guard not in guard_seen:
                    guard_seen.add(guard)
                    guards.append(guard)
                body = f"(/ 1.0 {power})"
            else:
                body = power
        elif node.payload == "max":
            if not args:
                raise EncodeError("max of no arguments")
            acc = args[0]
            for j, a in enumerate(args[1:]):
                step = f"t{i}_{j}"
                lines.append(f"(define-fun {step} () Real (ite (>= {a} {acc}) {a} {acc}))")
                acc = step
            body = acc
        else:
            sym = f"a{i}"
            f = fun_sym[(node.payload, len(node.args))]
            call = f"({f} {' '.join(args)})" if args else f
            applications[sym] = node
            lines.append(f"(declare-fun {sym} () Real)")
            lines.append(f"(assert (= {sym} {call}))")
            ref[node] = sym
            continue
        name = f"t{i}"
        lines.append(f"(define-fun {name} () Real {body})")
        ref[node] = name

    logic = "QF_" + ("UF" if fun_keys else "") + ("N" if nonlinear else "L") + "RA"
    head = [f"(set-logic {logic})"]
    for name in var_names:
        head.append(f"; {var_sym[name]} = {name!r}")
    for key in fun_keys:
        head.append(f"; {fun_sym[key]} = {key[0]!r}/{key[1]}")
    head += [f"(declare-fun {var_sym[name]} () Real)" for name in var_names]
    for (fname, arity), sym in fun_sym.items():
        head.append(f"(declare-fun {sym} ({' '.join(['Real'] * arity)}) Real)")
    body_lines = head + lines
    body_lines += [f"(assert {g})" for g in guards]
    body_lines += [f"(assert (= {ref[a]} {ref[b]}))" for a, b in lemmas]
    if claim:
        body_lines.append(f"(assert (not (= {ref[lhs]} {ref[rhs]})))")
    text = "\n".join(body_lines) + "\n"
    return Encoding(text=text, logic=logic, variables={var_sym[n]: n for n in var_names},
                    applications=applications, guards=tuple(guards), claim=claim,
                    lemma_count=len(lemmas), key=hashlib.sha256(text.encode()).hexdigest())


__all__ = ["Encoding", "EncodeError", "INTERPRETED", "encode", "real_literal"]
