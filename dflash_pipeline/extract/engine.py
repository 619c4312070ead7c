"""The per-GPU extraction engine: target forward -> side-stream copies -> collector -> writer pool.

The GPU loop runs the target, the codec's encode (fp8 scaling on the GPU), the top-k and the feature
statistics on the compute stream, then a side stream copies the results into a small pool of pinned
staging buffers. A collector thread moves each batch into its segment's host arrays (plan order); a
writer pool compresses and commits whole segments. Both queues are bounded (staging buffers,
segments in flight), so host memory stays bounded, and the time the GPU loop spends blocked on each
is measured: the progress line names the bottleneck.

Legend: N real tokens of a batch, L captured layers, H hidden, K top-k, T tokens of a segment.
"""

from __future__ import annotations

import json
import queue
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from dflash_pipeline.errors import DFlashError
from dflash_pipeline.extract.plan import SegmentPlan
from dflash_pipeline.extract.procwriter import BULK, ProcessWriter, SharedArrays, SharedBlockPool, shm_free_bytes
from dflash_pipeline.extract.profiling import BatchProfiler, ProfileWindow
from dflash_pipeline.extract.target import TargetRunner
from dflash_pipeline.progress import LiveLine, fmt_count, fmt_duration
from dflash_pipeline.schemas.config import ExtractConfig
from dflash_pipeline.store.backends import KV
from dflash_pipeline.store.codecs import hidden_layer_stats
from dflash_pipeline.store.shards import pool_threads
from dflash_pipeline.store.writer import SegmentArrays, StoreWriter

STAT_ROWS = ("count", "sum", "sumsq", "absmax", "nonfinite", "err_sq", "ref_sq", "max_abs")
MAX_ROWS = {"absmax", "max_abs"}


class Staging:
    """One batch's results in (pinned, on CUDA) host memory."""

    def __init__(self, n: int, L: int, H: int, K: int, codec, pin: bool):
        def empty(shape, dtype):
            return torch.empty(shape, dtype=dtype, pin_memory=pin)

        self.n = n
        self.hidden = empty((n, L, H), torch.uint8 if codec.storage_dtype.itemsize == 1 else torch.int16)
        self.scale = empty((n, L), torch.float32) if codec.has_scale else None
        self.topk_ids = empty((n, K), torch.int32)
        self.topk_lps = empty((n, K), torch.float16)
        self.small = empty((len(STAT_ROWS), L), torch.float64)


class SegmentAssembly:
    """A segment's host arrays, filled batch by batch in plan order."""

    def __init__(self, sp: SegmentPlan, L: int, H: int, K: int, codec, shared: SharedBlockPool | None = None):
        self.plan = sp
        lengths = np.array([len(x) for x in sp.input_ids], dtype=np.int64)
        self.offsets = np.concatenate([[0], np.cumsum(lengths)])
        T = int(self.offsets[-1])
        # With writer processes the bulk arrays live in shared memory, which the writer attaches to.
        self.shared = SharedArrays(shared) if shared is not None else None
        empty = self.shared.empty if shared is not None else (lambda _name, shape, dtype: np.empty(shape, dtype=dtype))
        self.hidden = empty("hidden_TLH", (T, L, H), codec.storage_dtype)
        self.scale = empty("hidden_scale_TL", (T, L), np.float32) if codec.has_scale else None
        self.topk_ids = empty("topk_ids_TK", (T, K), np.int32)
        self.topk_lps = empty("topk_logprobs_TK", (T, K), np.float16)
        self.small = np.zeros((len(STAT_ROWS), L), dtype=np.float64)
        self.tokens = T

    def add(self, buf: Staging, samples: list[int], n: int) -> None:
        src = 0
        hid = buf.hidden[:n].numpy().view(self.hidden.dtype)
        for i in samples:
            a, b = int(self.offsets[i]), int(self.offsets[i + 1])
            m = b - a
            self.hidden[a:b] = hid[src:src + m]
            if self.scale is not None:
                self.scale[a:b] = buf.scale[src:src + m].numpy()
            self.topk_ids[a:b] = buf.topk_ids[src:src + m].numpy()
            self.topk_lps[a:b] = buf.topk_lps[src:src + m].numpy()
            src += m
        small = buf.small.numpy()
        for j, name in enumerate(STAT_ROWS):
            self.small[j] = np.maximum(self.small[j], small[j]) if name in MAX_ROWS else self.small[j] + small[j]

    def release(self) -> None:
        """Free shared memory (after the segment was written or abandoned)."""
        if self.shared is not None:
            self.hidden = self.scale = self.topk_ids = self.topk_lps = None
            self.shared.release()

    def arrays(self) -> SegmentArrays:
        sp = self.plan
        stats = {name: self.small[j].tolist() for j, name in enumerate(STAT_ROWS)}
        return SegmentArrays(
            tokens_T=np.concatenate(sp.input_ids).astype(np.int32),
            loss_mask_T=np.concatenate(sp.loss_masks).astype(bool),
            sample_offsets=self.offsets.astype(np.int64),
            sample_ids=np.asarray(sp.sample_ids, dtype=np.int64),
            hidden_TLH=self.hidden, hidden_scale_TL=self.scale,
            topk_ids_TK=self.topk_ids, topk_logprobs_TK=self.topk_lps,
            hidden_stats={k: stats[k] for k in ("count", "sum", "sumsq", "absmax", "nonfinite")},
            codec_error={"err_sq": stats["err_sq"], "ref_sq": stats["ref_sq"], "max_abs": stats["max_abs"]},
        )


PAD_MULTIPLE = 16


def padded_length(longest: int, cap: int | None = None) -> int:
    """A batch's row width: its longest sample rounded up to a multiple of PAD_MULTIPLE (not past `cap`,
    the longest a sample may be). Batch shapes then repeat within a run instead of being new at almost
    every batch, and what is built once per shape (cuDNN builds its attention graph per shape: 40-70 ms
    on an H200) is built rarely; the extra padding is at most 15 tokens a row."""
    width = -(-longest // PAD_MULTIPLE) * PAD_MULTIPLE
    return max(longest, min(width, cap)) if cap else width


def make_batches(lengths: list[int], tokens_per_batch: int, cap: int | None = None) -> list[list[int]]:
    """Sample indices grouped into right-padded batches of at most `tokens_per_batch` padded tokens
    (rows `padded_length` wide), longest first so that rows of a batch have similar lengths."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    batches: list[list[int]] = []
    cur: list[int] = []
    for i in order:
        width = padded_length(lengths[cur[0] if cur else i], cap)  # longest first: the first row sets it
        if cur and width * (len(cur) + 1) > tokens_per_batch:
            batches.append(cur)
            cur = []
        cur.append(i)
    if cur:
        batches.append(cur)
    return batches


class Engine:
    """The per-worker pipeline: GPU loop -> side-stream copies -> collector thread -> writer pool."""

    def __init__(self, runner: TargetRunner, writer: StoreWriter, cfg: ExtractConfig, device: torch.device, rank: int):
        self.runner, self.writer, self.cfg, self.device, self.rank = runner, writer, cfg, device, rank
        self.codec = writer.codec
        meta = writer.meta
        self.L, self.H, self.K = len(meta.layer_ids), meta.target.hidden_size, meta.topk
        self.cuda = device.type == "cuda"
        self.copy_stream = torch.cuda.Stream(device) if self.cuda else None
        self.free: queue.Queue[Staging] = queue.Queue()
        self.num_staging = 4
        for _ in range(self.num_staging):
            self.free.put(Staging(cfg.tokens_per_batch, self.L, self.H, self.K, self.codec, self.cuda))
        self.collect_q: queue.Queue = queue.Queue()
        self.slots = threading.Semaphore(cfg.inflight_segments)
        self.pool = ThreadPoolExecutor(max_workers=max(1, cfg.inflight_segments), thread_name_prefix="dflash-write")
        self.futures: list = []
        self.error: BaseException | None = None
        self.lock = threading.Lock()
        self.t_start = time.time()
        self.c = {"tokens_gpu": 0, "samples_gpu": 0, "tokens": 0, "samples": 0, "segments": 0, "bytes": 0,
                  "wait_staging": 0.0, "wait_write": 0.0, "writing": 0}
        # Compute-stream time of each batch (forward, top-k, encode): against the loop's wall time it
        # says whether the GPU was kept busy. Resolved lazily, a few batches behind, to avoid syncs.
        self.gpu_events: list = []
        self.gpu_busy_s = 0.0
        # GPU idle between consecutive batches (end of one to start of the next, on the compute stream),
        # split by whether the next batch opens a segment: says where a pipeline stall sits.
        self.gpu_gap_s = {"within_segment": 0.0, "segment_start": 0.0}
        self._last_end_event = None
        self.batches = 0
        self.profiler = BatchProfiler(ProfileWindow.from_env(rank), label="dflash extract")
        # Where the GPU loop's own (host) time goes: building inputs, launching the target's forward,
        # launching encode/statistics, blocked on a staging buffer, blocked on an event. When launches
        # take as long as the GPU work, the host is the limit (e.g. another thread holding the GIL).
        self.host_s = {"inputs": 0.0, "launch_forward": 0.0, "launch_post": 0.0, "transfer": 0.0, "sync": 0.0}
        # (time, tokens launched) after each segment's batches, and when the GPU finished the last one:
        # the steady-state rate leaves out model warm-up and the final segments' drain.
        self.marks: list[tuple[float, int]] = []
        self.t_gpu_done: float | None = None
        n_proc = self._writer_processes()
        self.procs = ProcessWriter(writer.url, meta.to_dict(), self.codec, n_proc, max(1, pool_threads() // n_proc)) \
            if n_proc > 0 else None
        # Segments' shared memory is reused: each segment in flight holds 4 blocks at most.
        self.shm_pool = SharedBlockPool(keep=4 * (cfg.inflight_segments + 1)) if self.procs is not None else None
        self.collector = threading.Thread(target=self._collect, name="dflash-collect", daemon=True)
        self.collector.start()

    def _writer_processes(self) -> int:
        """How many writer processes: as configured, else one per segment in flight on GPUs (threads on
        CPUs), if shared memory can hold the segments in flight (a container's /dev/shm is often
        64 MB; touching more than it holds kills the process)."""
        cfg = self.cfg
        n = cfg.writer_processes if cfg.writer_processes is not None else (cfg.inflight_segments if self.cuda else 0)
        if n <= 0:
            return 0
        per_token = self.L * self.H * self.codec.storage_dtype.itemsize + self.K * 6 + self.L * 4
        need = (cfg.inflight_segments + 1) * cfg.segment_tokens * per_token
        free = shm_free_bytes()
        if free is not None and free < need:
            msg = (f"/dev/shm has {free / 2**30:.1f} GiB free, writer processes need about {need / 2**30:.1f} GiB "
                   f"({cfg.inflight_segments + 1} segments of {cfg.segment_tokens} tokens)")
            if cfg.writer_processes is not None:
                raise DFlashError(f"--writer-processes {n}: {msg}; give the container more shared memory "
                                  "(e.g. docker --shm-size) or use --writer-processes 0")
            warnings.warn(f"{msg}: writing segments with threads instead", stacklevel=2)
            return 0
        return n

    # -- GPU loop -------------------------------------------------------------------------------------

    def submit_segment(self, sp: SegmentPlan) -> None:
        self._check()
        t0 = time.time()
        while not self.slots.acquire(timeout=1.0):
            self._check()
        self.c["wait_write"] += time.time() - t0
        asm = SegmentAssembly(sp, self.L, self.H, self.K, self.codec, shared=self.shm_pool)
        lengths = [len(x) for x in sp.input_ids]
        with torch.inference_mode():
            self._run_batches(asm, sp, lengths)
        self.collect_q.put(("end", asm))
        self.marks.append((time.time(), self.c["tokens_gpu"]))

    def _run_batches(self, asm: SegmentAssembly, sp: SegmentPlan, lengths: list[int]) -> None:
        h = self.host_s
        for j, batch in enumerate(make_batches(lengths, self.cfg.tokens_per_batch, self.cfg.max_length)):
            self.profiler.before(self.batches, self.c["tokens_gpu"])
            self.batches += 1
            t0 = time.perf_counter()
            lens = [lengths[i] for i in batch]
            S = padded_length(max(lens), self.cfg.max_length)
            ids = torch.zeros((len(batch), S), dtype=torch.long)
            for r, i in enumerate(batch):
                ids[r, :lens[r]] = torch.from_numpy(sp.input_ids[i].astype(np.int64))
            if self.cuda:
                ev = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                ev[0].record()
            t1 = time.perf_counter()
            out = self.runner.run_batch(ids, lens)
            t2 = time.perf_counter()
            enc = self.codec.encode(out.hidden_NLH)
            st = hidden_layer_stats(out.hidden_NLH)
            small = torch.stack([st["count"], st["sum"], st["sumsq"], st["absmax"], st["nonfinite"],
                                 enc.err_sq_L, enc.ref_sq_L, enc.max_abs_err_L])
            if self.cuda:
                ev[1].record()
                self.gpu_events.append((*ev, j == 0))
            t3 = time.perf_counter()
            self._transfer(asm, batch, sum(lens), enc, out, small)
            t4 = time.perf_counter()
            self._resolve_gpu_time(8)
            t5 = time.perf_counter()
            h["inputs"] += t1 - t0
            h["launch_forward"] += t2 - t1
            h["launch_post"] += t3 - t2
            h["transfer"] += t4 - t3
            h["sync"] += t5 - t4
            self.c["tokens_gpu"] += sum(lens)
            self.c["samples_gpu"] += len(batch)

    def _transfer(self, asm: SegmentAssembly, batch: list[int], n: int, enc, out, small: torch.Tensor) -> None:
        t0 = time.time()
        while True:
            try:
                buf = self.free.get(timeout=1.0)
                break
            except queue.Empty:
                self._check()
        self.c["wait_staging"] += time.time() - t0
        if buf.n < n:  # a single sample longer than the batch budget
            buf = Staging(n, self.L, self.H, self.K, self.codec, self.cuda)
        pairs = [(buf.hidden[:n], enc.data_TLH), (buf.topk_ids[:n], out.topk_ids_NK),
                 (buf.topk_lps[:n], out.topk_logprobs_NK), (buf.small, small)]
        if buf.scale is not None:
            pairs.append((buf.scale[:n], enc.scale_TL))
        event = None
        if self.cuda:
            self.copy_stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.copy_stream):
                for dst, src in pairs:
                    dst.copy_(src, non_blocking=True)
                event = torch.cuda.Event()
                event.record(self.copy_stream)
            for _, src in pairs:  # the allocator must not reuse them before the copy ran
                src.record_stream(self.copy_stream)
        else:
            for dst, src in pairs:
                dst.copy_(src)
        self.collect_q.put(("batch", asm, batch, n, buf, event))

    # -- host side ------------------------------------------------------------------------------------

    def _collect(self) -> None:
        while True:
            item = self.collect_q.get()
            if item is None:
                return
            if item[0] == "batch":
                _, asm, batch, n, buf, event = item
                try:
                    if event is not None:
                        event.synchronize()
                    if self.error is None:
                        asm.add(buf, batch, n)
                except BaseException as e:  # surfaced to the GPU loop by _check
                    self.error = e
                # Keep the pool at its size: an oversized buffer is replaced by a regular one.
                self.free.put(buf if buf.n == self.cfg.tokens_per_batch else
                              Staging(self.cfg.tokens_per_batch, self.L, self.H, self.K, self.codec, self.cuda))
            elif self.error is None:
                self.futures.append(self.pool.submit(self._write, item[1]))
            else:
                item[1].release()
                self.slots.release()

    def _write(self, asm: SegmentAssembly) -> None:
        try:
            with self.lock:
                self.c["writing"] += 1
            if self.procs is not None:
                arrays = asm.arrays()
                small = {k: v for k, v in vars(arrays).items() if k not in BULK}
                del arrays
                marker = self.procs.write(asm.plan.segment, small, asm.shared)
            else:
                marker = self.writer.write_segment(asm.plan.segment, asm.arrays())
            with self.lock:
                self.c["segments"] += 1
                self.c["tokens"] += asm.tokens
                self.c["samples"] += len(asm.plan.sample_ids)
                self.c["bytes"] += sum(a.bytes for a in marker.arrays.values())
        except BaseException as e:
            self.error = e
        finally:
            asm.release()
            with self.lock:
                self.c["writing"] -= 1
            self.slots.release()

    def _check(self) -> None:
        if self.error is not None:
            raise self.error

    def finish(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)
        self.t_gpu_done = time.time()
        self.collect_q.put(None)
        self.collector.join()
        for f in self.futures:
            f.result()
        self._check()

    def close(self) -> None:
        if self.collector.is_alive():
            self.collect_q.put(None)
            self.collector.join(timeout=60)
        self.pool.shutdown(wait=True)
        if self.procs is not None:
            self.procs.close()
        if self.shm_pool is not None:
            self.shm_pool.close()

    def queue_depths(self) -> dict[str, int]:
        return {"staging_busy": self.num_staging - self.free.qsize(), "staging": self.num_staging,
                "collect": self.collect_q.qsize(),
                "segments_in_flight": self.cfg.inflight_segments - self.slots._value,  # noqa: SLF001
                "segments_max": self.cfg.inflight_segments}

    def _resolve_gpu_time(self, keep: int) -> None:
        while len(self.gpu_events) > keep:
            a, b, opens_segment = self.gpu_events.pop(0)
            b.synchronize()
            self.gpu_busy_s += a.elapsed_time(b) / 1e3
            if self._last_end_event is not None:
                self.gpu_gap_s["segment_start" if opens_segment else "within_segment"] += \
                    self._last_end_event.elapsed_time(a) / 1e3
            self._last_end_event = b

    def summary(self) -> dict[str, Any]:
        self.profiler.finish(self.c["tokens_gpu"])  # a window the run was too short to close
        self._resolve_gpu_time(0)
        elapsed = time.time() - self.t_start
        out = {"rank": self.rank, "device": str(self.device), "seconds": elapsed,
               "segments": self.c["segments"], "samples": self.c["samples"], "tokens": self.c["tokens"],
               "bytes": self.c["bytes"], "tokens_per_second": self.c["tokens"] / elapsed if elapsed else 0.0,
               "wait_staging_s": self.c["wait_staging"], "wait_write_s": self.c["wait_write"],
               "gpu_busy_s": self.gpu_busy_s if self.cuda else None,
               "host_loop_s": dict(self.host_s), "gpu_gap_s": dict(self.gpu_gap_s) if self.cuda else None}
        if self.t_gpu_done is not None and self.marks:
            # Steady state: from the end of the first segment's launches to the GPU finishing the last
            # batch. Tokens still queued at the first mark count on neither side of it, which biases
            # the rate down, never up.
            t_first, tok_first = self.marks[0]
            out["first_segment_s"] = t_first - self.t_start
            out["gpu_loop_s"] = self.t_gpu_done - self.t_start
            out["drain_s"] = time.time() - self.t_gpu_done
            if len(self.marks) > 1 and self.t_gpu_done > t_first:
                out["steady_tokens_per_second"] = (self.c["tokens_gpu"] - tok_first) / (self.t_gpu_done - t_first)
        if self.cuda:
            # The caching allocator's trips to the driver: a cudaFree (after a failed allocation, a
            # retry) synchronises the device and stalls the pipeline where no event sees it.
            st = torch.cuda.memory_stats(self.device)
            out["cuda_allocator"] = {k: st.get(k, 0) for k in ("num_alloc_retries", "num_device_alloc",
                                                                 "num_device_free", "num_sync_all_streams")}
        return out


class Reporter:
    """Live progress: each rank publishes a small status object; rank 0 prints the aggregate line."""

    def __init__(self, engine: Engine, prep, cfg: ExtractConfig, rank: int, world: int, line: LiveLine, kv: KV):
        self.engine, self.prep, self.cfg, self.rank, self.world, self.line, self.kv = engine, prep, cfg, rank, world, line, kv
        self.total = sum(prep.pending_tokens.values())
        self.stop_ev = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="dflash-progress", daemon=True)
        self.history: list[tuple[float, int, float, float]] = [(time.time(), 0, 0.0, 0.0)]

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.stop_ev.set()
        self.thread.join(timeout=10)
        self.line.done()

    def _status(self) -> dict[str, Any]:
        e = self.engine
        return {"rank": self.rank, "time": time.time(), "tokens_gpu": e.c["tokens_gpu"], "tokens": e.c["tokens"],
                "samples_gpu": e.c["samples_gpu"],
                "segments": e.c["segments"], "wait_staging": e.c["wait_staging"], "wait_write": e.c["wait_write"],
                **e.queue_depths()}

    def _loop(self) -> None:
        interval = 1.0 if self.line.tty else 5.0
        while not self.stop_ev.wait(interval):
            st = self._status()
            if self.world > 1:
                self.kv.put(f"runs/{self.prep.run_id}/status-rank{self.rank:04d}.json", json.dumps(st).encode())
            if self.rank != 0:
                continue
            ranks = [st]
            if self.world > 1:
                for r in range(1, self.world):
                    raw = self.kv.get(f"runs/{self.prep.run_id}/status-rank{r:04d}.json")
                    if raw:
                        ranks.append(json.loads(raw))
            self.line.update(self._render(st, ranks))

    def _render(self, st: dict[str, Any], ranks: list[dict[str, Any]]) -> str:
        now = time.time()
        gpu_tokens = sum(r["tokens_gpu"] for r in ranks)
        written = sum(r["tokens"] for r in ranks)
        # Rates over the last ~30 s: per-interval counts are too lumpy when a batch takes seconds.
        self.history.append((now, gpu_tokens, st["wait_staging"], st["wait_write"]))
        while len(self.history) > 2 and now - self.history[1][0] >= 30:
            self.history.pop(0)
        t_last, tok_last, ws_last, ww_last = self.history[0]
        dt = max(now - t_last, 1e-6)
        rate = (gpu_tokens - tok_last) / dt
        ws = (st["wait_staging"] - ws_last) / dt
        ww = (st["wait_write"] - ww_last) / dt
        bound = "write-bound" if ww > 0.1 else "copy-bound" if ws > 0.1 else "target-bound"
        overall = gpu_tokens / max(now - self.engine.t_start, 1e-6)
        eta = (self.total - gpu_tokens) / overall if overall > 0 else float("inf")
        segs = sum(r["segments"] for r in ranks)
        samples = sum(r.get("samples_gpu", 0) for r in ranks)
        return (f"extract  segments {segs}/{len(self.prep.pending)}  samples {samples:,}  "
                f"tokens {fmt_count(gpu_tokens)}/{fmt_count(self.total)} "
                f"(written {fmt_count(written)})  {fmt_count(rate)} tok/s  "
                f"queues: staging {st['staging_busy']}/{st['staging']} segments {st['segments_in_flight']}/{st['segments_max']}  "
                f"ETA {fmt_duration(eta)}  [{bound}]")
