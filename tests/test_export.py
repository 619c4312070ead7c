"""Exported folders carry exactly the names and config fields that SGLang, vLLM and `dflash` read."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from dflash_pipeline.train.export import export_drafter, load_exported

from test_model import packed_batch, random_drafter, tiny_config


def _expected_names(num_layers):
    names = {"fc.weight", "hidden_norm.weight", "norm.weight"}
    for i in range(num_layers):
        p = f"layers.{i}."
        names |= {p + "input_layernorm.weight", p + "post_attention_layernorm.weight"}
        names |= {f"{p}self_attn.{n}.weight" for n in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")}
        names |= {f"{p}mlp.{n}.weight" for n in ("gate_proj", "up_proj", "down_proj")}
    return names


def test_export_names_dtype_and_config(tmp_path):
    cfg = tiny_config("sliding")
    model = random_drafter(cfg)
    export_drafter(model, cfg, tmp_path, extra={"dflash_pipeline": {"step": 7}})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]
    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        names = set(f.keys())
        assert all(f.get_tensor(n).dtype == torch.bfloat16 for n in names)
    assert names == _expected_names(cfg.num_layers)
    assert set(dict(model.named_parameters())) == names  # parameter names are the export names

    c = json.loads((tmp_path / "config.json").read_text())
    assert c["architectures"] == ["DFlashDraftModel"] and c["model_type"] == "qwen3"
    assert (c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"]) == (32, 48, 2)
    assert (c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]) == (4, 2, 8)
    assert c["rope_theta"] == 10000.0
    assert c["rope_parameters"] == {"rope_type": "default", "rope_theta": 10000.0}
    assert c["layer_types"] == ["sliding_attention", "full_attention"]
    assert c["sliding_window"] == 5 and c["use_sliding_window"] is True
    assert c["attention_bias"] is False and c["tie_word_embeddings"] is False and c["hidden_act"] == "silu"
    assert c["block_size"] == 8 and c["num_target_layers"] == 8
    assert c["dflash_config"] == {"block_size": 8, "mask_token_id": 63, "target_layer_ids": [1, 3, 5]}
    assert c["vocab_size"] == 64 and c["max_position_embeddings"] == 32768 and c["rms_norm_eps"] == 1e-6
    assert c["dflash_pipeline"] == {"step": 7}

    loaded, loaded_cfg = load_exported(tmp_path)
    assert loaded_cfg == cfg
    batch, _ = packed_batch()
    with torch.no_grad():
        bf16_model = random_drafter(cfg).to(torch.bfloat16).float()
        torch.testing.assert_close(loaded(**batch), bf16_model(**batch))


def test_full_attention_config_and_fp32_roundtrip(tmp_path):
    cfg = tiny_config("full")
    model = random_drafter(cfg)
    export_drafter(model.state_dict(), cfg, tmp_path, dtype=torch.float32)
    c = json.loads((tmp_path / "config.json").read_text())
    assert c["sliding_window"] is None and c["use_sliding_window"] is False
    loaded, _ = load_exported(tmp_path)
    for (n, a), (_, b) in zip(model.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), n


def test_wrapped_state_dict_and_errors(tmp_path):
    cfg = tiny_config("full")
    state = {f"module._orig_mod.{k}": v for k, v in random_drafter(cfg).state_dict().items()}
    export_drafter(state, cfg, tmp_path / "ok")
    with pytest.raises(ValueError, match="embed_tokens"):
        export_drafter({**state, "embed_tokens.weight": torch.zeros(64, 32)}, cfg, tmp_path / "bad")
    with pytest.raises(ValueError, match="shape"):
        export_drafter({**state, "module.fc.weight": torch.zeros(3, 3)}, cfg, tmp_path / "bad")
    with pytest.raises(ValueError, match="replace"):
        export_drafter(state, cfg, tmp_path / "bad", extra={"block_size": 4})
    assert not (tmp_path / "bad").exists() or not any((tmp_path / "bad").iterdir())
    with pytest.raises(ValueError):
        load_exported(tmp_path / "missing")


def test_bidirectional_sliding_option_is_exported_and_matches_reference(tmp_path):
    from dflash.model import DFlashDraftModel

    cfg = tiny_config("sliding", sliding_causal=False)
    model = random_drafter(cfg)
    export_drafter(model, cfg, tmp_path, dtype=torch.float32)
    assert json.loads((tmp_path / "config.json").read_text())["is_causal"] is False
    assert load_exported(tmp_path)[1] == cfg
    ref = DFlashDraftModel.from_pretrained(tmp_path, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(0)
    feats, emb = torch.randn(1, 12, 96, generator=g), torch.randn(1, 8, 32, generator=g)
    with torch.no_grad():
        want = ref(target_hidden=feats, noise_embedding=emb, position_ids=torch.arange(20)[None])
        got = model.draft_step(feats, torch.arange(12), emb, 12 + torch.arange(8), model.new_cache())
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_hybrid_target_export_loads_in_reference_and_drafts_the_same(tmp_path, smollm_dir):
    """A drafter for a Qwen3.5 (hybrid linear-attention) target: config.json counts every decoder layer of
    the target (8, linear attention or not) and reads the default layers of that count; the authors'
    `dflash` package loads it and, from the target's own hidden states, drafts what our drafter drafts."""
    from types import SimpleNamespace

    from transformers import AutoModelForCausalLM

    from dflash_pipeline.method import default_layer_ids
    from dflash_pipeline.train.model import DrafterConfig
    from families import FAMILIES, build
    from test_families import check_reference_drafts

    family = next(f for f in FAMILIES if f.model_type == "qwen3_5")
    target = AutoModelForCausalLM.from_pretrained(build(family, tmp_path / "target", smollm_dir), dtype=torch.float32)
    text = target.config
    assert text.layer_types.count("linear_attention") == 6 and text.num_hidden_layers == 8
    cfg = DrafterConfig(hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                        vocab_size=49152, block_size=8, mask_token_id=49151, num_target_layers=8,
                        target_layer_ids=default_layer_ids(8, 3), rope_theta=1e7)
    export_drafter(random_drafter(cfg), cfg, tmp_path / "export", dtype=torch.float32)
    c = json.loads((tmp_path / "export" / "config.json").read_text())
    assert c["num_target_layers"] == 8 and c["dflash_config"]["target_layer_ids"] == [1, 3, 5]
    assert [text.layer_types[k] for k in (1, 3, 5)] == ["linear_attention", "full_attention", "linear_attention"]
    assert c["layer_types"] == ["full_attention"] * 2  # the drafter's own layers, not the target's
    assert "input_embedding_scale" not in c["dflash_config"]  # Qwen3.5 embeds unscaled
    check_reference_drafts(SimpleNamespace(model=target.eval(), export=tmp_path / "export"), list(range(100, 140)))
