"""Tier 2 encoding: an equation between two scalar terms (or many at once) as pysmt formulas.

The conjunction of `Encoding.formulas()` is satisfiable exactly when the two
sides differ somewhere both are defined:

    definitions ∧ guards ∧ lemmas ∧ ¬(lhs = rhs)

`encode_all` puts many equations in one query, each under its own guards:
satisfiable exactly when some equation's sides differ somewhere they are
defined (a stage key's equations proved in one solver call rather than one
each: `tv_ray.smt.portfolio.prove_all`):

    definitions ∧ lemmas ∧ ⋁ᵢ (guardsᵢ ∧ ¬(lhsᵢ = rhsᵢ))

- variables are pysmt `Real` symbols `x0, x1, …` (numbered by variable name);
- every application other than `max` is an uninterpreted function
  (`FunctionType(REAL, [REAL]*n)`, symbol `f<i>_<n>`, numbered by name/arity)
  and each application node is named by a `Real` symbol `a<K>` with the
  definition `a<K> = f(args)`, so a model gives its value as a plain constant
  (the SMT-LIB process backend's model reader parses nothing but constants);
- `max` is a chain of `Ite`; integer powers are products, negative ones
  `1 / …`, and every such denominator `d` adds the guard `d ≠ 0` — the
  obligation holds "wherever both sides are defined";
- optional ground lemmas (pairs of terms) are equalities, never quantified
  axioms.

`formulas(claim=False)` drops `¬(lhs = rhs)`: the consistency check of the
assumptions, without which an unsat claim could be a vacuous proof (for many
equations, every equation's guards at once: where they hold together, each
one's hold).
Formulas live in pysmt's global environment (its `FNode` methods use that one);
build and read them in one thread only — pysmt's formula manager is not
thread-safe. `smtlib()` prints the query as an SMT-LIB script (the form that
travels between processes, or into a bug report).

    >>> from tv_ray.terms import var, div
    >>> x = var("x")
    >>> enc = encode(div(x, x), x ** 0)
    >>> [str(g) for g in enc.guards]
    ['(! (x0 = 0.0))']
"""
from __future__ import annotations

from dataclasses import dataclass
from io import StringIO
from typing import Callable, Iterable

import pysmt.logics
import pysmt.smtlib.commands as smtcmd
from pysmt.environment import get_env
from pysmt.fnode import FNode
from pysmt.smtlib.script import SmtLibScript
from pysmt.typing import REAL, FunctionType

from tv_ray.errors import EncodeError
from tv_ray.terms.term import Kind, Term, postorder

# Applications the semantics treats as the real functions: a solver model gives
# them arbitrary values, so a model involving them cannot be replayed exactly.
INTERPRETED = frozenset({"exp", "log"})

LOGICS = {(uf, nl): getattr(pysmt.logics, "QF_" + ("UF" if uf else "") + ("N" if nl else "L") + "RA")
          for uf in (False, True) for nl in (False, True)}


@dataclass(frozen=True)
class Encoding:
    """One query as pysmt formulas, and the maps needed to read a model back.

    `variables` maps symbol -> variable name; `applications` maps symbol -> the
    application node it names; `definitions` are the `a<K> = f(args)` equalities.
    `carried`: guards the claim carries itself (`encode_all`: each equation's
    within its disjunct), asserted only by the consistency check.
    """

    claim: FNode
    definitions: tuple[FNode, ...]
    guards: tuple[FNode, ...]
    lemmas: tuple[FNode, ...]
    logic: pysmt.logics.Logic
    variables: dict[FNode, str]
    applications: dict[FNode, Term]
    carried: tuple[FNode, ...] = ()

    @property
    def value_symbols(self) -> tuple[FNode, ...]:
        """The symbols a model must give values for: variables, then applications."""
        return tuple(self.variables) + tuple(self.applications)

    def formulas(self, claim: bool = True) -> tuple[FNode, ...]:
        """The assertions of the query; with `claim=False` only the assumptions."""
        if not claim:
            return self.definitions + self.guards + self.carried + self.lemmas
        return self.definitions + self.guards + self.lemmas + (self.claim,)

    def formula(self, claim: bool = True) -> FNode:
        """The conjunction of `formulas(claim)`: one assertion, whose shared subterms a printer writes once."""
        return get_env().formula_manager.And(self.formulas(claim))

    def smtlib(self, claim: bool = True, daggify: bool = True) -> str:
        """The query as SMT-LIB 2 text: set-logic, declarations, one assert per formula (no check-sat).

        With `daggify` shared subterms are let-bound, so the text is linear in the term DAG.
        """
        formulas = self.formulas(claim)
        script = SmtLibScript()
        script.add(smtcmd.SET_LOGIC, [self.logic])
        symbols = set().union(*(f.get_free_variables() for f in formulas))
        for s in sorted(symbols, key=FNode.symbol_name):
            script.add(smtcmd.DECLARE_FUN, [s])
        for f in formulas:
            script.add(smtcmd.ASSERT, [f])
        out = StringIO()
        script.serialize(out, daggify=daggify)
        return out.getvalue()


def _walk_pow(mgr, node: Term, args: list[FNode], guard: Callable[[FNode], None]) -> FNode:
    base, n = args[0], node.payload
    if node.args[0].kind is Kind.CONST and node.args[0].payload == 0 and n < 0:
        raise EncodeError("a side divides by the constant 0: it is defined nowhere, so any claim about it "
                          "would be vacuous", term=node)
    power = base if abs(n) == 1 else mgr.Times([base] * abs(n))
    if n > 0:
        return power
    guard(base)
    return mgr.Div(mgr.Real(1), power)


def _walk_max(mgr, node: Term, args: list[FNode]) -> FNode:
    if not args:
        raise EncodeError("max of no arguments", term=node)
    acc = args[0]
    for a in args[1:]:
        acc = mgr.Ite(mgr.GE(a, acc), a, acc)
    return acc


def encode(lhs: Term, rhs: Term, lemmas: Iterable[tuple[Term, Term]] = ()) -> Encoding:
    """The query `definitions ∧ guards ∧ lemmas ∧ ¬(lhs = rhs)` as pysmt formulas (see the module docstring)."""
    return _encode(((lhs, rhs),), lemmas)


def encode_all(equations: Iterable[tuple[Term, Term]], lemmas: Iterable[tuple[Term, Term]] = ()) -> Encoding:
    """One query for every equation: `definitions ∧ lemmas ∧ ⋁ᵢ (guardsᵢ ∧ ¬(lhsᵢ = rhsᵢ))` (the module docstring).
    Unsat only if no equation's sides differ at a real point where its own divisions are defined: guardsᵢ are
    those of the divisions in equation i's sides; every lemma holds at every real point, whatever value a division
    by zero takes (`tv_ray.terms.normal.ground_lemmas`: ground instances of the exp/log axioms, log_mul only on
    factors known positive), so asserting the other equations' lemmas too, without their guards, excludes none. Every guard is asserted by the consistency check."""
    equations = tuple(equations)
    if not equations:
        raise EncodeError("no equation to encode")
    return _encode(equations, lemmas)


def _encode(equations: tuple[tuple[Term, Term], ...], lemmas: Iterable[tuple[Term, Term]]) -> Encoding:
    lemmas = tuple((a, b) for a, b in lemmas)
    for a, b in lemmas:
        if not isinstance(a, Term) or not isinstance(b, Term):
            raise EncodeError(f"lemma ({a!r}, {b!r}) is not a pair of Terms; ground lemmas are (Term, Term) pairs")
    mgr = get_env().formula_manager
    nodes = postorder(*(t for pair in equations + lemmas for t in pair))

    var_names = sorted({n.payload for n in nodes if n.kind is Kind.VAR}, key=str)
    var_sym = {name: mgr.Symbol(f"x{i}", REAL) for i, name in enumerate(var_names)}
    fun_keys = sorted({(n.payload, len(n.args)) for n in nodes if n.kind is Kind.APP and n.payload != "max"})
    fun_sym = {(name, arity): mgr.Symbol(f"f{i}_{arity}", FunctionType(REAL, [REAL] * arity) if arity else REAL)
               for i, (name, arity) in enumerate(fun_keys)}

    guards: dict[FNode, None] = {}        # ordered and deduplicated (formulas are hash-consed)
    guard_of: dict[Term, FNode] = {}      # a negative power -> its denominator's guard
    definitions: list[FNode] = []
    applications: dict[FNode, Term] = {}
    nonlinear = False

    def guard(denominator: FNode) -> None:
        guards[mgr.Not(mgr.Equals(denominator, mgr.Real(0)))] = None

    def walk_app(node: Term, args: list[FNode]) -> FNode:
        if node.payload == "max":
            return _walk_max(mgr, node, args)
        f = fun_sym[(node.payload, len(args))]
        sym = mgr.Symbol(f"a{len(applications)}", REAL)
        applications[sym] = node
        definitions.append(mgr.Equals(sym, mgr.Function(f, args) if args else f))
        return sym

    walk: dict[Kind, Callable[[Term, list[FNode]], FNode]] = {
        Kind.CONST: lambda node, args: mgr.Real(node.payload),
        Kind.VAR: lambda node, args: var_sym[node.payload],
        Kind.ADD: lambda node, args: mgr.Plus(args),
        Kind.MUL: lambda node, args: mgr.Times(args),
        Kind.POW: lambda node, args: _walk_pow(mgr, node, args, guard),
        Kind.APP: walk_app,
    }
    memo: dict[Term, FNode] = {}
    for node in nodes:
        k = node.kind
        if (k is Kind.MUL and sum(1 for a in node.args if a.kind is not Kind.CONST) >= 2) or \
                (k is Kind.POW and node.args[0].kind is not Kind.CONST):
            nonlinear = True
        memo[node] = walk[k](node, [memo[a] for a in node.args])
        if k is Kind.POW and node.payload < 0:       # the guard `_walk_pow` added (hash-consed: the same formula)
            guard_of[node] = mgr.Not(mgr.Equals(memo[node.args[0]], mgr.Real(0)))

    lemmas_ = tuple(mgr.Equals(memo[a], memo[b]) for a, b in lemmas)
    common = dict(definitions=tuple(definitions), lemmas=lemmas_, logic=LOGICS[(bool(fun_keys), nonlinear)],
                  variables={var_sym[n]: n for n in var_names}, applications=applications)
    if len(equations) == 1:
        lhs, rhs = equations[0]
        return Encoding(claim=mgr.Not(mgr.Equals(memo[lhs], memo[rhs])), guards=tuple(guards), **common)
    disjuncts = []
    for lhs, rhs in equations:
        own = {guard_of[n]: None for n in postorder(lhs, rhs) if n in guard_of} if guard_of else {}
        disjuncts.append(mgr.And(*own, mgr.Not(mgr.Equals(memo[lhs], memo[rhs]))))
    return Encoding(claim=mgr.Or(disjuncts), guards=(), carried=tuple(guards), **common)


__all__ = ["Encoding", "EncodeError", "INTERPRETED", "LOGICS", "encode", "encode_all"]
