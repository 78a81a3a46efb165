"""Terms: interning (structural equality is identity), stable content hashes, cheap sound constructors, no recursion."""
from __future__ import annotations

import pickle
import subprocess
import sys
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest

import tv_ray.terms

from tv_ray.terms import (ONE, ZERO, Kind, TermError, add, app, const, depth, div, exp, from_table, fold, log,
                          max_, mul, normal_form, postorder, pow_, prove_equal, refute, size, sub, to_str,
                          to_table, var)

# The package root imports torch (seconds); the child loads only tv_ray.terms and tv_ray.errors.
KEY_SCRIPT = """
import sys, types
root = types.ModuleType("tv_ray")
root.__path__ = [sys.argv[1]]
sys.modules["tv_ray"] = root
from tv_ray.terms import add, app, const, div, exp, log, max_, mul, var
x, y = var("x"), var("y")
t = add(log(add(exp(x), exp(y))), div(mul(const(3), x), add(y, const("0.5"))), max_(x, y), app("silu", x))
print(t.key)
"""


def sample():
    x, y = var("x"), var("y")
    return add(log(add(exp(x), exp(y))), div(mul(const(3), x), add(y, const("0.5"))), max_(x, y), app("silu", x))


def test_structurally_equal_terms_are_the_same_object():
    x, y, z = var("x"), var("y"), var("z")
    assert var("x") is x
    assert add(x, y) is add(y, x)
    assert add(x, add(y, z)) is add(add(x, y), z) is add(z, y, x)
    assert mul(x, mul(y, z)) is mul(z, x, y)
    assert app("sigmoid", x) is app("sigmoid", var("x"))
    assert app("sigmoid", x) is not app("silu", x)
    assert const(Fraction(1, 2)) is const("0.5") is const(0.5)
    assert sample() is sample()


@pytest.mark.parametrize("base", ["w", "layers.0.attn.q_proj.weight", ("stage", 3)], ids=str)
def test_a_tensors_atoms_made_at_once_are_the_atoms_var_makes(base):
    from tv_ray.terms.atom import Atom
    from tv_ray.terms.term import atom_vars, grid_vars
    indices = [(), (0,), (1, 2), (10, 0, 3)]
    made = atom_vars(base, indices)
    assert all(t is var(Atom(base, idx)) for t, idx in zip(made, indices))
    assert [t.payload for t in made] == [Atom(base, idx) for idx in indices]
    for shape in [(), (3,), (2, 3), (2, 0, 3), (3, 1, 12)]:       # a whole tensor's, in row-major order
        grid = grid_vars(base, shape)
        assert len(grid) == int(np.prod(shape))
        assert all(t is var(Atom(base, idx)) for t, idx in zip(grid, np.ndindex(shape)))
    for offsets, shape in [((2,), (3,)), ((1, 4), (2, 3)), ((0, 5, 1), (3, 1, 2)), ((7, 0), (0, 2))]:   # a region's
        grid = grid_vars(base, shape, offsets)
        assert len(grid) == int(np.prod(shape))
        assert all(t is var(Atom(base, tuple(o + i for o, i in zip(offsets, idx))))
                   for t, idx in zip(grid, np.ndindex(shape)))


def test_max_arguments_keep_their_order_in_the_constructor():
    x, y = var("x"), var("y")
    assert max_(x, y) is not max_(y, x)  # commutativity is the normaliser's recorded axiom, not the constructor's


def test_content_hash_is_stable_across_processes():
    key = sample().key
    assert len(key) == 64
    package_dir = str(Path(tv_ray.terms.__file__).resolve().parents[1])
    out = subprocess.run([sys.executable, "-c", KEY_SCRIPT, package_dir], capture_output=True, text=True, check=True,
                         env={"PYTHONHASHSEED": "12345", "PATH": ""})
    assert out.stdout.strip() == key


def test_hash_separates_kinds_and_payloads():
    x = var("x")
    keys = {t.key for t in (x, var("y"), const(1), const(-1), app("x"), app("exp", x), app("log", x),
                            pow_(x, 2), pow_(x, -2), pow_(x, 3), mul(const(2), x), add(const(2), x))}
    assert len(keys) == 12


def test_constructors_fold_constants_and_neutral_elements():
    x, y = var("x"), var("y")
    assert add(x, const(2), const(-2)) is x
    assert add() is ZERO and mul() is ONE
    assert mul(x, const(0), y) is ZERO
    assert mul(const(2), const(3)) is const(6)
    assert pow_(x, 1) is x and pow_(x, 0) is ONE
    assert pow_(pow_(x, 2), -3) is pow_(x, -6)
    assert pow_(const(2), -2) is const(Fraction(1, 4))
    assert pow_(ZERO, -1).kind is Kind.POW  # 1/0 is kept, not folded
    assert sub(x, x).kind is Kind.ADD  # like terms are the normaliser's job


def test_terms_are_immutable_and_reject_bad_input():
    x = var("x")
    with pytest.raises(AttributeError, match="immutable"):
        x.payload = "y"
    with pytest.raises(TermError, match="not an integer"):
        pow_(x, 0.5)
    with pytest.raises(TermError, match="not a number"):
        const(True)
    with pytest.raises(TermError, match="finite"):
        const(float("inf"))
    with pytest.raises(TermError, match="non-empty"):
        var("")


def test_table_and_pickle_round_trip_to_the_same_object():
    t = sample()
    assert from_table(to_table(t)) is t
    assert pickle.loads(pickle.dumps(t)) is t
    with pytest.raises(TermError, match="later or missing"):
        from_table({"nodes": [[int(Kind.APP), "exp", [1]], [int(Kind.VAR), "x", []]], "roots": [0]})


def test_walkers_visit_each_shared_node_once_children_first():
    x = var("x")
    e = exp(x)
    t = mul(add(e, const(1)), add(e, const(2)))
    order = postorder(t)
    assert len(order) == len(set(order)) == size(t)
    pos = {n: i for i, n in enumerate(order)}
    assert all(pos[a] < pos[n] for n in order for a in n.args)
    assert fold(t, lambda n, cs: 1 + sum(cs)) == 9  # tree count: shared exp(x) counted per use


def test_a_deep_chain_never_hits_the_recursion_limit():
    n = 10_000
    assert n > sys.getrecursionlimit()
    x = var("x")
    t, u = x, x
    for i in range(n):
        t = app("tanh", add(t, const(1)))
        u = app("tanh", add(const(1), u))
    assert t is u
    assert depth(t) == 2 * n + 1
    assert len(to_table(t)["nodes"]) == size(t)
    assert pickle.loads(pickle.dumps(t)) is t
    assert len(to_str(t)) > n
    assert prove_equal(t, u).proved
    assert refute(t, u, points=1).verdict == "unknown"
    nested = x
    for _ in range(n):
        nested = log(exp(nested))
    assert normal_form(nested) is x
    del t, u, nested  # freeing the chain must not recurse either
