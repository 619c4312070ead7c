"""An epoch's order, planned up front from the manifest alone (lengths, no data), and the loader state.

- whole samples are held out for evaluation by a hash of their sample id (independent of world size);
- segments are shuffled per epoch and dealt to ranks (rank r takes every world-th), so every rank
  reads its own disjoint data and nobody broadcasts batches;
- within a window of a few consecutive segments, samples are shuffled and packed into rows of
  `row_len` tokens (a sample never straddles rows; attention never crosses samples);
- every rank computes every rank's row count and all run the same number of steps (the few rows
  beyond that are dropped), so no collective hangs at the end of an epoch.

Planning needs numpy only: no tensors, no worker processes. Loader state is (epoch, batch index) plus
what it was computed from; loading it refuses a changed world size, seed or store instead of resuming
wrongly.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from dflash_pipeline.errors import ConfigMismatchError

LOADER_STATE_VERSION = 1
_MASK64 = (1 << 64) - 1


def _splitmix64(x: np.ndarray) -> np.ndarray:
    x = (x.astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15)) & np.uint64(_MASK64)
    x = ((x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)) & np.uint64(_MASK64)
    x = ((x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)) & np.uint64(_MASK64)
    return x ^ (x >> np.uint64(31))


def eval_holdout(sample_ids: np.ndarray, fraction: float, seed: int) -> np.ndarray:
    """Bool per sample: held out for evaluation (a stable hash of the sample id, not its position)."""
    if fraction <= 0:
        return np.zeros(len(sample_ids), dtype=bool)
    with np.errstate(over="ignore"):
        h = _splitmix64(sample_ids.astype(np.uint64) ^ np.uint64(seed * 0x5851F42D4C957F2D & _MASK64))
    return (h >> np.uint64(11)).astype(np.float64) / float(1 << 53) < fraction


@dataclass
class RowPiece:
    row: int        # manifest row (sample)
    n: int          # tokens taken from the sample's start


@dataclass
class Window:
    index: int
    segments: list[int]
    rows: list[list[RowPiece]]


@dataclass
class EpochPlan:
    epoch: int
    windows: list[Window]           # this rank's
    steps: int                      # batches every rank runs this epoch
    rows_per_rank: list[int]

    def batch_rows(self, rows_per_batch: int) -> list[tuple[int, int]]:
        """(window index, row index) of every row this rank feeds, in order, cut to `steps` batches."""
        out = [(w.index, i) for w in self.windows for i in range(len(w.rows))]
        return out[: self.steps * rows_per_batch]


class Manifest:
    """The columns the planner needs, as numpy."""

    def __init__(self, reader):
        self.segment = reader.column("segment")
        self.length = reader.column("length").astype(np.int64)
        self.sample_id = reader.column("sample_id")
        self.supervised = reader.column("supervised").astype(np.int64)


def _pack(lengths: np.ndarray, rows_idx: np.ndarray, row_len: int) -> list[list[RowPiece]]:
    rows, cur, used = [], [], 0
    for r in rows_idx:
        n = int(min(lengths[r], row_len))
        if cur and used + n > row_len:
            rows.append(cur)
            cur, used = [], 0
        cur.append(RowPiece(int(r), n))
        used += n
    if cur:
        rows.append(cur)
    return rows


def plan_epoch(man: Manifest, train_mask: np.ndarray, *, epoch: int, rank: int, world: int, seed: int,
               row_len: int, rows_per_batch: int, window_segments: int = 2) -> EpochPlan:
    """This rank's windows and rows for `epoch`, and the common step count of all ranks."""
    usable = train_mask & (man.supervised >= 2)
    segs = np.unique(man.segment[usable])
    rng = np.random.default_rng([seed, epoch])
    order = segs[rng.permutation(len(segs))]
    by_seg: dict[int, np.ndarray] = {}
    rows_all = np.nonzero(usable)[0]
    seg_of = man.segment[rows_all]
    sort = np.argsort(seg_of, kind="stable")
    seg_sorted, rows_sorted = seg_of[sort], rows_all[sort]
    starts = np.searchsorted(seg_sorted, segs, side="left")
    ends = np.searchsorted(seg_sorted, segs, side="right")
    for s, a, b in zip(segs, starts, ends):
        by_seg[int(s)] = rows_sorted[a:b]

    def rank_windows(r: int) -> list[Window]:
        mine = order[r::world]
        out = []
        for w, a in enumerate(range(0, len(mine), window_segments)):
            group = [int(s) for s in mine[a:a + window_segments]]
            samples = np.concatenate([by_seg[s] for s in group])
            wrng = np.random.default_rng([seed, epoch, r, w])
            samples = samples[wrng.permutation(len(samples))]
            out.append(Window(w, group, _pack(man.length, samples, row_len)))
        return out

    per_rank = [sum(len(w.rows) for w in rank_windows(r)) for r in range(world)]
    steps = min(per_rank) // rows_per_batch
    return EpochPlan(epoch, rank_windows(rank), steps, per_rank)


@dataclass
class LoaderState:
    version: int = LOADER_STATE_VERSION
    epoch: int = 0
    batch: int = 0                   # batches already consumed in `epoch`
    world: int = 1
    rank: int = 0
    seed: int = 0
    store_fingerprint: str = ""
    row_len: int = 0
    rows_per_batch: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def check_compatible(self, other: "LoaderState") -> None:
        """`self` is the saved state; refuse to resume it under different conditions."""
        if self.version != other.version:
            raise ConfigMismatchError(f"loader state version {self.version} != {other.version}")
        for name in ("world", "seed", "store_fingerprint", "row_len", "rows_per_batch"):
            a, b = getattr(self, name), getattr(other, name)
            if a != b:
                raise ConfigMismatchError(f"cannot resume: the data loader was saved with {name}={a!r}, "
                                          f"this run has {name}={b!r}")


def store_fingerprint(reader) -> str:
    """What a resumed run must find unchanged: the store's identity and its sample index."""
    import hashlib

    m = reader.meta
    h = hashlib.sha256()
    h.update(f"{m.target.config_hash}|{m.tokenizer.hash}|{m.layer_ids}|{m.codec}|{m.data_fingerprint}|{reader.num_samples}".encode())
    h.update(np.ascontiguousarray(reader.column("sample_id")).tobytes())
    return h.hexdigest()[:32]
