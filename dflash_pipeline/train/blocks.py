"""Anchor sampling and block construction for training, vectorised over blocks.

An anchor is a position p whose token is known (the last committed token at inference) and whose next
token is supervised: loss_mask[p] and loss_mask[p+1] in the same sample. Anchors are drawn anew at every
step, without replacement per sample, capped, then sorted (random anchors beat a fixed partition).

A block is [token at p, MASK x (B-1)] at positions pos[p] + 0..B-1. Labels are same-position: slot k
(k >= 1) predicts the token at row index p + k, with weight exp(-(k-1)/gamma) if p + k lies inside the
same sample and is supervised, else 0; slot 0 has weight 0. There is no EAGLE-style shift. The teacher
distribution for the token at row index t is the target's next-token distribution stored at t - 1,
i.e. at `label_index - 1`. These rules (block inputs, label and teacher rows, the decay) are the
method's and live in `dflash_pipeline.method`; this module applies them to packed rows.

Padding is explicit: padded anchors are -1, padded blocks get block id -1, doc -1 and weight 0.

Shape legend: R rows, S row positions, A anchors (blocks) per row, B block size, Q = A * B.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dflash_pipeline.method import block_input_ids, label_index, position_decay

IGNORE_LABEL = -100


def anchor_candidates(loss_mask_S: torch.Tensor, doc_S: torch.Tensor) -> torch.Tensor:
    """Bool [S]: p and p+1 supervised and in the same (non-padding) sample."""
    ok = loss_mask_S[:-1].bool() & loss_mask_S[1:].bool() & (doc_S[:-1] == doc_S[1:]) & (doc_S[:-1] >= 0)
    return torch.cat([ok, ok.new_zeros(1)])


def sample_anchors(
    loss_mask_S: torch.Tensor,
    doc_S: torch.Tensor,
    max_anchors_per_sample: int,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Sorted anchor row indices [A] of one packed row, at most max_anchors_per_sample per sample.

    Without replacement: every candidate gets a uniform random key; within each sample the candidates
    with the smallest keys are kept.
    """
    if max_anchors_per_sample < 1:
        raise ValueError(f"max_anchors_per_sample must be >= 1, got {max_anchors_per_sample}")
    S = loss_mask_S.shape[0]
    device = loss_mask_S.device
    cand_S = anchor_candidates(loss_mask_S, doc_S)
    keys_S = torch.rand(S, generator=generator, device=device)
    keys_S = torch.where(cand_S, keys_S, torch.full_like(keys_S, 2.0))
    by_key = torch.argsort(keys_S)
    order = by_key[torch.sort(doc_S[by_key], stable=True).indices]  # grouped by sample, keys ascending
    doc_sorted = doc_S[order]
    idx = torch.arange(S, device=device)
    group_start = torch.ones(S, dtype=torch.bool, device=device)
    group_start[1:] = doc_sorted[1:] != doc_sorted[:-1]
    rank_S = idx - torch.cummax(torch.where(group_start, idx, torch.zeros_like(idx)), dim=0).values
    keep = cand_S[order] & (rank_S < max_anchors_per_sample)
    return torch.sort(order[keep]).values


def pad_anchors(anchor_lists: list[torch.Tensor], num_blocks: int | None = None) -> torch.Tensor:
    """Stack per-row anchors into [R, A] with -1 padding (A = the longest list unless given)."""
    A = max((len(a) for a in anchor_lists), default=0) if num_blocks is None else num_blocks
    out = torch.full((len(anchor_lists), A), -1, dtype=torch.long)
    for r, a in enumerate(anchor_lists):
        if len(a) > A:
            raise ValueError(f"row {r} has {len(a)} anchors, more than num_blocks={A}")
        out[r, : len(a)] = a
    return out.to(anchor_lists[0].device) if anchor_lists else out


@dataclass
class Blocks:
    """Block inputs and targets of a batch, all [R, Q] with blocks contiguous (B slots each)."""

    token_ids_RQ: torch.Tensor  # [anchor token, MASK...]; MASK also for padded blocks
    pos_RQ: torch.Tensor  # anchor position (within its sample) + slot; 0 for padded blocks
    doc_RQ: torch.Tensor  # the anchor's sample, -1 for padded blocks
    block_id_RQ: torch.Tensor  # block index within the row, -1 for padded blocks
    labels_RQ: torch.Tensor  # token at row index anchor + slot; IGNORE_LABEL where weight is 0
    weights_RQ: torch.Tensor  # float32 decay * validity; 0 at slot 0 and for padding
    label_index_RQ: torch.Tensor  # row index of the labelled token (teacher row: label_index - 1), -1 if none


def build_blocks(
    input_ids_RS: torch.Tensor,
    pos_RS: torch.Tensor,
    doc_RS: torch.Tensor,
    loss_mask_RS: torch.Tensor,
    anchors_RA: torch.Tensor,
    *,
    block_size: int,
    mask_token_id: int,
    gamma: float,
) -> Blocks:
    """Blocks, labels and weights for anchors [R, A] (row indices, -1 = padding)."""
    R, S = input_ids_RS.shape
    A, B = anchors_RA.shape[1], block_size
    device = input_ids_RS.device
    valid_RA = anchors_RA >= 0
    anchor_RA = anchors_RA.clamp_min(0)
    slot_B = torch.arange(B, device=device)

    def at(t_RS: torch.Tensor, index_RX: torch.Tensor) -> torch.Tensor:
        return t_RS.gather(1, index_RX)

    anchor_doc_RA = torch.where(valid_RA, at(doc_RS, anchor_RA), -1)
    anchor_pos_RA = torch.where(valid_RA, at(pos_RS, anchor_RA), 0)
    anchor_tok_RA = at(input_ids_RS, anchor_RA)

    token_RAB = block_input_ids(torch.where(valid_RA, anchor_tok_RA, mask_token_id), B, mask_token_id)
    pos_RAB = anchor_pos_RA[:, :, None] + slot_B
    doc_RAB = anchor_doc_RA[:, :, None].expand(R, A, B)
    block_RAB = torch.where(valid_RA, torch.arange(A, device=device), -1)[:, :, None].expand(R, A, B)

    target_RAB = label_index(anchor_RA[:, :, None], slot_B)
    in_row_RAB = target_RAB < S
    target_flat = target_RAB.clamp_max(S - 1).reshape(R, A * B)
    same_doc_RAB = at(doc_RS, target_flat).view(R, A, B) == anchor_doc_RA[:, :, None]
    supervised_RAB = at(loss_mask_RS.bool(), target_flat).view(R, A, B)
    labelled_RAB = valid_RA[:, :, None] & in_row_RAB & same_doc_RAB & supervised_RAB & (slot_B > 0)
    decay_B = position_decay(slot_B, gamma)
    weights_RAB = torch.where(labelled_RAB, decay_B, 0.0)
    labels_RAB = torch.where(labelled_RAB, at(input_ids_RS, target_flat).view(R, A, B), IGNORE_LABEL)
    label_index_RAB = torch.where(labelled_RAB, target_RAB, -1)

    def flat(t: torch.Tensor) -> torch.Tensor:
        return t.reshape(R, A * B)

    return Blocks(
        token_ids_RQ=flat(token_RAB),
        pos_RQ=flat(pos_RAB),
        doc_RQ=flat(doc_RAB),
        block_id_RQ=flat(block_RAB),
        labels_RQ=flat(labels_RAB),
        weights_RQ=flat(weights_RAB),
        label_index_RQ=flat(label_index_RAB),
    )


__all__ = ["IGNORE_LABEL", "Blocks", "anchor_candidates", "build_blocks", "pad_anchors", "sample_anchors"]
