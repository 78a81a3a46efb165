"""The symbolic rules agree with the concrete ones: every node of real training steps, evaluated as terms
at the concrete inputs, gives the concrete value (so the two domains are one semantics)."""
import math

import numpy as np
import pytest

from tv_ray import api
from tv_ray.errors import UnknownOpError
from tv_ray.ir import Node, Op
from tv_ray.semantics import run_graph
from tv_ray.partition.stages import LogicalTerms
from tv_ray.semantics.symbolic import SymbolicError, choice, eval_symbolic, positions, select
from tv_ray.simulate import draw_inputs
from tv_ray.terms import Kind, Term, postorder, var
from tv_ray.terms.atom import Atom
from tv_ray.terms.onehot import is_indicator

REAL = {"exp": math.exp, "log": math.log, "rsqrt": lambda x: 1 / math.sqrt(x), "sqrt": math.sqrt,
        "sigmoid": lambda x: 1 / (1 + math.exp(-x)), "tanh": math.tanh, "cos": math.cos, "sin": math.sin,
        "abs": abs, "max": max, "gelu[none]": lambda x: 0.5 * x * (1 + math.erf(x / math.sqrt(2))),
        "gelu[tanh]": lambda x: 0.5 * x * (1 + math.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3))),
        "inf": lambda: math.inf}


def evaluate(term, atoms: dict, ints: dict) -> float:
    memo = {}
    for node in postorder(term):
        vs = [memo[a] for a in node.args]
        if node.kind is Kind.CONST:
            v = float(node.payload)
        elif node.kind is Kind.VAR:
            if is_indicator(node.payload):
                v = float(ints[node.payload.element] == node.payload.onehot[0])
            else:
                v = atoms[node.payload]
        elif node.kind is Kind.ADD:
            v = math.fsum(vs)
        elif node.kind is Kind.MUL:
            v = math.prod(vs)
        elif node.kind is Kind.POW:
            v = vs[0] ** node.payload
        elif node.payload.startswith("pow["):
            v = vs[0] ** float(node.payload[4:-1])
        elif node.payload.startswith("powbase["):
            v = float(node.payload[8:-1]) ** vs[0]
        else:
            v = REAL[node.payload](*vs)
        memo[node] = v
    return memo[term]


@pytest.mark.parametrize("model", ["llama3-tiny", "gpt2-tiny"])
def test_every_node_of_a_training_step_matches_the_concrete_rule(model):
    graph = api.capture_step(model, optim="adamw", clip=1.0)
    dims = {"batch": 2, "seq": 2, "kv_heads": 1, "n_rep": 2, "head_dim": 2, "ffn": 2, "vocab": 3, "heads": 2,
            "d_model": 4, "d_ff": 4, "positions": 2}
    dims = {k: v for k, v in dims.items() if any(k in str(s) for s in graph.inputs for s in s.shape)}
    values = run_graph(graph, dims, draw_inputs(graph, dims, np.random.default_rng(0)), keep=True)
    lt = LogicalTerms.build(graph, dims)
    ints = {}
    for spec in graph.inputs:
        if spec.dtype == "int":
            for idx in np.ndindex(values[spec.name].shape):
                ints[Atom(spec.name, idx)] = int(values[spec.name][idx])
    atoms = {}
    for tensor in lt.order:             # every tensor, its atoms made where they were left for later
        value = lt.full(tensor)
        for idx in np.ndindex(value.shape):
            term = value[idx]
            if isinstance(term, Term) and lt.tensor_of(term) == tensor:
                atoms[term.payload] = float(values[tensor][idx])
    for node in graph.nodes:            # an arange's elements are variables named by its definition
        if node.op is Op.ARANGE:
            for k, value in enumerate(values[node.name]):
                atoms[Atom(positions(node), (k,))] = float(value)
    checked = 0
    for node in graph.nodes:
        if node.dtype != "float":
            continue
        want = values[node.name]
        got = lt.definition_at(node.name, tuple(slice(0, n) for n in want.shape) + (Ellipsis,))
        for idx in np.ndindex(want.shape):
            w = float(want[idx])
            g = evaluate(got[idx], atoms, ints)
            assert g == pytest.approx(w, rel=1e-9, abs=1e-12) or (math.isinf(w) and g == w), \
                f"{node.name} = {node.op}{list(node.args)} at {idx}: symbolic {g}, concrete {w}"
            checked += 1
    assert checked > 1000


def test_choice_select_and_int_ops():
    t = choice(Atom("tok", (0,)), 3)
    row = [var("w0"), var("w1"), var("w2")]
    picked = select(t, row)
    for v in range(3):
        assert evaluate(picked, {"w0": 1.0, "w1": 2.0, "w2": 4.0}, {Atom("tok", (0,)): v}) == [1.0, 2.0, 4.0][v]
    node = Node.make("e", "eq", ["a"], {"other": 1}, [], "bool")
    out = eval_symbolic(node, [np.asarray(t, dtype=object)], {})
    assert out.item().table == (False, True, False)


@pytest.mark.parametrize("op", ["gather", "scatter", "scatter_add"])
def test_gather_and_scatter_by_an_index_from_data_match_the_concrete_rule(op):
    """A row indexed by a token: at every value of the token, the symbolic value is the concrete one."""
    from tv_ray.semantics import eval_node
    tok = Atom("tok", (0,))
    x = np.asarray([[var(f"x{i}{j}") for j in range(3)] for i in range(2)], dtype=object)
    src = np.asarray([[var("s0")], [var("s1")]], dtype=object)
    index = np.asarray([[choice(tok, 3)], [1]], dtype=object)
    args, shape = ([x, index], (2, 1)) if op == "gather" else ([x, index, src], (2, 3))
    node = Node.make("o", op, ["x", "i", "s"][:len(args)], {"dim": 1}, shape)
    got = eval_symbolic(node, args, {})
    atoms = {f"x{i}{j}": float(3 * i + j + 1) for i in range(2) for j in range(3)} | {"s0": 10.0, "s1": 20.0}
    for v in range(3):
        concrete = [np.arange(1.0, 7.0).reshape(2, 3), np.asarray([[v], [1]])] + \
            ([np.asarray([[10.0], [20.0]])] if op != "gather" else [])
        want = eval_node(node, concrete, {})
        for idx in np.ndindex(shape):
            assert evaluate(got[idx], atoms, {tok: v}) == want[idx], (v, idx)


def test_scatter_at_a_fixed_numpy_index_writes_that_position_alone():
    x = np.asarray([[var("x0"), var("x1"), var("x2")]], dtype=object)
    node = Node.make("o", "scatter", ["x", "i", "s"], {"dim": 1}, (1, 3))
    got = eval_symbolic(node, [x, np.asarray([[np.int64(1)]], dtype=object), np.asarray([[var("s")]], dtype=object)], {})
    assert list(got[0]) == [var("x0"), var("s"), var("x2")]


def test_a_choice_inside_a_choice_on_the_same_token_has_no_product_of_its_indicators():
    """select(t, [.., select(t, ..), ..]) takes the inner one where the token is that value (one-hot)."""
    t = choice(Atom("tok", (0,)), 3)
    inner = select(t, [var("a"), var("b"), var("c")])
    outer = select(t, [inner, var("d"), inner])
    for v in range(3):
        assert evaluate(outer, {"a": 1.0, "b": 2.0, "c": 4.0, "d": 8.0}, {Atom("tok", (0,)): v}) == [1.0, 8.0, 4.0][v]
    def has_indicator(term) -> bool:
        return any(a.kind is Kind.VAR and is_indicator(a.payload) for a in postorder(term))
    assert not [n for n in postorder(outer) if n.kind is Kind.MUL and sum(map(has_indicator, n.args)) > 1]


def test_two_data_elements_in_one_int_value_are_refused():
    node = Node.make("s", "add", ["a", "b"], {}, [], "int")
    with pytest.raises(SymbolicError, match="depends on two data elements"):
        eval_symbolic(node, [np.asarray(choice(Atom("a", (0,)), 2), dtype=object),
                             np.asarray(choice(Atom("b", (0,)), 2), dtype=object)], {})


def test_an_op_without_a_symbolic_rule_is_named():
    node = Node.make("k", "topk_values", ["x"], {"k": 1, "dim": 0}, [1], "float")
    with pytest.raises(UnknownOpError, match="no symbolic rule for op topk_values"):
        eval_symbolic(node, [np.asarray([var("x0"), var("x1")], dtype=object)], {})


def test_a_double_nearest_a_root_of_a_small_rational_is_that_root():
    """fl(√2) (DTensor divides a replicated tensor's norm by it on a mesh axis of 2) stands for √2 — so n such norms
    squared and summed are the norm squared; other doubles are their exact binary values."""
    from fractions import Fraction
    from tv_ray.semantics.symbolic import to_term
    from tv_ray.terms import app, const, var
    from tv_ray.terms.normal import prove_equal
    assert to_term(math.sqrt(2)) is app("sqrt", const(2)) and to_term(-math.sqrt(3)) is -app("sqrt", const(3))
    assert to_term(1 / math.sqrt(2)) is to_term(math.sqrt(0.5)) is app("sqrt", const(Fraction(1, 2)))
    assert to_term(0.1) is const(Fraction(0.1)) and to_term(0.5) is const(Fraction(1, 2))
    assert to_term(1 / math.sqrt(128)) is const(Fraction(1 / math.sqrt(128)))      # beyond ROOT_LIMIT
    x = var("x")
    share = x / to_term(math.sqrt(2))
    assert prove_equal(share * share + share * share, x * x).__class__.__name__ == "Proved"


def test_an_int_arange_indexes_as_ints_and_is_its_positions_variables_as_a_number():
    """torchtitan's RoPE: `arange(0, dim, 2)[: dim // 2].float() / dim` — at reduced dims the arange keeps its
    first positions, so used as a number each element is the variable of its position, as a float arange's is."""
    arange = Node.make("a", "arange", [], {"start": 0, "end": "head_dim", "step": 2, "dtype": "int"},
                       ["head_dim/2"], "int")
    ints = eval_symbolic(arange, [], {"head_dim": 6})
    assert list(ints) == [0, 2, 4] and all(isinstance(v, int) for v in ints)
    floats = eval_symbolic(Node.make("f", "cast", ["a"], {"dtype": "float"}, ["head_dim/2"], "float"), [ints],
                           {"head_dim": 6})
    assert [str(t) for t in floats] == ["arange(0,head_dim,2)[0]", "arange(0,head_dim,2)[1]", "arange(0,head_dim,2)[2]"]
    shifted = eval_symbolic(Node.make("s", "add", ["a"], {"other": 1}, ["head_dim/2"], "int"), [ints], {"head_dim": 6})
    assert list(shifted) == [1, 3, 5]
