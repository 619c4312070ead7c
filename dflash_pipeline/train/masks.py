"""Who may attend to whom in the drafter, as one predicate rendered two ways.

Training runs every anchor block of a packed row in one attention call. Keys are [context | blocks]:
the S fused target features of the row, then the A*B block tokens. The rule (docs/dflash-method.md):

- a query of block j (anchor position a_j, query position q_pos = a_j + slot) sees a context key iff it
  belongs to the same sample and its position is < a_j (strictly: at inference the anchor's own target
  state is not known yet);
- it sees block keys of its own block only: all of them in full-attention layers, key_pos <= q_pos in
  causal (sliding-window) layers;
- sliding-window layers also drop keys with q_pos - key_pos >= W (and key_pos - q_pos >= W when not
  causal, as the reference's `_attention_mask` does);
- padding queries (block id -1) see only themselves, so that no softmax row is empty (no NaN).

Visibility is decided from absolute positions and sample ids carried by every query and key, never from
block-index arithmetic: anchors may be closer than B apart, and a rule like "block j sees context
< j * B" then leaks the future (a real bug; see the leak tests).

`visible()` is that rule, written with elementwise tensor ops only, so that the same function serves as
the FlexAttention `mask_mod` (scalar indices, CUDA, block-sparse) and builds the dense boolean mask for
SDPA (CPU, tests, inference). The backend is chosen by device and can be overridden.

Shape legend: R rows, Q block tokens (A anchors x B slots), S context positions, K = S + Q keys,
h heads, D head dim.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from dflash_pipeline.train.kernels import allow_recompiles

Backend = Literal["dense", "flex"]
BACKENDS = ("dense", "flex")


def visible(
    q_idx, q_pos, q_anchor, q_doc, q_block,
    kv_idx, kv_pos, kv_doc, kv_block,
    *, num_ctx: int, causal: bool, window: int | None,
):
    """True where query q_idx may attend to key kv_idx (all arguments broadcastable tensors)."""
    kv_is_ctx = kv_idx < num_ctx
    same_doc = (kv_doc == q_doc) & (q_doc >= 0)
    ctx_ok = kv_is_ctx & same_doc & (kv_pos < q_anchor)
    own_block = (~kv_is_ctx) & same_doc & (kv_block == q_block)
    if causal:
        own_block = own_block & (kv_pos <= q_pos)
    ok = ctx_ok | own_block
    if window is not None:
        ok = ok & (q_pos - kv_pos < window)
        if not causal:
            ok = ok & (kv_pos - q_pos < window)
    is_pad = q_block < 0
    return (ok & ~is_pad) | (is_pad & (kv_idx - num_ctx == q_idx))


@dataclass(frozen=True)
class MaskLayout:
    """Per-row metadata of queries and keys that `visible` reads. Integer tensors, one device."""

    q_pos_RQ: torch.Tensor
    q_anchor_RQ: torch.Tensor
    q_doc_RQ: torch.Tensor
    q_block_RQ: torch.Tensor
    kv_pos_RK: torch.Tensor
    kv_doc_RK: torch.Tensor
    kv_block_RK: torch.Tensor
    num_ctx: int

    @classmethod
    def for_training(
        cls,
        ctx_pos_RS: torch.Tensor,
        ctx_doc_RS: torch.Tensor,
        block_pos_RQ: torch.Tensor,
        block_doc_RQ: torch.Tensor,
        block_id_RQ: torch.Tensor,
        block_size: int,
    ) -> "MaskLayout":
        """Layout of a packed training batch; blocks are laid out contiguously, B slots each."""
        R, Q = block_pos_RQ.shape
        if Q % block_size:
            raise ValueError(f"block tokens per row ({Q}) are not a multiple of block_size ({block_size})")
        # The anchor is slot 0 of each block: its position bounds the visible context.
        anchor_RQ = block_pos_RQ.view(R, Q // block_size, block_size)[:, :, :1]
        anchor_RQ = anchor_RQ.expand(R, Q // block_size, block_size).reshape(R, Q)
        no_block_RS = torch.full_like(ctx_doc_RS, -1)
        return cls(
            q_pos_RQ=block_pos_RQ,
            q_anchor_RQ=anchor_RQ,
            q_doc_RQ=block_doc_RQ,
            q_block_RQ=block_id_RQ,
            kv_pos_RK=torch.cat([ctx_pos_RS, block_pos_RQ], dim=1),
            kv_doc_RK=torch.cat([ctx_doc_RS, block_doc_RQ], dim=1),
            kv_block_RK=torch.cat([no_block_RS, block_id_RQ], dim=1),
            num_ctx=ctx_pos_RS.shape[1],
        )

    @classmethod
    def for_decoding(cls, ctx_pos_S: torch.Tensor, block_pos_Q: torch.Tensor) -> "MaskLayout":
        """Layout of one drafting step: cached context, then one block whose anchor is its slot 0."""
        device = block_pos_Q.device
        ctx_pos_S = ctx_pos_S.to(device)
        S, Q = ctx_pos_S.shape[0], block_pos_Q.shape[0]
        zeros_Q = torch.zeros(Q, dtype=torch.long, device=device)
        return cls(
            q_pos_RQ=block_pos_Q[None],
            q_anchor_RQ=block_pos_Q[:1].expand(Q)[None],
            q_doc_RQ=zeros_Q[None],
            q_block_RQ=zeros_Q[None],
            kv_pos_RK=torch.cat([ctx_pos_S, block_pos_Q])[None],
            kv_doc_RK=torch.zeros(S + Q, dtype=torch.long, device=device)[None],
            kv_block_RK=torch.cat([torch.full((S,), -1, dtype=torch.long, device=device), zeros_Q])[None],
            num_ctx=S,
        )

    @property
    def num_rows(self) -> int:
        return self.q_pos_RQ.shape[0]

    @property
    def num_queries(self) -> int:
        return self.q_pos_RQ.shape[1]

    @property
    def num_keys(self) -> int:
        return self.kv_pos_RK.shape[1]

    def mask_mod(self, causal: bool, window: int | None):
        """The predicate as a FlexAttention mask_mod(b, h, q_idx, kv_idx)."""

        def mask_mod(b, h, q_idx, kv_idx):
            return visible(
                q_idx, self.q_pos_RQ[b, q_idx], self.q_anchor_RQ[b, q_idx], self.q_doc_RQ[b, q_idx],
                self.q_block_RQ[b, q_idx],
                kv_idx, self.kv_pos_RK[b, kv_idx], self.kv_doc_RK[b, kv_idx], self.kv_block_RK[b, kv_idx],
                num_ctx=self.num_ctx, causal=causal, window=window,
            )

        return mask_mod


def dense_mask(layout: MaskLayout, causal: bool, window: int | None) -> torch.Tensor:
    """Boolean mask [R, 1, Q, K] for SDPA (True = attend)."""
    device = layout.q_pos_RQ.device
    q_idx = torch.arange(layout.num_queries, device=device)[None, :, None]
    kv_idx = torch.arange(layout.num_keys, device=device)[None, None, :]
    mask_RQK = visible(
        q_idx, layout.q_pos_RQ[:, :, None], layout.q_anchor_RQ[:, :, None], layout.q_doc_RQ[:, :, None],
        layout.q_block_RQ[:, :, None],
        kv_idx, layout.kv_pos_RK[:, None, :], layout.kv_doc_RK[:, None, :], layout.kv_block_RK[:, None, :],
        num_ctx=layout.num_ctx, causal=causal, window=window,
    )
    return mask_RQK[:, None]


def flex_block_mask(layout: MaskLayout, causal: bool, window: int | None, tile: int = 128):
    """FlexAttention BlockMask of the same predicate, built from per-tile bounds with plain tensor ops.

    `create_block_mask` evaluates the predicate on every (query, key) pair through a compiled kernel;
    at training shapes (32K block queries x 35K keys) that kernel takes minutes to compile. Here each
    query is compared with per-key-tile bounds instead (min/max of position, sample and block id of the
    tile's context keys and block keys): [R, Q, K/tile] work, no compilation. A tile is skipped only
    when the bounds prove no key visible, and marked full only when they prove every key visible; the
    rest are partial tiles, where the kernel evaluates `visible` itself, so the result is exact for any
    layout (and the bounds are tight for packed rows, where they decide nearly every tile).
    """
    from torch.nn.attention.flex_attention import BlockMask

    any_RTK, full_RTK = tile_visibility(layout, causal, window, tile)
    partial_RTK = any_RTK & ~full_RTK

    def sparse(m_RTK):
        num = m_RTK.sum(-1, dtype=torch.int32)
        idx = torch.argsort((~m_RTK).to(torch.int8), dim=-1, stable=True).to(torch.int32)
        return num[:, None].contiguous(), idx[:, None].contiguous()

    kv_num, kv_idx = sparse(partial_RTK)
    full_num, full_idx = sparse(full_RTK)
    return BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=tile,
                                    mask_mod=layout.mask_mod(causal, window),
                                    seq_lengths=(layout.num_queries, layout.num_keys))


def tile_visibility(layout: MaskLayout, causal: bool, window: int | None, tile: int = 128):
    """Per (row, query tile, key tile): (any key visible to some query, every key visible to every query).

    `any` may be True for a tile that has no visible pair (it is then a partial tile, evaluated
    exactly) but is never False for one that has; `full` is True only when every pair is visible.
    """
    R, Q, K, S = layout.num_rows, layout.num_queries, layout.num_keys, layout.num_ctx
    device = layout.q_pos_RQ.device
    nQ, nK = -(-Q // tile), -(-K // tile)
    big = torch.iinfo(torch.int64).max // 4
    kv_idx = torch.arange(nK * tile, device=device)
    in_range = kv_idx < K
    is_ctx = (kv_idx < S)[None].expand(R, -1)
    is_blk = (in_range & (kv_idx >= S))[None].expand(R, -1)

    def bounds(x_RK, sel_RK):
        x = torch.nn.functional.pad(x_RK.long(), (0, nK * tile - K))
        lo = torch.where(sel_RK, x, big).view(R, nK, tile).amin(-1)
        hi = torch.where(sel_RK, x, -big).view(R, nK, tile).amax(-1)
        return lo[:, None], hi[:, None]  # [R, 1, nK]

    ctx_doc, ctx_pos = bounds(layout.kv_doc_RK, is_ctx), bounds(layout.kv_pos_RK, is_ctx)
    blk_doc, blk_pos = bounds(layout.kv_doc_RK, is_blk), bounds(layout.kv_pos_RK, is_blk)
    blk_id = bounds(layout.kv_block_RK, is_blk)
    has_ctx = is_ctx.reshape(R, nK, tile).any(-1)[:, None]
    has_blk = is_blk.reshape(R, nK, tile).any(-1)[:, None]
    complete = in_range.view(nK, tile).all(-1)[None, None]

    q_pos, q_anchor = layout.q_pos_RQ[:, :, None], layout.q_anchor_RQ[:, :, None]
    q_doc, q_block = layout.q_doc_RQ[:, :, None], layout.q_block_RQ[:, :, None]
    real = (q_block >= 0) & (q_doc >= 0)

    def window_any(pos):
        if window is None:
            return True
        ok = pos[1] > q_pos - window
        return ok if causal else ok & (pos[0] < q_pos + window)

    def window_all(pos):
        if window is None:
            return True
        ok = pos[0] > q_pos - window
        return ok if causal else ok & (pos[1] < q_pos + window)

    def inside(v, b):
        return (b[0] <= v) & (v <= b[1])

    def equal(v, b):
        return (b[0] == v) & (b[1] == v)

    ctx_any = has_ctx & inside(q_doc, ctx_doc) & (ctx_pos[0] < q_anchor) & window_any(ctx_pos)
    ctx_all = ~has_ctx | (equal(q_doc, ctx_doc) & (ctx_pos[1] < q_anchor) & window_all(ctx_pos))
    blk_any = has_blk & inside(q_block, blk_id) & inside(q_doc, blk_doc) & window_any(blk_pos)
    blk_all = ~has_blk | (equal(q_block, blk_id) & equal(q_doc, blk_doc) & window_all(blk_pos))
    if causal:
        blk_any = blk_any & (blk_pos[0] <= q_pos)
        blk_all = blk_all & (blk_pos[1] <= q_pos)
    any_RQK = real & (ctx_any | blk_any)
    full_RQK = real & ctx_all & blk_all & complete
    # Padding queries see only their own key (S + q).
    own_tile = (S + torch.arange(Q, device=device))[None, :, None] // tile == torch.arange(nK, device=device)
    any_RQK = any_RQK | (~real & own_tile)

    def per_tile(x_RQK, reduce):
        x = torch.nn.functional.pad(x_RQK, (0, 0, 0, nQ * tile - Q), value=False).view(R, nQ, tile, nK)
        return x.any(2) if reduce == "any" else x.all(2)

    return per_tile(any_RQK, "any"), per_tile(full_RQK, "all")


def build_mask(layout: MaskLayout, causal: bool, window: int | None, backend: Backend):
    """The mask object `attend` expects for this backend."""
    if backend == "flex":
        return flex_block_mask(layout, causal, window)
    return dense_mask(layout, causal, window)


def choose_backend(device: torch.device, override: str | None = None) -> Backend:
    """`override` if given, else flex attention on CUDA and dense SDPA elsewhere."""
    if override is not None:
        if override not in BACKENDS:
            raise ValueError(f"unknown attention backend '{override}': use one of {', '.join(BACKENDS)}")
        return override  # type: ignore[return-value]
    return "flex" if device.type == "cuda" else "dense"


_compiled_flex = None


def _flex_attention(device: torch.device):
    """flex_attention, compiled once per process for CUDA (eager elsewhere: CPU tests only)."""
    global _compiled_flex
    from torch.nn.attention.flex_attention import flex_attention

    if device.type != "cuda":
        return flex_attention
    if _compiled_flex is None:
        allow_recompiles()
        _compiled_flex = torch.compile(flex_attention)
    return _compiled_flex


def _dense_sdpa_backends():
    # cuDNN attention builds a plan per shape: ~40 ms per call when the key length grows every
    # drafting step. The memory-efficient kernel takes boolean masks without that cost.
    from torch.nn.attention import SDPBackend

    return [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]


def attend(q_RhQD, k_RhKD, v_RhKD, mask, scale: float) -> torch.Tensor:
    """Attention of Q queries over K keys with GQA; `mask` from `build_mask` decides the backend."""
    if isinstance(mask, torch.Tensor):
        from torch.nn.attention import sdpa_kernel

        with sdpa_kernel(_dense_sdpa_backends()):
            return torch.nn.functional.scaled_dot_product_attention(
                q_RhQD, k_RhKD, v_RhKD, attn_mask=mask, scale=scale,
                enable_gqa=q_RhQD.shape[1] != k_RhKD.shape[1],
            )
    # Under autocast q and k leave their RMSNorms in fp32 (fp32 weight * bf16), v stays bf16; SDPA
    # casts for itself, flex attention needs one dtype.
    device_type = q_RhQD.device.type
    if torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
        q_RhQD, k_RhKD, v_RhKD = q_RhQD.to(dtype), k_RhKD.to(dtype), v_RhKD.to(dtype)
    return _flex_attention(q_RhQD.device)(
        q_RhQD, k_RhKD, v_RhKD, block_mask=mask, scale=scale,
        enable_gqa=q_RhQD.shape[1] != k_RhKD.shape[1],
    )
