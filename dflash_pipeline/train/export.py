"""Export a drafter in the layout that SGLang, vLLM and the reference `dflash` package load.

`config.json` is a Qwen3 config with `architectures: ["DFlashDraftModel"]` plus the DFlash fields
(`block_size` top level and in `dflash_config`, `dflash_config.mask_token_id`,
`dflash_config.target_layer_ids`, `num_target_layers`; for targets that scale embeddings or transform
logits, as Gemma does, `dflash_config.input_embedding_scale` / `output_multiplier` /
`final_logit_softcapping`, which the reference package applies); `model.safetensors` holds exactly the
drafter's parameters under their module names, without the target's embedding or LM head.

Files are written under temporary names and renamed into place, weights first and config last, so a
crash never leaves a folder that looks complete.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from torch import nn

from dflash_pipeline.errors import DFlashError
from dflash_pipeline.train.model import DFlashDrafter, DrafterConfig

WEIGHTS_NAME = "model.safetensors"
CONFIG_NAME = "config.json"
_WRAPPER_PREFIXES = ("module.", "_orig_mod.")  # DDP / torch.compile wrappers


def hf_config_dict(cfg: DrafterConfig, dtype: torch.dtype = torch.bfloat16) -> dict:
    """The config.json contents for a drafter."""
    sliding = "sliding_attention" in cfg.layer_types
    d = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "max_position_embeddings": cfg.max_position_embeddings,
        "vocab_size": cfg.vocab_size,
        "layer_types": list(cfg.layer_types),
        "sliding_window": cfg.sliding_window if sliding else None,
        "use_sliding_window": sliding,
        "max_window_layers": cfg.num_layers,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        "initializer_range": 0.02,
        "use_cache": True,
        "dtype": str(dtype).removeprefix("torch."),
        "block_size": cfg.block_size,
        "num_target_layers": cfg.num_target_layers,
        "dflash_config": {
            "block_size": cfg.block_size,
            "mask_token_id": cfg.mask_token_id,
            "target_layer_ids": list(cfg.target_layer_ids),
        },
    }
    # The target's embedding scale and logit transform, under the names `dflash_generate` reads; without
    # them it embeds a Gemma block unscaled and drafts other tokens than the drafter was trained to.
    if cfg.embedding_scale != 1.0:
        d["dflash_config"]["input_embedding_scale"] = cfg.embedding_scale
    if cfg.logit_scale is not None:
        d["dflash_config"]["output_multiplier"] = cfg.logit_scale
    if cfg.final_logit_softcapping:
        d["dflash_config"]["final_logit_softcapping"] = cfg.final_logit_softcapping
    if sliding and not cfg.sliding_causal:
        d["is_causal"] = False  # the reference applies this to every layer; full layers are bidirectional anyway
    return d


def config_from_hf_dict(d: dict) -> DrafterConfig:
    """A DrafterConfig from an exported config.json (ours or another DFlash trainer's)."""
    dflash = d.get("dflash_config", {})
    rope = d.get("rope_parameters") or {}
    layer_types = d.get("layer_types") or ["full_attention"] * d["num_hidden_layers"]
    sliding = "sliding_attention" in layer_types
    try:
        return DrafterConfig(
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_layers=d["num_hidden_layers"],
            num_heads=d["num_attention_heads"],
            num_kv_heads=d.get("num_key_value_heads") or d["num_attention_heads"],
            head_dim=d.get("head_dim") or d["hidden_size"] // d["num_attention_heads"],
            vocab_size=d["vocab_size"],
            block_size=int(dflash.get("block_size", d.get("block_size", 16))),
            mask_token_id=dflash.get("mask_token_id", d.get("mask_token_id")),
            target_layer_ids=dflash.get("target_layer_ids", d.get("target_layer_ids")),
            num_target_layers=d["num_target_layers"],
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            rope_theta=rope.get("rope_theta", d.get("rope_theta", 10000.0)),
            max_position_embeddings=d.get("max_position_embeddings", 32768),
            layer_types=layer_types,
            sliding_window=d.get("sliding_window") if sliding else None,
            sliding_causal=d.get("is_causal") is not False,
            embedding_scale=float(dflash.get("input_embedding_scale", 1.0)),
            logit_scale=dflash.get("output_multiplier"),
            final_logit_softcapping=dflash.get("final_logit_softcapping"),
        )
    except (KeyError, TypeError) as e:
        raise ValueError(f"not a DFlash drafter config: {e!r}") from e


def clean_state_dict(state: dict) -> dict:
    """The state dict's names without the wrappers' prefixes (DDP's `module.`, torch.compile's `_orig_mod.`)."""
    out = {}
    for name, tensor in state.items():
        changed = True
        while changed:
            changed = False
            for prefix in _WRAPPER_PREFIXES:
                if name.startswith(prefix):
                    name, changed = name[len(prefix):], True
        out[name] = tensor
    return out


def export_drafter(
    state_dict_or_model: dict | nn.Module,
    cfg: DrafterConfig,
    out_dir: str | os.PathLike,
    extra: dict | None = None,
    dtype: torch.dtype = torch.bfloat16,
) -> Path:
    """Write model.safetensors (in `dtype`) and config.json into out_dir; returns out_dir.

    `extra` is merged into the top level of config.json (e.g. {"dflash_pipeline": {...training
    metadata...}}); it may not replace a standard key.
    """
    from safetensors.torch import save_file

    if dtype not in (torch.bfloat16, torch.float32, torch.float16):
        raise ValueError(f"export dtype must be bfloat16, float16 or float32, got {dtype}")
    state = state_dict_or_model.state_dict() if isinstance(state_dict_or_model, nn.Module) else state_dict_or_model
    state = clean_state_dict(state)
    with torch.device("meta"):
        expected = DFlashDrafter(cfg).state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise ValueError(f"drafter state does not match its config: missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]} (embed_tokens / lm_head are never exported)")
    for name, ref in expected.items():
        if tuple(state[name].shape) != tuple(ref.shape):
            raise ValueError(f"drafter state: {name} has shape {tuple(state[name].shape)}, "
                             f"config says {tuple(ref.shape)}")
    config = hf_config_dict(cfg, dtype)
    if extra:
        clash = sorted(set(extra) & set(config))
        if clash:
            raise ValueError(f"export extra keys {clash} would replace standard config fields")
        config.update(extra)

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {name: state[name].detach().to("cpu", dtype).contiguous() for name in expected}
    tmp_weights = out / f".{WEIGHTS_NAME}.tmp"
    tmp_config = out / f".{CONFIG_NAME}.tmp"
    save_file(tensors, str(tmp_weights), metadata={"format": "pt"})
    tmp_config.write_text(json.dumps(config, indent=2) + "\n")
    os.replace(tmp_weights, out / WEIGHTS_NAME)
    os.replace(tmp_config, out / CONFIG_NAME)
    return out


def load_exported(
    directory: str | os.PathLike, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> tuple[DFlashDrafter, DrafterConfig]:
    """Load an exported drafter folder into our own model."""
    from safetensors.torch import load_file

    directory = Path(directory)
    config_path, weights_path = directory / CONFIG_NAME, directory / WEIGHTS_NAME
    if not config_path.exists() or not weights_path.exists():
        raise ValueError(f"{directory}: not an exported drafter (needs {CONFIG_NAME} and {WEIGHTS_NAME})")
    cfg = config_from_hf_dict(json.loads(config_path.read_text()))
    state = clean_state_dict(load_file(str(weights_path), device=str(device)))
    with torch.device("meta"):
        model = DFlashDrafter(cfg)
    model.load_state_dict(state, strict=True, assign=True)
    return model.to(device=device, dtype=dtype), cfg


def read_drafter_config(directory: str) -> DrafterConfig:
    """An exported drafter's config, or one line saying why the folder holds none (a user error)."""
    d = Path(directory)
    if not d.is_dir():
        raise DFlashError(f"{directory}: no such drafter folder")
    missing = [n for n in (CONFIG_NAME, WEIGHTS_NAME) if not (d / n).is_file()]
    if missing:
        raise DFlashError(f"{directory}: not an exported drafter (missing {', '.join(missing)}); "
                          f"write one with `dflash export`")
    try:
        return config_from_hf_dict(json.loads((d / CONFIG_NAME).read_text()))
    except ValueError as e:  # JSONDecodeError included
        raise DFlashError(f"{directory}/{CONFIG_NAME}: {e}") from None


def load_drafter(directory: str, dtype: torch.dtype, device: torch.device) -> DFlashDrafter:
    """`load_exported`'s model, its failures (a damaged file, a state-dict mismatch) as one-line user errors."""
    from safetensors import SafetensorError

    try:
        model, _ = load_exported(directory, dtype=dtype, device=device)
    except (ValueError, RuntimeError, OSError, SafetensorError) as e:
        raise DFlashError(f"{directory}: cannot load the drafter weights ({str(e).splitlines()[0]})") from None
    return model

