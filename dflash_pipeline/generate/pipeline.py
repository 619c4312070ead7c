"""`dflash generate`: the target regenerates the assistant turns of the training conversations.

Roles, as in extraction:
- The coordinator (the launching process, or rank 0 under torchrun) checks the inputs, reads the
  conversations once and writes the plan (shards of `--shard-size` conversations) with the run file,
  or, on a re-run, refuses changed settings (naming each difference) and finds the shards still
  missing. Every user error is raised here, before any model is loaded.
- One worker per GPU takes its share of the missing shards (divided by shard number, so a re-run
  with another number of processes completes the same output), keeps `rows` replies in flight on
  the decoding runner (`engine.Engine`) and commits each shard as its last conversation ends.
- The coordinator then writes the run record: target identity, sampling settings, counts, stop
  reasons, throughput.
"""

from __future__ import annotations

import datetime as _dt
import socket
import time
import uuid
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from dflash_pipeline import __version__
from dflash_pipeline.errors import ConfigMismatchError, DFlashError
from dflash_pipeline.extract.readers import NO_PROMPT, DataReport, check_inputs
from dflash_pipeline.generate.conversations import NoPrompt, iter_conversations, reply_slots
from dflash_pipeline.generate.engine import Engine
from dflash_pipeline.generate.output import OutputFolder
from dflash_pipeline.generate.progress import GenerateProgress
from dflash_pipeline.generate.rows import check_target, open_rows
from dflash_pipeline.generate.work import ShardCounts, ShardWork
from dflash_pipeline.launch import Proc, bind_device, launch, launched, plan_processes, process_group
from dflash_pipeline.progress import LiveLine, fmt_count, fmt_duration
from dflash_pipeline.schemas.chat_template import unused_template_kwargs
from dflash_pipeline.schemas.generate import GENERATE_FORMAT, GenerateConfig, output_diff

# Tokens per sequence (prompt + reply), the target's own limit when lower. Training reads at most
# --max-length tokens of a sample (3072 in the paper's recipe; extraction cuts at 2048 by default): a
# longer conversation costs KV cache, hence sequences in flight, for tokens no drafter sees.
DEFAULT_MAX_LENGTH = 4096


@dataclass
class Prepared:
    """What the coordinator hands to the workers (picklable)."""

    run_id: str
    target_path: str
    run: dict[str, Any]              # the run file
    pending: list[int]               # shards without a committed data file
    data_report: dict[str, Any] = field(default_factory=dict)


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def _target_identity(cfg: GenerateConfig, target_path, tokenizer) -> tuple[dict[str, Any], int]:
    from transformers import AutoConfig

    from dflash_pipeline.extract.target import config_hash, text_config, tokenizer_identity

    tconfig = AutoConfig.from_pretrained(target_path)
    tok_hash, template_hash = tokenizer_identity(tokenizer)
    identity = {"name_or_path": str(cfg.target or "embedded:SmolLM2-135M-Instruct"),
                "config_hash": config_hash(tconfig), "architecture": (tconfig.architectures or [""])[0],
                "tokenizer_hash": tok_hash, "chat_template_hash": template_hash}
    return identity, int(getattr(text_config(tconfig), "max_position_embeddings", 0) or DEFAULT_MAX_LENGTH)


def _report_dict(report: DataReport) -> dict[str, Any]:
    import dataclasses

    # summary_lines' first two lines count tokens of tokenized samples; nothing is tokenized here.
    summary = [f"rows read: {report.num_rows_read:,}; conversations: {report.num_samples:,}"]
    return {"summary": summary + report.summary_lines()[2:], "num_rows_read": report.num_rows_read,
            "num_conversations": report.num_samples, "num_skipped": report.num_skipped,
            "skipped_by_reason": dict(report.skipped_by_reason),
            "problems": [dataclasses.asdict(p) for p in report.problems[:50]]}


def _plan_shards(cfg: GenerateConfig, folder: OutputFolder, run: dict[str, Any], line: LiveLine) -> dict[str, Any]:
    """Read the input once, write the plan shards and the run file; returns the run file."""
    what = ", ".join(cfg.data) if cfg.data else "the embedded ShareGPT conversations"
    line.say(f"reading {what} ...")
    report = DataReport()
    shards: list[list] = [[]]
    for conv in iter_conversations(cfg.data or None, "train", report):
        try:
            reply_slots(conv.messages, cfg.turns)
        except NoPrompt as e:  # a row that is a conversation, but not one a target can answer
            report.num_samples -= 1
            report.skip(conv.file, conv.row, NO_PROMPT, str(e))
            continue
        if len(shards[-1]) == cfg.shard_size:
            shards.append([])
        shards[-1].append(conv)
        if cfg.limit is not None and report.num_samples >= cfg.limit:
            break
    if not shards[0]:
        raise DFlashError("no usable conversations in the input (every row was skipped): "
                          + "; ".join(report.summary_lines()[:3]))
    run["shards"] = [{"shard": k, "conversations": len(s)} for k, s in enumerate(shards)]
    run["data_report"] = _report_dict(report)
    folder.write_plan(shards, run)
    return run


def prepare(cfg: GenerateConfig, line: LiveLine) -> tuple[GenerateConfig, Prepared]:
    """Check inputs and settings, plan (or check the existing plan); the resolved config and the plan."""
    from transformers import AutoTokenizer

    from dflash_pipeline.embedded import embedded_sharegpt_path
    from dflash_pipeline.extract.plan import fingerprint_inputs
    from dflash_pipeline.extract.target import resolve_target

    if cfg.data:
        check_inputs(cfg.data)
    line.say("resolving target ...")
    target_path = resolve_target(cfg.target)
    check_target(target_path)
    tokenizer = AutoTokenizer.from_pretrained(target_path)
    target, max_positions = _target_identity(cfg, target_path, tokenizer)
    if cfg.max_length is None:
        cfg = replace(cfg, max_length=min(max_positions, DEFAULT_MAX_LENGTH))
    for key in unused_template_kwargs(tokenizer, cfg.chat_template_kwargs):
        line.say(f"warning: --chat-template-kwargs '{key}' is not read by the target's chat template; it has no effect")
    inputs = [Path(p) for p in cfg.data] if cfg.data else [embedded_sharegpt_path()]
    fingerprint = fingerprint_inputs(inputs, {"embedded": not cfg.data, "split": "train"})
    run = {"format": GENERATE_FORMAT, "tool_version": __version__, "created": _now(), "target": target,
           "settings": cfg.output_settings(), "data": {"inputs": [str(p) for p in inputs], "fingerprint": fingerprint}}
    folder = OutputFolder(cfg.out)
    folder.remove_leftovers()
    existing = folder.run_file()
    if existing is None:
        run = _plan_shards(cfg, folder, run, line)
    else:
        _check_same_run(cfg.out, existing, run)
        run = existing
    done = folder.committed(cfg.format)
    pending = [s["shard"] for s in run["shards"] if s["shard"] not in done]
    run_id = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ") + "-" + uuid.uuid4().hex[:6]
    return cfg, Prepared(run_id, str(target_path), run, pending, run.get("data_report", {}))


def _check_same_run(out: str, saved: dict[str, Any], now: dict[str, Any]) -> None:
    diff = output_diff(saved["settings"], now["settings"])
    for key in ("config_hash", "tokenizer_hash"):
        if saved["target"][key] != now["target"][key]:
            diff.append(f"target {key}: the output has {saved['target'][key][:12]}, this run's target has "
                        f"{now['target'][key][:12]} ({now['target']['name_or_path']})")
    if saved["data"]["fingerprint"] != now["data"]["fingerprint"]:
        diff.append("input data: the input files' contents or names differ")
    if diff:
        raise ConfigMismatchError(f"{out}: was generated with other settings: " + "; ".join(diff)
                                  + "; use another --out or the same settings")


# ------------------------------------------------------------------------------------------------
# Worker
# ------------------------------------------------------------------------------------------------

def worker_main(proc: Proc, cfg: GenerateConfig, prep: Prepared, line: LiveLine) -> dict[str, Any]:
    """Generate this process's share of the missing shards (by shard number); its counts and engine statistics."""
    from transformers import AutoTokenizer

    from dflash_pipeline.eval.models import stop_token_ids
    from dflash_pipeline.extract.chat import ChatTokenizer
    from dflash_pipeline.extract.target import DTYPES, load_target

    line = line if proc.is_main else LiveLine(enabled=False)
    mine = prep.pending[proc.rank::proc.world]
    if not mine:
        return {"rank": proc.rank, "shards": 0, "counts": ShardCounts().to_dict(), "engine": {}}
    device = bind_device(proc)
    kind, world = proc.kind, proc.world
    line.say(f"loading target {prep.target_path} ({cfg.dtype}) on {kind} x {world} process(es) ...")
    model = load_target(prep.target_path, DTYPES[cfg.dtype], device, quiet=cfg.quiet)
    tokenizer = AutoTokenizer.from_pretrained(prep.target_path)
    stop_ids = stop_token_ids(tokenizer, model)
    total = sum(s["conversations"] for s in prep.run["shards"] if s["shard"] in set(mine))
    rows = open_rows(model, cfg, device, line, total)
    folder = OutputFolder(cfg.out)
    work = ShardWork(
        mine, folder.read_plan, lambda k, rows_, counts: folder.commit_shard(k, rows_, counts.to_dict(), cfg.format),
        ChatTokenizer(tokenizer, cfg.chat_template_kwargs).prompt,   # rendered and tokenized as extraction does
        lambda ids: tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False),
        stop_ids=stop_ids, capacity=rows.capacity, max_new_tokens=cfg.max_new_tokens, seed=cfg.seed, turns=cfg.turns,
    )
    progress = GenerateProgress(line, work, total, rows.num_rows, world)
    engine = Engine(rows, stop_ids=sorted(stop_ids), temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p)
    try:
        stats = engine.run(work, on_step=progress.update)
    finally:
        rows.close()   # the runner gives the model its own attention back
    progress.done()
    # the attention kernels the steps ran: in bf16 they round differently, so a record says which produced its replies
    return {"rank": proc.rank, "shards": len(work.committed), "counts": work.total.to_dict(), "engine": stats.to_dict(),
            "rows": rows.num_rows, "capacity": rows.capacity, "compile": rows.compiled,
            "decode_attention": rows.runner.decode_attention}


# ------------------------------------------------------------------------------------------------
# Launch and the run record
# ------------------------------------------------------------------------------------------------

def run_generate(cfg: GenerateConfig) -> dict[str, Any]:
    """Entry point of `dflash generate`. Returns the run record."""
    line = LiveLine(enabled=not cfg.quiet)
    proc = launched(cfg.device)
    if proc is not None:
        return _run_launched(cfg, proc, line)
    kind, nprocs = plan_processes(cfg.device, cfg.gpus, cfg.num_procs)
    cfg, prep = prepare(_resolve_dtype(cfg, kind), line)
    t0 = time.time()
    if not prep.pending:
        line.say(f"{cfg.out}: every shard is already generated; nothing to do")
        results = []
    else:
        results = launch(worker_main, (cfg, prep, line), nprocs=nprocs, kind=kind)
    return finish(cfg, prep, results, time.time() - t0, line)


def _resolve_dtype(cfg: GenerateConfig, kind: str) -> GenerateConfig:
    return cfg if cfg.dtype != "auto" else replace(cfg, dtype="bf16" if kind == "cuda" else "fp32")


def _run_launched(cfg: GenerateConfig, proc: Proc, line: LiveLine) -> dict[str, Any]:
    """Under torchrun / accelerate launch: rank 0 plans, every rank works, rank 0 writes the record."""
    import torch.distributed as dist

    with process_group("gloo"):  # for the coordinator's objects only: the workers never communicate
        box: list[Any] = [None]
        if proc.is_main:
            try:
                box[0] = prepare(_resolve_dtype(cfg, proc.kind), line)
            except DFlashError as e:
                box[0] = e
        dist.broadcast_object_list(box, src=0)
        if isinstance(box[0], Exception):
            raise box[0]
        cfg, prep = box[0]
        t0 = time.time()
        gathered: list[Any] = [None] * proc.world
        dist.all_gather_object(gathered, worker_main(proc, cfg, prep, line))
        record = finish(cfg, prep, gathered, time.time() - t0, line) if proc.is_main else {}
        dist.barrier()
    return record


def finish(cfg: GenerateConfig, prep: Prepared, results: list[dict[str, Any]], seconds: float,
           line: LiveLine) -> dict[str, Any]:
    """The run record: this run's counts and throughput, and the totals over every committed shard."""
    folder = OutputFolder(cfg.out)
    this_run = ShardCounts()
    for r in results:
        this_run.add(ShardCounts.from_dict(r["counts"]))
    tokens = sum(r["engine"].get("tokens", 0) for r in results)
    committed = sorted(folder.committed(cfg.format))
    total = ShardCounts()
    for c in folder.shard_counts(committed):
        total.add(ShardCounts.from_dict(c))
    planned = len(prep.run["shards"])
    record = {
        "command": "generate", "run_id": prep.run_id, "tool_version": __version__, "finished": _now(),
        "host": socket.gethostname(), "config": cfg.to_dict(), "target": prep.run["target"],
        "settings": prep.run["settings"], "processes": len(results), "seconds": seconds,
        "tokens_this_run": tokens, "tokens_per_second": tokens / seconds if seconds > 0 else 0.0,
        "shards_this_run": sum(r["shards"] for r in results), "this_run": this_run.to_dict(),
        "shards_committed": len(committed), "shards_planned": planned, "total": total.to_dict(),
        "workers": results, "data_report": prep.data_report,
    }
    folder.write_run_record(prep.run_id, record)
    line.done("\n".join(summary_lines(record)))
    if len(committed) == planned and total.conversations and not total.rows:
        dropped = ", ".join(f"{k}: {v:,}" for k, v in total.dropped.items()) or "none"
        raise DFlashError(f"{cfg.out}: no conversation kept: all {total.conversations:,} were dropped ({dropped}); "
                          "replies that decode to no text mean the target emits only special or end tokens: check "
                          "the target and its chat template before extracting")
    return record


def summary_lines(record: dict[str, Any]) -> list[str]:
    t = record["total"]
    replies = max(t["replies"], 1)
    finish = ", ".join(f"{k} {v / replies:.1%}" for k, v in sorted(t["finish"].items(), key=lambda kv: -kv[1]))
    lines = [
        f"generate done in {fmt_duration(record['seconds'])}: {fmt_count(record['tokens_this_run'])} tokens this run "
        f"({fmt_count(record['tokens_per_second'])} tok/s over {record['processes']} process(es))",
        f"output {record['config']['out']}: {record['shards_committed']}/{record['shards_planned']} shards, "
        f"{t['rows']:,} conversations, {t['replies']:,} replies (mean {t['reply_tokens'] / replies:.0f} tokens; "
        f"{finish or 'none'}; {t['truncated']:,} truncated)",
    ]
    if t["empty_replies"] or t["dropped"]:
        dropped = ", ".join(f"{k}: {v:,}" for k, v in t["dropped"].items()) or "none"
        lines.append(f"  empty replies dropped: {t['empty_replies']:,}; conversations dropped: {dropped}")
    lines += ["  " + s for s in record["data_report"].get("summary", [])]
    return lines
