"""The packed training batch: what the loader yields and what a training step and the held-out
estimate consume.

Its own module so that the step and the evaluation import a type, not the loader's worker pool and
prefetch thread. A batch lives on the device; the small fields that the host needs every step
(anchors, blocks and labels are built there) are kept as host copies, because reading them back from
the device would make the host wait for the GPU.

Legend: R rows per batch, S row length, L layers, H hidden, K top-k.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

# One packed row, as the loader's workers build it (train/rows.py): every tensor field of `Batch`
# without the leading R, plus "sample_ids" (list[int]).
Row = dict[str, Any]


@dataclass
class Batch:
    tokens: torch.Tensor          # [R, S] int64
    loss_mask: torch.Tensor       # [R, S] bool
    pos: torch.Tensor             # [R, S] int64, position within the sample
    doc: torch.Tensor             # [R, S] int64, sample index within the row, -1 = padding
    features: torch.Tensor        # [R, S, L*H] bf16, layers concatenated in layer-id order
    topk_ids: torch.Tensor        # [R, S, K] int64
    topk_logprobs: torch.Tensor   # [R, S, K] float32
    num_tokens: int
    sample_ids: list[int] = field(default_factory=list)
    # Host copies of the small fields (HOST_FIELDS), for the per-step work done on the host (anchors,
    # blocks, labels): reading them from the device would make the host wait for the GPU every step.
    host: dict[str, torch.Tensor] | None = None

    TENSOR_FIELDS = ("tokens", "loss_mask", "pos", "doc", "features", "topk_ids", "topk_logprobs")
    HOST_FIELDS = ("tokens", "loss_mask", "pos", "doc")

    def to(self, device: torch.device, non_blocking: bool = False) -> "Batch":
        host = self.host
        if host is None and self.tokens.device.type == "cpu":
            host = {f: getattr(self, f) for f in self.HOST_FIELDS}
        return Batch(*(getattr(self, f).to(device, non_blocking=non_blocking) for f in self.TENSOR_FIELDS),
                     self.num_tokens, self.sample_ids, host)

    def rows(self, start: int, stop: int) -> "Batch":
        """Rows [start, stop) as a batch of their own (views, no copy; host copies sliced alike, and its
        token count read from them, not from the device)."""
        host = {f: t[start:stop] for f, t in self.host_fields().items()}
        return Batch(*(getattr(self, f)[start:stop] for f in self.TENSOR_FIELDS), int((host["doc"] >= 0).sum()), [],
                     host)

    def host_fields(self) -> dict[str, torch.Tensor]:
        """tokens, loss_mask, pos and doc on the host (copied from the device once if not kept)."""
        if self.host is None:
            self.host = {f: getattr(self, f).cpu() for f in self.HOST_FIELDS}
        return self.host


def rows_meta(rows: list[Row]) -> tuple[int, list[int]]:
    """(real tokens, sample ids in order) of the rows of one batch."""
    return (int(sum(int((r["doc"] >= 0).sum()) for r in rows)), [s for r in rows for s in r["sample_ids"]])


def stack_rows(rows: list[Row]) -> Batch:
    """The rows of one batch stacked into a host batch (the CPU path; on CUDA the loader stacks into
    pinned buffers instead)."""
    return Batch(*(torch.stack([r[f] for r in rows]) for f in Batch.TENSOR_FIELDS), *rows_meta(rows))
