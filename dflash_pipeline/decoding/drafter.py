"""The DFlash drafter's block step over a static context cache, one graph launch per round.

`DFlashDrafter.draft_step` (train/model.py) grows a `DrafterCache` by concatenation, so every round has
new shapes and hundreds of small launches. Here each layer's context keys/values live in static
buffers [R, hk, S, D] where slot = position (the context is always the committed chain), and one
round is one fixed-shape function of static inputs:

- new context: the target features of up to B positions committed since the last round, padded to B
  (`ctx_RBF`, `n_new_R` of them valid) at slots start - n_new .. start - 1;
- the block [anchor, MASK x (B-1)] at positions start .. start + B - 1, whose keys/values are written at
  slots start .. start + B - 1 (over the padding of the new context, which no round ever reads);
- visibility from the house predicate `masks.visible` (context strictly below the anchor's position;
  the block bidirectional in full layers, causal + window in sliding ones), so the rule is the one
  training and `draft_step` use, and the test checks equality with `draft_step`.

Nothing is committed explicitly: what a round may see is decided by `start` alone, so rolling back is
free and a row is reset by drafting from a smaller start. A prompt longer than B is appended eagerly
(`extend_context`) before its first round.

The drafter borrows the target's embedding and LM head (`embed`, `head` callables: frozen tables with
the target's embedding scale, logit scale and soft-capping) inside the same graph.

Legend: R rows, B block size, m = B - 1 drafted slots, F concatenated target features, H hidden,
hk KV heads, S slots, V vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from dflash_pipeline.decoding.attention import fold_mask, folded_attention
from dflash_pipeline.decoding.graphs import GraphedStep, new_pool
from dflash_pipeline.decoding.runner import SLOT_ROUND, round_up
from dflash_pipeline.train.kernels import kernels
from dflash_pipeline.train.masks import visible
from dflash_pipeline.train.model import DFlashDrafter, rope_cos_sin


@dataclass
class DraftIO:
    """Static inputs and outputs of the drafter's round."""

    ctx_RBF: torch.Tensor      # new context features, padded to B
    n_new_R: torch.Tensor      # long: valid positions in ctx_RBF
    start_R: torch.Tensor      # long: the anchor's position (= committed context length)
    ids_RB: torch.Tensor       # long: [anchor, MASK, ..., MASK]
    logits_RmV: torch.Tensor   # fp32 logits of slots 1..B-1
    argmax_Rm: torch.Tensor    # long


class StaticDrafter:
    def __init__(self, model: DFlashDrafter, *, embed: Callable[[torch.Tensor], torch.Tensor],
                 head: Callable[[torch.Tensor], torch.Tensor], vocab_size: int, feature_dtype: torch.dtype,
                 rows: int = 1, max_len: int, block_size: int | None = None, graphs: bool | None = None,
                 compile: bool = False):
        cfg = model.config
        # compile: the layers' elementwise chains as the fused kernels training uses (train/kernels.py)
        self.k = kernels(compile)
        self.model, self.cfg, self.embed, self.head = model.eval(), cfg, embed, head
        w = model.fc.weight
        self.device, self.dtype = w.device, w.dtype
        self.B = int(block_size or cfg.block_size)
        self.rows, self.slots = rows, round_up(max_len + self.B, SLOT_ROUND)
        shape = (rows, cfg.num_kv_heads, self.slots, cfg.head_dim)
        self.keys = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(cfg.num_layers)]
        self.values = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(cfg.num_layers)]
        R, B, dev = rows, self.B, self.device
        ids = torch.full((R, B), cfg.mask_token_id, dtype=torch.long, device=dev)
        self.io = DraftIO(
            ctx_RBF=torch.zeros(R, B, cfg.num_features * cfg.hidden_size, dtype=feature_dtype, device=dev),
            n_new_R=torch.zeros(R, dtype=torch.long, device=dev), start_R=torch.zeros(R, dtype=torch.long, device=dev),
            ids_RB=ids, logits_RmV=torch.zeros(R, B - 1, vocab_size, dtype=torch.float32, device=dev),
            argmax_Rm=torch.zeros(R, B - 1, dtype=torch.long, device=dev),
        )
        self._step = GraphedStep(self._round, self.device, new_pool(self.device),
                                 self.device.type == "cuda" if graphs is None else graphs)

    def _rope(self, positions: torch.Tensor):
        return rope_cos_sin(positions, self.cfg.head_dim, self.cfg.rope_theta, self.dtype)

    def _write(self, layer: int, slots_RB: torch.Tensor, k_RkBD: torch.Tensor, v_RkBD: torch.Tensor,
               rows: slice = slice(None)) -> None:
        index = slots_RB[:, None, :, None].expand(k_RkBD.shape)
        self.keys[layer][rows].scatter_(2, index, k_RkBD.to(self.dtype))
        self.values[layer][rows].scatter_(2, index, v_RkBD.to(self.dtype))

    @torch.inference_mode()
    def extend_context(self, row: int, features_nF: torch.Tensor, start: int) -> None:
        """Write the context of positions start - n .. start - 1 of `row` eagerly (a long prompt)."""
        n = features_nF.shape[0]
        if start > self.slots - self.B:
            raise ValueError(f"drafter row {row}: position {start} beyond its cache ({self.slots - self.B})")
        ctx_1nH = self.model.fuse(features_nF[None])
        slots_1n = torch.arange(start - n, start, device=self.device)[None]
        rope = self._rope(slots_1n)
        for i, layer in enumerate(self.model.layers):
            self._write(i, slots_1n, *layer.self_attn.project_kv(ctx_1nH, rope), rows=slice(row, row + 1))

    @torch.inference_mode()
    def step(self) -> DraftIO:
        """One drafting round for every row from `io`'s inputs."""
        self._step()
        return self.io

    def _masks(self, start_R: torch.Tensor) -> dict:
        """Additive folded bias per (causal, window) kind of layer, over all slots."""
        R, B, S, dev = self.rows, self.B, self.slots, self.device
        q_pos = (start_R[:, None] + torch.arange(B, device=dev))[:, :, None]
        kv_idx = torch.arange(S, device=dev)[None, None, :]
        start = start_R[:, None, None]
        zeros = torch.zeros_like(q_pos)
        groups = self.cfg.num_heads // self.cfg.num_kv_heads
        out = {}
        for kind in set(self.cfg.layer_mask_kinds()):
            vis = visible(torch.arange(B, device=dev)[None, :, None], q_pos, start, zeros, zeros,
                          kv_idx, kv_idx, torch.where(kv_idx < start + B, 0, -1), torch.where(kv_idx < start, -1, 0),
                          num_ctx=start, causal=kind[0], window=kind[1])
            out[kind] = fold_mask(vis.expand(R, B, S), groups, self.dtype)
        return out

    def _round(self) -> None:
        io, B, dev = self.io, self.B, self.device
        arange_B = torch.arange(B, device=dev)
        blk_slots = io.start_R[:, None] + arange_B
        ctx_slots = blk_slots - io.n_new_R[:, None]
        ctx_RBH = self.model.fuse(io.ctx_RBF, self.k)
        rope_ctx, rope_q = self._rope(ctx_slots), self._rope(blk_slots)
        masks = self._masks(io.start_R)
        h = self.embed(io.ids_RB).to(self.dtype)
        for i, layer in enumerate(self.model.layers):
            self._write(i, ctx_slots, *layer.self_attn.project_kv(ctx_RBH, rope_ctx, self.k))
            h = self._layer(i, layer, h, rope_q, blk_slots, masks[self.cfg.layer_mask_kind(i)])
        hidden = self.model.norm(h, None, self.k)
        io.logits_RmV.copy_(self.head(hidden[:, 1:]))
        torch.argmax(io.logits_RmV, dim=-1, out=io.argmax_Rm)

    def _layer(self, i: int, layer, h_RBH: torch.Tensor, rope_q, blk_slots_RB: torch.Tensor, bias) -> torch.Tensor:
        """`DrafterLayer.block` with the block's keys/values written into the static cache, not concatenated."""
        attn = layer.self_attn
        R, B, _ = h_RBH.shape
        x = layer.input_layernorm(h_RBH, None, self.k)
        q = attn.project_q(x, rope_q, self.k)
        self._write(i, blk_slots_RB, *attn.project_kv(x, rope_q, self.k))
        out = folded_attention(q, self.keys[i], self.values[i], bias, attn.scale)
        out = attn.o_proj(out.reshape(R, B, attn.num_heads * attn.head_dim))
        post = layer.post_attention_layernorm
        h_RBH, x = self.k.add_rms_norm(h_RBH, out, post.weight, post.eps)
        return h_RBH + layer.mlp(x)


__all__ = ["StaticDrafter", "DraftIO"]
