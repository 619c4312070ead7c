"""The target families `dflash-pipeline` claims, as tiny random models: the list that
tests/test_families.py runs end to end and that the README's "Supported target families" table is
rendered from (`python tests/families.py` prints it; a test keeps the README equal to it).

Each family is built the way its real checkpoints are laid out (Qwen3.5 and Qwen3.5-MoE as their
`qwen3_5` / `qwen3_5_moe` vision-language configs, which `AutoModelForCausalLM` loads as the text model),
at toy width, with weights drawn wide enough (std 0.1) that every kind of layer moves the logits.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

VOCAB = 49152  # SmolLM2's tokenizer: real chat template, fast tokenizer, no hub access
_TINY = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, max_position_embeddings=4096, initializer_range=0.1, bos_token_id=None, eos_token_id=None,
             pad_token_id=None)
_LINEAR = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
               linear_conv_kernel_dim=4)
_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)
# A vision tower is part of the Qwen3.5 checkpoints; extraction and eval load the text model from them.
_VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4,
               spatial_merge_size=2, temporal_patch_size=2)


@dataclass(frozen=True)
class Family:
    name: str
    model_type: str          # the checkpoint's config.json model_type
    special: str             # what sets it apart, for the pipeline
    config: Callable[[], object]
    hybrid: bool = False     # has linear-attention layers (rolled back by eval/rollback.py)
    also: str = ""           # what else is tested of it, for the README
    # The chat templates its checkpoints ship (tests/templates/<name>.jinja; "" is SmolLM2's own ChatML),
    # whose loss masks tests/test_chat_templates.py checks.
    chat_templates: tuple[str, ...] = ()

    def __str__(self) -> str:  # pytest ids
        return self.model_type


def _llama():
    from transformers import LlamaConfig

    return LlamaConfig(**_TINY, num_hidden_layers=6, tie_word_embeddings=True)


def _qwen3():
    from transformers import Qwen3Config

    return Qwen3Config(**_TINY, num_hidden_layers=6, tie_word_embeddings=False)


def _qwen3_5():
    from transformers import Qwen3_5Config

    return Qwen3_5Config(text_config=dict(**_TINY, **_LINEAR, num_hidden_layers=8, tie_word_embeddings=False),
                         vision_config=_VISION)


def _qwen3_5_moe():
    from transformers import Qwen3_5MoeConfig

    return Qwen3_5MoeConfig(text_config=dict(**_TINY, **_LINEAR, **_MOE, num_hidden_layers=8,
                                             tie_word_embeddings=False), vision_config=_VISION)


def _qwen3_next():
    from transformers import Qwen3NextConfig

    return Qwen3NextConfig(**_TINY, **_LINEAR, **_MOE, num_hidden_layers=8, tie_word_embeddings=False)


def _gemma3():
    from transformers import Gemma3TextConfig

    # 5 sliding-window layers per full one, a window short enough for decoding to slide past it,
    # embeddings scaled by sqrt(hidden), logits soft-capped.
    return Gemma3TextConfig(**{**_TINY, "head_dim": 16}, num_hidden_layers=6, sliding_window=8,
                            query_pre_attn_scalar=16, final_logit_softcapping=30.0, tie_word_embeddings=True)


FAMILIES = [
    Family("Llama (SmolLM2 shape)", "llama", "the reference family; tied LM head", _llama,
           also="; the real SmolLM2-135M-Instruct is the embedded default of every other test", chat_templates=("",)),
    Family("Qwen3", "qwen3", "q/k RMSNorm; untied LM head", _qwen3, chat_templates=("qwen3",)),
    Family("Qwen3.5", "qwen3_5", "hybrid: 3 Gated DeltaNet (linear attention) layers per full-attention layer; "
           "vision-language checkpoint, the text model is used", _qwen3_5, hybrid=True,
           chat_templates=("qwen3_5", "qwen3_6")),
    Family("Qwen3.5-MoE", "qwen3_5_moe", "hybrid as Qwen3.5, mixture-of-experts MLPs", _qwen3_5_moe, hybrid=True,
           chat_templates=("qwen3_5", "qwen3_6")),
    Family("Qwen3-Next", "qwen3_next", "hybrid, its own Gated DeltaNet module (fused projections), "
           "mixture-of-experts MLPs; plain causal-LM checkpoint", _qwen3_next, hybrid=True,
           chat_templates=("qwen3_thinking",)),
    Family("Gemma 3 (text: 270M, 1B)", "gemma3_text", "sliding-window layers (5 per full one), embeddings "
           "scaled by sqrt(hidden), final-logit soft-capping", _gemma3,
           also="; the real Gemma-3-270M (GGUF from PyPI) end to end in a slow test", chat_templates=("gemma3",)),
]
# How the README names each chat template.
TEMPLATE_NAMES = {"": "ChatML (SmolLM2's)", "qwen3": "Qwen3", "qwen3_thinking": "Qwen3 thinking-only (Next-Thinking)",
                  "qwen3_5": "Qwen3.5", "qwen3_6": "Qwen3.6", "gemma3": "Gemma 3 (its structure)"}
STATUS = "extract, train, export and eval tested on CPU; eval lossless in fp32"
GENERATE = {False: "generate equals plain greedy decoding", True: "generate refuses it (no static cache)"}


def build(family: Family, out_dir, tokenizer_dir, seed: int = 0) -> Path:
    """Save a random model of `family` with SmolLM2's tokenizer files as an HF folder (once per folder)."""
    import shutil

    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    out = Path(out_dir)
    if (out / "config.json").exists():
        return out
    torch.manual_seed(seed)
    cfg = family.config()
    auto = AutoModelForImageTextToText if hasattr(cfg, "vision_config") else AutoModelForCausalLM
    model = auto.from_config(cfg, dtype=torch.float32)
    model.save_pretrained(out)
    for f in Path(tokenizer_dir).iterdir():
        if f.name.startswith("tokenizer") or f.name in ("chat_template.jinja", "special_tokens_map.json"):
            shutil.copy(f, out / f.name)
    return out


def readme_table() -> str:
    """The README's "Supported target families" table."""
    rows = ["| family | model_type | what is special | chat templates (loss mask tested) | status |",
            "|---|---|---|---|---|"]
    rows += [f"| {f.name} | `{f.model_type}` | {f.special} | {', '.join(TEMPLATE_NAMES[t] for t in f.chat_templates)} "
             f"| {STATUS}; {GENERATE[f.hybrid]}{f.also} |" for f in FAMILIES]
    return "\n".join(rows)


if __name__ == "__main__":
    print(readme_table())
