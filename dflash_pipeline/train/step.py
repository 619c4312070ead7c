"""One drafter step on a packed batch: anchors -> blocks -> drafter -> fused head loss -> metrics.

Shared by training and evaluation. Everything random draws from generators seeded by (seed, rank, step):
anchors on the host, feature noise on the device, so a resumed run replays exactly what an
uninterrupted one would. Everything whose shape depends on the data (anchors, blocks, the labelled
selection) is built on the host from the batch's host copy: the host then never waits for the GPU
within or between steps, and keeps the GPU's queue full.

Legend: R rows, S row length, A anchors per row, B block size, Q = A*B, N labelled slots, H hidden,
V vocabulary, K teacher top-k (or the drafter's, `DraftTopK`), J top-k accuracy levels (`TOPK_ACCURACY`),
m = B - 1 drafted slots.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dflash_pipeline.method import teacher_index
from dflash_pipeline.train.blocks import build_blocks, pad_anchors, sample_anchors
from dflash_pipeline.train.batch import Batch
from dflash_pipeline.train.loss import fused_head_loss


@dataclass
class Frozen:
    """What the drafter shares with the target, on the training device (never trained or saved)."""

    embed_VH: torch.Tensor
    head_VH: torch.Tensor
    embed_scale: float = 1.0


@dataclass
class DraftTopK:
    """The drafter's top-K at the drafted slots 1..B-1 of every block (m = B - 1), from the loss's own pass.
    Only labelled slots have logits there: the others hold log-probability -inf (no tree node) and
    reference -1."""

    logprobs_RAmK: torch.Tensor   # fp32, best first
    ids_RAmK: torch.Tensor        # int64
    reference_RAm: torch.Tensor   # int64: the label (the token the block slot predicts), -1 where unlabelled


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
    attn_pairs: float             # visible (query, key) pairs, for the FLOP count (from the host)
    run_RA: torch.Tensor          # per block: correct slots in a row from slot 1 (-1: no label)
    topk_correct_JB: torch.Tensor  # [len(TOPK_ACCURACY), B] labels within the drafter's top k, per block slot
    draft_topk: DraftTopK | None = None  # with run_blocks(topk=K): the tree estimate's input


# Top-k accuracies per block slot beside top-1 (`correct_B`): how often a tree that offers k tokens at a
# slot holds the right one. From each loss chunk's logits, in the same pass.
TOPK_ACCURACY = (4, 8)


ANCHOR_STREAM, NOISE_STREAM = 0, 1


def step_generator(seed: int, rank: int, step: int, device: torch.device | str = "cpu",
                   stream: int = ANCHOR_STREAM) -> torch.Generator:
    """The generator of one step's draws: anchors (ANCHOR_STREAM, on the host) or feature noise
    (NOISE_STREAM, on the training device); independent streams, a function of (seed, rank, step)."""
    g = torch.Generator(device=device)
    g.manual_seed((seed * 1_000_003 + rank * 7919 + step * 104_729 + stream * 15_485_863) % (2 ** 63))
    return g


def draw_anchors(batch: Batch, max_anchors: int, g: torch.Generator, block_size: int = 16) -> torch.Tensor:
    """[R, A] sorted anchor indices per row, -1 padded, on the host (g: a host generator).

    Drawn from the batch's host copy: on the device, the variable anchor count would make the host
    wait for the GPU to finish the previous step before it could queue this one.
    A is rounded up so that A * block_size is a multiple of 128: query lengths then fall on
    FlexAttention's 128-token tiles and take few distinct values, so the compiled kernel is not
    recompiled for every step's anchor count.
    """
    h = batch.host_fields()
    lists = [sample_anchors(h["loss_mask"][r], h["doc"][r], max_anchors, generator=g)
             for r in range(h["tokens"].shape[0])]
    bucket = max(1, 128 // block_size)
    longest = max((len(a) for a in lists), default=0)
    return pad_anchors(lists, num_blocks=max(bucket, -(-longest // bucket) * bucket))


LOGITS_BUDGET_BYTES = 1 << 30


def loss_chunk_for(loss_chunk: int, vocab: int) -> int:
    """Positions per loss chunk: at most `loss_chunk`, and few enough that one chunk's fp32 logits stay
    within 1 GiB (a chunk holds about three [C, V] fp32 buffers at its peak; at V = 248K and C = 4096
    that was 12 GB of the step's peak)."""
    return max(128, min(loss_chunk, LOGITS_BUDGET_BYTES // (4 * vocab)))


@dataclass
class StagedBlocks:
    """A step's blocks built on the host and sent to the device in two copies. N: labelled slots."""

    token_ids_RQ: torch.Tensor
    pos_RQ: torch.Tensor
    doc_RQ: torch.Tensor
    block_id_RQ: torch.Tensor
    sel_N: torch.Tensor           # flat [R*Q] index of each labelled slot
    labels_N: torch.Tensor
    teacher_N: torch.Tensor       # flat [R*S] row of the teacher distribution (label index - 1)
    weights_N: torch.Tensor       # float32
    attn_pairs: float


def stage_blocks(batch: Batch, anchors_RA: torch.Tensor, *, block_size: int, mask_token_id: int, gamma: float,
                 layer_kinds: list[tuple[bool, int | None]], device: torch.device) -> StagedBlocks:
    """Blocks, labels and the labelled selection from the batch's host copy: the labelled count (a
    shape) is known without asking the device, so the host never waits for the GPU within a step."""
    h = batch.host_fields()
    anchors_RA = anchors_RA.cpu()
    blocks = build_blocks(h["tokens"], h["pos"], h["doc"], h["loss_mask"], anchors_RA, block_size=block_size,
                          mask_token_id=mask_token_id, gamma=gamma)
    R, Q = blocks.labels_RQ.shape
    S = h["tokens"].shape[1]
    w = blocks.weights_RQ.reshape(-1)
    sel = (w > 0).nonzero()[:, 0]
    row = sel // Q
    teacher = row * S + teacher_index(blocks.label_index_RQ.reshape(-1)[sel]).clamp_min(0)
    ints = [blocks.token_ids_RQ, blocks.pos_RQ, blocks.doc_RQ, blocks.block_id_RQ, sel,
            blocks.labels_RQ.reshape(-1)[sel], teacher]
    pairs = attention_pairs(blocks, block_size, layer_kinds)
    ints = _to_device(ints, device)
    weights = _to_device([w[sel]], device)[0]
    return StagedBlocks(*ints, weights, pairs)


def _to_device(tensors: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """Same-dtype host tensors to the device in one asynchronous copy from pinned memory."""
    if device.type == "cpu":
        return tensors
    flat = torch.cat([t.reshape(-1) for t in tensors]).pin_memory().to(device, non_blocking=True)
    out, at = [], 0
    for t in tensors:
        out.append(flat[at:at + t.numel()].view(t.shape))
        at += t.numel()
    return out


def run_blocks(model, frozen: Frozen, batch: Batch, anchors_RA: torch.Tensor, *, block_size: int,
               mask_token_id: int, gamma: float, kl_weight: float, cap_weight: float, feature_noise: float,
               loss_chunk: int, g: torch.Generator | None, autocast: bool, topk: int = 0,
               staged: StagedBlocks | None = None, normalizer: torch.Tensor | None = None) -> StepOut:
    """One step's forward and loss. anchors_RA: from `draw_anchors` (host); g: the device generator of
    the feature noise; topk > 0: also the drafter's top-k per drafted slot (`StepOut.draft_topk`).
    A batch that runs in chunks of rows passes each chunk's `staged` blocks and the loss `normalizer` of the
    whole batch (its blocks' summed weights), so that the chunks' losses add up to the batch's."""
    core = model.module if hasattr(model, "module") else model
    cfg = core.config
    feats = batch.features
    device = feats.device
    st = staged if staged is not None else stage_blocks(
        batch, anchors_RA, block_size=block_size, mask_token_id=mask_token_id, gamma=gamma,
        layer_kinds=cfg.layer_mask_kinds(), device=device)
    if feature_noise > 0:
        noise = torch.rand(feats.shape, generator=g, device=device, dtype=torch.float32)
        feats = (feats.float() + (noise * 2 - 1) * feature_noise).to(feats.dtype)
    embeds = frozen.embed_VH[st.token_ids_RQ]
    if frozen.embed_scale != 1.0:
        embeds = embeds * frozen.embed_scale
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
        hidden_RQH = model(feats, batch.pos, batch.doc, embeds, st.pos_RQ, st.doc_RQ, st.block_id_RQ)
    R, Q = st.token_ids_RQ.shape
    B = block_size
    hidden_NH = hidden_RQH.reshape(R * Q, -1).index_select(0, st.sel_N)
    t_ids = t_lps = None
    if kl_weight > 0:
        # The teacher for the token at t is the target's distribution computed at t - 1.
        K = batch.topk_ids.shape[-1]
        t_ids = batch.topk_ids.reshape(-1, K).index_select(0, st.teacher_N)
        t_lps = batch.topk_logprobs.reshape(-1, K).index_select(0, st.teacher_N).float()
    head = frozen.head_VH
    res = fused_head_loss(hidden_NH.to(head.dtype), head, st.labels_N, st.weights_N, t_ids, t_lps,
                          kl_weight=kl_weight, cap_weight=cap_weight, normalizer=normalizer,
                          chunk_size=loss_chunk_for(loss_chunk, head.shape[0]), rank_limit=max(TOPK_ACCURACY),
                          compiled=False if core.options.compile_kernels is False else None, topk=topk)
    # Per-slot accuracy and the acceptance streak of each block, from the same logits' argmax; top-k
    # accuracy from the label's rank in those logits.
    labelled_RQ = torch.zeros(R * Q, dtype=torch.bool, device=device).index_fill_(0, st.sel_N, True)
    correct_RQ = torch.zeros(R * Q, dtype=torch.bool, device=device).index_put_((st.sel_N,), res.correct_N)
    rank_RQ = torch.full((R * Q,), head.shape[0], dtype=torch.long, device=device).index_put_(
        (st.sel_N,), res.label_rank_N)
    labelled = labelled_RQ.view(R, Q // B, B)
    correct = correct_RQ.view(R, Q // B, B)
    rank = rank_RQ.view(R, Q // B, B)
    count_B = labelled.sum(dim=(0, 1))
    correct_B = (correct & labelled).sum(dim=(0, 1))
    topk_correct_JB = torch.stack([((rank < k) & labelled).sum(dim=(0, 1)) for k in TOPK_ACCURACY])
    has = labelled[..., 1:].any(-1)
    run = (correct[..., 1:] & labelled[..., 1:]).int().cumprod(-1)  # stops at the first miss or unlabelled slot
    streak = run.sum(-1) + 1
    return StepOut(res.loss, res.ce.detach(), res.kl.detach(), res.cap.detach(), correct_B, count_B,
                   (streak * has).sum(), has.sum(), R * Q, int(batch.num_tokens), st.attn_pairs,
                   torch.where(has, run.sum(-1), -1), topk_correct_JB,
                   _draft_topk(res, st, R, Q, B) if topk else None)


def _draft_topk(res, st: StagedBlocks, R: int, Q: int, B: int) -> DraftTopK:
    """The loss pass's top-k of the labelled slots scattered into [R, A, B - 1, K]."""
    K, dev = res.topk_ids_NK.shape[1], res.topk_ids_NK.device
    lp = torch.full((R * Q, K), -float("inf"), dtype=torch.float32, device=dev)
    ids = torch.zeros(R * Q, K, dtype=torch.long, device=dev)
    ref = torch.full((R * Q,), -1, dtype=torch.long, device=dev)
    lp.index_copy_(0, st.sel_N, res.topk_logprobs_NK.float())
    ids.index_copy_(0, st.sel_N, res.topk_ids_NK)
    ref.index_copy_(0, st.sel_N, st.labels_N)
    A = Q // B
    return DraftTopK(lp.view(R, A, B, K)[:, :, 1:], ids.view(R, A, B, K)[:, :, 1:], ref.view(R, A, B)[:, :, 1:])


def attention_pairs(blocks, block_size: int, layer_kinds: list[tuple[bool, int | None]]) -> float:
    """Visible (query, key) pairs summed over layers, counted exactly from the host blocks by the rule of
    `masks.visible`: context keys of the sample before the anchor, and keys of the query's own block
    (all of them, or up to its slot when causal), both within the window in sliding layers."""
    valid = (blocks.block_id_RQ >= 0).double()
    slot = (torch.arange(blocks.pos_RQ.shape[1]) % block_size).double()
    q_pos = blocks.pos_RQ.double()
    anchor = q_pos - slot
    total = 0.0
    for causal, window in layer_kinds:
        if window is None:
            ctx = anchor
            own = slot + 1 if causal else torch.full_like(slot, float(block_size))
        else:
            ctx = (anchor - (q_pos - window + 1).clamp_min(0)).clamp_min(0)   # keys in (q_pos - W, anchor)
            lo = (slot - window + 1).clamp_min(0)
            hi = slot if causal else (slot + window - 1).clamp_max(block_size - 1)
            own = hi - lo + 1
        total += float(((ctx + own) * valid).sum())
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
    """`flops_from_totals` of one step (reads the labelled count from the device: a host sync)."""
    return flops_from_totals(cfg, block_tokens=out.block_tokens, context_tokens=context_tokens,
                             attn_pairs=out.attn_pairs, labelled=float(out.count_B.sum()), train=train)
