"""The built-in model registry: names, sizes, parameter counts, the forward's loss."""
import pytest
import torch

import tv_ray.models as models
from tv_ray.errors import TvRayError


def test_registry_lists_the_built_in_models():
    assert models.list_models() == ["llama3-tiny", "llama3-8b", "llama3-70b", "llama3-405b", "deepseek-tiny",
                                    "deepseek-v2-lite-16b", "deepseek-v2-236b", "deepseek-v3-671b", "gpt2-tiny",
                                    "gpt2-small"]


def test_unknown_model_names_the_known_ones():
    with pytest.raises(TvRayError, match=r"unknown model 'llama9'; built-in models: llama3-tiny, llama3-8b"):
        models.get("llama9")


@pytest.mark.parametrize("name, params", [
    ("llama3-8b", 8_030_261_248), ("llama3-70b", 70_553_706_496), ("llama3-405b", 405_853_388_800),
    ("gpt2-small", 124_439_808)])
def test_parameter_counts_match_the_published_models(name, params):
    assert models.get(name).param_count() == params


@pytest.mark.parametrize("name, billions", [("deepseek-v2-lite-16b", 15.7), ("deepseek-v2-236b", 235.7),
                                             ("deepseek-v3-671b", 671.0)])
def test_deepseek_parameter_counts_match_the_published_totals(name, billions):
    """The published totals (V3's 671B without its multi-token-prediction module), to the reported precision."""
    assert round(models.get(name).param_count() / 1e9, 1) == billions


def test_deepseek_routing_chooses_top_k_and_only_the_bias_moves_the_choice():
    spec = models.get("deepseek-tiny")
    module = spec.build(device="cpu", dtype=torch.float64)
    router = module.layers[1].mlp.gate
    x = torch.randn(6, spec.config.d_model, dtype=torch.float64)
    gates, mask, scores = router(x)
    assert torch.equal(mask.sum(-1), torch.full((6,), 2.0, dtype=torch.float64))
    assert torch.allclose(gates.sum(-1), torch.ones(6, dtype=torch.float64))          # renormalised (V3)
    assert torch.equal(gates > 0, mask > 0)
    with torch.no_grad():
        router.bias.copy_(torch.tensor([0.0, 0.0, 0.0, 10.0]))        # expert 3 always chosen
    assert torch.equal(router(x)[1][:, 3], torch.ones(6, dtype=torch.float64))
    assert torch.equal(router(x)[2], scores)                          # the scores do not see the bias


def test_llama3_8b_dims():
    spec = models.get("llama3-8b")
    assert spec.dims == {"batch": 8, "seq": 8192, "kv_heads": 8, "n_rep": 4, "head_dim": 128,
                         "ffn": 14336, "vocab": 128256}
    assert spec.config.layers == 32 and spec.config.d_model == 4096


@pytest.mark.parametrize("name", ["llama3-tiny", "gpt2-tiny"])
def test_tiny_dims_divide_by_every_degree_up_to_2(name):
    dims = models.get(name).dims
    assert all(v % 2 == 0 for v in dims.values()), dims
    assert models.get(name).config.layers % 2 == 0


@pytest.mark.parametrize("name, tied", [("llama3-tiny", False), ("llama3-tiny", True), ("gpt2-tiny", True),
                                        ("gpt2-tiny", False)])
def test_forward_returns_the_scalar_loss(name, tied):
    spec = models.get(name).with_dims(tied=tied)
    module = spec.build(device="cpu", dtype=torch.float64)
    names = [n for n, _ in module.named_parameters()]
    assert ("lm_head.weight" in names) != tied
    tokens, targets = spec.example_inputs()
    assert tokens.dtype == targets.dtype == torch.int64 and tokens.shape == (8, 16)
    loss = module(tokens, targets)
    assert loss.shape == () and loss.dtype == torch.float64


def test_parameter_names_are_module_paths():
    names = [n for n, _ in models.get("llama3-tiny").build().named_parameters()]
    assert "layers.0.attn.q_proj.weight" in names and "layers.1.mlp.down_proj.weight" in names


def test_with_dims_rejects_an_incomplete_table():
    with pytest.raises(TvRayError, match=r"dims table must define exactly .*missing \['vocab'\]"):
        models.get("llama3-tiny").with_dims({"batch": 2, "seq": 2, "kv_heads": 2, "n_rep": 2, "head_dim": 2, "ffn": 2})


def test_cmd_models_prints_a_row_per_model(capsys):
    assert models.cmd_models() == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split() == ["name", "layers", "d_model", "heads", "kv_heads", "ffn", "vocab", "params"]
    assert out[2].split() == ["llama3-8b", "32", "4096", "32", "8", "14336", "128256", "8,030,261,248"]
