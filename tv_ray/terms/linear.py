"""Like terms collected: a term's outer linear layer as one sum with a coefficient per summand.

The constructors of `term` flatten sums but never combine like terms, so
``x + (-1)·(x + y)`` stays as built. `collect` rewrites the sums and constant
multiples at the top of a term into one linear combination of what lies below
them (products, powers, applications and variables, kept as they are),
with zero coefficients dropped: ``x + (-1)·(x + y)`` is ``(-1)·y``. Only the
ring identities (distributing a constant over a sum, adding coefficients) are
used, so the result equals the term over the reals wherever it is defined.

A stage reads this where a partial claim's parts are summed whole: the last
member's part is the tensor minus the others', so over every member the parts
cancel, and a sum over a dp × tp group (512 members at 405B) collects to the
claimed tensor's own atoms.

    >>> from tv_ray.terms import var, add, neg, mul, const
    >>> x, y = var("x"), var("y")
    >>> collect(add(x, neg(add(x, y)))) is neg(y)
    True
    >>> collect(add(mul(x, y), mul(const(2), x), const(3))) is add(mul(x, y), mul(const(2), x), const(3))
    True
"""
from __future__ import annotations

from fractions import Fraction

from tv_ray.terms.term import ONE, Kind, Term, add, const, mul

Linear = dict[Term, Fraction]    # summand (ONE for the constant) → nonzero coefficient


def collect(term: Term, memo: dict[Term, Linear] | None = None) -> Term:
    """`term` with the like terms of its outer sums collected; `memo` shares the work across terms."""
    memo = {} if memo is None else memo
    stack = [term]
    while stack:                       # iterative, into sums and constant multiples only
        node = stack[-1]
        if node in memo:
            stack.pop()
            continue
        inner = _summands(node)
        pending = [a for a in inner if a not in memo]
        if pending:
            stack.extend(pending)
            continue
        memo[node] = _linear(node, inner, memo)
        stack.pop()
    return add(*(summand if c == 1 else mul(const(c), summand) for summand, c in memo[term].items()))


def _summands(node: Term) -> tuple[Term, ...]:
    """What a node's linear form is made of: a sum's summands, c·x's x (a product of the other factors)."""
    if node.kind is Kind.ADD:
        return node.args
    if node.kind is Kind.MUL and any(a.kind is Kind.CONST for a in node.args):
        return (mul(*(a for a in node.args if a.kind is not Kind.CONST)),)
    return ()


def _linear(node: Term, inner: tuple[Term, ...], memo: dict[Term, Linear]) -> Linear:
    if node.kind is Kind.CONST:
        return {ONE: node.payload} if node.payload else {}
    if not inner:
        return {node: Fraction(1)}
    if node.kind is Kind.MUL:                       # c·x (the constructors fold a product's constants into one)
        c = next(a.payload for a in node.args if a.kind is Kind.CONST)
        return {t: c * k for t, k in memo[inner[0]].items()}
    out: Linear = {}
    for arg in inner:
        for t, k in memo[arg].items():
            total = out.get(t, 0) + k
            if total:
                out[t] = total
            else:
                out.pop(t, None)
    return out
