"""Packed training rows back to their samples (for trainers and target passes that take one sample per
sequence: SpecForge's DFlash trainer, the target's forward in the online loop).

Our loader packs several samples into each row of S tokens (`doc` = sample index within the row, -1 =
padding). Here each sample becomes one right-padded sequence of a batch, through one flat index into the
[R*S] positions, so the gather and the scatter back are single device ops. Built on the host from the
batch's host copy of `doc`: no device sync.

Legend: R rows, S row length, n samples, T longest sample.
"""

from __future__ import annotations

import torch


def sample_spans(doc_RS: torch.Tensor) -> list[tuple[int, int, int]]:
    """(row, start, length) of every sample of the packed rows, in row order (host tensors)."""
    spans = []
    for r in range(doc_RS.shape[0]):
        d = doc_RS[r]
        real = (d >= 0).nonzero()[:, 0]
        if not len(real):
            continue
        # Samples are contiguous runs of one doc value.
        starts = torch.cat([real[:1], real[1:][d[real[1:]] != d[real[:-1]]]])
        ends = torch.cat([starts[1:], real[-1:] + 1])
        spans += [(r, int(a), int(b - a)) for a, b in zip(starts, ends)]
    return spans


def span_index(spans: list[tuple[int, int, int]], S: int, pad: int) -> torch.Tensor:
    """[n, T] flat row-major index into [R*S] of each sample's positions; `pad` where a sample is shorter."""
    T = max(length for _, _, length in spans)
    index = torch.full((len(spans), T), pad, dtype=torch.long)
    for i, (r, a, length) in enumerate(spans):
        index[i, :length] = r * S + a + torch.arange(length)
    return index
