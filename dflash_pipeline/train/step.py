"""One drafter step on a packed batch: anchors -> blocks -> drafter -> fused head loss -> metrics.

Shared by training and evaluation. Everything random (anchors, feature noise) draws from a generator
seeded by (seed, rank, step), so a resumed run replays exactly what an uninterrupted one would.

Legend: R rows, S row length, A anchors per row, B block size, Q = A*B, N labelled slots, H hidden,
V vocabulary, K teacher top-k.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dflash_pipeline.train.blocks import build_blocks, pad_anchors, sample_anchors
from dflash_pipeline.train.data import Batch
from dflash_pipeline.train.loss import fused_head_loss


@dataclass
class Frozen:
    """What the drafter shares with the target, on the training device (never trained or saved)."""

    embed_VH: torch.Tensor
    head_VH: torch.Tensor
    embed_scale: float = 1.0


@dataclass
class StepOut:
    loss: torch.Tensor            # differentiable scalar
    ce: torch.Tensor
    kl: torch.Tensor
    cap: torch.Tensor
    correct_B: torch.Tensor       # [B] correct predictions per block slot (slot 0 unused)
    count_B: torch.Tensor         # [B] labelled slots per block slot
    streak_sum: torch.Tensor      # sum over blocks of (run of correct slots from slot 1) + 1
    blocks: torch.Tensor          # blocks with at least one label
    block_tokens: int             # A*B*R computed
    input_tokens: int
    attn_pairs: torch.Tensor      # visible (query, key) pairs, for the FLOP count
    run_RA: torch.Tensor          # per block: correct slots in a row from slot 1 (-1: no label)


def step_generator(seed: int, rank: int, step: int, device: torch.device) -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed((seed * 1_000_003 + rank * 7919 + step * 104_729) % (2 ** 63))
    return g


def draw_anchors(batch: Batch, max_anchors: int, g: torch.Generator, block_size: int = 16) -> torch.Tensor:
    """[R, A] sorted anchor indices per row, -1 padded.

    A is rounded up so that A * block_size is a multiple of 128: query lengths then fall on
    FlexAttention's 128-token tiles and take few distinct values, so the compiled kernel is not
    recompiled for every step's anchor count.
    """
    lists = [sample_anchors(batch.loss_mask[r], batch.doc[r], max_anchors, generator=g)
             for r in range(batch.tokens.shape[0])]
    bucket = max(1, 128 // block_size)
    longest = max((len(a) for a in lists), default=0)
    return pad_anchors(lists, num_blocks=max(bucket, -(-longest // bucket) * bucket))


LOGITS_BUDGET_BYTES = 1 << 30


def loss_chunk_for(loss_chunk: int, vocab: int) -> int:
    """Positions per loss chunk: at most `loss_chunk`, and few enough that one chunk's fp32 logits stay
    within 1 GiB (a chunk holds about three [C, V] fp32 buffers at its peak; at V = 248K and C = 4096
    that was 12 GB of the step's peak)."""
    return max(128, min(loss_chunk, LOGITS_BUDGET_BYTES // (4 * vocab)))


def run_blocks(model, frozen: Frozen, batch: Batch, anchors_RA: torch.Tensor, *, block_size: int,
               mask_token_id: int, gamma: float, kl_weight: float, cap_weight: float, feature_noise: float,
               loss_chunk: int, g: torch.Generator | None, autocast: bool) -> StepOut:
    blocks = build_blocks(batch.tokens, batch.pos, batch.doc, batch.loss_mask, anchors_RA, block_size=block_size,
                          mask_token_id=mask_token_id, gamma=gamma)
    feats = batch.features
    if feature_noise > 0:
        noise = torch.rand(feats.shape, generator=g, device=feats.device, dtype=torch.float32)
        feats = (feats.float() + (noise * 2 - 1) * feature_noise).to(feats.dtype)
    embeds = frozen.embed_VH[blocks.token_ids_RQ]
    if frozen.embed_scale != 1.0:
        embeds = embeds * frozen.embed_scale
    device_type = feats.device.type
    with torch.autocast(device_type, dtype=torch.bfloat16, enabled=autocast):
        hidden_RQH = model(feats, batch.pos, batch.doc, embeds, blocks.pos_RQ, blocks.doc_RQ, blocks.block_id_RQ)
    R, Q = blocks.labels_RQ.shape
    B = block_size
    sel = blocks.weights_RQ.reshape(-1) > 0
    hidden_NH = hidden_RQH.reshape(R * Q, -1)[sel]
    labels_N = blocks.labels_RQ.reshape(-1)[sel]
    weights_N = blocks.weights_RQ.reshape(-1)[sel]
    t_ids = t_lps = None
    if kl_weight > 0:
        # The teacher for the token at t is the target's distribution computed at t - 1.
        src = blocks.label_index_RQ.reshape(R, Q) - 1
        src = src.clamp_min(0)
        K = batch.topk_ids.shape[-1]
        t_ids = batch.topk_ids.gather(1, src[:, :, None].expand(R, Q, K)).reshape(R * Q, K)[sel]
        t_lps = batch.topk_logprobs.gather(1, src[:, :, None].expand(R, Q, K)).reshape(R * Q, K)[sel].float()
    head = frozen.head_VH
    core = model.module if hasattr(model, "module") else model
    res = fused_head_loss(hidden_NH.to(head.dtype), head, labels_N, weights_N, t_ids, t_lps,
                          kl_weight=kl_weight, cap_weight=cap_weight,
                          chunk_size=loss_chunk_for(loss_chunk, head.shape[0]),
                          compiled=False if getattr(core, "compile_kernels", None) is False else None)
    # Per-slot accuracy and the acceptance streak of each block, from the same logits' argmax.
    correct_RQ = torch.zeros(R * Q, dtype=torch.bool, device=hidden_RQH.device)
    correct_RQ[sel] = res.correct_N
    labelled = sel.view(R, Q // B, B)
    correct = correct_RQ.view(R, Q // B, B)
    count_B = labelled.sum(dim=(0, 1))
    correct_B = (correct & labelled).sum(dim=(0, 1))
    has = labelled[..., 1:].any(-1)
    run = (correct[..., 1:] & labelled[..., 1:]).int().cumprod(-1)  # stops at the first miss or unlabelled slot
    streak = run.sum(-1) + 1
    cfg = core.config
    return StepOut(res.loss, res.ce.detach(), res.kl.detach(), res.cap.detach(), correct_B, count_B,
                   (streak * has).sum(), has.sum(), R * Q, int(batch.num_tokens),
                   attention_pairs(batch, blocks, B, cfg), torch.where(has, run.sum(-1), -1))


def attention_pairs(batch: Batch, blocks, block_size: int, cfg) -> torch.Tensor:
    """Visible (query, key) pairs summed over layers: context keys before the anchor (capped by the
    window in sliding layers) plus the block's own keys."""
    valid = blocks.block_id_RQ >= 0
    anchor_pos = (blocks.pos_RQ - torch.arange(blocks.pos_RQ.shape[1], device=valid.device) % block_size).float()
    total = torch.zeros((), device=valid.device)
    for i in range(cfg.num_layers):
        causal, window = cfg.layer_mask_kind(i)
        ctx = anchor_pos if window is None else anchor_pos.clamp_max(float(window))
        own = float(block_size) if not causal else (torch.arange(blocks.pos_RQ.shape[1], device=valid.device) % block_size + 1).float()
        total = total + ((ctx + own) * valid).sum()
    return total


def flops_from_totals(cfg, *, block_tokens: float, context_tokens: float, attn_pairs: float, labelled: float,
                      train: bool = True) -> float:
    """Model FLOPs without recompute (the MFU numerator), from totals over any number of steps.

    Drafter matmuls per block token (q, k, v, o, MLP per layer) and per context token (fc, and k, v per
    layer), attention scores and values per visible pair, the LM head per labelled slot. Backward costs
    twice the forward for trainable weights; the frozen head only needs its input gradient (one more
    matmul), the frozen embedding nothing.
    """
    H, I, D = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    nq, nkv = cfg.num_heads * D, cfg.num_kv_heads * D
    per_block_token = cfg.num_layers * 2 * (H * nq + 2 * H * nkv + nq * H + 3 * H * I)
    per_ctx_token = 2 * cfg.num_features * H * H + cfg.num_layers * 2 * (2 * H * nkv)
    fwd = block_tokens * per_block_token + context_tokens * per_ctx_token + 4 * cfg.num_heads * D * attn_pairs
    head = 2 * H * cfg.vocab_size * labelled
    return fwd + head if not train else 3 * fwd + 2 * head


def step_flops(cfg, out: StepOut, context_tokens: int, train: bool = True) -> float:
    """`flops_from_totals` of one step (reads two device scalars: a host sync)."""
    return flops_from_totals(cfg, block_tokens=out.block_tokens, context_tokens=context_tokens,
                             attn_pairs=float(out.attn_pairs), labelled=float(out.count_B.sum()), train=train)
