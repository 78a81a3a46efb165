"""Tensor-parallel block symmetry: which logical tensors are cut into tp blocks, and the proof that the logical step
commutes with permuting the blocks — checked here by running the step on permuted inputs."""
from __future__ import annotations

import numpy as np
import pytest

from tv_ray import api, models
from tv_ray.errors import Asymmetric
from tv_ray.ir import Node
from tv_ray.ir.ops import RANK_DEPENDENT
from tv_ray.partition.claims import Claim, Claims
from tv_ray.partition.derive import derived_claims
from tv_ray.partition.logical import LogicalTerms
from tv_ray.partition.tp_blocks import TP, Spans, TpBlocks, TpTag, derived_tag, share, tp_mirrors
from tv_ray.reduce import reduce_plan
from tv_ray.semantics.interpret import eval_node, run_graph
from tv_ray.semantics.symbolic import eval_symbolic
from tv_ray.terms.atom import Atom
from tv_ray.terms.normal import prove_equal
from tv_ray.simulate import draw_inputs


def _plan(model: str, spec: str):
    plan = api.parallelize(api.capture_step(model, optim="adamw", clip=1.0), spec, model=model)
    return plan, reduce_plan(plan).reduced


@pytest.fixture(scope="module")
def llama():
    plan, dims = _plan("llama3-tiny", "dp=2,tp=2,pp=2,mb=2")
    return plan, dims, TpBlocks.of(plan, dims)


def _swapped(value: np.ndarray, tag: TpTag, a: int, b: int) -> np.ndarray:
    """`value` with tp blocks a and b swapped along its tagged dim."""
    idx = np.arange(value.shape[tag.dim])
    block = (idx // tag.q) % tag.period
    moved = idx + np.where(block == a, (b - a) * tag.q, np.where(block == b, (a - b) * tag.q, 0))
    return np.take(value, moved, axis=tag.dim)


def test_the_plan_s_tp_weights_give_the_blocks_and_what_is_computed_from_them(llama):
    plan, dims, blocks = llama
    tags = blocks.tags
    heads, hd = dims["kv_heads"] * dims["n_rep"], dims["head_dim"]
    assert tags["layers.0.attn.q_proj.weight"] == TpTag(0, heads * hd // 2, 2)
    assert tags["layers.0.attn.k_proj.weight"] == TpTag(0, dims["kv_heads"] * hd // 2, 2)
    assert tags["layers.1.attn.o_proj.weight"] == TpTag(1, heads * hd // 2, 2)
    assert tags["layers.0.mlp.down_proj.weight"] == TpTag(1, dims["ffn"] // 2, 2)
    assert tags["exp_avg_sq/layers.1.mlp.gate_proj.weight"] == TpTag(0, dims["ffn"] // 2, 2)
    # the vocabulary-parallel tables: token data index their blocks, so nothing may permute them
    assert blocks.dropped["embed.weight"] == "logical op embedding = embedding(...): embedding is not known to " \
                                            "commute with permuting tp blocks"
    assert blocks.dropped["lm_head.weight"] == "logical op _log_softmax = _log_softmax(...): _log_softmax along " \
                                              "the tp blocks"
    assert "embed.weight" not in tags and "lm_head.weight" not in tags and "exp_avg/lm_head.weight" not in tags
    # attention's batched products hold head blocks on the merged (batch · heads) dim
    scores = [n for n in plan.logical.nodes if n.op.value == "bmm"][0]
    assert tags[scores.name] == TpTag(0, heads // 2, 2)
    # the output projection contracts over the head blocks: a contribution sum, without blocks
    o_proj = next(n.name for n in plan.logical.nodes if n.op.value == "mm" and
                  "layers.0.attn.o_proj.weight" in _sources(plan, n.name))
    assert o_proj in blocks.sums and o_proj not in tags


def _sources(plan, name: str) -> set[str]:
    nodes = {n.name: n for n in plan.logical.nodes}
    seen, stack = set(), [name]
    while stack:
        n = nodes.get(stack.pop())
        for a in n.args if n is not None else ():
            if a not in seen and len(seen) < 8:
                seen.add(a)
                stack.append(a)
    return seen


@pytest.mark.parametrize("model,spec", [("llama3-tiny", "dp=2,tp=2,pp=2,mb=2"), ("gpt2-tiny", "tp=2"),
                                        ("deepseek-tiny", "dp=2,tp=2,ep=2")])
def test_the_step_on_inputs_with_two_blocks_swapped_is_the_step_with_them_swapped(model, spec):
    """What the proof claims, run: every tensor's value on inputs whose tagged blocks 0 and 1 are swapped is its
    value with those blocks swapped (a tensor without blocks: the same value)."""
    plan, dims = _plan(model, spec)
    blocks = TpBlocks.of(plan, dims)
    graph = plan.logical
    inputs = draw_inputs(graph, dims, np.random.default_rng(0))
    swapped = {name: _swapped(v, blocks.tags[name], 0, 1) if name in blocks.tags else v for name, v in inputs.items()}
    assert any(not np.array_equal(swapped[n], inputs[n]) for n in blocks.seeds)
    plain = run_graph(graph, dims, inputs, keep=True)
    moved = run_graph(graph, dims, swapped, keep=True)
    checked = 0
    for node in graph.nodes:
        if node.dtype != "float":
            continue
        want = plain[node.name]
        if node.name in blocks.tags:
            want = _swapped(want, blocks.tags[node.name], 0, 1)
            checked += 1
        assert np.allclose(moved[node.name], want, rtol=1e-9, atol=1e-12, equal_nan=True), node.name
    assert checked > 100


def test_a_tp_block_swapped_in_one_weight_alone_changes_what_the_proof_says_it_keeps(llama):
    """The check above can fail: swap the blocks of one tagged weight only, and a tensor the proof relates to it
    no longer matches."""
    plan, dims, blocks = llama
    graph = plan.logical
    inputs = draw_inputs(graph, dims, np.random.default_rng(1))
    name = "layers.0.attn.q_proj.weight"
    swapped = dict(inputs, **{name: _swapped(inputs[name], blocks.tags[name], 0, 1)})
    plain = run_graph(graph, dims, inputs, keep=True)
    moved = run_graph(graph, dims, swapped, keep=True)
    wrong = [n.name for n in graph.nodes if n.dtype == "float" and not np.allclose(
        moved[n.name], _swapped(plain[n.name], blocks.tags[n.name], 0, 1) if n.name in blocks.tags else plain[n.name],
        rtol=1e-9, atol=1e-12, equal_nan=True)]
    assert wrong


def _node(op: str, **attr) -> Node:
    return Node.make("y", op, ["a", "b"][:2 if op in ("mm", "bmm", "add", "cat") else 1], attr, shape=[1])


def test_ops_that_read_along_the_blocks_are_refused_with_the_reason():
    tag = TpTag(1, 2, 2)
    assert derived_tag(_node("_softmax", dim=-1), [tag], [(3, 4)], (3, 4)) == \
        "_softmax along the tp blocks"
    assert derived_tag(_node("mm"), [tag, None], [(3, 4), (4, 5)], (3, 5)) == \
        "mm contracts over blocks of one operand only"
    # an untagged argument spanning the blocks: refused, unless it is an expand along them (`Spans` says which
    # argument and the tag it would need)
    assert derived_tag(_node("add"), [tag, None], [(3, 4), (3, 4)], (3, 4)) == \
        Spans(1, tag, "an argument without tp blocks spans them")
    assert derived_tag(_node("cat", dim=0), [None, tag], [(3, 4), (3, 4)], (6, 4)) == \
        Spans(0, tag, "cat mixes tensors with and without tp blocks")
    assert derived_tag(_node("cat", dim=2), [TpTag(0, 1, 3), tag], [(3, 4, 2), (3, 4, 2)], (3, 4, 4)) == \
        "cat mixes tensors with tp blocks on different dims"
    # a contraction over the blocks of both operands alike is a sum; a broadcast operand is fine
    assert derived_tag(_node("mm"), [tag, TpTag(0, 2, 2)], [(3, 4), (4, 5)], (3, 5)) is None
    assert derived_tag(_node("mm"), [TpTag(1, 2, 2), TpTag(0, 1, 2)], [(3, 4), (4, 5)], (3, 5)) == \
        "mm operands hold tp blocks on dims that do not line up"     # blocks of other widths: not the same sum
    assert derived_tag(_node("add"), [tag, None], [(3, 4), (3, 1)], (3, 4)) == tag


@pytest.mark.parametrize("src,tag,dst,want", [
    ((2, 8), TpTag(1, 4, 2), (2, 2, 4), TpTag(1, 1, 2)),       # (b, heads·hd) -> (b, heads, hd): one head a block
    ((2, 4, 3), TpTag(1, 2, 2), (8, 3), TpTag(0, 2, 2)),       # (b, heads, s) -> (b·heads, s): the modulus
    ((12,), TpTag(0, 2, 3), (3, 4), None),                     # block (f // 2) % 3 straddles both dims
])
def test_a_reshape_keeps_the_block_digit_where_it_lands_on_one_dim(src, tag, dst, want):
    node = Node.make("y", "view", ["a"], {"size": list(dst)}, shape=list(dst))
    got = derived_tag(node, [tag], [src], dst)
    assert got == (want or "a reshape splits the blocks")
    if want is not None:        # the same blocks, element by element
        flat = np.arange(int(np.prod(src)))
        before = (np.unravel_index(flat, src)[tag.dim] // tag.q) % tag.period
        after = (np.unravel_index(flat, dst)[want.dim] // want.q) % want.period
        assert (before == after).all()


def test_an_expand_along_the_heads_takes_the_blocks_its_reader_needs():
    """DeepSeek's rotary key is one for every head: expanded to the heads and joined to each head's own key. The
    expand is the same along the heads, so it may take the heads' blocks — and then the attention, its projections
    and their gradients keep theirs (without it the join refused every attention weight)."""
    plan, dims = _plan("deepseek-tiny", "dp=2,tp=2,ep=2")
    blocks = TpBlocks.of(plan, dims)
    nodes = {n.name: n for n in plan.logical.nodes}
    joins = [n for n in plan.logical.nodes if n.op.value == "cat" and n.name in blocks.tags and
             any(nodes.get(a) is not None and nodes[a].op.value == "expand" and a in blocks.tags for a in n.args)]
    assert joins
    assert not [s for s in blocks.dropped if "attn" in s]
    assert {"layers.0.attn.q_b_proj.weight", "layers.0.attn.kv_b_proj.weight",
            "layers.0.attn.o_proj.weight"} <= set(blocks.tags)


def test_a_plan_without_tp_has_no_blocks():
    plan, dims = _plan("llama3-tiny", "dp=2")
    with pytest.raises(Asymmetric, match="no tp axis"):
        TpBlocks.of(plan, dims)


# -- shares: what a partial claim over tp holds on each rank ---------------------------------------------------------
def _block_values(plan, dims, blocks, inputs):
    """Every float tensor's value, and each share's block-t share for each t, at `inputs`."""
    graph = plan.logical
    nodes = {n.name: n for n in graph.nodes}
    values = run_graph(graph, dims, inputs, keep=True)
    evaluate = lambda node, args: eval_node(node, args, dims)        # noqa: E731
    memos = [{} for _ in range(blocks.count)]
    shares = {name: [share(blocks, nodes, name, t, values.__getitem__, evaluate, memos[t])
                     for t in range(blocks.count)] for name in blocks.shares}
    return values, shares


@pytest.mark.parametrize("model,spec", [("llama3-tiny", "dp=2,tp=2,pp=2,mb=2"), ("deepseek-tiny", "dp=2,tp=2,ep=2")])
def test_every_share_is_the_sum_of_its_blocks_shares(model, spec):
    """A share (a contribution sum over the tp blocks, or linear in such sums alone) is the sum over t of block t's
    share — the op on its arguments' shares, a contraction over block t's elements alone at the bottom."""
    plan, dims = _plan(model, spec)
    blocks = TpBlocks.of(plan, dims)
    values, shares = _block_values(plan, dims, blocks, draw_inputs(plan.logical, dims, np.random.default_rng(2)))
    assert len(blocks.shares) > 2 * len(blocks.sums) > 40
    for name, parts in shares.items():
        assert not np.allclose(parts[0], values[name]), name        # each block's share is a part, not the whole
        assert np.allclose(sum(parts), values[name], rtol=1e-9, atol=1e-12), name


def test_a_share_plus_a_tensor_without_blocks_is_no_share(llama):
    """The residual stream after attention, h + o_proj(...), is no share: each block's share plus h would add h tp
    times. Taken for one, its shares do not add up — the check above fails for it."""
    plan, dims, blocks = llama
    o_proj = next(n for n in plan.logical.nodes if n.op.value == "mm" and n.name in blocks.sums and
                  "layers.0.attn.o_proj.weight" in _sources(plan, n.name))
    view = next(n for n in plan.logical.nodes if o_proj.name in n.args)
    residual = next(n for n in plan.logical.nodes if n.op.value == "add" and view.name in n.args)
    assert view.name in blocks.shares and residual.name not in blocks.shares
    wrong = TpBlocks(blocks.tags, blocks.count, blocks.seeds, blocks.sums, shares=blocks.shares | {residual.name})
    values, shares = _block_values(plan, dims, wrong, draw_inputs(plan.logical, dims, np.random.default_rng(3)))
    assert np.allclose(sum(shares[view.name]), values[view.name])
    assert not np.allclose(sum(shares[residual.name]), values[residual.name])


def test_block_0_s_share_renamed_to_block_t_is_block_t_s_share_symbolically(llama):
    """What a stage proved for tp rank 0 gives the others: σ_t (block 0 and block t of every tagged tensor's atoms
    swapped) takes block 0's share to block t's, and the shares sum to the tensor — checked by the normaliser on
    terms, for the output projection (a contraction over the heads) and a share four ops above its contractions."""
    plan, dims, blocks = llama
    graph = plan.logical
    nodes = {n.name: n for n in graph.nodes}
    logical = LogicalTerms.build(graph, dims)
    evaluate = lambda node, args: eval_symbolic(node, args, dims)        # noqa: E731
    o_proj = next(n.name for n in graph.nodes if n.op.value == "mm" and n.name in blocks.sums and
                  "layers.0.attn.o_proj.weight" in _sources(plan, n.name))
    linear = next(n.name for n in graph.nodes if n.name in blocks.shares and _depth(blocks, nodes, n.name) == 4)
    for name in (o_proj, linear):
        first = share(blocks, nodes, name, 0, logical.full, evaluate).reshape(-1).tolist()
        other = share(blocks, nodes, name, 1, logical.full, evaluate).reshape(-1).tolist()
        whole = _unmasked(blocks, nodes, name, logical.full, evaluate).reshape(-1).tolist()
        renamed = blocks.rename(first, 1)
        for a, b, c, w in zip(first, renamed, other, whole):
            assert prove_equal(b, c).proved, name
            assert prove_equal(a + b, w).proved, name
        assert any(not prove_equal(a, c).proved for a, c in zip(first, other)), name


def _depth(blocks, nodes, name: str) -> int:
    """The ops between a share and the contractions it is built on."""
    if name in blocks.sums:
        return 0
    return 1 + max(_depth(blocks, nodes, a) for a in nodes[name].args if a in blocks.shares)


def _unmasked(blocks, nodes, name, value, evaluate, memo=None):
    """A share's value from the same ops as its shares, its contributions over every block."""
    memo = {} if memo is None else memo
    if name not in memo:
        node = nodes[name]
        args = [_unmasked(blocks, nodes, a, value, evaluate, memo) if a in blocks.shares and
                name not in blocks.sums else value(a) for a in node.args]
        memo[name] = evaluate(node, args)
    return memo[name]


def test_a_claim_moves_from_block_0_to_block_t_inside_one_block(llama):
    plan, dims, blocks = llama
    name = "layers.0.attn.q_proj.weight"
    tag = blocks.tags[name]
    rows = Claim(name, (0, 0), (tag.q, 4))
    assert blocks.move(rows, 1) == Claim(name, (tag.q, 0), (tag.q, 4))
    assert blocks.move(Claim("embed.weight", (0, 0), (3, 4)), 1) == Claim("embed.weight", (0, 0), (3, 4))
    with pytest.raises(Asymmetric, match=rf"a slice \[0, {tag.q + 1}\) of dim 0 is not inside one tp block 0 "
                                         rf"\(blocks of {tag.q}\)"):
        blocks.move(Claim(name, (0, 0), (tag.q + 1, 4)), 1)
    with pytest.raises(Asymmetric, match="is not inside one tp block 0"):
        blocks.move(Claim(name, (tag.q, 0), (tag.q, 4)), 1)          # block 1 already
    atom = Atom(name, (1, 2))
    assert blocks.rename_name(atom, 1) == Atom(name, (tag.q + 1, 2))
    assert blocks.rename_name(Atom(name, (tag.q + 1, 2)), 1) == atom
    assert blocks.rename_name(Atom("embed.weight", (1, 2)), 1) == Atom("embed.weight", (1, 2))


@pytest.fixture(scope="module", params=["deepseek-tiny", "llama3-tiny"])
def four_stages(request):
    """A 4-layer model at tp=2,pp=4 with its claims: two middle stages that never read their tp coordinate."""
    config = models.get(request.param).with_dims(layers=4)
    plan = api.parallelize(api.capture_step(config, optim="adamw", clip=1.0), "tp=2,pp=4", model=config)
    dims = reduce_plan(plan).reduced
    return request.param, plan, TpBlocks.of(plan, dims), derived_claims(plan, dims, None)[1]


def test_which_partial_claims_over_tp_are_shares_on_ranks_off_the_vocabulary(four_stages):
    """Where the shares stand for tp rank t's stages being rank 0's renamed: on the pipeline stages that never read
    their tp coordinate (no vocabulary-parallel op), every partial claim over tp of DeepSeek is a share. Llama's
    lowering sends the residual stream's gradient back partial over tp, so there it still holds the
    vocabulary-parallel output layer's gradient, which no σ_t relates: those claims are no shares."""
    model, plan, blocks, claims = four_stages
    names, ids = plan.rank_programs()
    off = {r for r in range(plan.num_ranks)
           if not any(n.op in RANK_DEPENDENT for n in plan.programs[names[ids[r]]].nodes)}
    assert off == {2, 3, 4, 5}                    # the two middle stages
    partial = {c.logical for (rank, _), c in claims.made.items() if rank in off and c.partial and TP in c.partial}
    assert len(partial & blocks.shares) > 20
    others = partial - blocks.shares
    if model == "deepseek-tiny":
        assert not others
        return
    assert others
    nodes = {n.name: n for n in plan.logical.nodes}
    for name in others:         # each reaches lm_head's gradient through tensors neither tagged nor shares
        seen, stack, modules = set(), [name], set()
        while stack:
            node = nodes.get(stack.pop())
            if node is not None and node.name not in seen:
                seen.add(node.name)
                modules.add(node.get_meta("module") or "")
                stack += [a for a in node.args if a not in blocks.shares and a not in blocks.tags]
        assert "lm_head" in modules, name


def test_the_tp_ranks_that_mirror_tp_rank_0_and_why_the_others_do_not(four_stages):
    model, plan, blocks, claims = four_stages
    found = tp_mirrors(plan, blocks, claims)
    ends = ["tp: rank 1 not stood in for: it reads its tp coordinate (embedding.flat~1 = local_chunk)",
            "tp: rank 7 not stood in for: it reads its tp coordinate (nll_loss_forward.sum.onehot~1 = local_chunk)"]
    if model == "deepseek-tiny":
        assert found.rep == {3: 2, 5: 4} and found.block == {3: 1, 5: 1}
        assert found.notes == ends
        return
    assert found.rep == {}
    assert found.notes[0] == ends[0] and found.notes[-1] == ends[1]
    assert [n.split(" not stood in for: ")[0] for n in found.notes[1:3]] == ["tp: rank 3", "tp: rank 5"]
    assert all(n.endswith(", no share") and " is claimed partial over tp on " in n for n in found.notes[1:3])


def test_a_tp_rank_whose_claim_is_not_rank_0_s_moved_mirrors_nothing(four_stages):
    """Claims are the ranks' own (stated or matched by value): one that is not rank 0's moved, or missing, keeps the
    rank out, naming the tensor."""
    model, plan, blocks, claims = four_stages
    if model != "deepseek-tiny":
        return
    weight = next(name for (rank, name), c in claims.made.items() if rank == 3 and c.logical in blocks.tags and
                  not c.partial)
    moved = Claims({**claims.made, (3, weight): claims.made[2, weight]})     # rank 0's own block, not block 1
    assert tp_mirrors(plan, blocks, moved).notes[1] == \
        f"tp: rank 3 not stood in for: its claim on {weight} is not tp rank 0's moved to block 1"
    dropped = Claims({k: c for k, c in claims.made.items() if k != (3, weight)})
    assert tp_mirrors(plan, blocks, dropped).notes[1] == \
        f"tp: rank 3 not stood in for: {weight} is claimed on tp rank 0 alone"
    assert tp_mirrors(plan, blocks, claims, others=frozenset({2})).rep == {5: 4}
