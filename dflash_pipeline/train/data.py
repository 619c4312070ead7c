"""Streaming the store into a trainer: per-rank segment order, packing, worker processes, prefetch.

Everything about an epoch's order is computed up front from the manifest alone (lengths, no data):
- whole samples are held out for evaluation by a hash of their sample id (independent of world size);
- segments are shuffled per epoch and dealt to ranks (rank r takes every world-th), so every rank
  reads its own disjoint data and nobody broadcasts batches;
- within a window of a few consecutive segments, samples are shuffled and packed into rows of
  `row_len` tokens (a sample never straddles rows; attention never crosses samples);
- every rank computes every rank's row count and all run the same number of steps (the few rows
  beyond that are dropped), so no collective hangs at the end of an epoch.

Reading and decoding happen in worker processes (one window at a time, whole segments, verified
against their commit markers); rows come back through shared memory and are reassembled in order, so
the batch sequence does not depend on the number of workers or their timing. A thread stacks rows
into pinned buffers and starts the host-to-device copy on a side stream; the training loop only waits
when data is really late, and that wait is measured (`data_wait`).

Loader state is (epoch, batch index) plus what it was computed from; loading it refuses a changed
world size, seed or store instead of resuming wrongly.

Legend: R rows per batch, S row length, L layers, H hidden, K top-k.
"""

from __future__ import annotations

import itertools
import math
import os
import queue
import threading
import time
import warnings
from dataclasses import asdict, dataclass, field
from typing import Any, Iterator

import numpy as np
import torch

from dflash_pipeline.errors import ConfigMismatchError, CorruptSegmentError, StoreError

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

    HOST_FIELDS = ("tokens", "loss_mask", "pos", "doc")

    def to(self, device: torch.device, non_blocking: bool = False) -> "Batch":
        host = self.host
        if host is None and self.tokens.device.type == "cpu":
            host = {f: getattr(self, f) for f in self.HOST_FIELDS}
        return Batch(*(getattr(self, f).to(device, non_blocking=non_blocking) for f in
                       ("tokens", "loss_mask", "pos", "doc", "features", "topk_ids", "topk_logprobs")),
                     self.num_tokens, self.sample_ids, host)

    def host_fields(self) -> dict[str, torch.Tensor]:
        """tokens, loss_mask, pos and doc on the host (copied from the device once if not kept)."""
        if self.host is None:
            self.host = {f: getattr(self, f).cpu() for f in self.HOST_FIELDS}
        return self.host


# -- building rows (runs in workers) ----------------------------------------------------------------

def _empty(shape: tuple[int, ...], dtype: torch.dtype, shared: bool) -> torch.Tensor:
    """Uninitialised tensor; `shared`: allocated in shared memory, so that sending it to the trainer
    process costs no copy (torch moves any other tensor into shared memory by copying it)."""
    if not shared:
        return torch.empty(shape, dtype=dtype)
    storage = torch.UntypedStorage._new_shared(math.prod(shape) * dtype.itemsize)  # noqa: SLF001
    return torch.empty(0, dtype=dtype).set_(storage, 0, shape)


def build_window_rows(reader, window: Window, man_cols: dict[str, np.ndarray], layers: list[int],
                      row_len: int, strict: bool, shared: bool = False) -> tuple[list[dict[str, torch.Tensor]], list[str]]:
    """Read the window's segments and assemble its rows. Corrupt segments: their samples become
    padding (the row structure, hence the step count, stays), unless strict. The feature rows (the
    bulk: row_len x layers x hidden) are written once, straight into their final (shared) memory;
    only their unfilled positions are zeroed."""
    segs, problems = {}, []
    for s in window.segments:
        try:
            segs[s] = reader.read_segment(s, layers, verify=True)
        except CorruptSegmentError as e:
            if strict:
                raise
            problems.append(str(e))
    K = reader.meta.topk
    rows = []
    for pieces in window.rows:
        tokens = np.zeros(row_len, np.int64)
        mask = np.zeros(row_len, bool)
        pos = np.zeros(row_len, np.int64)
        doc = np.full(row_len, -1, np.int64)
        feats = _empty((row_len, len(layers) * reader.meta.target.hidden_size), torch.bfloat16, shared)
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
        rows.append({"tokens": torch.from_numpy(tokens), "loss_mask": torch.from_numpy(mask),
                     "pos": torch.from_numpy(pos), "doc": torch.from_numpy(doc), "features": feats,
                     "topk_ids": torch.from_numpy(ids), "topk_logprobs": torch.from_numpy(lps),
                     "sample_ids": sample_ids})
    return rows, problems


def _worker_main(url: str, man_cols: dict[str, np.ndarray], layers: list[int], row_len: int, strict: bool,
                 task_q, out_q, stop, threads: int) -> None:
    """A persistent loader worker: builds the rows of each window it is given, for any epoch."""
    from dflash_pipeline.store.reader import StoreReader
    from dflash_pipeline.store.shards import set_pool_threads

    torch.set_num_threads(1)
    set_pool_threads(threads)  # decode threads: this worker's share of the cores
    try:
        reader = StoreReader(url)
        while not stop.is_set():
            task = task_q.get()
            if task is None:
                break
            key, window = task
            rows, problems = build_window_rows(reader, window, man_cols, layers, row_len, strict, shared=True)
            out_q.put(("window", key, rows, problems))
    except BaseException as e:  # surfaced in the trainer with its message
        out_q.put(("error", None, repr(e) if not isinstance(e, CorruptSegmentError) else str(e), None))
    # Tensors travel as shared-memory file descriptors that this process serves: stay alive until
    # the trainer has taken everything.
    stop.wait()


class _WorkerPool:
    """Worker processes started once per loader and kept across epochs (a spawn costs seconds: per
    epoch, on a small store, it dominated the data wait). Windows are tasks keyed by (epoch, window);
    results may arrive in any order and are handed out by key."""

    def __init__(self, loader: StreamingLoader):
        import torch.multiprocessing as mp

        from dflash_pipeline.store.shards import available_cpus

        ctx = mp.get_context("spawn")
        self.url = loader.reader.url
        # The node's cores are shared by every rank's workers (LOCAL_WORLD_SIZE: torchrun's, or ours),
        # with one core per rank left for the thread that drives its GPU: 8 workers x 4 threads x 2
        # ranks on 32 cores made the training loops wait for a core to launch their kernels.
        local = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
        threads = max(1, (available_cpus() - local) // max(1, loader.num_workers * local))
        self.task_q, self.out_q, self.stop = ctx.Queue(), ctx.Queue(), ctx.Event()
        self.procs = [ctx.Process(target=_worker_main, args=(self.url, loader.man_cols, loader.layers, loader.row_len,
                                                             loader.strict, self.task_q, self.out_q, self.stop,
                                                             threads),
                                  daemon=True) for _ in range(loader.num_workers)]
        for p in self.procs:
            p.start()
        self.submitted: set[tuple[int, int]] = set()
        self.ready: dict[tuple[int, int], tuple[list, list[str]]] = {}

    def submit(self, key: tuple[int, int], window: Window) -> None:
        if key not in self.submitted and key not in self.ready:
            self.task_q.put((key, window))
            self.submitted.add(key)

    def outstanding(self) -> int:
        return len(self.submitted) + len(self.ready)

    def forget_before(self, epoch: int) -> None:
        """Drop results of earlier epochs nobody will ask for (a run stopped or resumed mid-epoch)."""
        for k in [k for k in self.ready if k[0] < epoch]:
            del self.ready[k]

    def get(self, key: tuple[int, int]) -> tuple[list, list[str]]:
        while key not in self.ready:
            try:
                kind, k, rows, problems = self.out_q.get(timeout=5.0)
            except queue.Empty:
                dead = [p for p in self.procs if not p.is_alive() and p.exitcode not in (0, None)]
                if dead:
                    raise RuntimeError(f"data loader worker died (exit code {dead[0].exitcode})") from None
                continue
            if kind == "error":
                if rows.startswith(self.url):  # a store problem, already one clear line
                    raise StoreError(rows)
                raise RuntimeError(f"data loader worker failed: {rows}")
            self.submitted.discard(k)
            self.ready[k] = (rows, problems)
        return self.ready.pop(key)

    def close(self) -> None:
        self.stop.set()
        for _ in self.procs:
            self.task_q.put(None)
        for p in self.procs:
            p.join(timeout=1.0)
            if p.is_alive():
                p.terminate()
        self.ready.clear()


class StreamingLoader:
    """Yields this rank's batches for an epoch, from a given batch index, with prefetch."""

    def __init__(self, reader, *, layers: list[int], rank: int, world: int, seed: int, row_len: int,
                 rows_per_batch: int, eval_fraction: float = 0.0, num_workers: int = 2,
                 window_segments: int = 2, prefetch: int = 2, device: torch.device | None = None,
                 strict: bool = False):
        self.reader, self.layers = reader, list(layers)
        self.rank, self.world, self.seed = rank, world, seed
        self.row_len, self.rows_per_batch = row_len, rows_per_batch
        self.num_workers, self.window_segments, self.prefetch = num_workers, window_segments, prefetch
        self.device = device or torch.device("cpu")
        self.strict = strict
        self.man = Manifest(reader)
        self.holdout = eval_holdout(self.man.sample_id, eval_fraction, seed)
        self.man_cols = {"segment": self.man.segment, "offset": reader.column("offset"),
                         "sample_id": self.man.sample_id}
        self.data_wait = 0.0
        self.started, self.startup_wait = False, 0.0
        self.corrupt: list[str] = []
        self._plans: dict[int, EpochPlan] = {}
        self._plan_lock = threading.Lock()
        self._pool: _WorkerPool | None = None

    # -- planning -------------------------------------------------------------------------------------

    def epoch_plan(self, epoch: int) -> EpochPlan:
        """This rank's plan for `epoch` (a few recent ones and epoch 0's are kept; the prefetch thread
        plans ahead while the trainer asks for epoch 0's step count)."""
        with self._plan_lock:
            plan = self._plans.get(epoch)
        if plan is not None:
            return plan
        plan = self._plan(epoch)  # outside the lock: the trainer's lookups never wait on a planning
        with self._plan_lock:
            plan = self._plans.setdefault(epoch, plan)
            for k in sorted(k for k in self._plans if k not in (0, epoch))[:-2]:
                del self._plans[k]
        return plan

    def _plan(self, epoch: int) -> EpochPlan:
        return plan_epoch(self.man, ~self.holdout, epoch=epoch, rank=self.rank, world=self.world, seed=self.seed,
                          row_len=self.row_len, rows_per_batch=self.rows_per_batch,
                          window_segments=self.window_segments)

    def steps_per_epoch(self) -> int:
        return self.epoch_plan(0).steps

    def eval_rows(self) -> np.ndarray:
        """Manifest rows of held-out samples (every rank sees the same list)."""
        return np.nonzero(self.holdout)[0]

    def state(self, epoch: int, batch: int) -> LoaderState:
        return LoaderState(epoch=epoch, batch=batch, world=self.world, rank=self.rank, seed=self.seed,
                           store_fingerprint=store_fingerprint(self.reader), row_len=self.row_len,
                           rows_per_batch=self.rows_per_batch)

    # -- iteration ------------------------------------------------------------------------------------

    def iter_epoch(self, epoch: int, start_batch: int = 0) -> Iterator[Batch]:
        """This rank's batches of one epoch, from batch `start_batch`."""
        for _, b in self._prefetched(self._epoch_items(epoch, start_batch)):
            yield b

    def iter_from(self, epoch: int, start_batch: int = 0) -> Iterator[tuple[tuple[int, int, int], Batch]]:
        """((epoch, batch index, batches in that epoch), batch) from `start_batch` of `epoch` on, through
        every following epoch, in one prefetch pipeline: an epoch boundary neither drains the prefetch
        queue nor pins new buffers (per epoch, that cost 4-8% data wait on two H200s). Ends only if an
        epoch has no batch."""
        def items():
            e, start = epoch, start_batch
            while True:
                any_item = False
                for item in self._epoch_items(e, start):
                    any_item = True
                    yield item
                if not any_item and start == 0:
                    return
                e, start = e + 1, 0

        return self._prefetched(items())

    def _epoch_items(self, epoch: int, start_batch: int) -> Iterator[tuple[tuple[int, int, int], list[dict[str, Any]]]]:
        plan = self.epoch_plan(epoch)
        order = plan.batch_rows(self.rows_per_batch)[start_batch * self.rows_per_batch:]
        if not order:
            return
        needed = sorted({w for w, _ in order})
        windows = [plan.windows[w] for w in needed]
        rows_iter = self._rows(windows, set(order), epoch)
        for k, rows in enumerate(self._batches(rows_iter)):
            yield (epoch, start_batch + k, plan.steps), rows

    def _rows(self, windows: list[Window], wanted: set[tuple[int, int]], epoch: int) -> Iterator[dict[str, Any]]:
        """Rows in window order, built in worker processes (or inline with num_workers=0)."""
        # A memory:// store lives in this process only: worker processes would see an empty one.
        if self.num_workers == 0 or self.reader.url.startswith("memory://"):
            for w in windows:
                rows, problems = build_window_rows(self.reader, w, self.man_cols, self.layers, self.row_len, self.strict)
                self._note(problems)
                for i, r in enumerate(rows):
                    if (w.index, i) in wanted:
                        yield r
            return
        if self._pool is None:
            self._pool = _WorkerPool(self)
        pool = self._pool
        pool.forget_before(epoch)
        # Tasks in flight are bounded; past this epoch's last windows the following epochs' are started,
        # so that an epoch boundary costs no wait.
        limit = self.num_workers + self.prefetch

        def later_epochs():
            # Windows of the epochs that follow, as far as the bound lets the workers run ahead (on a
            # small store several epochs: one epoch's windows may take longer to build than to train).
            # Through `epoch_plan`'s cache: the stream asks for the same plans when those epochs start.
            e = epoch + 1
            while True:
                ws = self.epoch_plan(e).windows
                if not ws:
                    return
                for w in ws:
                    yield (e, w.index), w
                e += 1

        ahead = itertools.chain((((epoch, w.index), w) for w in windows), later_epochs())
        submitted = 0

        def top_up(consumed: int) -> None:
            nonlocal submitted
            while submitted < consumed + 1 or pool.outstanding() < limit:
                task = next(ahead, None)
                if task is None:
                    return
                pool.submit(*task)
                submitted += 1

        for j, w in enumerate(windows):
            top_up(j)
            rows, problems = pool.get((epoch, w.index))
            self._note(problems)
            for i, r in enumerate(rows):
                if (w.index, i) in wanted:
                    yield r
        top_up(len(windows) - 1)

    def close(self) -> None:
        """Stop the worker processes (the loader starts them again if iterated later)."""
        if self._pool is not None:
            self._pool.close()
            self._pool = None

    def _note(self, problems: list[str]) -> None:
        for msg in problems:
            if msg not in self.corrupt:
                self.corrupt.append(msg)
                warnings.warn(f"skipping corrupt segment: {msg}", stacklevel=2)

    def _batches(self, rows: Iterator[dict[str, Any]]) -> Iterator[list[dict[str, Any]]]:
        buf = []
        for r in rows:
            buf.append(r)
            if len(buf) == self.rows_per_batch:
                yield buf
                buf = []

    def _prefetched(self, batches: Iterator[tuple[Any, list[dict[str, Any]]]]) -> Iterator[tuple[Any, Batch]]:
        """A thread stacks into pinned memory and starts the copy; the loop waits only when data is late."""
        cuda = self.device.type == "cuda"
        q: queue.Queue = queue.Queue(maxsize=self.prefetch)
        stream = torch.cuda.Stream(self.device) if cuda else None
        done = object()
        err: list[BaseException] = []

        ring = _PinnedRing(self.prefetch + 2) if cuda else None
        halt = threading.Event()

        def put(item) -> bool:
            while not halt.is_set():
                try:
                    q.put(item, timeout=0.5)
                    return True
                except queue.Full:
                    continue
            return False

        def produce():
            try:
                for tag, rows in batches:
                    if cuda:
                        b = ring.stage(rows)
                        with torch.cuda.stream(stream):
                            d = b.to(self.device, non_blocking=True)
                            ev = torch.cuda.Event()
                            ev.record(stream)
                        ring.last_event = ev
                        item = (tag, d, ev)
                    else:
                        item = (tag, _stack(rows), None)
                    if not put(item):
                        break
            except BaseException as e:
                err.append(e)
            finally:
                batches.close()  # ends the row generator when the consumer left early (workers stay)
                put(done)

        t = threading.Thread(target=produce, name="dflash-prefetch", daemon=True)
        t.start()
        try:
            while True:
                t0 = time.perf_counter()
                item = q.get()
                waited = time.perf_counter() - t0
                if self.started:
                    self.data_wait += waited
                else:  # the run's first batch: worker start-up and the first windows, reported apart
                    self.startup_wait, self.started = waited, True
                if item is done:
                    break
                tag, b, ev = item
                if ev is not None:
                    main = torch.cuda.current_stream(self.device)
                    main.wait_event(ev)
                    # Allocated on the copy stream, used on the main one: tell the allocator, or it could
                    # hand the memory to the next copy while kernels still read it.
                    for f in _PinnedRing.FIELDS:
                        getattr(b, f).record_stream(main)
                yield tag, b
        finally:
            # The consumer may stop early (end of run, signal): release the producer and wait for it,
            # so no thread is left blocked inside torch when the interpreter exits.
            halt.set()
            while t.is_alive():
                try:
                    q.get(timeout=0.1)
                except queue.Empty:
                    pass
            t.join()
        if err:
            raise err[0]


def _stack_meta(rows: list[dict[str, Any]]) -> tuple[int, list[int]]:
    return (int(sum(int((r["doc"] >= 0).sum()) for r in rows)), [s for r in rows for s in r["sample_ids"]])


def _stack(rows: list[dict[str, Any]]) -> Batch:
    return Batch(*(torch.stack([r[f] for r in rows]) for f in _PinnedRing.FIELDS), *_stack_meta(rows))


class _PinnedRing:
    """Reused pinned host buffers (pinning per batch costs more than the copy). A slot is refilled
    only after the device copy that read it has finished."""

    FIELDS = ("tokens", "loss_mask", "pos", "doc", "features", "topk_ids", "topk_logprobs")

    def __init__(self, slots: int):
        self.slots: list[dict[str, torch.Tensor] | None] = [None] * slots
        self.events: list[Any] = [None] * slots
        self.i = 0
        self.last_event = None

    def stage(self, rows: list[dict[str, Any]]) -> Batch:
        """Stack rows straight into a pinned slot (one copy from the workers' shared memory)."""
        if self.last_event is not None:  # the previous slot's copy was recorded after staging it
            self.events[(self.i - 1) % len(self.slots)] = self.last_event
            self.last_event = None
        k = self.i % len(self.slots)
        self.i += 1
        if self.events[k] is not None:
            self.events[k].synchronize()
        slot = self.slots[k]
        shapes = {f: (len(rows), *rows[0][f].shape) for f in self.FIELDS}
        if slot is None or any(tuple(slot[f].shape) != shapes[f] for f in self.FIELDS):
            slot = {f: torch.empty(shapes[f], dtype=rows[0][f].dtype).pin_memory() for f in self.FIELDS}
            self.slots[k] = slot
        for f in self.FIELDS:
            torch.stack([r[f] for r in rows], out=slot[f])
        meta = _stack_meta(rows)
        host = {f: slot[f].clone() for f in Batch.HOST_FIELDS}  # the slot is refilled later: copies
        return Batch(*(slot[f] for f in self.FIELDS), *meta, host)


def store_fingerprint(reader) -> str:
    """What a resumed run must find unchanged: the store's identity and its sample index."""
    import hashlib

    m = reader.meta
    h = hashlib.sha256()
    h.update(f"{m.target.config_hash}|{m.tokenizer.hash}|{m.layer_ids}|{m.codec}|{m.data_fingerprint}|{reader.num_samples}".encode())
    h.update(np.ascontiguousarray(reader.column("sample_id")).tobytes())
    return h.hexdigest()[:32]
