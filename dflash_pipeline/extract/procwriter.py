"""Segment writes in separate processes, so that compression never shares a GIL with the GPU loop.

In one process, the threads that compress and write segments hold the GIL between their C calls; the
thread that launches the target's kernels then waits for it, and the GPU idles (BENCHMARKS.md,
extraction). Here a segment's bulk arrays are assembled in shared memory by the extraction process and
written by a pool of writer processes that attach to them: no copy, no pickling of features.

Writer processes die with their parent (PR_SET_PDEATHSIG on Linux): one left running after the
extraction was killed could still be writing a segment that the resumed run redoes.
"""

from __future__ import annotations

import os
import signal
import threading
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context, shared_memory
from typing import Any

import numpy as np

from dflash_pipeline.schemas.store import SegmentCommit
from dflash_pipeline.store.codecs import HiddenCodec
from dflash_pipeline.store.writer import SegmentArrays

BULK = ("hidden_TLH", "hidden_scale_TL", "topk_ids_TK", "topk_logprobs_TK")

_WRITER = None


class SharedBlockPool:
    """Shared-memory blocks kept for reuse across segments. Writing into a fresh block faults in every
    page (zeroed by the kernel): 0.3-1 GB/s in a VM, against 6 GB/s into a block already mapped, for
    1.3 GB per Qwen3-8B segment on the collector thread. Blocks in use are bounded by the segments in
    flight; free blocks beyond `keep` are unlinked, smallest first."""

    def __init__(self, keep: int = 16):
        self.keep = keep
        self.free: list[shared_memory.SharedMemory] = []
        self.lock = threading.Lock()

    def take(self, nbytes: int) -> shared_memory.SharedMemory:
        with self.lock:
            fits = [b for b in self.free if b.size >= nbytes]
            if fits:
                best = min(fits, key=lambda b: b.size)
                self.free.remove(best)
                return best
        # A little headroom, so that the next, slightly larger segment reuses it too.
        return shared_memory.SharedMemory(create=True, size=max(1, nbytes + nbytes // 8))

    def give(self, block: shared_memory.SharedMemory) -> None:
        with self.lock:
            self.free.append(block)
            self.free.sort(key=lambda b: b.size)
            while len(self.free) > self.keep:
                _unlink(self.free.pop(0))

    def close(self) -> None:
        with self.lock:
            for b in self.free:
                _unlink(b)
            self.free.clear()


def _unlink(shm: shared_memory.SharedMemory) -> None:
    try:
        shm.close()
    except BufferError:  # a view is still alive somewhere: the unlink below still frees the name
        pass
    try:
        shm.unlink()
    except FileNotFoundError:
        pass


class SharedArrays:
    """Numpy arrays backed by named shared-memory blocks, owned (and unlinked) by their creator, or
    taken from and given back to a `SharedBlockPool`."""

    def __init__(self, pool: SharedBlockPool | None = None) -> None:
        self.pool = pool
        self.blocks: dict[str, shared_memory.SharedMemory] = {}
        self.specs: dict[str, tuple[str, tuple[int, ...], str]] = {}

    def empty(self, name: str, shape: tuple[int, ...], dtype) -> np.ndarray:
        dtype = np.dtype(dtype)
        nbytes = max(1, int(np.prod(shape)) * dtype.itemsize)
        shm = self.pool.take(nbytes) if self.pool is not None else shared_memory.SharedMemory(create=True, size=nbytes)
        self.blocks[name] = shm
        self.specs[name] = (shm.name, tuple(int(x) for x in shape), dtype.str)
        return np.ndarray(shape, dtype=dtype, buffer=shm.buf)

    def release(self) -> None:
        """Give every block back to the pool (or close and unlink it); arrays made by `empty` must no
        longer be used."""
        for shm in self.blocks.values():
            if self.pool is not None:
                self.pool.give(shm)
            else:
                _unlink(shm)
        self.blocks.clear()


def shm_free_bytes() -> int | None:
    """Free bytes of the shared-memory filesystem (None where there is none to ask)."""
    import shutil

    try:
        return shutil.disk_usage("/dev/shm").free
    except OSError:
        return None


def _die_with_parent() -> None:
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: the parent's pool shutdown still ends the process
        pass


def _init(url: str, meta: dict[str, Any], codec: HiddenCodec, threads: int, parent: int) -> None:
    _die_with_parent()
    if os.getppid() != parent:  # the parent died before the signal was armed
        os._exit(1)
    from dflash_pipeline.schemas.store import StoreMeta
    from dflash_pipeline.store.shards import set_pool_threads
    from dflash_pipeline.store.writer import StoreWriter

    set_pool_threads(threads)
    global _WRITER
    _WRITER = StoreWriter(url, StoreMeta.from_dict(meta), codec=codec, create=False)


def _ready() -> int:
    return os.getpid()


def _write(segment: int, small: dict[str, Any], specs: dict[str, tuple[str, tuple[int, ...], str]]) -> SegmentCommit:
    blocks, arrays = [], {}
    try:
        for name, (shm_name, shape, dtype) in specs.items():
            # A spawned child shares its parent's resource tracker: attaching registers the name there
            # once more (a set), and the creator's unlink unregisters it. Nothing to undo here.
            shm = shared_memory.SharedMemory(name=shm_name)
            blocks.append(shm)
            arrays[name] = np.ndarray(shape, dtype=np.dtype(dtype), buffer=shm.buf)
        for name in BULK:
            arrays.setdefault(name, None)
        return _WRITER.write_segment(segment, SegmentArrays(**small, **arrays))
    finally:
        arrays.clear()
        for shm in blocks:
            shm.close()


class ProcessWriter:
    """`write(segment, small, shared)` -> the commit marker, done in one of `processes` processes. Each
    process opens the store once, with the extraction's codec object (pickled to it), not its name."""

    def __init__(self, url: str, meta: dict[str, Any], codec: HiddenCodec, processes: int, threads_per_process: int):
        self.pool = ProcessPoolExecutor(max_workers=processes, mp_context=get_context("spawn"), initializer=_init,
                                        initargs=(url, meta, codec, threads_per_process, os.getpid()))
        # Start every process now, from this thread (the death signal follows the thread that started
        # them), and surface a failing start before any GPU work.
        [f.result() for f in [self.pool.submit(_ready) for _ in range(processes)]]

    def write(self, segment: int, small: dict[str, Any], shared: SharedArrays) -> SegmentCommit:
        return self.pool.submit(_write, segment, small, shared.specs).result()

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)
