"""Scalar terms and the first two solving tiers: hash-consed terms, the tier 0 normaliser, tier 1 random points.

    >>> from tv_ray.terms import var, exp, log, add, sub, prove_equal
    >>> a, b, m = var("a"), var("b"), var("m")
    >>> lhs = add(log(add(exp(sub(a, m)), exp(sub(b, m)))), m)
    >>> prove_equal(lhs, log(add(exp(a), exp(b)))).proved
    True
"""
from tv_ray.terms.term import (ONE, ZERO, Kind, Term, TermError, add, app, const, depth, div, exp, fn, fold,
                               from_table, rebuild, substitute, log, max_, mul, neg, postorder, pow_, prod, size, sub, sum_, to_str,
                               to_table, var, variables)
from tv_ray.terms.result import Proved, Refuted, Unknown
from tv_ray.terms.normal import normal_form, prove_equal
from tv_ray.terms.random_point import refute

__all__ = [
    "Term", "Kind", "TermError", "const", "var", "add", "mul", "pow_", "app", "neg", "sub", "div", "sum_",
    "prod", "exp", "log", "max_", "fn", "ZERO", "ONE", "postorder", "fold", "size", "depth", "variables",
    "to_str", "to_table", "from_table", "rebuild", "substitute", "Proved", "Refuted", "Unknown", "normal_form", "prove_equal", "refute",
]
