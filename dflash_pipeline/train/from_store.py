"""What the trainer takes from a store: the drafter shaped after the stored target, the frozen tensors
it shares with the target, and the checks that the store holds what a training config needs.

The target itself is never loaded for training: the store's target/ group carries its config, its
tokenizer, its embedding and its LM head, and these functions read only that.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from dflash_pipeline.errors import DFlashError
from dflash_pipeline.method import NOISE_OVER_RMS_MEASURED, choose_mask_token_id
from dflash_pipeline.schemas.config import ModelConfig, TrainConfig
from dflash_pipeline.schemas.store import LAYER_CONVENTION
from dflash_pipeline.store.reader import StoreReader
from dflash_pipeline.store.stats import layer_rms
from dflash_pipeline.train.model import DrafterConfig
from dflash_pipeline.train.step import Frozen


def drafter_config_for(model: ModelConfig, reader: StoreReader) -> DrafterConfig:
    """A drafter of the target's width, from the target config stored in the store."""
    attrs = reader.target_config()
    tc = attrs["config"]
    tc = tc.get("text_config", tc) if isinstance(tc.get("text_config"), dict) else tc
    H = attrs["hidden_size"]
    heads = tc.get("num_attention_heads")
    layer_ids = list(model.layers) if model.layers else list(reader.meta.layer_ids)
    missing = [k for k in layer_ids if k not in reader.meta.layer_ids]
    if missing:
        raise DFlashError(f"--layers {missing} are not in the store (it has {reader.meta.layer_ids})")
    tokenizer = reader.load_tokenizer()
    try:
        mask_id = choose_mask_token_id(model.mask_token_id, tokenizer, attrs["vocab_size"])
    except ValueError as e:
        raise DFlashError(str(e) if model.mask_token_id is not None else f"{e}; pass --mask-token-id") from None
    rope = tc.get("rope_theta") or (tc.get("rope_parameters") or {}).get("rope_theta") or 10000.0
    layer_types = ["sliding_attention" if i in model.swa_layers else "full_attention"
                   for i in range(model.num_layers)]
    return DrafterConfig(
        hidden_size=H, intermediate_size=tc.get("intermediate_size", 4 * H), num_layers=model.num_layers,
        num_heads=heads, num_kv_heads=tc.get("num_key_value_heads") or heads,
        head_dim=tc.get("head_dim") or H // heads, vocab_size=attrs["vocab_size"], block_size=model.block_size,
        mask_token_id=mask_id, target_layer_ids=layer_ids, num_target_layers=attrs["num_layers"],
        rms_norm_eps=attrs.get("rms_norm_eps") or tc.get("rms_norm_eps") or 1e-6, rope_theta=float(rope),
        max_position_embeddings=tc.get("max_position_embeddings", 32768), layer_types=layer_types,
        sliding_window=model.sliding_window, embedding_scale=float(attrs.get("embedding_scale") or 1.0),
        logit_scale=attrs.get("logit_scale"), final_logit_softcapping=attrs.get("final_logit_softcapping"),
    )


def check_store_fits(cfg: TrainConfig, reader: StoreReader) -> None:
    """Refuse, before training starts, a store without what the config needs."""
    if reader.meta.layer_convention != LAYER_CONVENTION:
        # Tools disagree by one on what "layer k" means; features of the wrong layers train a drafter
        # that looks fine and fails at serving time.
        raise DFlashError(f"{cfg.data.store}: layer ids use the convention '{reader.meta.layer_convention}', this "
                          f"trainer and the DFlash export use '{LAYER_CONVENTION}' (HF hidden_states[k+1])")
    if cfg.loss.kl_for(reader.meta.topk) > 0 and reader.meta.topk == 0:
        raise DFlashError(f"{cfg.data.store}: --kl-weight needs the teacher's top-k, and this store has none "
                          "(extracted with --topk 0)")
    if not reader.kv.exists("target/zarr.json"):
        raise DFlashError(f"{cfg.data.store}: the store has no target/ tensors (frozen embedding and LM head); "
                          "it was not written by a complete `dflash extract`")
    if reader.num_samples == 0:
        raise DFlashError(f"{cfg.data.store}: the store has no committed samples")


def noise_scale(noise: float, reader: StoreReader) -> tuple[list[float | None], str]:
    """`--feature-noise` is absolute: its amplitude over each stored layer's RMS (None: no statistics), and
    a line that says it (a warning where a layer's ratio is well above what the default was measured at)."""
    rms = layer_rms(reader)
    ratios = [noise / r if r > 0 else None for r in rms]
    seen = [r for r in rms if r > 0]
    if not seen:
        return ratios, f"feature noise U(-{noise:g}, {noise:g}): the store's markers hold no feature statistics"
    lo, hi = NOISE_OVER_RMS_MEASURED
    text = (f"feature noise U(-{noise:g}, {noise:g}) is {noise / max(seen):.1%}-{noise / min(seen):.1%} of the "
            f"features' RMS by layer ({min(seen):.3g}-{max(seen):.3g})")
    if noise / min(seen) > 3 * hi:
        text += (f"; warning: the default was measured at {lo:.1%}-{hi:.1%}, so it is strong for this target "
                 f"(--feature-noise {hi * min(seen):.3g} puts its noisiest layer at {hi:.1%}; 0 turns it off)")
    return ratios, text


# Above this share of a sample's supervised positions drawn as anchors every step, neighbouring blocks teach
# nearly the same thing: on the 40,000-question SmolLM2 store (~265 supervised tokens a sample), 512 anchors
# (~all positions) trailed 128 over twice the tokens per step at about equal block tokens (held-out tau
# estimate 2.06 against 2.43 at 1,500 steps, real chat tau 2.56; BENCHMARKS.md, 2026-12-03)
DENSE_ANCHOR_COVERAGE = 0.75
# `dflash train`'s anchors and batch where the options are left to the store (auto): the paper's 512 anchors
# on 4 rows of 3,072 tokens, unless that anchors nearly every position of the store's samples; then fewer
# anchors (a power of two near 1/SPARSE_SHARE of the median sample) over up to SPARSE_MAX_BATCH_FACTOR times the
# tokens. Measured on that store (BENCHMARKS.md): 128 over 24,576 tokens gave real chat tau 3.07 (fp32) after
# 3,600 steps; 64 over 49,152 gave 3.02 after 1,818 steps of the same schedule (held-out estimate 2.58 against
# 2.35 at step 1,200), for ~1.2x the block tokens a step (2026-12-05)
BASE_ANCHORS = 512
BASE_TOKENS_PER_BATCH = 12288
SPARSE_SHARE = 4                 # anchors near 1/4 of the median sample's positions
SPARSE_MAX_BATCH_FACTOR = 4


def store_candidates(reader: StoreReader) -> np.ndarray:
    """Anchor positions of each sample of the store (about its supervised tokens less one)."""
    return np.maximum(reader.column("supervised").astype(np.int64) - 1, 0)


def _coverage(max_anchors: int, candidates: np.ndarray) -> float:
    return float(np.minimum(candidates, max_anchors).sum() / max(int(candidates.sum()), 1))


def sparse_anchors(max_anchors: int, candidates: np.ndarray) -> tuple[int, int] | None:
    """Where `max_anchors` a sample anchors nearly every position (coverage above DENSE_ANCHOR_COVERAGE):
    (fewer anchors, the largest power of two at most 1/SPARSE_SHARE of the median sample, at least 16; the factor
    of tokens per batch that keeps about the same anchored positions a step, at most SPARSE_MAX_BATCH_FACTOR).
    None where it does not."""
    if not candidates.sum():
        return None
    cov, med = _coverage(max_anchors, candidates), int(np.median(candidates))
    if cov <= DENSE_ANCHOR_COVERAGE or med < 32:
        return None
    fewer = 1 << max(4, int(med // SPARSE_SHARE).bit_length() - 1)
    if fewer >= max_anchors:
        return None
    return fewer, max(1, min(SPARSE_MAX_BATCH_FACTOR, round(cov / _coverage(fewer, candidates))))


def resolve_batch(cfg: TrainConfig, reader: StoreReader,
                  resumed: dict | None = None) -> tuple[TrainConfig, str | None]:
    """`--max-anchors` and `--tokens-per-batch` left to the store (None) made concrete: BASE_ANCHORS over
    BASE_TOKENS_PER_BATCH (in whole rows of --max-length), or, on a store of short samples, sparse_anchors'
    fewer anchors over proportionally more tokens. A given option is kept; the other still follows the rule
    (a given batch keeps its size, given anchors keep the base batch). Deterministic in the store, so every
    rank and every --resume resolves the same. `resumed` (the flat config of the checkpoint a --resume continues)
    wins over the rule: a run resumes with the values it began with, whatever the defaults were then. Returns
    the concrete config and a line that says what was chosen."""
    loss, data = cfg.loss, cfg.data
    if loss.max_anchors is not None and data.tokens_per_batch is not None:
        return cfg, None
    if resumed and resumed.get("max_anchors") and resumed.get("tokens_per_batch"):
        anchors = loss.max_anchors if loss.max_anchors is not None else int(resumed["max_anchors"])
        tokens = data.tokens_per_batch if data.tokens_per_batch is not None else int(resumed["tokens_per_batch"])
        return _with_batch(cfg, anchors, tokens), (f"anchors and batch: {anchors} anchors a sample over "
                                                    f"{tokens:,} tokens a batch, as the run began")
    anchors, factor, why = loss.max_anchors, 1, ""
    if anchors is None:
        anchors = BASE_ANCHORS
        candidates = store_candidates(reader)
        sparse = sparse_anchors(BASE_ANCHORS, candidates)
        if sparse is not None and sparse[1] > 1:   # thinner only where more samples make up for it
            anchors, factor = sparse
            why = (f": the store's samples are short (median {int(np.median(candidates))} anchor positions) and "
                   f"{BASE_ANCHORS} would anchor nearly all of them; fewer anchors over more samples a step "
                   "trained a better drafter (BENCHMARKS.md)")
    tokens = data.tokens_per_batch
    if tokens is None:
        tokens = max(1, round(BASE_TOKENS_PER_BATCH / data.max_length)) * data.max_length * factor
    return _with_batch(cfg, anchors, tokens), f"anchors and batch (auto): {anchors} anchors a sample over {tokens:,} tokens a batch{why}"


def _with_batch(cfg: TrainConfig, anchors: int, tokens: int) -> TrainConfig:
    return TrainConfig(seed=cfg.seed, model=cfg.model, loss=dataclasses.replace(cfg.loss, max_anchors=anchors),
                       optim=cfg.optim, data=dataclasses.replace(cfg.data, tokens_per_batch=tokens),
                       runtime=cfg.runtime, output=cfg.output)


def anchor_coverage(max_anchors: int, tokens_per_batch: int, reader: StoreReader) -> tuple[float, str]:
    """The share of the store's anchor positions that `--max-anchors` draws every step, and a line that says
    it; where nearly every position is an anchor, the line suggests fewer anchors over proportionally more
    tokens per batch (about the same anchored positions a step)."""
    candidates = store_candidates(reader)
    if not candidates.sum():
        return 0.0, "anchors: the store has no supervised positions"
    cov = _coverage(max_anchors, candidates)
    med = int(np.median(candidates))
    text = f"anchors: up to {max_anchors} a sample, {cov:.0%} of the supervised positions a step (median sample {med})"
    sparse = sparse_anchors(max_anchors, candidates)
    if sparse is not None and sparse[1] > 1:
        fewer, factor = sparse
        text += (f"; nearly every position is an anchor, and neighbouring blocks teach nearly the same thing: "
                 f"fewer anchors over more samples a step trained a better drafter at about the same compute on "
                 f"short samples (BENCHMARKS.md): try --max-anchors {fewer} --tokens-per-batch "
                 f"{tokens_per_batch * factor}")
    return cov, text


def frozen_tensors(reader: StoreReader, device: torch.device, dtype: torch.dtype) -> Frozen:
    """The target's embedding and LM head (the embedding again when tied), in the compute dtype."""
    embed = reader.target_tensor("embed").to(device=device, dtype=dtype)
    head = reader.target_tensor("lm_head").to(device=device, dtype=dtype) if reader.has_target_tensor("lm_head") else embed
    attrs = reader.target_config()
    return Frozen(embed, head, float(attrs.get("embedding_scale") or 1.0))


# Options that set a drafter field, named in the error when an --init-from drafter differs from this run's.
_FIELD_OPTIONS = {"num_layers": "--num-layers", "block_size": "--block-size", "target_layer_ids": "--layers",
                  "mask_token_id": "--mask-token-id", "layer_types": "--swa-layers", "sliding_window": "--sliding-window"}


def _differs(a, b) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        return a is None or b is None or abs(float(a) - float(b)) > 1e-9 * max(1.0, abs(float(a)))
    return a != b


def check_init(directory: str, dcfg: DrafterConfig) -> None:
    """Refuse an --init-from drafter unlike the one this run builds: another architecture or another target
    (width, vocabulary, layers read). One line names what differs and the option that sets it."""
    from dflash_pipeline.train.export import read_drafter_config

    try:
        theirs = read_drafter_config(directory)
    except DFlashError as e:
        raise DFlashError(f"--init-from {e}") from None
    full = ["full_attention"]
    diffs = []
    for f in dataclasses.fields(DrafterConfig):
        a, b = getattr(theirs, f.name), getattr(dcfg, f.name)
        if f.name == "layer_types":  # empty means every layer full attention
            a, b = a or full * theirs.num_layers, b or full * dcfg.num_layers
        if _differs(a, b):
            how = f"pass {_FIELD_OPTIONS[f.name]}" if f.name in _FIELD_OPTIONS else "a drafter of another target"
            diffs.append(f"{f.name} {a} there, {b} here ({how})")
    if diffs:
        raise DFlashError(f"--init-from {directory}: the drafter differs from this run's: {'; '.join(diffs)}")


def init_state(directory: str, dcfg: DrafterConfig) -> dict[str, torch.Tensor]:
    """The weights of an exported drafter (`dflash train`'s final/, `dflash export`, or the DFlash authors'
    format) to start a run from, once `check_init` accepts it: they then have this run's names and shapes
    (loaded strictly against the same config)."""
    from dflash_pipeline.train.export import load_drafter

    check_init(directory, dcfg)
    try:
        return load_drafter(directory, torch.float32, torch.device("cpu")).state_dict()
    except DFlashError as e:
        raise DFlashError(f"--init-from {e}") from None


__all__ = ["anchor_coverage", "check_init", "check_store_fits", "drafter_config_for", "frozen_tensors", "init_state",
           "noise_scale"]
