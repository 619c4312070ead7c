"""`dflash extract`: run the target on every GPU and fill the feature store.

Roles:
- The coordinator (the launching process, or rank 0 under torchrun) checks the inputs, tokenizes
  them once, writes the plan and the store's root metadata, and at the end rebuilds the manifest and
  writes the run record. Every user error is raised here, before any GPU work.
- One worker per GPU (or per `--gpus-per-replica` GPUs) takes its share of the uncommitted segments
  (divided by segment id, so a restart with another number of processes completes the same store),
  runs the target through `engine.Engine` (the GPU never waits on storage), and commits segments.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import socket
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dflash_pipeline import __version__
from dflash_pipeline.errors import ConfigMismatchError, DFlashError
from dflash_pipeline.extract.engine import Engine, Reporter, make_batches  # noqa: F401 (make_batches: API)
from dflash_pipeline.extract.plan import (
    PlanReader, fingerprint_inputs, read_plan, write_plan,
)
from dflash_pipeline.extract.target import (
    DTYPES, TargetRunner, config_hash, load_target, resolve_target, text_config, tokenizer_files, tokenizer_identity,
)
from dflash_pipeline.launch import (
    Proc, bind_device, launch, launched, local_world_size, plan_processes, process_gpus, process_group,
)
from dflash_pipeline.method import default_layer_ids
from dflash_pipeline.progress import LiveLine, fmt_count, fmt_duration
from dflash_pipeline.schemas.chat_template import unused_template_kwargs
from dflash_pipeline.schemas.config import ExtractConfig
from dflash_pipeline.schemas.store import StoreMeta, TargetInfo, TokenizerInfo
from dflash_pipeline.store.backends import KV, open_zarr_store
from dflash_pipeline.store.codecs import HiddenCodec, get_codec
from dflash_pipeline.store.manifest import committed_segments, read_commits, rebuild_manifest
from dflash_pipeline.store.shards import available_cpus, set_pool_threads
from dflash_pipeline.store.writer import StoreWriter, now_iso



# ------------------------------------------------------------------------------------------------
# Coordinator
# ------------------------------------------------------------------------------------------------

@dataclass
class Prepared:
    """What the coordinator hands to the workers (picklable)."""

    run_id: str
    target_path: str
    meta: dict[str, Any]
    codec: HiddenCodec            # built once, from the config; every writer (thread or process) uses it
    pending: list[int]
    pending_tokens: dict[int, int]
    needs_target: bool
    plan_tokens: int
    plan_samples: int
    data_report: dict[str, Any] = field(default_factory=dict)


def prepare(cfg: ExtractConfig, line: LiveLine) -> Prepared:
    from transformers import AutoConfig, AutoTokenizer

    from dflash_pipeline.embedded import embedded_sharegpt_path
    from dflash_pipeline.extract.readers import check_inputs
    from dflash_pipeline.extract.samples import load_samples

    data_files, provenance = _generated_inputs(cfg.data)   # generate output folders -> their shard files
    cfg.chat_template_kwargs = _template_kwargs(cfg.chat_template_kwargs, provenance, line)
    if data_files:
        check_inputs(data_files)
    line.say("resolving target ...")
    target_path = resolve_target(cfg.target)
    tconfig = AutoConfig.from_pretrained(target_path)
    tcfg = text_config(tconfig)
    num_layers = tcfg.num_hidden_layers
    layer_ids = list(cfg.layers) if cfg.layers else default_layer_ids(num_layers, cfg.num_features)
    if any(k < 0 or k >= num_layers for k in layer_ids):
        raise DFlashError(f"--layers {layer_ids}: the target has {num_layers} decoder layers (ids 0..{num_layers - 1})")
    tokenizer = AutoTokenizer.from_pretrained(target_path)
    tok_hash, template_hash = tokenizer_identity(tokenizer)
    codec = get_codec(cfg.codec)

    _mark_same_target(provenance, config_hash(tconfig), tok_hash, line)
    inputs = [Path(p) for p in data_files] if data_files else [embedded_sharegpt_path()]
    fp_options = {"max_length": cfg.max_length, "limit": cfg.limit, "segment_tokens": cfg.segment_tokens,
                  "tokenizer": tok_hash, "embedded": not cfg.data}
    if cfg.chat_template_kwargs:  # only when given, so that stores planned before the option still resume
        fp_options["chat_template_kwargs"] = cfg.chat_template_kwargs
    for key in unused_template_kwargs(tokenizer, cfg.chat_template_kwargs):
        line.say(f"warning: --chat-template-kwargs '{key}' is not read by the target's chat template; "
                 "it has no effect")
    fingerprint = fingerprint_inputs(inputs, fp_options)
    meta = StoreMeta(
        target=TargetInfo(name_or_path=str(cfg.target or "embedded:SmolLM2-135M-Instruct"),
                          config_hash=config_hash(tconfig), num_layers=num_layers, hidden_size=tcfg.hidden_size,
                          vocab_size=tcfg.vocab_size, dtype=str(DTYPES[cfg.dtype]).removeprefix("torch."),
                          architecture=(tconfig.architectures or [""])[0]),
        tokenizer=TokenizerInfo(hash=tok_hash, vocab_size=len(tokenizer), chat_template_hash=template_hash),
        layer_ids=layer_ids, topk=cfg.topk, codec=codec.name, codec_params=codec.params(),
        extract_config={k: v for k, v in cfg.to_dict().items() if k not in ("quiet", "num_procs", "device")},
        data_fingerprint=fingerprint, data_provenance=provenance, tool_version=__version__,
    )
    existing = _existing_plan(cfg.out)
    if existing is not None and existing.fingerprint != fingerprint:
        changed = [f"{k}: store has {_plan_option(existing.options, k)!r}, asked for {_plan_option(fp_options, k)!r}"
                   for k in {**fp_options, **existing.options}
                   if _plan_option(existing.options, k) != _plan_option(fp_options, k)]
        raise ConfigMismatchError(f"{cfg.out}: the store was extracted from other input: "
                                  + ("; ".join(changed) if changed else "the input files' contents differ"))
    writer = StoreWriter(cfg.out, meta, codec=codec)   # creates the store, or refuses a different target/layers/codec
    plan = read_plan(writer.kv)
    if plan is None:
        line.say(f"tokenizing {'embedded ShareGPT conversations' if not cfg.data else ', '.join(cfg.data)} ...")
        workers = cfg.tokenize_workers or min(16, os.cpu_count() or 1)
        samples, report = load_samples(data_files or None, tokenizer, cfg.max_length, cfg.limit, workers=workers,
                                       template_kwargs=cfg.chat_template_kwargs)
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
        target_path=str(target_path), meta=writer.meta.to_dict(), codec=codec, pending=pending,
        pending_tokens={s["segment"]: s["tokens"] for s in plan.segments if s["segment"] in set(pending)},
        needs_target=not writer.kv.exists("target/zarr.json"),
        plan_tokens=plan.num_tokens, plan_samples=plan.num_samples, data_report=plan.data_report,
    )


def _generated_inputs(paths: list[str]) -> tuple[list[str], list[dict[str, Any]]]:
    from dflash_pipeline.schemas.generate import expand_generated_inputs

    try:
        return expand_generated_inputs(list(paths))
    except ValueError as e:
        raise DFlashError(str(e)) from None


def _mark_same_target(provenance: list[dict[str, Any]], target_hash: str, tok_hash: str, line: LiveLine) -> None:
    """Record whether each generated input's replies come from this target; say so when they do not."""
    for p in provenance:
        by = p["generated_by"]
        p["same_target"] = by["config_hash"] == target_hash and by["tokenizer_hash"] == tok_hash
        if not p["same_target"]:
            line.say(f"warning: {p['folder']} was generated by another target ({by['name_or_path']}, config "
                     f"{by['config_hash'][:12]}): the drafter learns that target's replies, not this one's")


def _template_kwargs(given: dict[str, Any], provenance: list[dict[str, Any]], line: LiveLine) -> dict[str, Any]:
    """The chat-template variables to mask with: the ones `dflash generate` rendered its replies with, so
    that a reply generated with thinking off is not masked as if thinking were on. Given ones must match."""
    used = {json.dumps(p["generation"].get("chat_template_kwargs") or {}, sort_keys=True): p for p in provenance}
    if not used:
        return given
    if len(used) > 1:
        raise DFlashError("the generated inputs were rendered with different --chat-template-kwargs ("
                          + "; ".join(f"{p['folder']}: {k}" for k, p in used.items()) + "): extract them separately")
    (text, p), = used.items()
    generated = json.loads(text)
    if given and given != generated:
        raise DFlashError(f"--chat-template-kwargs {json.dumps(given, sort_keys=True)} differs from the {text} that "
                          f"{p['folder']} was generated with: the loss mask must follow the template the replies "
                          "were written under (omit the option to use the generated one)")
    if generated and not given:
        line.say(f"chat template kwargs {text}: as {p['folder']} was generated")
    return generated


def _plan_option(options: dict[str, Any], key: str) -> Any:
    """One option of a plan's fingerprint; chat_template_kwargs is left out of it when empty."""
    return options.get(key, {} if key == "chat_template_kwargs" else None)


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


def run_extract(cfg: ExtractConfig) -> dict[str, Any]:
    """Entry point of `dflash extract`. Returns the run record."""
    from dflash_pipeline.extract.profiling import ProfileWindow

    ProfileWindow.from_env()  # a malformed DFLASH_PROFILE fails here, before any work
    line = LiveLine(enabled=not cfg.quiet)
    proc = launched(cfg.device)
    if proc is not None:
        return _run_launched(cfg, proc, line)
    kind, nprocs = plan_processes(cfg.device, cfg.gpus, cfg.num_procs, cfg.gpus_per_replica)
    cfg = _resolve_dtype(cfg, kind)
    prep = prepare(cfg, line)
    t0 = time.time()
    if not prep.pending and not prep.needs_target:
        line.say(f"{cfg.out}: every segment is already committed; nothing to do")
        results = []
    else:
        results = launch(worker_main, (cfg, prep, line), nprocs=nprocs, kind=kind)
    return finish(cfg, prep, results, time.time() - t0, line)


def _run_launched(cfg: ExtractConfig, proc: Proc, line: LiveLine) -> dict[str, Any]:
    """Under torchrun / accelerate launch: rank 0 coordinates, every rank works."""
    import torch.distributed as dist

    cfg = _resolve_dtype(cfg, proc.kind)
    with process_group("gloo"):  # for the coordinator's objects only: the workers never communicate
        box: list[Any] = [None]
        if proc.is_main:
            try:
                box[0] = prepare(cfg, line)
            except DFlashError as e:
                box[0] = e
        dist.broadcast_object_list(box, src=0)
        if isinstance(box[0], Exception):
            raise box[0]
        prep = box[0]
        t0 = time.time()
        res = worker_main(proc, cfg, prep, line)
        gathered: list[Any] = [None] * proc.world
        dist.all_gather_object(gathered, res)
        record = finish(cfg, prep, gathered, time.time() - t0, line) if proc.is_main else {}
        dist.barrier()
    return record


def _resolve_dtype(cfg: ExtractConfig, kind: str) -> ExtractConfig:
    import dataclasses

    if cfg.dtype != "auto":
        return cfg
    return dataclasses.replace(cfg, dtype="bf16" if kind == "cuda" else "fp32")


def finish(cfg: ExtractConfig, prep: Prepared, results: list[dict[str, Any]], seconds: float,
           line: LiveLine) -> dict[str, Any]:
    from dflash_pipeline.store.stats import compute_stats, own_text_hint

    kv = KV(open_zarr_store(cfg.out, read_only=False))
    commits = read_commits(kv, committed_segments(kv))   # read once: for the manifest and the summary
    rebuild_manifest(kv, commits)
    s = compute_stats(cfg.out, sample=1024, commits=commits)
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
                                     "topk_mass_mean", "target_agreement", "layer_ids")},
    }
    StoreWriter(cfg.out, StoreMeta.from_dict(prep.meta), codec=prep.codec, create=False).write_run_record(
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
    agree = (st.get("target_agreement") or {}).get("share")
    if agree is not None:
        hint = own_text_hint(agree)
        lines.append(f"  the target's own text: {agree:.1%} of supervised tokens are its top-1 choice"
                     + (f"; {hint}" if hint else ""))
    lines += ["  " + l for l in prep.data_report.get("summary", [])]
    line.done("\n".join(lines))
    return record


# ------------------------------------------------------------------------------------------------
# Worker
# ------------------------------------------------------------------------------------------------

def worker_main(proc: Proc, cfg: ExtractConfig, prep: Prepared, line: LiveLine) -> dict[str, Any]:
    """One extraction process: its share of the pending segments (by segment id), through the target."""
    rank, world, kind = proc.rank, proc.world, proc.kind
    line = line if proc.is_main else LiveLine(enabled=False)
    mine = prep.pending[rank::world]
    write_target = rank == 0 and prep.needs_target
    if not mine and not write_target:
        return {"rank": rank, "segments": 0, "tokens": 0}
    meta = StoreMeta.from_dict(prep.meta)
    # This process's share of the node's cores for compression, one core left for the thread that
    # drives the GPU.
    local = local_world_size(world)
    set_pool_threads(max(2, available_cpus() // max(1, local) - (1 if kind == "cuda" else 0)))
    devices = process_gpus(proc, cfg.gpus_per_replica) if kind == "cuda" else None
    device = bind_device(proc, cfg.gpus_per_replica)
    line.say(f"loading target {prep.target_path} ({cfg.dtype}) on {len(devices or [0])} {kind} device(s) "
             f"x {world} process(es) ...")
    model = load_target(prep.target_path, DTYPES[cfg.dtype], device, devices, quiet=cfg.quiet)
    runner = TargetRunner(model, meta.layer_ids, meta.topk, cfg.logit_chunk_tokens)
    writer = StoreWriter(cfg.out, meta, codec=prep.codec, create=False)
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


