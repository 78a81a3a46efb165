"""Tensor-parallel block symmetry: which logical tensors are cut into tp blocks, and the proof that the logical step
commutes with permuting the blocks — checked here by running the step on permuted inputs."""
from __future__ import annotations

import numpy as np
import pytest

from tv_ray import api
from tv_ray.errors import Asymmetric
from tv_ray.ir import Node
from tv_ray.partition.tp_blocks import Spans, TpBlocks, TpTag, derived_tag
from tv_ray.reduce import reduce_plan
from tv_ray.semantics.interpret import run_graph
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
