"""`dflash train`: the store streamed into DFlash drafter trainers on every GPU.

The target is never loaded: its frozen embedding and LM head come from the store's target/. One process
per GPU (spawned here, or given by torchrun / accelerate launch), DDP over the drafter only, bf16
autocast with fp32 master weights and AdamW, cosine schedule with warmup, clipping, accumulation,
optional EMA. Checkpoints go out periodically, on SIGTERM/SIGINT and on `--stop-after`; `--resume`
continues exactly (same anchors, noise and batches) and refuses another store or config.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import socket
import time
from pathlib import Path
from typing import Any

import torch

from dflash_pipeline import __version__
from dflash_pipeline.errors import DFlashError
from dflash_pipeline.extract.target import env_rank, visible_gpus
from dflash_pipeline.progress import JsonlLog, LiveLine, fmt_count, fmt_duration
from dflash_pipeline.schemas.config import TrainConfig
from dflash_pipeline.schemas.store import LAYER_CONVENTION
from dflash_pipeline.store.reader import StoreReader
from dflash_pipeline.train.blocks import default_gamma
from dflash_pipeline.train.checkpoint import check_resume, latest_checkpoint, load_checkpoint, save_checkpoint
from dflash_pipeline.train.loader import StreamingLoader
from dflash_pipeline.train.plan import LoaderState, store_fingerprint
from dflash_pipeline.train.evaluate import evaluate
from dflash_pipeline.train.model import DFlashDrafter, DrafterConfig, choose_mask_token_id, init_drafter_weights
from dflash_pipeline.train.step import (NOISE_STREAM, Frozen, draw_anchors, flops_from_totals, run_blocks,
                                        step_generator)

PEAK_BF16_FLOPS = 790e12   # measured bf16 matmul peak of one H200 (see BENCHMARKS.md)


def drafter_config_for(cfg: TrainConfig, reader: StoreReader) -> DrafterConfig:
    """A drafter of the target's width, from the target config stored in the store."""
    attrs = reader.target_config()
    tc = attrs["config"]
    tc = tc.get("text_config", tc) if isinstance(tc.get("text_config"), dict) else tc
    H = attrs["hidden_size"]
    heads = tc.get("num_attention_heads")
    layer_ids = list(cfg.layers) if cfg.layers else list(reader.meta.layer_ids)
    missing = [k for k in layer_ids if k not in reader.meta.layer_ids]
    if missing:
        raise DFlashError(f"--layers {missing} are not in the store (it has {reader.meta.layer_ids})")
    tokenizer = reader.load_tokenizer()
    mask_id = pick_mask_token(cfg.mask_token_id, tokenizer, attrs["vocab_size"])
    rope = tc.get("rope_theta") or (tc.get("rope_parameters") or {}).get("rope_theta") or 10000.0
    layer_types = ["sliding_attention" if i in cfg.swa_layers else "full_attention" for i in range(cfg.num_layers)]
    return DrafterConfig(
        hidden_size=H, intermediate_size=tc.get("intermediate_size", 4 * H), num_layers=cfg.num_layers,
        num_heads=heads, num_kv_heads=tc.get("num_key_value_heads") or heads,
        head_dim=tc.get("head_dim") or H // heads, vocab_size=attrs["vocab_size"], block_size=cfg.block_size,
        mask_token_id=mask_id, target_layer_ids=layer_ids, num_target_layers=attrs["num_layers"],
        rms_norm_eps=attrs.get("rms_norm_eps") or tc.get("rms_norm_eps") or 1e-6, rope_theta=float(rope),
        max_position_embeddings=tc.get("max_position_embeddings", 32768), layer_types=layer_types,
        sliding_window=cfg.sliding_window,
    )


def pick_mask_token(configured: int | None, tokenizer, embedding_rows: int) -> int:
    """The method's rule (config, tokenizer's mask token, first free embedding row); for targets
    whose vocabulary fills the table (SmolLM2), a special token that the chat template never emits."""
    try:
        return choose_mask_token_id(configured, tokenizer, embedding_rows)
    except ValueError as e:
        template = str(tokenizer.chat_template or "")
        used = {tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id, tokenizer.unk_token_id}
        added = sorted(getattr(tokenizer, "added_tokens_decoder", {}).items())
        for tid, tok in reversed(added):
            if tok.special and tok.content not in template and tid not in used and 0 <= tid < embedding_rows:
                return int(tid)
        raise DFlashError(f"{e}; pass --mask-token-id") from None


def check_store_fits(cfg: TrainConfig, reader: StoreReader) -> None:
    """Refuse, before training starts, a store without what the config needs."""
    if reader.meta.layer_convention != LAYER_CONVENTION:
        # Tools disagree by one on what "layer k" means; features of the wrong layers train a drafter
        # that looks fine and fails at serving time.
        raise DFlashError(f"{cfg.store}: layer ids use the convention '{reader.meta.layer_convention}', this "
                          f"trainer and the DFlash export use '{LAYER_CONVENTION}' (HF hidden_states[k+1])")
    if cfg.kl_weight > 0 and reader.meta.topk == 0:
        raise DFlashError(f"{cfg.store}: --kl-weight needs the teacher's top-k, and this store has none "
                          "(extracted with --topk 0)")
    if not reader.kv.exists("target/zarr.json"):
        raise DFlashError(f"{cfg.store}: the store has no target/ tensors (frozen embedding and LM head); "
                          "it was not written by a complete `dflash extract`")
    if reader.num_samples == 0:
        raise DFlashError(f"{cfg.store}: the store has no committed samples")


def frozen_tensors(reader: StoreReader, device: torch.device, dtype: torch.dtype) -> Frozen:
    embed = reader.target_tensor("embed").to(device=device, dtype=dtype)
    head = reader.target_tensor("lm_head").to(device=device, dtype=dtype) if reader.has_target_tensor("lm_head") else embed
    attrs = reader.target_config()
    return Frozen(embed, head, float(attrs.get("embedding_scale") or 1.0))


class _StopFlag:
    """`requested` by a signal on this rank; `set` once every rank agrees to stop after this step."""

    def __init__(self):
        self.requested = False
        self.set = False
        self.signal = None

    def __call__(self, signum, frame):
        self.requested = True
        self.signal = signum


def _lr_at(cfg: TrainConfig, step: int, total: int) -> float:
    warm = int(cfg.warmup_ratio * total)
    if step < warm:
        return cfg.lr * (step + 1) / warm
    progress = (step - warm) / max(1, total - warm)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def run_train(cfg: TrainConfig) -> dict[str, Any]:
    """Entry point of `dflash train`. Returns the final summary (on rank 0)."""
    launched = env_rank()
    if launched is not None:
        kind = "cpu" if (cfg.device == "cpu" or visible_gpus() == 0) else "cuda"
        return train_rank(cfg, *launched, kind)
    gpus = visible_gpus()
    if cfg.device == "cpu" or (cfg.device == "auto" and gpus == 0):
        kind, n = "cpu", cfg.num_procs or 1
    else:
        if gpus == 0:
            raise DFlashError("--device cuda asked for, but no GPU is visible")
        kind, n = "cuda", gpus if cfg.gpus == "all" else int(cfg.gpus)
        if n > gpus:
            raise DFlashError(f"--gpus {n}: only {gpus} GPUs are visible")
    check_store_fits(cfg, StoreReader(cfg.store))   # user errors before any process starts
    if n == 1:
        return train_rank(cfg, 0, 1, 0, kind)
    import torch.multiprocessing as mp

    port = _free_port()
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    mp.start_processes(_spawn_entry, args=(cfg, n, kind, port, results), nprocs=n, join=True, start_method="spawn")
    out: dict[str, Any] = {}
    while not results.empty():
        rank, res = results.get()
        if rank == 0:
            out = res
    return out


def _spawn_entry(rank: int, cfg: TrainConfig, world: int, kind: str, port: int, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    results.put((rank, train_rank(cfg, rank, world, rank, kind)))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train_rank(cfg: TrainConfig, rank: int, world: int, local_rank: int, kind: str) -> dict[str, Any]:
    import torch.distributed as dist

    if kind == "cuda":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    owns_group = world > 1 and not dist.is_initialized()
    if owns_group:
        if kind == "cuda":
            dist.init_process_group("nccl", device_id=device)
        else:
            dist.init_process_group("gloo")
    line = LiveLine(enabled=rank == 0 and not cfg.quiet)
    run_dir = Path(cfg.out)
    reader = StoreReader(cfg.store)
    check_store_fits(cfg, reader)
    line.say(f"opening store {cfg.store}: {reader.num_samples:,} samples, {reader.num_tokens:,} tokens, "
             f"layers {reader.meta.layer_ids}, codec {reader.meta.codec}")
    dcfg = drafter_config_for(cfg, reader)
    gamma = cfg.gamma if cfg.gamma is not None else default_gamma(cfg.block_size)
    compute_dtype = torch.bfloat16 if kind == "cuda" else torch.float32
    frozen = frozen_tensors(reader, device, compute_dtype)
    torch.manual_seed(cfg.seed)
    model = DFlashDrafter(dcfg)
    model.checkpoint_layers = dcfg.num_layers if cfg.activation_checkpointing else min(cfg.checkpoint_layers,
                                                                                        dcfg.num_layers)
    init_drafter_weights(model, generator=torch.Generator().manual_seed(cfg.seed))
    model.compile_kernels = None if cfg.compile else False
    model.to(device)
    n_params = sum(p.numel() for p in model.parameters())
    line.say(f"drafter: {dcfg.num_layers} layers, hidden {dcfg.hidden_size}, {n_params / 1e6:.1f}M trainable "
             f"parameters; block {dcfg.block_size}, features from target layers {dcfg.target_layer_ids}, "
             f"mask token {dcfg.mask_token_id}; {world} process(es) on {kind}")
    if kind == "cuda":
        line.say("the first step compiles FlexAttention" + (" and the fused kernels" if cfg.compile else "")
                 + " (about a minute, once per process; cached on disk for later runs)")
    # gradient_as_bucket_view: gradients live in the all-reduce buckets (no copy into them each step,
    # and no second copy of the gradients: 4 GB for a Qwen3-8B-sized drafter).
    ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[local_rank] if kind == "cuda" else None,
                                                    gradient_as_bucket_view=True,
                                                    bucket_cap_mb=cfg.ddp_bucket_mb) if world > 1 else model
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay,
                            fused=kind == "cuda")
    loader = StreamingLoader(reader, layers=dcfg.target_layer_ids, rank=rank, world=world, seed=cfg.seed,
                             row_len=cfg.max_length, rows_per_batch=cfg.rows_per_batch,
                             eval_fraction=cfg.eval_fraction, num_workers=cfg.num_workers, device=device,
                             strict=cfg.strict)
    per_epoch = loader.steps_per_epoch() // cfg.grad_accum
    if per_epoch == 0:
        raise DFlashError(f"{cfg.store}: too little data for one step per rank ({loader.epoch_plan(0).rows_per_rank} "
                          f"rows of {cfg.max_length} tokens per rank; a step takes {cfg.rows_per_batch * cfg.grad_accum})")
    total = cfg.steps if cfg.steps is not None else max(1, round(cfg.epochs * per_epoch))
    ema = {k: v.detach().clone().float() for k, v in model.state_dict().items()} if cfg.ema else None
    store_fp = store_fingerprint(reader)

    step, epoch, batch_in_epoch = 0, 0, 0
    if cfg.resume:
        ckpt_path = latest_checkpoint(run_dir)
        if ckpt_path is None:
            raise DFlashError(f"--resume: no checkpoint in {run_dir / 'checkpoints'}")
        ck = load_checkpoint(ckpt_path, map_location=device)
        ts = ck["trainer_state"]
        check_resume(ts, cfg, store_fp)
        LoaderState(**ts["loader"]).check_compatible(loader.state(0, 0))
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["optimizer"])
        if ema is not None and ck["ema"] is not None:
            ema = {k: v.to(device) for k, v in ck["ema"].items()}
        step, epoch, batch_in_epoch = ts["step"], ts["loader"]["epoch"], ts["loader"]["batch"]
        line.say(f"resumed from {ckpt_path} at step {step}")
    if rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.json").write_text(json.dumps({
            "train": cfg.to_dict(), "drafter": dcfg.to_dict(), "gamma": gamma, "world_size": world,
            "steps_total": total, "steps_per_epoch": per_epoch, "store": {"url": cfg.store, "fingerprint": store_fp,
            "meta": reader.meta.to_dict()}, "tool_version": __version__}, indent=1))
    metrics = JsonlLog(run_dir / "metrics.jsonl") if rank == 0 else None
    trackers = _Trackers(cfg, run_dir) if rank == 0 else None

    stop = _StopFlag()
    old_handlers = {s: signal.signal(s, stop) for s in (signal.SIGTERM, signal.SIGINT)} \
        if _in_main_thread() else {}

    def trainer_state() -> dict[str, Any]:
        return {"step": step, "config": cfg.to_dict(), "drafter": dcfg.to_dict(), "store_fingerprint": store_fp,
                "loader": loader.state(epoch, batch_in_epoch).to_dict(), "world_size": world, "gamma": gamma,
                "time": time.time()}

    def save() -> Path | None:
        if rank != 0:
            return None
        return save_checkpoint(run_dir, step, model_state=model.state_dict(), optim_state=opt.state_dict(),
                               ema_state=ema, trainer_state=trainer_state(), keep=cfg.keep_checkpoints)

    def run_eval() -> dict[str, Any]:
        return _do_eval(model, frozen, reader, eval_rows, dcfg, cfg, gamma, rank, world, device, autocast, step,
                        metrics, trackers, line)

    acc = _Accum(device, dcfg)
    t_run, started_step, t_log = time.time(), step, time.time()
    loader.data_wait = 0.0
    first_log = True
    steps_this_run = 0
    autocast = kind == "cuda"
    eval_rows = loader.eval_rows()[: cfg.eval_max_samples]
    last_eval: dict[str, Any] = {}
    model.train()
    # One stream of batches across epochs (the loader's prefetch never drains at an epoch boundary),
    # grouped into steps of --grad-accum batches of one epoch.
    groups = _epoch_groups(loader.iter_from(epoch, batch_in_epoch), cfg.grad_accum)
    try:
        for (epoch, last, in_epoch), batch in (groups if step < total else ()):
            opt.zero_grad(set_to_none=True)
            g_anchors = step_generator(cfg.seed, rank, step)
            g = step_generator(cfg.seed, rank, step, device, NOISE_STREAM)
            for i, b in enumerate(batch):
                anchors = draw_anchors(b, cfg.max_anchors, g_anchors, cfg.block_size)
                ctx = ddp.no_sync() if (world > 1 and i < len(batch) - 1) else contextlib.nullcontext()
                with ctx:
                    out = run_blocks(ddp, frozen, b, anchors, block_size=cfg.block_size,
                                     mask_token_id=dcfg.mask_token_id, gamma=gamma, kl_weight=cfg.kl_weight,
                                     cap_weight=cfg.cap_weight, feature_noise=cfg.feature_noise,
                                     loss_chunk=cfg.loss_chunk, g=g, autocast=autocast)
                    (out.loss / len(batch)).backward()
                acc.add(out, b.tokens.numel())
            lr = _lr_at(cfg, step, total)
            for group in opt.param_groups:
                group["lr"] = lr
            gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip if cfg.grad_clip > 0 else float("inf"))
            opt.step()
            if ema is not None:
                with torch.no_grad():
                    for k, v in model.state_dict().items():
                        ema[k].mul_(cfg.ema).add_(v.float(), alpha=1 - cfg.ema)
            step += 1
            steps_this_run += 1
            batch_in_epoch = last + 1
            epoch_done = batch_in_epoch + cfg.grad_accum > in_epoch  # no further full step this epoch
            acc.grad_norm = acc.grad_norm + gnorm.detach().double()
            acc.steps += 1
            if world == 1:
                stop.set = stop.requested
            elif step % 10 == 0 or step == total:
                # Ranks agree on a signal every 10 steps (the same steps everywhere), not every step:
                # each agreement is a host sync.
                flag = torch.tensor([float(stop.requested)], device=device)
                dist.all_reduce(flag, op=dist.ReduceOp.MAX)
                stop.set = bool(flag.item())
            if cfg.stop_after is not None and steps_this_run >= cfg.stop_after:
                stop.set = True
            if step % cfg.log_every == 0 or step == total or stop.set:
                rec = acc.reduce(world, dist if world > 1 else None)
                now = time.time()
                rec.update(step=step, epoch=epoch + batch_in_epoch / max(1, in_epoch), lr=lr,
                           data_wait_frac=loader.data_wait / max(
                               now - t_log - (loader.startup_wait if first_log else 0.0), 1e-9),
                           peak_mem_gb=torch.cuda.max_memory_allocated(device) / 2 ** 30 if kind == "cuda" else None,
                           eta_s=(total - step) * (now - t_run) / max(1, step - started_step),
                           corrupt_segments_skipped=len(loader.corrupt))
                if first_log:  # the wait for the first batch (workers starting) is not data wait
                    rec["data_startup_s"], first_log = loader.startup_wait, False
                rec["mfu"] = rec.pop("flops_per_s") / (PEAK_BF16_FLOPS * world) if kind == "cuda" else None
                loader.data_wait, t_log = 0.0, now
                acc.clear()
                if rank == 0:
                    metrics.write({"type": "train", **rec})
                    trackers.log(rec, step)
                    line.update(_render(rec, total), force=True)
            elif rank == 0:
                # Between logged steps: a line with no device sync (on a terminal every step, in a
                # log every 30 s), so a slow first interval never looks like a hang.
                el = time.time() - t_run
                line.update(f"step {step:,}/{total:,}  {el:.0f}s  data wait {loader.data_wait:.1f}s  "
                            f"ETA {fmt_duration((total - step) * el / max(1, step - started_step))}")
            if cfg.eval_every and step % cfg.eval_every == 0 and len(eval_rows):
                last_eval = run_eval()
            if cfg.save_every and step % cfg.save_every == 0 and not stop.set:
                save()
            if epoch_done:
                epoch, batch_in_epoch = epoch + 1, 0
                if not cfg.eval_every and len(eval_rows) and step < total:
                    last_eval = run_eval()
            if step >= total or stop.set:
                break
    finally:
        groups.close()  # stops the loader's prefetch thread now
        loader.close()
        for s, h in old_handlers.items():
            signal.signal(s, h)
    ckpt = save()
    finished = step >= total
    summary: dict[str, Any] = {"step": step, "steps_total": total, "finished": finished, "checkpoint": str(ckpt),
                               "seconds": time.time() - t_run, "corrupt_segments_skipped": loader.corrupt}
    if finished:
        if not last_eval.get("step") == step and len(eval_rows):
            last_eval = run_eval()
        summary["eval"] = last_eval
        if rank == 0:
            from dflash_pipeline.train.export import export_drafter

            final = export_drafter(ema or model.state_dict(), dcfg, run_dir / "final", extra={"dflash_pipeline": {
                "store_fingerprint": store_fp, "step": step, "ema": cfg.ema, "eval": last_eval,
                "tool_version": __version__}})
            summary["final"] = str(final)
    if rank == 0:
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
        metrics.close()
        trackers.close()
        if finished:
            line.done(f"trained {step} steps in {fmt_duration(summary['seconds'])}; drafter exported to {summary['final']}"
                      + (f"; held-out acceptance estimate tau {last_eval.get('tau_chain', 0):.2f}" if last_eval else ""))
        else:
            why = f"signal {stop.signal}" if stop.signal else f"--stop-after {cfg.stop_after}"
            line.done(f"stopped at step {step}/{total} ({why}); checkpoint {ckpt}; continue with --resume")
    if world > 1:
        dist.barrier()
    if owns_group:  # torchrun / accelerate may own the group; a group we made we also end (no exit warnings)
        dist.destroy_process_group()
    return summary


def _do_eval(model, frozen, reader, eval_rows, dcfg, cfg, gamma, rank, world, device, autocast, step,
             metrics, trackers, line) -> dict[str, Any]:
    model.eval()
    res = evaluate(model, frozen, reader, eval_rows[rank::world], dcfg, gamma=gamma, device=device,
                   autocast=autocast, max_anchors=cfg.max_anchors, loss_chunk=cfg.loss_chunk, world=world)
    model.train()
    res["step"] = step
    if rank == 0:
        metrics.write({"type": "eval", **res})
        trackers.log({f"eval/{k}": v for k, v in res.items() if isinstance(v, (int, float))}, step)
        line.say(f"eval @ step {step}: loss {res['loss']:.3f} acc {res['acc']:.3f} "
                 f"streak {res['streak']:.2f} greedy-chain tau {res['tau_chain']:.2f} ({res['samples']} samples)")
    return res


class _Accum:
    """Sums over a logging interval, kept on the device (no host sync per step), reduced over ranks
    when logged. Slots of `v`: loss, ce, kl, cap, streak sum, blocks, labelled slots, then correct and
    labelled counts per block slot; the counts known on the host (tokens, attention pairs) beside it."""

    def __init__(self, device, dcfg):
        self.device, self.dcfg, self.B = device, dcfg, dcfg.block_size
        self.clear()

    def clear(self):
        self.t0 = time.time()
        self.v = torch.zeros(7 + 2 * self.B, dtype=torch.float64, device=self.device)
        self.grad_norm = torch.zeros((), dtype=torch.float64, device=self.device)
        self.steps = self.micro = 0
        self.input_tokens = self.block_tokens = self.context_tokens = 0
        self.attn_pairs = 0.0

    def add(self, out, context_tokens: int):
        B = self.B
        self.v[:7] += torch.stack([out.loss.detach().double(), out.ce.double(), out.kl.double(), out.cap.double(),
                                   out.streak_sum.double(), out.blocks.double(), out.count_B.sum().double()])
        self.v[7:7 + B] += out.correct_B.double()
        self.v[7 + B:] += out.count_B.double()
        self.attn_pairs += out.attn_pairs
        self.input_tokens += out.input_tokens
        self.block_tokens += out.block_tokens
        self.context_tokens += context_tokens
        self.micro += 1

    def reduce(self, world, dist) -> dict[str, Any]:
        ints = torch.tensor([self.input_tokens, self.block_tokens, self.context_tokens, self.attn_pairs],
                            dtype=torch.float64, device=self.device)
        v = torch.cat([self.v, ints, self.grad_norm.view(1)])
        if dist is not None:
            dist.all_reduce(v)
        v = v.cpu()
        dt = max(time.time() - self.t0, 1e-9)
        micro = max(self.micro, 1) * world
        B = self.B
        correct, count = v[7:7 + B], v[7 + B:7 + 2 * B]
        input_tokens, block_tokens, context_tokens, attn_pairs, grad_norm = (float(x) for x in v[7 + 2 * B:])
        flops = flops_from_totals(self.dcfg, block_tokens=block_tokens, context_tokens=context_tokens,
                                  attn_pairs=attn_pairs, labelled=float(v[6]))
        return {"loss": float(v[0] / micro), "ce": float(v[1] / micro), "kl": float(v[2] / micro),
                "cap": float(v[3] / micro), "acc": float(correct[1:].sum() / count[1:].sum().clamp_min(1)),
                "acc_per_pos": [round(float(c / max(n, 1)), 4) for c, n in zip(correct[1:], count[1:])],
                "streak": float(v[4] / v[5].clamp_min(1)), "grad_norm": grad_norm / max(self.steps * world, 1),
                "input_tok_s": input_tokens / dt, "block_tok_s": block_tokens / dt, "flops_per_s": flops / dt}


def _render(rec: dict[str, Any], total: int) -> str:
    mfu = f" MFU {rec['mfu']:.0%}" if rec.get("mfu") is not None else ""
    mem = f" mem {rec['peak_mem_gb']:.1f}G" if rec.get("peak_mem_gb") is not None else ""
    parts = f"ce {rec['ce']:.3f}" + (f" kl {rec['kl']:.3f}" if rec["kl"] else "") + (f" cap {rec['cap']:.3f}" if rec["cap"] else "")
    return (f"step {rec['step']}/{total} ep {rec['epoch']:.2f} | loss {rec['loss']:.3f} ({parts}) acc {rec['acc']:.3f} "
            f"streak {rec['streak']:.2f} | lr {rec['lr']:.2e} gn {rec['grad_norm']:.2f} | "
            f"{fmt_count(rec['input_tok_s'])} tok/s {fmt_count(rec['block_tok_s'])} blk/s{mfu} | "
            f"data-wait {rec['data_wait_frac']:.1%}{mem} | ETA {fmt_duration(rec['eta_s'])}")


class _Trackers:
    """Optional wandb / tensorboard mirrors of metrics.jsonl."""

    def __init__(self, cfg: TrainConfig, run_dir: Path):
        self.wandb = self.tb = None
        if cfg.wandb:
            try:
                import wandb
            except ImportError:
                raise DFlashError("--wandb needs the wandb package: pip install wandb") from None
            self.wandb = wandb.init(project=cfg.wandb, dir=str(run_dir), config=cfg.to_dict())
        if cfg.tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                raise DFlashError("--tensorboard needs the tensorboard package: pip install tensorboard") from None
            self.tb = SummaryWriter(str(run_dir / "tensorboard"))

    def log(self, rec: dict[str, Any], step: int) -> None:
        scalars = {k: v for k, v in rec.items() if isinstance(v, (int, float)) and v is not None}
        if self.wandb is not None:
            self.wandb.log(scalars, step=step)
        if self.tb is not None:
            for k, v in scalars.items():
                self.tb.add_scalar(k, v, step)

    def close(self) -> None:
        if self.wandb is not None:
            self.wandb.finish()
        if self.tb is not None:
            self.tb.close()


def _epoch_groups(stream, n: int):
    """((epoch, last batch index, batches in the epoch), n batches) from a loader stream; a step never
    mixes epochs (an epoch's last batches that do not fill a step are skipped)."""
    group: list = []
    current = None
    try:
        for (e, i, in_epoch), b in stream:
            if e != current:
                group, current = [], e
            group.append(b)
            if len(group) == n:
                yield (e, i, in_epoch), group
                group = []
    finally:
        stream.close()


def _in_main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()
