"""How many drafter layers recompute in backward (`--checkpoint-layers auto`, the default): measured on
the device before training, not guessed from a formula.

A step's memory follows its block tokens (rows x anchors x block size), the drafter's width and depth,
and the tokens of its rows; a wrong guess either runs out of memory an hour into a run or recomputes
layers (up to ~20% more step time) on a card that had room. So each rank builds the largest micro-batch
its data can make (`worst_shape`: the most anchors any packed row of its epoch plans can draw, on every
row, every block slot labelled) as a synthetic batch of exactly that shape, runs it forward and backward
with the real loss options, and reads the allocator's peak (`measure_step`). Memory the probe does not
hold itself is held for it while it runs: the optimizer's two moments (allocated at the first step) and
the device batches the loader keeps in flight. The search (`search_recompute`) tries no recompute
first (one probe in the common case), then every layer, then the fewest layers in between by bisection
(recomputing more layers never needs more memory). Where even every layer does not fit, it halves the
rows a forward pass takes until every layer recomputed fits, then looks for the fewest layers at that
size: each batch then runs forward and backward in chunks of that many rows, its gradients accumulated
and its loss normalised over the whole batch, so the step is the same step (the same batch, anchors,
loss and optimizer update; only the sums' order differs). Where not even one row fits, the run stops
before its first step with one line naming what to cut.

Ranks agree on the result (the most layers and the fewest rows any rank needs), so DDP runs one
configuration. Off the GPU nothing is measured: `auto` recomputes nothing there.

Legend: R rows, S row length, A anchors a row (padded), B block size, F = features x hidden, K top-k.
"""

from __future__ import annotations

import gc
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Iterable, Iterator

import numpy as np
import torch

from dflash_pipeline.train.batch import Batch
from dflash_pipeline.train.blocks import pad_anchors
from dflash_pipeline.train.plan import EpochPlan

# Part of the device's free memory left out of the budget: allocator fragmentation (the probe reads what
# tensors hold, not what the caching allocator reserved), and what grows after it (NCCL buffers, cuBLAS
# workspaces of other shapes, batches of other shapes). At least MIN_SLACK_BYTES.
SLACK_SHARE = 0.08
MIN_SLACK_BYTES = 1 << 30
# How long the largest step's search may plan epochs (each packs the rows anew: ~0.2 s for 40,000 samples)
PLAN_SECONDS = 20.0


@dataclass
class StepShape:
    """One micro-batch's shape as far as memory goes."""

    rows: int
    row_len: int
    anchors: int          # a row's anchors, padded as `draw_anchors` pads them
    block_size: int

    @property
    def block_tokens(self) -> int:
        return self.rows * self.anchors * self.block_size

    @property
    def tokens(self) -> int:
        return self.rows * self.row_len


def row_anchor_bound(pieces, supervised: np.ndarray, max_anchors: int) -> int:
    """The most anchors a packed row can draw: per sample, at most `max_anchors` and at most its positions
    whose token and next token are both supervised (fewer than its supervised tokens, and than the tokens
    of it the row holds)."""
    return int(sum(min(max_anchors, max(0, min(p.n, int(supervised[p.row])) - 1)) for p in pieces))


def run_plans(plan_of: Callable[[int], EpochPlan], epochs: int, seconds: float = PLAN_SECONDS) -> Iterator[EpochPlan]:
    """The plans of the epochs a run trains (`plan_of(epoch)`, epochs 0 to epochs - 1), as many as `seconds`
    of planning allow and at least two. Each epoch packs its rows anew, and a later packing can hold a row
    that draws more anchors than any of the first two: up to 7% more over 12 epochs of a 40,000-sample
    store's lengths, and an H100 run whose probe covered two epochs of ten peaked 1.4% above it
    (BENCHMARKS.md, 2026-12-06)."""
    t0 = time.perf_counter()
    for e in range(max(2, epochs)):
        if e >= 2 and time.perf_counter() - t0 > seconds:
            return
        yield plan_of(e)


def worst_shape(plans: Iterable[EpochPlan], supervised: np.ndarray, *, rows: int, row_len: int, max_anchors: int,
                block_size: int) -> tuple[StepShape, int]:
    """The largest micro-batch these epoch plans can make: the row that can draw the most anchors, on
    every row of the batch (a batch's anchor count is its fullest row's, padded to FlexAttention's tiles);
    and how many plans it read."""
    most, read = 1, 0
    for plan in plans:
        read += 1
        most = max([most] + [row_anchor_bound(pieces, supervised, max_anchors)
                             for w in plan.windows for pieces in w.rows])
    bucket = max(1, 128 // block_size)
    return StepShape(rows=rows, row_len=row_len, anchors=max(bucket, -(-most // bucket) * bucket),
                     block_size=block_size), read


def synthetic_batch(shape: StepShape, *, width: int, topk: int, vocab: int, device: torch.device,
                    seed: int = 0) -> tuple[Batch, torch.Tensor]:
    """A batch of `shape` (one sample a row, every position supervised; random tokens and features) and
    its anchors [R, A], spread over the row so every block is labelled: what a step of that shape holds."""
    g = torch.Generator().manual_seed(seed)
    R, S = shape.rows, shape.row_len
    tokens = torch.randint(0, vocab, (R, S), generator=g)
    pos = torch.arange(S).expand(R, S).contiguous()
    host = {"tokens": tokens, "loss_mask": torch.ones(R, S, dtype=torch.bool), "pos": pos,
            "doc": torch.zeros(R, S, dtype=torch.long)}
    features = torch.randn(R, S, width, generator=g).to(torch.bfloat16)
    ids = torch.randint(0, vocab, (R, S, topk), generator=g)
    lps = torch.log_softmax(torch.randn(R, S, topk, generator=g), dim=-1) if topk else torch.zeros(R, S, 0)
    b = Batch(host["tokens"], host["loss_mask"], host["pos"], host["doc"], features, ids, lps, R * S, [], host)
    n = min(shape.anchors, max(1, S - 1))
    row = torch.linspace(0, max(0, S - 2), n).round().long().unique()
    anchors = pad_anchors([row] * R, num_blocks=shape.anchors)
    return b.to(device), anchors


def batch_bytes(shape: StepShape, width: int, topk: int) -> int:
    """Device bytes of one loaded batch of `shape` (features bf16, top-k ids int64 and log-probs fp32,
    tokens / positions / sample index int64, the loss mask bool)."""
    return shape.tokens * (2 * width + 12 * topk + 3 * 8 + 1)


@dataclass
class Probe:
    """One measured configuration."""

    checkpoint_layers: int
    rows: int
    fits: bool
    peak_bytes: int | None      # the allocator's peak with the held memory; None: out of memory
    seconds: float = 0.0


@dataclass
class MemoryPlan:
    """What the probes found: the layers to recompute and the rows a forward pass takes (`chunk_rows`: the
    batch's rows when it fits whole, fewer where each batch runs in chunks of that many rows); layers None
    and chunk_rows 0 where not even one row fits. `held_bytes`: what was held beside the chosen size."""

    checkpoint_layers: int | None
    num_layers: int
    shape: StepShape
    budget_bytes: int
    total_bytes: int
    held_bytes: int
    probes: list[Probe] = field(default_factory=list)
    chunk_rows: int = 0
    epochs_planned: int = 0    # the epochs whose packed rows the shape was read from, of the run's `epochs`
    epochs: int = 0

    @property
    def chunks(self) -> int:
        """Forward/backward passes a batch of the largest shape takes."""
        return -(-self.shape.rows // self.chunk_rows) if self.chunk_rows else 0

    def chosen(self) -> Probe | None:
        """The measured probe behind the choice: the fitting one at the chosen rows with the most layers
        recomputed up to the chosen count (ranks agree on the most layers and the fewest rows any of them
        needs, which may exceed this rank's own: then its probe at more rows, which needs more memory)."""
        ok = [p for p in self.probes if p.fits and self.checkpoint_layers is not None and p.rows >= self.chunk_rows
              and p.checkpoint_layers <= self.checkpoint_layers]
        return min(ok, key=lambda p: (p.rows, -p.checkpoint_layers), default=None)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["shape"]["block_tokens"] = self.shape.block_tokens
        return d

    def line(self) -> str:
        s, gib = self.shape, 2 ** 30
        where = (f"the largest step ({s.rows} rows of {s.row_len:,} tokens, {s.block_tokens:,} block tokens)")
        chosen = self.chosen()
        if chosen is None:
            return f"memory: {where} does not fit the budget of {self.budget_bytes / gib:.1f} GiB"
        layers = ("no drafter layer recomputed" if self.checkpoint_layers == 0 else
                  f"{self.checkpoint_layers} of {self.num_layers} drafter layers recomputed in backward")
        split = "" if self.chunks <= 1 else (
            f"; it does not fit whole even with every layer recomputed, so each batch runs forward and backward "
            f"in {self.chunks} chunks of {self.chunk_rows} rows (the same step: gradients accumulated, the loss "
            f"normalised over the batch)")
        rows = "" if chosen.rows == self.shape.rows else f" in chunks of {chosen.rows} rows"
        return (f"memory (measured): {where} peaks at {chosen.peak_bytes / gib:.1f} GiB{rows} of a "
                f"{self.budget_bytes / gib:.1f} GiB budget"
                + ("" if (chosen.checkpoint_layers, chosen.rows) == (self.checkpoint_layers, self.chunk_rows)
                   else " as measured here (other ranks need more)")
                + f"; {layers}"
                + ("" if self.checkpoint_layers == 0 else " (fewer did not fit; --checkpoint-layers N sets it)")
                + split
                + ("" if self.epochs_planned >= self.epochs else
                   f"; the largest row of the first {self.epochs_planned} of {self.epochs} epochs' packings (the "
                   f"planning time ran out; later rows are left to the budget's slack)"))


def search_recompute(num_layers: int, rows: int, measure: Callable[[int, int], Probe]) -> tuple[
        int | None, list[Probe], int]:
    """The fewest recomputed layers whose step fits (`measure(layers, rows)`), trying none, then all, then
    bisecting. Where all do not fit, the rows a forward pass takes are halved (rounding up) until all fit,
    and the fewest layers are searched again at that size. Returns (layers, the probes in order, rows a
    pass takes); (None, probes, 0) where not even one row fits with every layer recomputed."""
    probes: list[Probe] = []

    def fits(k: int, r: int) -> bool:
        probes.append(measure(k, r))
        return probes[-1].fits

    def fewest(r: int, all_fit: bool) -> int | None:
        if fits(0, r):
            return 0
        if not all_fit and not fits(num_layers, r):
            return None
        lo, hi = 1, num_layers          # hi fits
        while lo < hi:
            mid = (lo + hi) // 2
            if fits(mid, r):
                hi = mid
            else:
                lo = mid + 1
        return hi

    layers = fewest(rows, all_fit=False)
    if layers is not None:
        return layers, probes, rows
    r = rows
    while r > 1:
        r = -(-r // 2)
        if fits(num_layers, r):
            return fewest(r, all_fit=True), probes, r
    return None, probes, 0


def held_bytes(*, moments: int, batch: int, chunk: int, prefetch: int, grad_accum: int) -> int:
    """What a training step holds beside the probe's own batch of `chunk` bytes: the optimizer's moments and
    the loader's device batches of `batch` bytes each: its prefetch queue, the one its thread has staged and
    waits to queue, and the step's group of --grad-accum batches, of which the probe is one batch (or one
    chunk of its rows). A batch the step has let go of counts no more, even while a copy stream's event
    still guards it: the allocator counts it freed when its tensor is."""
    return moments + (prefetch + 1 + grad_accum) * batch - chunk


def measure_step(model, step: Callable[[torch.nn.Module], torch.Tensor], *, layers: int, device: torch.device,
                 held_bytes: int, budget_bytes: int) -> tuple[bool, int | None]:
    """Run `step(model)` (a forward returning the loss) and its backward with `layers` layers recomputed
    and `held_bytes` held beside it; (fits the budget, peak bytes or None when out of memory). The model's
    gradients are dropped afterwards and its weights are untouched."""
    model.checkpoint_layers = layers
    cuda = device.type == "cuda"
    _release(model, device)
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    peak = None
    try:
        held = torch.empty(held_bytes, dtype=torch.uint8, device=device) if held_bytes else None
        loss = step(model)
        loss.backward()
        if cuda:
            torch.cuda.synchronize(device)
            peak = torch.cuda.max_memory_allocated(device)
        else:
            peak = 0
        del held, loss
    except torch.OutOfMemoryError:
        peak = None
    finally:
        _release(model, device)
    return peak is not None and peak <= budget_bytes, peak


def _release(model, device: torch.device) -> None:
    model.zero_grad(set_to_none=True)
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def device_budget(device: torch.device) -> tuple[int, int]:
    """(bytes a step may peak at, the device's total): what this process holds now plus the device's free
    memory, less the slack (SLACK_SHARE of the total, at least MIN_SLACK_BYTES)."""
    if device.type != "cuda":
        return 0, 0
    gc.collect()
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    slack = max(MIN_SLACK_BYTES, int(SLACK_SHARE * total))
    return torch.cuda.memory_allocated(device) + free - slack, total


def can_measure(device: torch.device) -> bool:
    """Whether `auto` measures on this device (the GPU); elsewhere it recomputes nothing."""
    return device.type == "cuda"


__all__ = ["MemoryPlan", "Probe", "StepShape", "batch_bytes", "can_measure", "device_budget", "measure_step",
           "row_anchor_bound", "search_recompute", "synthetic_batch", "worst_shape"]
