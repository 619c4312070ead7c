"""The DFlash method's rules, each in one place (docs/dflash-method.md says where they come from).

Extraction, training, export and evaluation all depend on these choices agreeing: which target layers
feed the drafter, which token id marks the masked block slots, how the loss decays along a block, and
which stored row holds the label and the teacher of a block slot. A rule that lives in two places
drifts (a label off by one trains a drafter that looks fine and fails at serving), so every module
imports them from here.

No torch import at module level: the command line reads the gamma table for its help text, and
`dflash --help` must stay instant. The tensor helpers only call methods of the tensors they are given.
"""

from __future__ import annotations

# -- target features -----------------------------------------------------------------------------------


def default_layer_ids(num_target_layers: int, n: int) -> list[int]:
    """Target layers whose outputs feed the drafter: n=1 -> [L//2], else spread over 1 .. L-3."""
    if n < 1 or num_target_layers < 1:
        raise ValueError(f"need n >= 1 features from a target of >= 1 layers, got n={n}, L={num_target_layers}")
    if n == 1:
        return [num_target_layers // 2]
    span = num_target_layers - 4
    ids = [round(1 + (i * span) / (n - 1)) for i in range(n)]
    if len(set(ids)) != n or min(ids) < 0:
        raise ValueError(f"cannot pick {n} distinct feature layers from a target of {num_target_layers} "
                         f"layers; pass target_layer_ids explicitly")
    return ids


# -- the mask token --------------------------------------------------------------------------------------


def choose_mask_token_id(configured: int | None, tokenizer, embedding_rows: int) -> int:
    """The token id whose (frozen) embedding fills the masked block slots.

    In order: the configured id; the tokenizer's mask token; the first embedding row past the
    tokenizer's vocabulary (Qwen3: 151669); for targets whose vocabulary fills the table (SmolLM2), the
    last added special token that the chat template never emits and that is not bos/eos/pad/unk.
    Raises ValueError when none applies or the configured id is outside the table.
    """
    if configured is not None:
        if not 0 <= int(configured) < embedding_rows:
            raise ValueError(f"mask_token_id {configured} is outside the target's embedding table "
                             f"({embedding_rows} rows)")
        return int(configured)
    tokenizer_mask = getattr(tokenizer, "mask_token_id", None)
    if tokenizer_mask is not None and 0 <= tokenizer_mask < embedding_rows:
        return int(tokenizer_mask)
    if len(tokenizer) < embedding_rows:
        return len(tokenizer)
    unused = _unused_special_token(tokenizer, embedding_rows)
    if unused is not None:
        return unused
    raise ValueError(
        f"no mask token: the tokenizer has no mask token and all {embedding_rows} embedding rows are "
        f"used by its {len(tokenizer)} tokens; set mask_token_id in the config (e.g. a reserved or "
        f"rarely used special token id)"
    )


def _unused_special_token(tokenizer, embedding_rows: int) -> int | None:
    """The highest added special token id that the chat template never writes and no role claims."""
    template = str(getattr(tokenizer, "chat_template", None) or "")
    used = {getattr(tokenizer, name, None) for name in ("bos_token_id", "eos_token_id", "pad_token_id",
                                                        "unk_token_id")}
    added = sorted(getattr(tokenizer, "added_tokens_decoder", {}).items())
    for tid, tok in reversed(added):
        if tok.special and tok.content not in template and tid not in used and 0 <= tid < embedding_rows:
            return int(tid)
    return None


# The loss's defaults (`dflash train`): the recipe that trained the better drafter in a side by side at
# equal data and steps (the real SmolLM2-135M target, 10,000 regenerated replies, 1,500 steps; BENCHMARKS.md,
# 2026-12-03): CE with position decay + 15% KL to the stored top-k + CAP 0.1 + uniform feature noise
# U(-0.2, 0.2) was ahead of CE alone on every eval set (real tau 1.89 / 1.43 / 1.48 against 1.84 / 1.39 /
# 1.43: chat T=0, chat T=1, code T=0). The noise is absolute (below).
DEFAULT_KL_WEIGHT = 0.15
DEFAULT_CAP_WEIGHT = 0.1
DEFAULT_FEATURE_NOISE = 0.2
# ... where it was 0.26% (layers 14-27, RMS 75-78) to 6.5% (layer 1, RMS 3.1) of each stored layer's RMS:
# `dflash train` reports the ratio on the store it trains from, and warns where a layer's is far above it.
NOISE_OVER_RMS_MEASURED = (0.0026, 0.065)


# -- loss decay along a block ----------------------------------------------------------------------------

# The paper's decay constant gamma per block size: slot k's loss weight is exp(-(k - 1) / gamma).
GAMMA_BY_BLOCK_SIZE = {16: 7.0, 10: 5.0, 8: 4.0}


def default_gamma(block_size: int) -> float:
    """The paper's decay constant for a block size (7 for 16, 5 for 10, 4 for 8)."""
    if block_size not in GAMMA_BY_BLOCK_SIZE:
        raise ValueError(f"no published loss decay gamma for block size {block_size} (known: "
                         f"{sorted(GAMMA_BY_BLOCK_SIZE)}); set gamma explicitly")
    return GAMMA_BY_BLOCK_SIZE[block_size]


def gamma_table_text() -> str:
    """The table as users read it in help texts and errors: "7 for 16, 5 for 10, 4 for 8"."""
    return ", ".join(f"{gamma:g} for {b}" for b, gamma in GAMMA_BY_BLOCK_SIZE.items())


def position_decay(slots, gamma: float):
    """Loss weights exp(-(k - 1) / gamma) of block slots k (a tensor); slot 0 is never labelled."""
    return (-(slots.float() - 1.0) / gamma).exp()


# -- blocks, labels and teachers -------------------------------------------------------------------------
# Labels are same-position: block slot k (k >= 1) predicts the token at anchor + k; slot 0 (the anchor,
# already committed) has no loss. No EAGLE-style shift. The stored teacher distribution at position t is
# the target's next-token distribution, i.e. the teacher of the token at t is stored at t - 1.

def label_index(anchor, slots):
    """Row index of the token that block slot k predicts: anchor + k (same position, no shift)."""
    return anchor + slots


def teacher_index(label_index):
    """Row index of the stored teacher distribution for the token at `label_index`: one before it."""
    return label_index - 1


def block_input_ids(anchor_ids, block_size: int, mask_token_id: int):
    """[..., B] token ids [anchor, MASK, ..., MASK] (int64) for anchor ids [...]."""
    out = anchor_ids.long().new_full((*anchor_ids.shape, block_size), mask_token_id)
    out[..., 0] = anchor_ids
    return out


__all__ = [
    "GAMMA_BY_BLOCK_SIZE", "block_input_ids", "choose_mask_token_id", "default_gamma",
    "default_layer_ids", "gamma_table_text", "label_index", "position_decay", "teacher_index",
]
