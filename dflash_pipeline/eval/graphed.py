"""The target and the drafter of `dflash eval` on the static-cache, graphed decoding path.

`GraphedTarget` is `Target` (same embedding and LM head for the drafter to borrow, same protocol for the
loops) whose forward runs on a `DecodingRunner` row: the prompt eagerly, then a decode step (q = 1)
or a verify step (q = B, a shorter final block padded: the causal mask keeps padding out of the real
positions) as one graph launch each. "Cropping" is setting the row's committed length; the loops'
`start` argument already says how much is committed, so every forward sets it first.

`GraphedDraft` is `DFlashDraft` (same pairing check) on a `StaticDrafter`: the context of the tokens
committed last round (at most B positions, a view of the verify step's feature buffer) is copied into
the drafter's padded input, and one graph launch drafts the block. A prompt longer than B is appended
eagerly first.

Tree verification (eval/tree_decoding.py) runs on `GraphedTarget` only: `verify_tree` is one graph launch
of q = N + 1 (the anchor and a budget-N tree) with the tree's depths as RoPE offsets and its ancestor
mask as the in-block mask, and `compact_path` moves the accepted path's keys and values to contiguous
slots on the device. A verify shape that a tree used gets its chain defaults (consecutive offsets,
causal mask) back before a chain block of the same length uses it.

Both keep their outputs in static buffers: the logits and features they return are views that stay
valid until the same step runs again, which is all the decoding loops need.
"""

from __future__ import annotations

from typing import Sequence

import torch

from dflash_pipeline.decoding.drafter import StaticDrafter
from dflash_pipeline.decoding.runner import DecodingRunner, StepIO
from dflash_pipeline.decoding.tree import TreeBuilder
from dflash_pipeline.eval.lossless import tie_ulps_for
from dflash_pipeline.eval.models import DFlashDraft, Target
from dflash_pipeline.train.model import DFlashDrafter


class GraphedTarget(Target):
    def __init__(self, model, layer_ids: Sequence[int], *, max_len: int, block_size: int, graphs: bool | None = None,
                 compile: bool | str = False):
        super().__init__(model)  # no hooks of its own: the runner captures the features
        self.layer_ids = [int(k) for k in layer_ids]
        self.block_size = block_size
        self.runner = DecodingRunner(model, rows=1, max_len=max_len, layer_ids=self.layer_ids, graphs=graphs,
                                     compile=compile)
        self.tie_ulps = tie_ulps_for(bool(compile))  # compiled passes round elsewhere: a wider measured spread
        self._tree_shapes: set[int] = set()  # verify shapes whose offsets and mask a tree overwrote
        self._tree_builders: dict[tuple[int, int, int], TreeBuilder] = {}

    def close(self) -> None:
        self.runner.close()
        super().close()

    def new_cache(self):
        self.runner.reset(0)
        return self.runner

    def crop(self, cache, length: int) -> None:
        self.runner.set_length(0, length)

    def forward(self, ids: Sequence[int] | torch.Tensor, start: int, cache, *, features: bool = False,
                last_only: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        self.runner.set_length(0, start)
        if not isinstance(ids, torch.Tensor):  # the prompt: eager, chunked
            logits, feats = self.runner.extend(0, ids, features=features, all_logits=not last_only)
            return logits, (feats[None] if feats is not None else None)
        k = ids.numel()
        q = 1 if k == 1 else self.block_size
        if k > q:
            raise ValueError(f"a block of {k} tokens is longer than the verify step ({q})")
        io = self.runner.inputs(q)
        if q in self._tree_shapes:  # a chain block after a tree of the same size: consecutive and causal again
            io.offsets_Rq[0].copy_(torch.arange(q, device=io.offsets_Rq.device))
            io.block_mask_Rqq[0].copy_(torch.ones(q, q, dtype=torch.bool, device=io.block_mask_Rqq.device).tril())
            self._tree_shapes.discard(q)
        io.ids_Rq[0, :k].copy_(ids)
        self.runner.step(q)
        logits = io.logits_RqV[0, :k]
        feats = io.features_RqF[:, :k] if features and io.features_RqF is not None else None
        return (logits[-1:] if last_only else logits), feats

    def verify_tree(self, ids_S: torch.Tensor, offsets_S: torch.Tensor, mask_SS: torch.Tensor, start: int) -> StepIO:
        """One forward of a tree's S slots after the `start` committed tokens (`Trees.verify_inputs`); the
        step's static buffers (logits, argmax, features of every slot). Commits nothing."""
        q = ids_S.shape[0]
        self.runner.set_length(0, start)
        io = self.runner.inputs(q)
        io.ids_Rq[0].copy_(ids_S)
        io.offsets_Rq[0].copy_(offsets_S)
        io.block_mask_Rqq[0].copy_(mask_SS)
        self._tree_shapes.add(q)
        self.runner.step(q)
        return io

    def tree_builder(self, budget: int, depth: int, vocab: int) -> TreeBuilder:
        """The round's tree builder of this budget (one graph each, kept for every prompt of the run)."""
        key = (budget, depth, vocab)
        if key not in self._tree_builders:
            self._tree_builders[key] = TreeBuilder(depth, vocab, budget, self.runner.device, self.runner.graphs)
        return self._tree_builders[key]

    def compact_path(self, start: int, path_D: torch.Tensor) -> None:
        """Make the accepted path contiguous after the anchor (slot `start`): node path_D[j], verified at
        slot start + 1 + path_D[j], moves to slot start + 1 + j; commit with `crop` afterwards. Runs on
        the device from path_D as it is (-1 past the accepted nodes: those slots copy onto themselves,
        beyond what is committed)."""
        dst_D = torch.arange(start + 1, start + 1 + path_D.shape[0], device=path_D.device)
        self.runner.compact(0, torch.where(path_D >= 0, start + 1 + path_D, dst_D), start + 1)


class GraphedDraft(DFlashDraft):
    def __init__(self, model: DFlashDrafter, target: GraphedTarget, *, max_len: int, block_size: int | None = None,
                 graphs: bool | None = None, compile: bool = False):
        super().__init__(model, target, block_size)
        vocab = target.model.get_output_embeddings().weight.shape[0]
        self.static = StaticDrafter(model, embed=target.embed, head=target.logits, vocab_size=vocab,
                                    feature_dtype=target.runner.dtype, max_len=max_len, block_size=self.block_size,
                                    graphs=graphs, compile=compile)

    def reset(self) -> None:
        pass  # what a round sees is decided by its start position alone

    @torch.inference_mode()
    def draft(self, context_1nF: torch.Tensor | None, anchor: int, start: int) -> torch.Tensor:
        io, n = self.static.io, context_1nF.shape[1]
        if n > self.block_size:
            self.static.extend_context(0, context_1nF[0], start)
            n = 0
        elif n:
            io.ctx_RBF[0, :n].copy_(context_1nF[0])
        io.n_new_R[0].fill_(n)
        io.start_R[0].fill_(start)
        io.ids_RB[0, 0].fill_(anchor)
        self.static.step()
        return io.logits_RmV[0]


__all__ = ["GraphedTarget", "GraphedDraft"]
