"""Streaming the store into a trainer: worker processes build the planned rows, a thread prefetches.

The order of an epoch is planned up front (train/plan.py). Reading and decoding happen in worker
processes (one window at a time, whole segments, verified against their commit markers: train/rows.py);
rows come back through shared memory and are reassembled in order, so the batch sequence does not
depend on the number of workers or their timing. Workers live for the whole run: windows of the
following epochs are started before an epoch ends. A thread stacks rows into pinned buffers and starts
the host-to-device copy on a side stream; the training loop only waits when data is really late, and
that wait is measured (`data_wait`).
"""

from __future__ import annotations

import itertools
import os
import queue
import threading
import time
import warnings
from typing import Any, Callable, Iterator

import numpy as np
import torch

from dflash_pipeline.errors import CorruptSegmentError, StoreError
from dflash_pipeline.train.batch import Batch, Row, rows_meta, stack_rows
from dflash_pipeline.train.plan import (
    EpochPlan, LoaderState, Manifest, Window, eval_holdout, plan_epoch, store_fingerprint,
)
from dflash_pipeline.train.rows import build_window_rows

# (epoch, batch index, batches in that epoch): where a batch sits in the run.
Tag = tuple[int, int, int]


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

    def iter_from(self, epoch: int, start_batch: int = 0) -> Iterator[tuple[Tag, Batch]]:
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

    def _epoch_items(self, epoch: int, start_batch: int) -> Iterator[tuple[Tag, list[Row]]]:
        plan = self.epoch_plan(epoch)
        order = plan.batch_rows(self.rows_per_batch)[start_batch * self.rows_per_batch:]
        if not order:
            return
        needed = sorted({w for w, _ in order})
        windows = [plan.windows[w] for w in needed]
        rows_iter = self._rows(windows, set(order), epoch)
        for k, rows in enumerate(self._batches(rows_iter)):
            yield (epoch, start_batch + k, plan.steps), rows

    def _rows(self, windows: list[Window], wanted: set[tuple[int, int]], epoch: int) -> Iterator[Row]:
        """Rows in window order, built in worker processes (or inline with num_workers=0)."""
        # A memory:// store lives in this process only: worker processes would see an empty one.
        if self.num_workers == 0 or self.reader.url.startswith("memory://"):
            return self._rows_inline(windows, wanted)
        return self._rows_from_workers(windows, wanted, epoch)

    def _rows_inline(self, windows: list[Window], wanted: set[tuple[int, int]]) -> Iterator[Row]:
        for w in windows:
            rows, problems = build_window_rows(self.reader, w, self.man_cols, self.layers, self.row_len, self.strict)
            self._note(problems)
            for i, r in enumerate(rows):
                if (w.index, i) in wanted:
                    yield r

    def _rows_from_workers(self, windows: list[Window], wanted: set[tuple[int, int]], epoch: int) -> Iterator[Row]:
        if self._pool is None:
            self._pool = _WorkerPool(self)
        pool = self._pool
        pool.forget_before(epoch)
        # Tasks in flight are bounded; past this epoch's last windows the following epochs' are started,
        # so that an epoch boundary costs no wait.
        limit = self.num_workers + self.prefetch
        ahead = itertools.chain((((epoch, w.index), w) for w in windows), self._later_windows(epoch))
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

    def _later_windows(self, epoch: int) -> Iterator[tuple[tuple[int, int], Window]]:
        """Windows of the epochs after `epoch`, as far as the workers are allowed to run ahead (on a
        small store several epochs: one epoch's windows may take longer to build than to train).
        Through `epoch_plan`'s cache: the stream asks for the same plans when those epochs start."""
        e = epoch + 1
        while True:
            ws = self.epoch_plan(e).windows
            if not ws:
                return
            for w in ws:
                yield (e, w.index), w
            e += 1

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

    def _batches(self, rows: Iterator[Row]) -> Iterator[list[Row]]:
        buf = []
        for r in rows:
            buf.append(r)
            if len(buf) == self.rows_per_batch:
                yield buf
                buf = []

    # -- prefetch -------------------------------------------------------------------------------------

    def _prefetched(self, batches: Iterator[tuple[Any, list[Row]]]) -> Iterator[tuple[Any, Batch]]:
        """A thread stacks into pinned memory and starts the copy; the loop waits only when data is late."""
        cuda = self.device.type == "cuda"
        q: queue.Queue = queue.Queue(maxsize=self.prefetch)
        stage = _CudaStager(self.device, self.prefetch + 2) if cuda else _host_stage
        halt = threading.Event()
        err: list[BaseException] = []
        t = threading.Thread(target=_produce, args=(batches, stage, q, halt, err), name="dflash-prefetch", daemon=True)
        t.start()
        try:
            while True:
                item = self._take(q)
                if item is _DONE:
                    break
                tag, b, ev = item
                if ev is not None:
                    _wait_copy(b, ev, self.device)
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

    def _take(self, q: queue.Queue) -> Any:
        """The next prefetched item; the time waited for it is data wait."""
        t0 = time.perf_counter()
        item = q.get()
        waited = time.perf_counter() - t0
        if self.started:
            self.data_wait += waited
        else:  # the run's first batch: worker start-up and the first windows, reported apart
            self.startup_wait, self.started = waited, True
        return item


_DONE = object()


def _host_stage(rows: list[Row]) -> tuple[Batch, None]:
    return stack_rows(rows), None


def _produce(batches: Iterator[tuple[Any, list[Row]]], stage: Callable[[list[Row]], tuple[Batch, Any]],
             q: queue.Queue, halt: threading.Event, err: list[BaseException]) -> None:
    """The prefetch thread: stage every batch and queue it (tag, batch, copy event or None), then _DONE."""

    def put(item) -> bool:
        while not halt.is_set():
            try:
                q.put(item, timeout=0.5)
                return True
            except queue.Full:
                continue
        return False

    try:
        for tag, rows in batches:
            b, ev = stage(rows)
            if not put((tag, b, ev)):
                break
    except BaseException as e:
        err.append(e)
    finally:
        batches.close()  # ends the row generator when the consumer left early (workers stay)
        put(_DONE)


def _wait_copy(b: Batch, ev, device: torch.device) -> None:
    """Make the compute stream wait for the batch's copy (not the host)."""
    main = torch.cuda.current_stream(device)
    main.wait_event(ev)
    # Allocated on the copy stream, used on the main one: tell the allocator, or it could hand the
    # memory to the next copy while kernels still read it.
    for f in Batch.TENSOR_FIELDS:
        getattr(b, f).record_stream(main)


class _CudaStager:
    """Stages a batch's rows in a pinned slot and starts its copy to the device on a side stream."""

    def __init__(self, device: torch.device, slots: int):
        self.device = device
        self.stream = torch.cuda.Stream(device)
        self.ring = _PinnedRing(slots)

    def __call__(self, rows: list[Row]) -> tuple[Batch, Any]:
        b = self.ring.stage(rows)
        with torch.cuda.stream(self.stream):
            d = b.to(self.device, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(self.stream)
        self.ring.last_event = ev
        return d, ev


class _PinnedRing:
    """Reused pinned host buffers (pinning per batch costs more than the copy). A slot is refilled
    only after the device copy that read it has finished."""

    FIELDS = Batch.TENSOR_FIELDS

    def __init__(self, slots: int):
        self.slots: list[dict[str, torch.Tensor] | None] = [None] * slots
        self.events: list[Any] = [None] * slots
        self.i = 0
        self.last_event = None

    def stage(self, rows: list[Row]) -> Batch:
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
        meta = rows_meta(rows)
        host = {f: slot[f].clone() for f in Batch.HOST_FIELDS}  # the slot is refilled later: copies
        return Batch(*(slot[f] for f in self.FIELDS), *meta, host)
