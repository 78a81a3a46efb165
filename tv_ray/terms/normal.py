"""Tier 0: the normaliser — canonical Laurent-polynomial form of a term over atoms, plus named axioms.

A normal form is a polynomial with Fraction coefficients whose monomials are
products of atoms to integer (possibly negative) powers. Atoms are variables,
uninterpreted applications whose arguments are themselves in canonical form,
and `P^-1` for a primitive polynomial P (division by a sum: its constant and
monomial factors are pulled out first, so 1/(2xy + 2x) = ½·x⁻¹·(y + 1)⁻¹; P's leading
coefficient, in digest order, is 1). An inverse atom appears in a normal form only to positive
powers: (P⁻¹)⁻ᵏ is multiplied out as Pᵏ, since the term (P⁻¹)⁻ᵏ is the sum Pᵏ. With both rules
normal_form is idempotent: a normal form is its own normal form.
Identities are those of rational functions over the reals, i.e. wherever both
sides are defined (x·x⁻¹ = 1).

Axioms beyond field arithmetic — each named, each recorded when it changes a term:

  exp_add   exp(a + b) = exp(a)·exp(b)   (and so exp(k·a) = exp(a)^k for integer k)
  exp_neg   exp(-a) = exp(a)^-1
  log_mul   log(a·b) = log a + log b     only when every factor is known positive
  log_exp   log(exp a) = a
  exp_log   exp(log a) = a                only when a is known positive (a sum of exponentials)
  max_assoc max(a, max(b, c)) = max(a, b, c)
  max_comm  max(a, b) = max(b, a)
  pow_half  x^0.5 = sqrt(x)
  sqrt_sq   sqrt(a)·sqrt(a) = a        where sqrt(a) is defined (a ≥ 0), as x·x⁻¹ = 1 where x ≠ 0
  onehot    δᵤ·δᵥ = 0 and δᵥᵏ = δᵥ for the indicators of one data element's values (`tv_ray.terms.onehot`):
            each is 0 or 1, and exactly one value holds

"Known positive": exp(...) atoms, positive constants, (P)^-1 for a known-positive
P, and products and positive-coefficient sums of those. An unguarded
log(x·y) = log x + log y is false at x = y = -1 and is never applied.

The normaliser is incomplete (no polynomial gcd, so Q·(1/Q) after a sum does
not cancel): equal normal forms prove equality, different ones mean Unknown.

    >>> from tv_ray.terms import var, exp, log, add, sub
    >>> a, m = var("a"), var("m")
    >>> prove_equal(add(log(exp(sub(a, m))), m), a)
    Proved(method='normalised', axioms=('exp_add', 'exp_neg', 'log_exp', 'log_mul'))
"""
from __future__ import annotations

from fractions import Fraction
from typing import Callable

from tv_ray.errors import NormaliseError
from tv_ray.terms.result import Proved, Unknown
from tv_ray.terms.onehot import is_indicator
from tv_ray.terms.term import Kind, Term, add, app, const, mul, postorder, pow_, to_str

Mono = tuple[tuple[Term, int], ...]   # sorted by atom digest, exponents nonzero
Poly = dict[Mono, Fraction]           # nonzero coefficients only; {} is zero

AXIOMS = ("exp_add", "exp_neg", "exp_log", "log_mul", "log_exp", "max_assoc", "max_comm", "onehot", "pow_half", "sqrt_sq")
_FACTOR_LIMIT = 10 ** 6  # trial-divide log constants below this; larger ones stay one atom


# -- polynomial arithmetic ---------------------------------------------------------------------

def _p_const(c: Fraction) -> Poly:
    return {(): Fraction(c)} if c != 0 else {}


def _p_atom(atom: Term, e: int = 1) -> Poly:
    return {((atom, e),): Fraction(1)}


def _m_mul(m1: Mono, m2: Mono) -> Mono | None:
    """The product of two monomials; None where one-hot indicators make it 0 (`_one_hot`)."""
    if not m1:
        return m2
    if not m2:
        return m1
    acc = dict(m1)
    for a, e in m2:
        s = acc.get(a, 0) + e
        if s:
            acc[a] = s
        else:
            del acc[a]
    return _one_hot(tuple(sorted(acc.items(), key=lambda ae: ae[0].digest)))


def _m_pow(m: Mono, n: int) -> Mono:
    return _one_hot(tuple((a, e * n) for a, e in m)) if n > 0 else tuple((a, e * n) for a, e in m)


def _one_hot(m: Mono) -> Mono | None:
    """The one-hot axiom on a monomial: an indicator of a data element's value is 0 or 1, so δᵥᵏ = δᵥ for k ≥ 1, and
    at most one value holds, so δᵤ·δᵥ = 0 for u ≠ v of the same element (None: the monomial is 0)."""
    elements = None
    for a, e in m:
        if e >= 1 and a.kind is Kind.VAR and is_indicator(a.payload):
            elements = elements or {}
            if elements.setdefault(a.payload.element, a) is not a:
                _one_hot_used[0] = True
                return None
    if elements is None or all(e == 1 for a, e in m if a in elements.values()):
        return m
    _one_hot_used[0] = True
    return tuple((a, 1 if a in elements.values() else e) for a, e in m)


_one_hot_used = [False]     # the axiom applied in the current normalise call (read by Normaliser.normalise)


def _p_add(ps: list[Poly]) -> Poly:
    acc: dict[Mono, Fraction] = {}
    for p in ps:
        for m, c in p.items():
            acc[m] = acc.get(m, 0) + c
    return {m: c for m, c in acc.items() if c != 0}


MAX_WORK = 20_000   # monomial products per normalise call; beyond it the expansion is not worth finishing
_work = [0]          # products done in the current normalise call (reset by Normaliser.normalise)


def _p_mul2(p: Poly, q: Poly) -> Poly:
    _work[0] += len(p) * len(q)
    if _work[0] > MAX_WORK:
        raise NormaliseError(f"expanding products exceeds the normaliser's budget of {MAX_WORK} monomial "
                             f"products")
    acc: dict[Mono, Fraction] = {}
    for m1, c1 in p.items():
        for m2, c2 in q.items():
            m = _m_mul(m1, m2)
            if m is not None:
                acc[m] = acc.get(m, 0) + c1 * c2
    return {m: c for m, c in acc.items() if c != 0}


def _mono_order(m: Mono) -> tuple:
    return tuple((a.digest, e) for a, e in m)


def _split_content(p: Poly) -> tuple[Fraction, Mono, Poly]:
    """p = c · M · P with P primitive: leading coefficient 1, no common monomial factor.

    The leading monomial is chosen *after* the common monomial M is divided out: the digest
    order of monomials is not preserved by division (m1 < m2 does not give m1/M < m2/M), so a
    lead picked in p can be a non-leading monomial of P, and P would then not be primitive —
    splitting P again would rescale it (e.g. flip its sign) and normal_form would not be
    idempotent. Chosen this way, _split_content(P) == (1, (), P).
    """
    low: dict[Term, int] = {}
    atoms = set(a for m in p for a, _ in m)
    for a in atoms:
        low[a] = min(dict(m).get(a, 0) for m in p)
    common: Mono = tuple(sorted(((a, e) for a, e in low.items() if e), key=lambda ae: ae[0].digest))
    inv_common = _m_pow(common, -1)
    reduced = {_m_mul(m, inv_common): q for m, q in p.items()}
    c = reduced[min(reduced, key=_mono_order)]
    prim = {m: q / c for m, q in reduced.items()}
    return c, common, prim


def term_of(p: Poly) -> Term:
    """The canonical term of a normal form (equal normal forms give the identical term)."""
    summands = []
    for m, c in p.items():
        summands.append(mul(const(c), *[pow_(a, e) for a, e in m]))
    return add(*summands)


def _is_monomial(p: Poly) -> bool:
    return len(p) == 1


# -- the normaliser ----------------------------------------------------------------------------

class Normaliser:
    """Normal forms of terms, memoised per node; `axioms` collects the names of the axioms used."""

    def __init__(self) -> None:
        self.memo: dict[Term, Poly] = {}
        self.axioms: set[str] = set()
        self._positive: dict[Term, bool] = {}  # atoms known positive (filled when atoms are made)
        self._rules: dict[Kind, Callable[[Term, list[Poly]], Poly]] = {
            Kind.CONST: lambda t, _: _p_const(t.payload),
            Kind.VAR: lambda t, _: _p_atom(t),
            Kind.ADD: lambda t, ps: _p_add(ps),
            Kind.MUL: self._mul,
            Kind.POW: lambda t, ps: self._pow(ps[0], t.payload),
            Kind.APP: self._app,
        }
        self._app_rules: dict[str, Callable[[Term, list[Poly]], Poly]] = {
            "exp": self._exp,
            "log": self._log,
            "max": self._max,
            "sqrt": self._sqrt,
            "pow[0.5]": self._sqrt,
        }
        self._roots: dict[Term, Poly] = {}     # each sqrt atom made -> its argument's normal form

    def normalise(self, term: Term) -> Poly:
        """The normal form of `term` (expanded: no inverse atom to a negative power).

        Raises NormaliseError past `MAX_WORK` monomial products (an exploding expansion is unknown, not slow)."""
        _work[0] = 0
        _one_hot_used[0] = False
        out = self._expand(self._memoised(term))
        if _one_hot_used[0]:
            self.axioms.add("onehot")
        return out

    def _memoised(self, term: Term) -> Poly:
        """`term`'s form in the memo (every subterm's made first), not expanded."""
        memo = self.memo
        for node in postorder(term):
            if node not in memo:
                memo[node] = self._rules[node.kind](node, [memo[a] for a in node.args])
        return memo[term]

    def _expand(self, p: Poly) -> Poly:
        """p with every inverse atom to a negative power, (P^-1)^-k, multiplied out as P^k.

        Inside the memo such factors are kept (so that (2/Q)^-1 · Q^-1 still cancels to ½),
        but they have no canonical term: pow_ folds (P^-1)^-k to the sum P^k, which
        re-normalises to its expansion. So every poly that leaves the memo — a result, or one
        that becomes a term or is inspected by a rule (_canon, _inv, exp, log) — is expanded
        first, and normal_form is idempotent.
        """
        if not any(a.kind is Kind.POW and e < 0 for m in p for a, e in m):
            return p
        parts: list[Poly] = []
        for m, c in p.items():
            acc: Poly = {(): c}
            rest = []
            for a, e in m:
                if a.kind is Kind.POW and e < 0:
                    # a = P^-1 was made by _inv from a primitive, expanded P seeded into the memo
                    base = self.memo.get(a.args[0])
                    base = self.normalise(a.args[0]) if base is None else self._expand(base)
                    acc = _p_mul2(acc, self._pow(base, -e))
                else:
                    rest.append((a, e))
            parts.append(_p_mul2(acc, {tuple(rest): Fraction(1)}))
        return _p_add(parts)

    # -- field arithmetic
    def _mul(self, t: Term, ps: list[Poly]) -> Poly:
        acc: Poly = {(): Fraction(1)}
        for p in ps:
            acc = _p_mul2(acc, p)
            if not acc:
                break
        return self._squared_roots(acc)

    def _pow(self, p: Poly, n: int) -> Poly:
        if n < 0:
            p, n = self._inv(p), -n
        acc: Poly = {(): Fraction(1)}
        base = p
        while n:  # square-and-multiply keeps the expansion count logarithmic in n
            if n & 1:
                acc = _p_mul2(acc, base)
            n >>= 1
            if n:
                base = _p_mul2(base, base)
        return self._squared_roots(acc)

    def _squared_roots(self, p: Poly) -> Poly:
        """sqrt_sq: sqrt(a)^(2q + r) = a^q · sqrt(a)^r in every monomial (where sqrt(a) is defined, a ≥ 0)."""
        roots = self._roots
        if not roots or not any(a in roots and abs(e) >= 2 for m in p for a, e in m):
            return p
        self.axioms.add("sqrt_sq")
        parts: list[Poly] = []
        for m, c in p.items():
            acc: Poly = {(): c}
            rest = []
            for a, e in m:
                if a in roots and abs(e) >= 2:
                    q, r = divmod(e, 2)
                    acc = _p_mul2(acc, self._pow(roots[a], q))
                    if r:
                        rest.append((a, r))
                else:
                    rest.append((a, e))
            parts.append(_p_mul2(acc, {tuple(rest): Fraction(1)}))
        return _p_add(parts)

    def _inv(self, p: Poly) -> Poly:
        if not p:
            raise NormaliseError("division by zero: a denominator normalises to 0")
        if _is_monomial(p):
            (m, c), = p.items()
            return {_m_pow(m, -1): 1 / c}  # may leave (P^-1)^-1 factors: see _expand
        p = self._expand(p)
        if len(p) <= 1:  # expanding can cancel: (2/Q)^-1 - Q/2 is 0
            return self._inv(p)
        c, common, prim = _split_content(p)
        atom = pow_(self._canon(prim), -1)
        if atom not in self._positive:
            self._positive[atom] = self._known_positive(prim)
        return {_m_mul(_m_pow(common, -1), ((atom, 1),)): 1 / c}

    # -- applications
    def _app(self, t: Term, ps: list[Poly]) -> Poly:
        rule = self._app_rules.get(t.payload)
        if rule is not None:
            return rule(t, ps)
        return _p_atom(self._atom(t.payload, [self._canon(p) for p in ps]))

    def _sqrt(self, t: Term, ps: list[Poly]) -> Poly:
        """sqrt(p) as an atom whose square is p (`_squared_roots`); pow_half: x^0.5 is sqrt(x)."""
        if t.payload != "sqrt":
            self.axioms.add("pow_half")
        p = self._expand(ps[0])
        atom = self._atom("sqrt", [self._canon(p)])
        self._roots[atom] = p
        return _p_atom(atom)

    def _canon(self, p: Poly) -> Term:
        # The canonical term has the value of p, so seeding the memo with it is sound and saves
        # re-normalising atom arguments (log_exp, inverse atoms) from scratch.
        p = self._expand(p)
        t = term_of(p)
        self.memo.setdefault(t, p)
        return t

    def _atom(self, name: str, args: list[Term]) -> Term:
        atom = app(name, *args)
        if atom not in self._positive:
            self._positive[atom] = name == "exp"
        return atom

    def _exp(self, t: Term, ps: list[Poly]) -> Poly:
        if len(ps) != 1:
            return _p_atom(self._atom("exp", [self._canon(p) for p in ps]))
        p = self._expand(ps[0])
        if len(p) > 1:
            self.axioms.add("exp_add")
        mono: Mono = ()
        logs: list[Poly] = []
        for m, c in p.items():
            # exp(c·m) with c = ±k/q  ->  exp(m/q)^(±k): one canonical atom per summand
            k, q = c.numerator, c.denominator
            if k < 0:
                self.axioms.add("exp_neg")
            if abs(k) != 1:
                self.axioms.add("exp_add")
            inner = self._logged(m) if q == 1 else None
            if inner is not None:       # exp(k·log P) = P^k for a known-positive P (a softmax by its log-sum-exp)
                self.axioms.add("exp_log")
                logs.append(self._pow(inner, k))
                continue
            atom = self._atom("exp", [self._canon({m: Fraction(1, q)})])
            mono = _m_mul(mono, ((atom, k),))
        out: Poly = {mono: Fraction(1)}
        for factor in logs:
            out = _p_mul2(out, factor)
        return out

    def _logged(self, m: Mono) -> Poly | None:
        """P where the monomial is log(P) for a known-positive P; else None."""
        if len(m) != 1 or m[0][1] != 1 or m[0][0].kind is not Kind.APP or m[0][0].payload != "log":
            return None
        inner = self._expand(self._memoised(m[0][0].args[0]))
        return inner if self._known_positive(inner) else None

    def _known_positive(self, p: Poly) -> bool:
        if not p:
            return False
        return all(c > 0 and all(self._positive.get(a, False) for a, _ in m) for m, c in p.items())

    def _log(self, t: Term, ps: list[Poly]) -> Poly:
        if len(ps) != 1:
            return _p_atom(self._atom("log", [self._canon(p) for p in ps]))
        p = self._expand(ps[0])
        if not p:
            raise NormaliseError("log of a term that normalises to 0")
        if _is_monomial(p):
            (common, c), = p.items()
            prim: Poly = {(): Fraction(1)}
        else:
            c, common, prim = _split_content(p)
        factors_positive = c > 0 and all(self._positive.get(a, False) for a, _ in common)
        if not (factors_positive and self._known_positive(prim)):
            return _p_atom(self._atom("log", [self._canon(p)]))
        parts: list[Poly] = [self._log_const(c)]
        if common and (c != 1 or len(common) > 1 or common[0][1] != 1 or len(prim) > 1):
            self.axioms.add("log_mul")
        for a, e in common:
            parts.append({m: e * q for m, q in self._log_positive_atom(a).items()})
        if prim != {(): 1}:
            if c != 1:
                self.axioms.add("log_mul")
            parts.append(_p_atom(self._atom("log", [self._canon(prim)])))
        return _p_add(parts)

    def _log_positive_atom(self, a: Term) -> Poly:
        if a.kind is Kind.APP and a.payload == "exp":
            self.axioms.add("log_exp")
            return self.normalise(a.args[0])
        # (P)^-1 with P positive: log(1/P) = -log P, a case of log_mul (log P + log(1/P) = log 1)
        self.axioms.add("log_mul")
        base = self.normalise(a.args[0])
        return {m: -q for m, q in self._log(app("log", a.args[0]), [base]).items()}

    def _log_const(self, c: Fraction) -> Poly:
        """log of a positive rational as Σ e·log(prime) (numbers above the trial-division limit stay whole)."""
        if c == 1:
            return {}
        parts: list[Poly] = []
        factors = [(p, e) for p, e in _factorise(c.numerator)] + [(p, -e) for p, e in _factorise(c.denominator)]
        if len(factors) > 1 or any(e != 1 for _, e in factors):
            self.axioms.add("log_mul")
        for prime, e in factors:
            parts.append({((self._atom("log", [const(prime)]), 1),): Fraction(e)})
        return _p_add(parts)

    def _max(self, t: Term, ps: list[Poly]) -> Poly:
        args = [self._canon(p) for p in ps]
        flat: list[Term] = []
        for a in args:
            if a.kind is Kind.APP and a.payload == "max":
                self.axioms.add("max_assoc")
                flat.extend(a.args)
            else:
                flat.append(a)
        ordered = sorted(flat, key=lambda a: a.digest)
        if ordered != flat:
            self.axioms.add("max_comm")
        return _p_atom(self._atom("max", ordered))


def _factorise(n: int) -> list[tuple[int, int]]:
    if n == 1:
        return []
    if n >= _FACTOR_LIMIT:
        return [(n, 1)]
    out = []
    p = 2
    while p * p <= n:
        e = 0
        while n % p == 0:
            n //= p
            e += 1
        if e:
            out.append((p, e))
        p += 1
    if n > 1:
        out.append((n, 1))
    return out


# -- public API --------------------------------------------------------------------------------

def normal_form(term: Term) -> Term:
    """The canonical term of `term`'s normal form (raises NormaliseError on a zero denominator)."""
    return term_of(Normaliser().normalise(term))


def ground_lemmas(*roots: Term) -> tuple[tuple[tuple[Term, Term], ...], tuple[str, ...]]:
    """For tier 2: each exp / log application in the formula equated with its normal form, and the axioms
    used. Each lemma is a ground instance of the guarded axioms (log_mul only where the normaliser knows
    both factors positive), so asserting it is sound — never a quantified or unguarded axiom. With them
    a solver that treats exp and log as uninterpreted can re-check the arithmetic around them."""
    n = Normaliser()
    lemmas = []
    for node in postorder(*roots):
        if node.kind is Kind.APP and node.payload in ("sqrt", "pow[0.5]"):
            root = app("sqrt", *node.args)
            n.axioms.add("sqrt_sq")
            lemmas.append((mul(root, root), node.args[0]))
            if node.payload != "sqrt":
                n.axioms.add("pow_half")
                lemmas.append((node, root))
        if node.kind is Kind.APP and node.payload in ("exp", "log"):
            try:
                canonical = n._canon(n.normalise(node))
            except NormaliseError:
                continue
            if canonical != node:
                lemmas.append((node, canonical))
    return tuple(lemmas), tuple(sorted(n.axioms))


def prove_equal(lhs: Term, rhs: Term) -> Proved | Unknown:
    """Tier 0: Proved(method="normalised", axioms) when the normal forms are equal, else Unknown.

    Never refutes: different normal forms only mean the normaliser could not show equality.

        >>> from tv_ray.terms import var, mul, add
        >>> x, a0, a1 = var("x"), var("a0"), var("a1")
        >>> prove_equal(mul(x, add(a0, a1)), add(mul(x, a0), mul(x, a1))).proved
        True
    """
    n = Normaliser()
    try:
        pl = n.normalise(lhs)
        pr = n.normalise(rhs)
    except NormaliseError as e:
        return Unknown(f"no normal form: {e}")
    if pl == pr:
        return Proved(method="normalised", axioms=tuple(sorted(n.axioms)))
    diff = _p_add([pl, {m: -c for m, c in pr.items()}])
    return Unknown(f"normal forms differ (the normaliser is incomplete); lhs - rhs normalises to "
                   f"{to_str(term_of(diff), max_chars=300)}")


__all__ = ["prove_equal", "normal_form", "ground_lemmas", "Normaliser", "NormaliseError", "term_of", "AXIOMS"]
