"""`dflash extract`: run the target on every GPU and fill the feature store.

Roles:
- The coordinator (the launching process, or rank 0 under torchrun) checks the inputs, tokenizes
  them once, writes the plan and the store's root metadata, and at the end rebuilds the manifest and
  writes the run record. Every user error is raised here, before any GPU work.
- One worker per GPU (or per `--gpus-per-replica` GPUs) takes its share of the uncommitted segments
  (divided by segment id, so a restart with another number of processes completes the same store),
  runs the target, and writes and commits segments.

Inside a worker the GPU never waits on storage: the target's forward, the codec's encode (fp8
scaling on the GPU) and the top-k run on the compute stream; a side stream copies results into a
small pool of pinned staging buffers; a collector thread moves them into the segment's host arrays;
a writer pool compresses and writes whole segments. Queues are bounded (staging buffers, segments in
flight), so host memory stays bounded, and the time the GPU loop spends blocked on each is measured:
the progress line names the bottleneck.

Legend: N real tokens of a batch, L captured layers, H hidden, K top-k, T tokens of a segment.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import queue
import socket
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dflash_pipeline import __version__
from dflash_pipeline.errors import ConfigMismatchError, DFlashError
from dflash_pipeline.extract.plan import (
    PlanReader, SegmentPlan, fingerprint_inputs, read_plan, write_plan,
)
from dflash_pipeline.extract.target import (
    DTYPES, TargetRunner, config_hash, env_rank, load_target, resolve_target, text_config, tokenizer_files,
    tokenizer_identity, visible_gpus,
)
from dflash_pipeline.progress import LiveLine, fmt_count, fmt_duration
from dflash_pipeline.schemas.config import ExtractConfig
from dflash_pipeline.schemas.store import StoreMeta, TargetInfo, TokenizerInfo
from dflash_pipeline.store.backends import KV, open_zarr_store
from dflash_pipeline.store.codecs import get_codec, hidden_layer_stats
from dflash_pipeline.store.manifest import committed_segments, rebuild_manifest
from dflash_pipeline.store.writer import SegmentArrays, StoreWriter, now_iso

STAT_ROWS = ("count", "sum", "sumsq", "absmax", "nonfinite", "err_sq", "ref_sq", "max_abs")
MAX_ROWS = {"absmax", "max_abs"}


# ------------------------------------------------------------------------------------------------
# Coordinator
# ------------------------------------------------------------------------------------------------

@dataclass
class Prepared:
    """What the coordinator hands to the workers (picklable)."""

    run_id: str
    target_path: str
    meta: dict[str, Any]
    pending: list[int]
    pending_tokens: dict[int, int]
    needs_target: bool
    plan_tokens: int
    plan_samples: int
    data_report: dict[str, Any] = field(default_factory=dict)


def default_layers(num_layers: int, n: int) -> list[int]:
    from dflash_pipeline.train.model import default_layer_ids

    return default_layer_ids(num_layers, n)


def prepare(cfg: ExtractConfig, line: LiveLine) -> Prepared:
    from transformers import AutoConfig, AutoTokenizer

    from dflash_pipeline.embedded import embedded_sharegpt_path
    from dflash_pipeline.extract import data as data_mod

    if cfg.data:
        data_mod.check_inputs(cfg.data)
    line.say("resolving target ...")
    target_path = resolve_target(cfg.target)
    tconfig = AutoConfig.from_pretrained(target_path)
    tcfg = text_config(tconfig)
    num_layers = tcfg.num_hidden_layers
    layer_ids = list(cfg.layers) if cfg.layers else default_layers(num_layers, cfg.num_features)
    if any(k < 0 or k >= num_layers for k in layer_ids):
        raise DFlashError(f"--layers {layer_ids}: the target has {num_layers} decoder layers (ids 0..{num_layers - 1})")
    tokenizer = AutoTokenizer.from_pretrained(target_path)
    tok_hash, template_hash = tokenizer_identity(tokenizer)
    codec = get_codec(cfg.codec)

    inputs = [Path(p) for p in cfg.data] if cfg.data else [embedded_sharegpt_path()]
    fp_options = {"max_length": cfg.max_length, "limit": cfg.limit, "segment_tokens": cfg.segment_tokens,
                  "tokenizer": tok_hash, "embedded": not cfg.data}
    fingerprint = fingerprint_inputs(inputs, fp_options)
    meta = StoreMeta(
        target=TargetInfo(name_or_path=str(cfg.target or "embedded:SmolLM2-135M-Instruct"),
                          config_hash=config_hash(tconfig), num_layers=num_layers, hidden_size=tcfg.hidden_size,
                          vocab_size=tcfg.vocab_size, dtype=str(DTYPES[cfg.dtype]).removeprefix("torch."),
                          architecture=(tconfig.architectures or [""])[0]),
        tokenizer=TokenizerInfo(hash=tok_hash, vocab_size=len(tokenizer), chat_template_hash=template_hash),
        layer_ids=layer_ids, topk=cfg.topk, codec=codec.name, codec_params=codec.params(),
        extract_config={k: v for k, v in cfg.to_dict().items() if k not in ("quiet", "num_procs", "device")},
        data_fingerprint=fingerprint, tool_version=__version__,
    )
    existing = _existing_plan(cfg.out)
    if existing is not None and existing.fingerprint != fingerprint:
        changed = [f"{k}: store has {existing.options.get(k)!r}, asked for {v!r}"
                   for k, v in fp_options.items() if existing.options.get(k) != v]
        raise ConfigMismatchError(f"{cfg.out}: the store was extracted from other input: "
                                  + ("; ".join(changed) if changed else "the input files' contents differ"))
    writer = StoreWriter(cfg.out, meta)   # creates the store, or refuses a different target/layers/codec
    plan = read_plan(writer.kv)
    if plan is None:
        line.say(f"tokenizing {'embedded ShareGPT conversations' if not cfg.data else ', '.join(cfg.data)} ...")
        workers = cfg.tokenize_workers or min(16, os.cpu_count() or 1)
        samples, report = data_mod.load_samples(cfg.data or None, tokenizer, cfg.max_length, cfg.limit, workers=workers)
        if not samples:
            raise DFlashError("no usable samples in the input (every row was skipped): "
                              + "; ".join(report.summary_lines()[:3]))
        report_dict = {"summary": report.summary_lines(), **_report_counts(report)}
        plan = write_plan(writer.kv, samples, cfg.segment_tokens, fingerprint, report_dict, fp_options)
        del samples
    committed = set(committed_segments(writer.kv))
    pending = [s["segment"] for s in plan.segments if s["segment"] not in committed]
    return Prepared(
        run_id=_dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ") + "-" + uuid.uuid4().hex[:6],
        target_path=str(target_path), meta=writer.meta.to_dict(), pending=pending,
        pending_tokens={s["segment"]: s["tokens"] for s in plan.segments if s["segment"] in set(pending)},
        needs_target=not writer.kv.exists("target/zarr.json"),
        plan_tokens=plan.num_tokens, plan_samples=plan.num_samples, data_report=plan.data_report,
    )


def _existing_plan(url: str):
    from dflash_pipeline.store.backends import is_object_url

    if not is_object_url(url) and not Path(url).is_dir():
        return None
    try:
        return read_plan(KV(open_zarr_store(url, read_only=True)))
    except Exception:
        return None


def _report_counts(report) -> dict[str, Any]:
    """The data report's counters and its first problems (file, row, reason), JSON-ready."""
    import dataclasses

    # Not dataclasses.asdict: it rebuilds a Counter from (key, value) pairs, which counts the pairs.
    d = {f.name: getattr(report, f.name) for f in dataclasses.fields(report)}
    d["skipped_by_reason"] = dict(d.get("skipped_by_reason", {}))
    d["problems"] = [dataclasses.asdict(p) for p in d.get("problems", [])[:50]]
    return d


def num_processes(cfg: ExtractConfig) -> tuple[str, int]:
    """(device kind, worker processes) for a launch without torchrun."""
    gpus = visible_gpus()
    if cfg.device == "cpu" or (cfg.device == "auto" and gpus == 0):
        return "cpu", cfg.num_procs or 1
    if gpus == 0:
        raise DFlashError("--device cuda asked for, but no GPU is visible")
    use = gpus if cfg.gpus == "all" else int(cfg.gpus)
    if use > gpus:
        raise DFlashError(f"--gpus {use}: only {gpus} GPUs are visible")
    if use % cfg.gpus_per_replica:
        raise DFlashError(f"--gpus-per-replica {cfg.gpus_per_replica} does not divide the {use} GPUs used")
    return "cuda", use // cfg.gpus_per_replica


def run_extract(cfg: ExtractConfig) -> dict[str, Any]:
    """Entry point of `dflash extract`. Returns the run record."""
    line = LiveLine(enabled=not cfg.quiet)
    launched = env_rank()
    if launched is None:
        kind, nprocs = num_processes(cfg)
        cfg = _resolve_dtype(cfg, kind)
        prep = prepare(cfg, line)
        t0 = time.time()
        if not prep.pending and not prep.needs_target:
            line.say(f"{cfg.out}: every segment is already committed; nothing to do")
            results = []
        elif nprocs == 1:
            results = [worker_main(cfg, prep, 0, 1, 0, kind, line)]
        else:
            results = _spawn_workers(cfg, prep, nprocs, kind)
        return finish(cfg, prep, results, time.time() - t0, line)
    # Under torchrun / accelerate launch: rank 0 coordinates, every rank works.
    import torch.distributed as dist

    rank, world, local_rank = launched
    kind = "cpu" if (cfg.device == "cpu" or visible_gpus() == 0) else "cuda"
    cfg = _resolve_dtype(cfg, kind)
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    box: list[Any] = [None]
    if rank == 0:
        try:
            box[0] = prepare(cfg, line)
        except DFlashError as e:
            box[0] = e
    dist.broadcast_object_list(box, src=0)
    if isinstance(box[0], Exception):
        raise box[0]
    prep = box[0]
    t0 = time.time()
    res = worker_main(cfg, prep, rank, world, local_rank, kind, line if rank == 0 else LiveLine(enabled=False))
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, res)
    record = finish(cfg, prep, gathered, time.time() - t0, line) if rank == 0 else {}
    dist.barrier()
    return record


def _resolve_dtype(cfg: ExtractConfig, kind: str) -> ExtractConfig:
    import dataclasses

    if cfg.dtype != "auto":
        return cfg
    return dataclasses.replace(cfg, dtype="bf16" if kind == "cuda" else "fp32")


def _spawn_entry(rank: int, cfg: ExtractConfig, prep: Prepared, nprocs: int, kind: str, results) -> None:
    line = LiveLine(enabled=(rank == 0 and not cfg.quiet))
    results.put((rank, worker_main(cfg, prep, rank, nprocs, rank, kind, line)))


def _spawn_workers(cfg: ExtractConfig, prep: Prepared, nprocs: int, kind: str) -> list[dict[str, Any]]:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    mp.start_processes(_spawn_entry, args=(cfg, prep, nprocs, kind, results), nprocs=nprocs, join=True,
                       start_method="spawn")
    out = [None] * nprocs
    while not results.empty():
        r, res = results.get()
        out[r] = res
    return out


def finish(cfg: ExtractConfig, prep: Prepared, results: list[dict[str, Any]], seconds: float,
           line: LiveLine) -> dict[str, Any]:
    from dflash_pipeline.store.stats import compute_stats

    kv = KV(open_zarr_store(cfg.out, read_only=False))
    rebuild_manifest(kv)
    s = compute_stats(cfg.out, sample=1024)
    done_tokens = sum(r.get("tokens", 0) for r in results if r)
    record = {
        "command": "extract", "run_id": prep.run_id, "tool_version": __version__, "finished": now_iso(),
        "host": socket.gethostname(), "config": cfg.to_dict(), "processes": len(results),
        "seconds": seconds, "tokens_this_run": done_tokens,
        "tokens_per_second": done_tokens / seconds if seconds > 0 else 0.0,
        "segments_this_run": sum(r.get("segments", 0) for r in results if r),
        "workers": results, "data_report": prep.data_report,
        "store": {k: s[k] for k in ("samples", "tokens", "supervised_tokens", "segments_committed",
                                     "segments_incomplete", "bytes_on_disk", "bytes_per_token",
                                     "compression_ratio", "codec", "codec_rel_rmse", "nonfinite_values",
                                     "topk_mass_mean", "layer_ids")},
    }
    StoreWriter(cfg.out, StoreMeta.from_dict(prep.meta), create=False).write_run_record(
        f"extract-{prep.run_id}.json", record)
    st = record["store"]
    lines = [
        f"extract done in {fmt_duration(seconds)}: {fmt_count(done_tokens)} tokens this run "
        f"({fmt_count(record['tokens_per_second'])} tok/s over {len(results)} process(es))",
        f"store {cfg.out}: {st['samples']:,} samples, {st['tokens']:,} tokens "
        f"({st['supervised_tokens']:,} supervised), {st['segments_committed']} segments",
        f"  {st['bytes_per_token']:,.0f} bytes/token on disk; hidden states {st['compression_ratio']:.2f}x smaller "
        f"than raw bf16 ({st['codec']}, relative error {st['codec_rel_rmse']:.2%})",
        f"  non-finite feature values: {st['nonfinite_values']:,}; mean top-{prep.meta['topk']} mass "
        f"{st['topk_mass_mean']:.1%}",
    ]
    lines += ["  " + l for l in prep.data_report.get("summary", [])]
    line.done("\n".join(lines))
    return record


# ------------------------------------------------------------------------------------------------
# Worker
# ------------------------------------------------------------------------------------------------

def worker_main(cfg: ExtractConfig, prep: Prepared, rank: int, world: int, local_rank: int, kind: str,
                line: LiveLine) -> dict[str, Any]:
    mine = prep.pending[rank::world]
    write_target = rank == 0 and prep.needs_target
    if not mine and not write_target:
        return {"rank": rank, "segments": 0, "tokens": 0}
    meta = StoreMeta.from_dict(prep.meta)
    if kind == "cuda":
        first = local_rank * cfg.gpus_per_replica
        devices = list(range(first, first + cfg.gpus_per_replica))
        torch.cuda.set_device(devices[0])
        device = torch.device("cuda", devices[0])
    else:
        devices, device = None, torch.device("cpu")
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    line.say(f"loading target {prep.target_path} ({cfg.dtype}) on {len(devices or [0])} {kind} device(s) "
             f"x {world} process(es) ...")
    model = load_target(prep.target_path, DTYPES[cfg.dtype], device, devices)
    runner = TargetRunner(model, meta.layer_ids, meta.topk, cfg.logit_chunk_tokens)
    writer = StoreWriter(cfg.out, meta, create=False)
    if write_target:
        writer.write_target(runner.frozen_tensors(), runner.target_attrs(), tokenizer_files(prep.target_path))
    engine = Engine(runner, writer, cfg, device, rank)
    reporter = Reporter(engine, prep, cfg, rank, world, line, writer.kv)
    reporter.start()
    plans = PlanReader(writer.kv)
    try:
        for seg in mine:
            engine.submit_segment(plans.segment(seg))
        engine.finish()
    finally:
        reporter.stop()
        engine.close()
        runner.close()
    return engine.summary()


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

    def __init__(self, sp: SegmentPlan, L: int, H: int, K: int, codec):
        self.plan = sp
        lengths = np.array([len(x) for x in sp.input_ids], dtype=np.int64)
        self.offsets = np.concatenate([[0], np.cumsum(lengths)])
        T = int(self.offsets[-1])
        self.hidden = np.empty((T, L, H), dtype=codec.storage_dtype)
        self.scale = np.empty((T, L), dtype=np.float32) if codec.has_scale else None
        self.topk_ids = np.empty((T, K), dtype=np.int32)
        self.topk_lps = np.empty((T, K), dtype=np.float16)
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


def make_batches(lengths: list[int], tokens_per_batch: int) -> list[list[int]]:
    """Sample indices grouped into right-padded batches of at most `tokens_per_batch` padded tokens,
    longest first so that rows of a batch have similar lengths (little padding)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    batches, cur, cur_max = [], [], 0
    for i in order:
        m = max(cur_max, lengths[i])
        if cur and m * (len(cur) + 1) > tokens_per_batch:
            batches.append(cur)
            cur, m = [], lengths[i]
        cur.append(i)
        cur_max = m
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
        self.c = {"tokens_gpu": 0, "tokens": 0, "samples": 0, "segments": 0, "bytes": 0,
                  "wait_staging": 0.0, "wait_write": 0.0, "writing": 0}
        self.collector = threading.Thread(target=self._collect, name="dflash-collect", daemon=True)
        self.collector.start()

    # -- GPU loop -------------------------------------------------------------------------------------

    def submit_segment(self, sp: SegmentPlan) -> None:
        self._check()
        t0 = time.time()
        while not self.slots.acquire(timeout=1.0):
            self._check()
        self.c["wait_write"] += time.time() - t0
        asm = SegmentAssembly(sp, self.L, self.H, self.K, self.codec)
        lengths = [len(x) for x in sp.input_ids]
        for batch in make_batches(lengths, self.cfg.tokens_per_batch):
            lens = [lengths[i] for i in batch]
            S = max(lens)
            ids = torch.zeros((len(batch), S), dtype=torch.long)
            for r, i in enumerate(batch):
                ids[r, :lens[r]] = torch.from_numpy(sp.input_ids[i].astype(np.int64))
            out = self.runner.run_batch(ids, lens)
            enc = self.codec.encode(out.hidden_NLH)
            st = hidden_layer_stats(out.hidden_NLH)
            small = torch.stack([st["count"], st["sum"], st["sumsq"], st["absmax"], st["nonfinite"],
                                 enc.err_sq_L, enc.ref_sq_L, enc.max_abs_err_L])
            self._transfer(asm, batch, sum(lens), enc, out, small)
            self.c["tokens_gpu"] += sum(lens)
        self.collect_q.put(("end", asm))

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
                self.slots.release()

    def _write(self, asm: SegmentAssembly) -> None:
        try:
            with self.lock:
                self.c["writing"] += 1
            marker = self.writer.write_segment(asm.plan.segment, asm.arrays())
            with self.lock:
                self.c["segments"] += 1
                self.c["tokens"] += asm.tokens
                self.c["samples"] += len(asm.plan.sample_ids)
                self.c["bytes"] += sum(a["bytes"] for a in marker["arrays"].values())
        except BaseException as e:
            self.error = e
        finally:
            with self.lock:
                self.c["writing"] -= 1
            self.slots.release()

    def _check(self) -> None:
        if self.error is not None:
            raise self.error

    def finish(self) -> None:
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

    def queue_depths(self) -> dict[str, int]:
        return {"staging_busy": self.num_staging - self.free.qsize(), "staging": self.num_staging,
                "collect": self.collect_q.qsize(),
                "segments_in_flight": self.cfg.inflight_segments - self.slots._value,  # noqa: SLF001
                "segments_max": self.cfg.inflight_segments}

    def summary(self) -> dict[str, Any]:
        elapsed = time.time() - self.t_start
        return {"rank": self.rank, "device": str(self.device), "seconds": elapsed,
                "segments": self.c["segments"], "samples": self.c["samples"], "tokens": self.c["tokens"],
                "bytes": self.c["bytes"], "tokens_per_second": self.c["tokens"] / elapsed if elapsed else 0.0,
                "wait_staging_s": self.c["wait_staging"], "wait_write_s": self.c["wait_write"]}


class Reporter:
    """Live progress: each rank publishes a small status object; rank 0 prints the aggregate line."""

    def __init__(self, engine: Engine, prep: Prepared, cfg: ExtractConfig, rank: int, world: int, line: LiveLine, kv: KV):
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
        bound = "write-bound" if ww > 0.1 else "copy-bound" if ws > 0.1 else "gpu-bound"
        overall = gpu_tokens / max(now - self.engine.t_start, 1e-6)
        eta = (self.total - gpu_tokens) / overall if overall > 0 else float("inf")
        segs = sum(r["segments"] for r in ranks)
        return (f"extract  segments {segs}/{len(self.prep.pending)}  tokens {fmt_count(gpu_tokens)}/{fmt_count(self.total)} "
                f"(written {fmt_count(written)})  {fmt_count(rate)} tok/s  "
                f"queues: staging {st['staging_busy']}/{st['staging']} segments {st['segments_in_flight']}/{st['segments_max']}  "
                f"ETA {fmt_duration(eta)}  [{bound}]")
