"""What the benchmark scripts share."""

from __future__ import annotations

import json


def save_json(path: str | None, obj) -> None:
    """Write a result to `path` (the script's --json), if one was given."""
    if path:
        with open(path, "w") as f:
            json.dump(obj, f, indent=1)


# Qwen3.5-27B / Qwen3.6-27B text decoder (their config.json and model card): 64 layers of 16 x (3 Gated
# DeltaNet + 1 gated attention), hidden 5,120, FFN 17,408, attention 24 query / 4 KV heads of 256
# (rotary on a quarter of each head, theta 1e7), DeltaNet 16 query-key / 48 value heads of 128 with a
# 4-wide convolution, vocabulary 248,320, untied LM head. Layer types default to every 4th layer full.
QWEN3_5_27B = dict(hidden_size=5120, intermediate_size=17408, num_hidden_layers=64, num_attention_heads=24,
                   num_key_value_heads=4, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=48,
                   linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
                   vocab_size=248320, max_position_embeddings=262144, rms_norm_eps=1e-6,
                   rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
                   tie_word_embeddings=False)
# The same layer pattern and head layout at toy width, for --smoke runs on the CPU.
QWEN3_5_TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                    linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4, vocab_size=49152,
                    max_position_embeddings=8192, tie_word_embeddings=False)


def int_list(text: str) -> list[int]:
    """An argparse type: comma-separated integers ("0,1,2,3"), as `dflash train --swa-layers` takes them."""
    return [int(x) for x in text.split(",") if x.strip()]
