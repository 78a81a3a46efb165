"""The tiers on single obligations: what each proves, refutes, or leaves open — and why."""
from tv_ray.engine.solve import Budget, solve
from tv_ray.terms import exp, log, max_, sum_, var
from tv_ray.terms.normal import ground_lemmas
from tv_ray.terms.atom import Atom
from tv_ray.terms.onehot import indicator

x, y, z = var("x"), var("y"), var("z")


def test_normaliser_proves_and_records_axioms():
    lhs = [log(exp(x - z) + exp(y - z)) + z, (x + y) * (x + y)]
    rhs = [log(exp(x) + exp(y)), x * x + 2 * x * y + y * y]
    v = solve(lhs, rhs)
    assert (v.verdict, v.tier, v.method) == ("proved", 0, "normalised")
    assert "log_mul" in v.axioms or "exp_add" in v.axioms


def test_sides_that_are_one_term_are_proved_by_reflexivity_past_the_normalisers_budget():
    big = sum_([var(f"a{i}") for i in range(200)]) * sum_([var(f"b{i}") for i in range(200)])   # 40,000 products
    v = solve([big, (x + y) * (x + y)], [big, x * x + 2 * x * y + y * y], Budget(tiers=(0,)))
    assert (v.verdict, v.tier, v.method) == ("proved", 0, "identical+normalised")
    v = solve([big * (x + y)], [big * x + big * y], Budget(tiers=(0,)))   # equal, not one term: past the budget
    assert v.verdict == "unknown"


def test_random_point_refutes_with_the_element_and_exact_values():
    v = solve([x + y, 2 * (x + y)], [x + y, x + y])
    assert (v.verdict, v.tier, v.method, v.element) == ("refuted", 1, "random-point", 1)
    left, right = v.values
    assert left != right and set(v.point) == {"x", "y"}


def test_a_true_identity_the_normaliser_cannot_show_stays_unknown_without_smt():
    lhs = [max_(x, y) + (-max_(-x, -y))]           # max + min = x + y: true, not a normal form
    v = solve(lhs, [x + y], Budget(tiers=(0, 1)))
    assert v.verdict == "unknown"
    assert v.reason == "1 of 1 equation(s) open; equation 0: normal forms differ and no counterexample was found"


def test_smt_tier_proves_what_the_normaliser_leaves_open():
    v = solve([max_(x, y) + (-max_(-x, -y))], [x + y], Budget(solvers=("z3",), tiers=(0, 1, 2)))
    assert (v.verdict, v.tier, v.method) == ("proved", 2, "smt:z3")


def test_smt_tier_proves_the_open_equations_in_one_query_and_names_a_false_one_alone(monkeypatch):
    from tv_ray.engine import solve as tiers
    alone = []
    prove = tiers.prove_with_record
    monkeypatch.setattr(tiers, "prove_with_record", lambda lhs, *rest: alone.append(lhs) or prove(lhs, *rest))
    min_ = -max_(-x, -y)
    v = solve([max_(x, y) + min_, max_(x, z) + (-max_(-x, -z))], [x + y, x + z], Budget(solvers=("z3",), tiers=(2,)))
    assert (v.verdict, v.tier, v.method) == ("proved", 2, "smt:z3") and alone == []
    v = solve([max_(x, y) + min_, max_(x, y)], [x + y, x], Budget(solvers=("z3",), tiers=(2,)))
    assert (v.verdict, v.element) == ("refuted", 1) and alone == [max_(x, y) + min_, max_(x, y)]


def test_indicators_are_drawn_one_hot_so_a_selection_identity_is_not_refuted():
    # Σ_v δ_v = 1 holds only for one-hot indicators; free random values would "refute" it.
    total = sum_([indicator(Atom("t", (0,)), v, 3) for v in range(3)])
    v = solve([total * x], [x], Budget(tiers=(0, 1)))
    assert v.verdict == "proved"
    d0, d1 = indicator(Atom("t", (0,)), 0, 3), indicator(Atom("t", (0,)), 1, 3)
    bad = solve([d0 * x + d1 * y], [d0 * y + d1 * x], Budget(tiers=(0, 1), points=8))
    assert bad.verdict == "refuted"
    values = [bad.point[k] for k in bad.point if k.startswith("onehot:")]
    assert all(val in ("0", "1") for val in values) and values.count("1") <= 1


def test_smt_tier_gets_the_normalisers_ground_lemmas_for_exp_and_log():
    """A split log-softmax re-proved by SMT alone (the checker's independent re-proof): exp and log are
    uninterpreted for the solvers, so each application comes with the ground equation to its normal form."""
    lhs, rhs = [log(exp(x - z) + exp(y - z)) + z], [log(exp(x) + exp(y))]
    v = solve(lhs, rhs, Budget(solvers=("z3",), tiers=(2,)))
    assert (v.verdict, v.method) == ("proved", "smt:z3") and "exp_add" in v.axioms
    wrong = solve(lhs, [log(exp(x) + exp(y)) + z], Budget(solvers=("z3",), tiers=(2,)))
    assert wrong.verdict != "proved"
    assert ground_lemmas(log(x * y)) == ((), ())      # signs unknown: log(xy) = log x + log y is not stated


def test_a_solve_task_travels_as_a_term_table_and_is_solved_here_as_it_is():
    """Pickled (to a worker process or an actor), a task is its key, a flat term table and the number of
    equations — no live term — and comes back with the very same interned terms; solved in this process, its
    terms are never serialised."""
    import pickle

    from tv_ray.engine.executor import SolveTask, solve_batch
    from tv_ray.terms import Term, add, to_table
    x, y = var("x"), var("y")
    task = SolveTask.make("k", [add(x, y), x], [add(y, x), y])
    rebuild, args = task.__reduce__()
    assert args == ("k", to_table(add(x, y), x, add(y, x), y), 2)
    assert not any(isinstance(a, Term) for a in args)
    back = pickle.loads(pickle.dumps(task))
    assert back.key == "k" and back.equations == 2 and all(a is b for a, b in zip(back.roots, task.roots))
    (key, verdict), = solve_batch([task], Budget(solvers=("z3",)))
    assert key == "k" and verdict.verdict == "refuted"          # x = y is false
