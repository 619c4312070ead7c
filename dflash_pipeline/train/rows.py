"""Building a window's packed rows from its segments: the work the loader's worker processes do.

A window's segments are read whole and verified against their commit markers; each planned row is
then filled from its pieces (sample starts). The feature rows, the bulk (row_len x layers x hidden),
are written once, straight into their final memory: shared memory when a worker builds them, so that
handing them to the trainer process costs no copy. A corrupt segment's samples become padding, so the
row structure (hence every rank's step count) stays, unless the run is strict.

Legend: S row length, K top-k.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from dflash_pipeline.errors import CorruptSegmentError
from dflash_pipeline.train.batch import Row
from dflash_pipeline.train.plan import RowPiece, Window


def _empty(shape: tuple[int, ...], dtype: torch.dtype, shared: bool) -> torch.Tensor:
    """Uninitialised tensor; `shared`: allocated in shared memory, so that sending it to the trainer
    process costs no copy (torch moves any other tensor into shared memory by copying it)."""
    if not shared:
        return torch.empty(shape, dtype=dtype)
    storage = torch.UntypedStorage._new_shared(math.prod(shape) * dtype.itemsize)  # noqa: SLF001
    return torch.empty(0, dtype=dtype).set_(storage, 0, shape)


def _read_segments(reader, segments: list[int], layers: list[int], strict: bool) -> tuple[dict, list[str]]:
    """The window's segments by id, verified; the messages of those that are corrupt (skipped unless strict)."""
    segs, problems = {}, []
    for s in segments:
        try:
            segs[s] = reader.read_segment(s, layers, verify=True)
        except CorruptSegmentError as e:
            if strict:
                raise
            problems.append(str(e))
    return segs, problems


def _build_row(pieces: list[RowPiece], segs: dict, man_cols: dict[str, np.ndarray], width: int, K: int,
               row_len: int, shared: bool) -> Row:
    """One packed row: its pieces one after another, padding after them (and for corrupt segments)."""
    tokens = np.zeros(row_len, np.int64)
    mask = np.zeros(row_len, bool)
    pos = np.zeros(row_len, np.int64)
    doc = np.full(row_len, -1, np.int64)
    feats = _empty((row_len, width), torch.bfloat16, shared)
    filled = np.zeros(row_len, bool)
    ids = np.zeros((row_len, K), np.int64)
    lps = np.zeros((row_len, K), np.float32)
    sample_ids = []
    at = 0
    for j, p in enumerate(pieces):
        seg = int(man_cols["segment"][p.row])
        sd = segs.get(seg)
        if sd is None:
            at += p.n
            continue
        a = int(man_cols["offset"][p.row])
        sl = slice(a, a + p.n)
        dst = slice(at, at + p.n)
        tokens[dst] = sd.tokens_T[sl]
        mask[dst] = sd.loss_mask_T[sl]
        pos[dst] = np.arange(p.n)
        doc[dst] = j
        h = sd.hidden_TLH[sl]
        feats[dst] = h.reshape(p.n, -1)
        filled[dst] = True
        ids[dst] = sd.topk_ids_TK[sl]
        lps[dst] = sd.topk_logprobs_TK[sl]
        sample_ids.append(int(man_cols["sample_id"][p.row]))
        at += p.n
    if not filled.all():  # padding, and samples of corrupt segments
        feats[torch.from_numpy(~filled)] = 0
    return {"tokens": torch.from_numpy(tokens), "loss_mask": torch.from_numpy(mask),
            "pos": torch.from_numpy(pos), "doc": torch.from_numpy(doc), "features": feats,
            "topk_ids": torch.from_numpy(ids), "topk_logprobs": torch.from_numpy(lps),
            "sample_ids": sample_ids}


def build_window_rows(reader, window: Window, man_cols: dict[str, np.ndarray], layers: list[int],
                      row_len: int, strict: bool, shared: bool = False) -> tuple[list[Row], list[str]]:
    """Read the window's segments and assemble its rows. Corrupt segments: their samples become
    padding (the row structure, hence the step count, stays), unless strict. The feature rows (the
    bulk: row_len x layers x hidden) are written once, straight into their final (shared) memory;
    only their unfilled positions are zeroed."""
    segs, problems = _read_segments(reader, window.segments, layers, strict)
    width = len(layers) * reader.meta.target.hidden_size
    rows = [_build_row(pieces, segs, man_cols, width, reader.meta.topk, row_len, shared) for pieces in window.rows]
    return rows, problems
