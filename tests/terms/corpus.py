"""Plan-shaped scalar obligations with their expected verdicts: one corpus drives the tier 0 and tier 1 tests.

Each case is (name, lhs, rhs, expect) with lhs the physical (distributed) side and
rhs the logical side; expect is
  "proved" — a true identity tier 0 must prove (and tier 1 must not refute),
  "gap"    — a true identity outside the normaliser (Unknown from both tiers),
  "bug"    — a false one (Unknown from tier 0, Refuted by tier 1).
"""
from __future__ import annotations


from tv_ray.terms import add, app, const, div, exp, log, max_, mul, sub, sum_, var

gelu = lambda t: app("gelu", t)  # noqa: E731


def mat(name: str, rows: int, cols: int) -> list[list]:
    return [[var(f"{name}[{i},{j}]") for j in range(cols)] for i in range(rows)]


def matmul(a: list[list], b: list[list]) -> list[list]:
    inner = len(b)
    return [[sum_(mul(a[i][k], b[k][j]) for k in range(inner)) for j in range(len(b[0]))] for i in range(len(a))]


def cols(m, lo, hi):
    return [row[lo:hi] for row in m]


def rows(m, lo, hi):
    return m[lo:hi]


def _mlp_tp2():
    """Megatron TP=2 MLP Y = gelu(X·A)·B, A split by columns, B by rows; two partial sums all-reduced."""
    b, d, f = 2, 2, 4
    X, A, B = mat("X", b, d), mat("A", d, f), mat("B", f, d)
    Z = matmul(X, A)
    Y = matmul([[gelu(z) for z in row] for row in Z], B)
    partial = []
    for r in range(2):
        Zr = matmul(X, cols(A, 2 * r, 2 * r + 2))
        partial.append(matmul([[gelu(z) for z in row] for row in Zr], rows(B, 2 * r, 2 * r + 2)))
    cases = []
    # column-parallel stage: Z[:, r-th half] == Z_r entrywise (r = 1, entry [1, 0])
    Z1 = matmul(X, cols(A, 2, 4))
    cases.append(("tp2_mlp_column_slice", Z1[1][0], Z[1][2], "proved"))
    cases.append(("tp2_mlp_all_reduce", add(partial[0][0][1], partial[1][0][1]), Y[0][1], "proved"))
    cases.append(("tp2_mlp_missing_all_reduce", partial[0][0][1], Y[0][1], "bug"))
    return cases


def _row_parallel():
    """Row-parallel linear Y = X·W, W split by rows, X by columns: Y == P_0 + P_1."""
    X, W = mat("X", 2, 4), mat("W", 4, 3)
    Y = matmul(X, W)
    P = [matmul(cols(X, 2 * r, 2 * r + 2), rows(W, 2 * r, 2 * r + 2)) for r in range(2)]
    return [("row_parallel_partial_sums", add(P[0][1][2], P[1][1][2]), Y[1][2], "proved"),
            ("row_parallel_missing_all_reduce", P[1][1][2], Y[1][2], "bug")]


def _dp_gradient():
    """DP=2 gradient of the mean squared error over a global batch of N=4, averaged across ranks."""
    n, d = 4, 2
    w = [var(f"w{k}") for k in range(d)]
    x = mat("x", n, d)
    y = [var(f"y{i}") for i in range(n)]

    def grad(k, batch):  # d/dw_k of (1/|batch|) Σ (w·x_i - y_i)^2
        terms = [mul(const(2), sub(sum_(mul(w[j], x[i][j]) for j in range(d)), y[i]), x[i][k]) for i in batch]
        return div(sum_(terms), const(len(batch)))

    logical = grad(0, range(n))
    g0, g1 = grad(0, range(0, 2)), grad(0, range(2, 4))
    avg = div(add(g0, g1), const(2))
    # a rank that sums local gradients and divides by the global batch once
    local_sums = [mul(const(2), grad(0, half)) for half in (range(0, 2), range(2, 4))]
    return [("dp_grad_all_reduce_avg", avg, logical, "proved"),
            ("dp_grad_global_batch", div(add(*local_sums), const(n)), logical, "proved"),
            ("dp_grad_sum_not_avg", add(g0, g1), logical, "bug"),          # 2×
            ("dp_grad_double_divide", div(avg, const(2)), logical, "bug")]  # ½×


def _softmax_split():
    """log-sum-exp with the max cancelled, whole and split over two ranks (max all-reduced)."""
    a = [var(f"a{j}") for j in range(4)]
    lse = log(sum_(exp(t) for t in a))
    m = max_(*a)
    stable = add(log(sum_(exp(sub(t, m)) for t in a)), m)
    m_r = [max_(a[0], a[1]), max_(a[2], a[3])]
    m_glob = max_(m_r[1], m_r[0])  # all-reduce max: the order of arrival is the other rank's
    s_r = [sum_(exp(sub(t, m_glob)) for t in a[2 * r: 2 * r + 2]) for r in range(2)]
    split = add(log(add(*s_r)), m_glob)
    # online softmax: each half rescaled from its local max to the global one
    s_loc = [sum_(exp(sub(t, m_r[r])) for t in a[2 * r: 2 * r + 2]) for r in range(2)]
    online = add(log(add(*(mul(s_loc[r], exp(sub(m_r[r], m_glob))) for r in range(2)))), m_glob)
    # softmax entry from the split sum equals the logical one
    sm_split = div(exp(sub(a[1], m_glob)), add(*s_r))
    sm_logical = div(exp(a[1]), sum_(exp(t) for t in a))
    return [("lse_max_cancelled", stable, lse, "proved"),
            ("lse_split_2", split, lse, "proved"),
            ("lse_split_vs_stable", split, stable, "proved"),
            ("online_softmax_rescale", online, lse, "proved"),
            ("softmax_entry_split", sm_split, sm_logical, "proved"),
            ("lse_split_one_partial", add(log(s_r[0]), m_glob), lse, "bug")]


def _vocab_parallel_ce():
    """Megatron vocab-parallel cross-entropy, vocab 4 split 2-way, target in rank 0's shard."""
    z = [var(f"z{j}") for j in range(4)]
    t = 1
    logical_loss = sub(log(sum_(exp(v) for v in z)), z[t])
    m = max_(max_(z[0], z[1]), max_(z[2], z[3]))
    shifted = [sub(v, m) for v in z]
    sum_exp = add(sum_(exp(v) for v in shifted[0:2]), sum_(exp(v) for v in shifted[2:4]))
    predicted = add(shifted[t], const(0))  # rank 1 contributes 0 (target outside its shard)
    loss = sub(log(sum_exp), predicted)
    # backward: d loss / d z_j = softmax_j - [j == t], from the shifted exp over the all-reduced sum
    grad_phys = [sub(div(exp(shifted[j]), sum_exp), const(1 if j == t else 0)) for j in range(4)]
    grad_log = [sub(div(exp(z[j]), sum_(exp(v) for v in z)), const(1 if j == t else 0)) for j in range(4)]
    cases = [("vocab_ce_forward", loss, logical_loss, "proved")]
    cases += [(f"vocab_ce_backward_{j}", grad_phys[j], grad_log[j], "proved") for j in (1, 2)]
    cases.append(("vocab_ce_plus_log_tp", add(loss, log(const(2))), logical_loss, "bug"))
    cases.append(("vocab_ce_local_sum_only", sub(log(sum_(exp(v) for v in shifted[0:2])), predicted),
                  logical_loss, "bug"))
    return cases


def _gaps():
    """True identities the normaliser cannot show (no gcd: Q·Q⁻¹ after a sum)."""
    a = [var(f"a{j}") for j in range(3)]
    s = sum_(exp(t) for t in a)
    x, y = var("x"), var("y")
    return [("softmax_sums_to_one", sum_(div(exp(t), s) for t in a), const(1), "gap"),
            ("q_times_inverse_q", mul(add(x, y), div(const(1), add(x, y))), const(1), "gap"),
            ("unguarded_log_product", log(mul(x, y)), add(log(x), log(y)), "gap")]


CASES = _mlp_tp2() + _row_parallel() + _dp_gradient() + _softmax_split() + _vocab_parallel_ce() + _gaps()
BY_NAME = {c[0]: c for c in CASES}
assert len(BY_NAME) == len(CASES), "duplicate case names"
