"""`dflash train`: the store streamed into DFlash drafter trainers on every GPU.

The target is never loaded: its frozen embedding and LM head come from the store's target/. One process
per GPU (spawned here, or given by torchrun / accelerate launch), DDP over the drafter only, bf16
autocast with fp32 master weights and AdamW, cosine schedule with warmup, clipping, accumulation,
optional EMA. Checkpoints go out periodically, on SIGTERM/SIGINT and on `--stop-after`; `--resume`
continues exactly (same anchors, noise and batches) and refuses another store or config.

`run_train` launches the processes (launch.py); each runs `train_rank`: a `Trainer` is built (model,
optimizer, loader, frozen tensors), resumed if asked, and its `train()` loop runs: step, then maybe
log, evaluate, save. Metrics live in metrics.py, the held-out estimate in heldout.py, what comes from
the store in from_store.py.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from dflash_pipeline import __version__
from dflash_pipeline.errors import DFlashError
from dflash_pipeline.launch import (Proc, StopRequest, bind_device, launch, launched, plan_processes,
                                    process_group, stop_signals)
from dflash_pipeline.method import default_gamma
from dflash_pipeline.progress import JsonlLog, LiveLine, fmt_duration
from dflash_pipeline.schemas.config import OptimConfig, TrainConfig
from dflash_pipeline.store.reader import StoreReader
from dflash_pipeline.train.checkpoint import check_resume, latest_checkpoint, load_checkpoint, save_checkpoint
from dflash_pipeline.train.loader import StreamingLoader
from dflash_pipeline.train.plan import LoaderState, store_fingerprint
from dflash_pipeline.train.from_store import (anchor_coverage, check_init, check_store_fits, drafter_config_for,
                                              frozen_tensors, init_state, noise_scale, resolve_batch)
from dflash_pipeline.train.batch import Batch
from dflash_pipeline.train.heldout import HeldoutSet, heldout_estimate
from dflash_pipeline.train.metrics import (PEAK_BF16_FLOPS, IntervalMetrics, Trackers, data_hint, render_eval_line,
                                           render_train_line)
from dflash_pipeline.train.memory import (MemoryPlan, Probe, batch_bytes, can_measure, device_budget, held_bytes,
                                          measure_step, run_plans, search_recompute, synthetic_batch,
                                          worst_shape)
from dflash_pipeline.train.model import DFlashDrafter, DrafterOptions, init_drafter_weights
from dflash_pipeline.train.step import NOISE_STREAM, draw_anchors, run_blocks, stage_blocks, step_generator

# --eval-every 0: the most share of a run's wall time the epoch-end held-out estimates may take (the last
# one, at the run's end, always happens)
EPOCH_EVAL_SHARE = 0.05


def lr_at(optim: OptimConfig, step: int, total: int) -> float:
    """Linear warmup, then cosine decay to min_lr_ratio * lr at the last step."""
    warm = int(optim.warmup_ratio * total)
    if step < warm:
        return optim.lr * (step + 1) / warm
    progress = (step - warm) / max(1, total - warm)
    cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return optim.lr * (optim.min_lr_ratio + (1 - optim.min_lr_ratio) * cosine)


def run_train(cfg: TrainConfig) -> dict[str, Any]:
    """Entry point of `dflash train`. Returns the final summary (of rank 0)."""
    proc = launched(cfg.runtime.device)
    if proc is not None:
        return train_rank(proc, cfg)
    kind, nprocs = plan_processes(cfg.runtime.device, cfg.runtime.gpus, cfg.runtime.num_procs)
    reader = StoreReader(cfg.data.store)
    check_store_fits(cfg, reader)   # user errors before any process starts
    if cfg.model.init_from and not cfg.output.resume:
        check_init(cfg.model.init_from, drafter_config_for(cfg.model, reader))   # its weights: read by each rank
    return launch(train_rank, (cfg,), nprocs=nprocs, kind=kind)[0]


def train_rank(proc: Proc, cfg: TrainConfig) -> dict[str, Any]:
    """One training process: its device, the process group when there are several, the run."""
    device = bind_device(proc)
    cuda = proc.kind == "cuda"
    with process_group("nccl" if cuda else "gloo", device if cuda else None) if proc.world > 1 \
            else contextlib.nullcontext():
        trainer = Trainer(cfg, proc, device)
        if cfg.output.resume:
            trainer.resume()
        summary = trainer.train()
        if proc.world > 1:
            dist.barrier()
    return summary


class Trainer:
    """One rank's training run: built from the config and the store, resumed, then `train()`.

    State that a checkpoint carries: the weights, the optimizer, the EMA, `step`, and the loader's
    place (`epoch`, `batch_in_epoch`); everything else is rebuilt from the config and the store.
    """

    def __init__(self, cfg: TrainConfig, proc: Proc, device: torch.device):
        self.proc, self.device = proc, device
        self.dist = dist if proc.world > 1 else None   # collectives only with several ranks
        self.line = LiveLine(enabled=proc.is_main and not cfg.output.quiet)
        self.run_dir = Path(cfg.output.out)
        self.reader = StoreReader(cfg.data.store)
        check_store_fits(cfg, self.reader)
        # --max-anchors and --tokens-per-batch left to the store: concrete from here on (config.json, checkpoints;
        # each rank resolves the same from the same store); a resumed run keeps what it began with
        cfg, self.batch_note = resolve_batch(cfg, self.reader, self._resumed_config(cfg))
        self.cfg = cfg
        r = self.reader
        self.line.say(f"opening store {cfg.data.store}: {r.num_samples:,} samples, {r.num_tokens:,} tokens, "
                      f"layers {r.meta.layer_ids}, codec {r.meta.codec}")
        self.dcfg = drafter_config_for(cfg.model, self.reader)
        self.gamma = cfg.loss.gamma if cfg.loss.gamma is not None else default_gamma(cfg.model.block_size)
        self.kl_weight = cfg.loss.kl_for(self.reader.meta.topk)
        self.noise_over_rms: list[float] | None = None   # --feature-noise over each stored layer's RMS
        if cfg.loss.feature_noise > 0 and proc.is_main:
            self.noise_over_rms, text = noise_scale(cfg.loss.feature_noise, self.reader)
            self.line.say(text)
        self.anchor_coverage: float | None = None   # the share of supervised positions anchored a step
        if proc.is_main:
            self.anchor_coverage, text = anchor_coverage(cfg.loss.max_anchors, cfg.data.tokens_per_batch, self.reader)
            self.line.say(text)
            if self.batch_note:
                self.line.say(self.batch_note)
        self.autocast = proc.kind == "cuda"   # bf16 autocast over fp32 master weights on GPUs
        self.frozen = frozen_tensors(self.reader, device, torch.bfloat16 if self.autocast else torch.float32)
        self.model = self._build_model()
        data = cfg.data
        self.loader = StreamingLoader(r, layers=self.dcfg.target_layer_ids, rank=proc.rank, world=proc.world,
                                      seed=cfg.seed, row_len=data.max_length, rows_per_batch=data.rows_per_batch,
                                      eval_fraction=data.eval_fraction, num_workers=cfg.runtime.num_workers,
                                      device=device, strict=cfg.runtime.strict)
        self.per_epoch, self.total = self._schedule_length()
        self.ema = {k: v.detach().clone().float() for k, v in self.model.state_dict().items()} \
            if cfg.optim.ema else None
        # --checkpoint-layers auto: measured now, before DDP and before any checkpoint is written; where a
        # whole batch does not fit, it runs forward and backward in chunks of the plan's `chunk_rows` rows
        self.memory_plan: MemoryPlan | None = self._plan_memory()
        self.ddp = self._wrap(self.model)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=cfg.optim.lr, betas=cfg.optim.betas,
                                     weight_decay=cfg.optim.weight_decay, fused=proc.kind == "cuda")
        self.store_fp = store_fingerprint(self.reader)
        self.step, self.epoch, self.batch_in_epoch = 0, 0, 0
        self.stop = StopRequest()
        self.last_eval: dict[str, Any] = {}
        self.eval_ended: float | None = None   # when the last held-out estimate ended (time.time()), and its cost
        self.last_eval_seconds = 0.0
        self.lr, self.in_epoch, self.steps_this_run = 0.0, 1, 0
        self.last_block_tokens = 0   # the last batch's anchors x block size: what a step's memory follows
        self.records: JsonlLog | None = None    # rank 0's metrics.jsonl and trackers, from `train()`
        self.trackers: Trackers | None = None

    def _build_model(self) -> DFlashDrafter:
        """The drafter, initialised from the seed (or --init-from), on the device."""
        cfg, dcfg, proc, rt = self.cfg, self.dcfg, self.proc, self.cfg.runtime
        torch.manual_seed(cfg.seed)
        checkpointed = dcfg.num_layers if rt.activation_checkpointing else min(rt.checkpoint_layers or 0, dcfg.num_layers)
        model = DFlashDrafter(dcfg, DrafterOptions(checkpoint_layers=checkpointed,
                                                   compile_kernels=None if rt.compile else False))
        init_drafter_weights(model, generator=torch.Generator().manual_seed(cfg.seed))
        if cfg.model.init_from and not cfg.output.resume:  # a resumed run takes its checkpoint's weights
            model.load_state_dict(init_state(cfg.model.init_from, dcfg))
            self.line.say(f"weights from {cfg.model.init_from} (the optimizer and its schedule start afresh)")
        model.to(self.device)
        self.line.say(f"drafter: {dcfg.num_layers} layers, hidden {dcfg.hidden_size}, "
                      f"{model.num_parameters() / 1e6:.1f}M trainable parameters; block {dcfg.block_size}, features "
                      f"from target layers {dcfg.target_layer_ids}, mask token {dcfg.mask_token_id}; "
                      f"{proc.world} process(es) on {proc.kind}")
        if proc.kind == "cuda":
            first = "measuring the largest step's memory" if self._measures_memory() else "the first step"
            self.line.say(f"{first} compiles FlexAttention" + (" and the fused kernels" if rt.compile else "")
                          + " (about a minute, once per process; cached on disk for later runs)")
        return model

    def _wrap(self, model: DFlashDrafter):
        """What steps run through: the drafter itself, or DDP around it with several ranks."""
        proc, rt = self.proc, self.cfg.runtime
        if proc.world == 1:
            return model
        # gradient_as_bucket_view: gradients live in the all-reduce buckets (no copy into them each step,
        # and no second copy of the gradients: 4 GB for a Qwen3-8B-sized drafter).
        ddp = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[proc.local_rank] if proc.kind == "cuda" else None, gradient_as_bucket_view=True,
            bucket_cap_mb=rt.ddp_bucket_mb)
        return ddp

    def _measures_memory(self) -> bool:
        rt = self.cfg.runtime
        return rt.checkpoint_layers is None and not rt.activation_checkpointing and can_measure(self.device)

    def _plan_memory(self) -> MemoryPlan | None:
        """--checkpoint-layers auto on a GPU: the fewest recomputed layers that fit this rank's largest step,
        measured (train/memory.py), and the rows a forward pass takes where the whole batch does not fit even
        with every layer recomputed; agreed over ranks and set on the model and the step. A step that fits in
        no way ends the run here, before its first step."""
        if not self._measures_memory():
            return None
        cfg, d, dev = self.cfg, self.dcfg, self.device
        epochs = -(-self.total // max(1, self.per_epoch))   # every epoch packs its rows anew
        shape, planned = worst_shape(run_plans(self.loader.epoch_plan, epochs), self.loader.man.supervised,
                                     rows=cfg.data.rows_per_batch, row_len=cfg.data.max_length,
                                     max_anchors=cfg.loss.max_anchors, block_size=cfg.model.block_size)
        width, topk = d.num_features * d.hidden_size, self.reader.meta.topk
        moments = 2 * sum(p.numel() * p.element_size() for p in self.model.parameters())   # AdamW, first step

        def held(rows: int) -> int:
            return held_bytes(moments=moments, batch=batch_bytes(shape, width, topk),
                              chunk=batch_bytes(dataclasses.replace(shape, rows=rows), width, topk),
                              prefetch=self.loader.prefetch, grad_accum=cfg.optim.grad_accum)

        budget, total = device_budget(dev)

        def measure(layers: int, rows: int) -> Probe:
            def step(model) -> torch.Tensor:
                batch, anchors = synthetic_batch(dataclasses.replace(shape, rows=rows), width=width, topk=topk,
                                                 vocab=d.vocab_size, device=dev, seed=cfg.seed)
                return run_blocks(model, self.frozen, batch, anchors, block_size=cfg.model.block_size,
                                  mask_token_id=d.mask_token_id, gamma=self.gamma, kl_weight=self.kl_weight,
                                  cap_weight=cfg.loss.cap_weight, feature_noise=cfg.loss.feature_noise,
                                  loss_chunk=cfg.runtime.loss_chunk, autocast=self.autocast,
                                  g=torch.Generator(device=dev).manual_seed(cfg.seed)).loss
            t0 = time.perf_counter()
            fits, peak = measure_step(self.model, step, layers=layers, device=dev, held_bytes=held(rows),
                                      budget_bytes=budget)
            return Probe(layers, rows, fits, peak, round(time.perf_counter() - t0, 2))

        layers, probes, rows = search_recompute(d.num_layers, shape.rows, measure)
        need = d.num_layers + 1 if layers is None else layers
        if self.dist is not None:
            # the most layers and the fewest rows any rank needs: a rank's layers fit at its own rows, so
            # they fit at fewer rows too
            t = torch.tensor([need, -rows], device=dev)
            self.dist.all_reduce(t, op=self.dist.ReduceOp.MAX)
            need, rows = int(t[0]), -int(t[1])
        fits = need <= d.num_layers and rows > 0
        plan = MemoryPlan(checkpoint_layers=need if fits else None, num_layers=d.num_layers, shape=shape,
                          budget_bytes=budget, total_bytes=total, held_bytes=held(rows or 1), probes=probes,
                          chunk_rows=rows if fits else 0, epochs_planned=planned, epochs=epochs)
        if plan.checkpoint_layers is None:
            raise self._does_not_fit(plan)
        self.model.checkpoint_layers = plan.checkpoint_layers
        if dev.type == "cuda":   # the log's peak is the training's, not the probes'
            torch.cuda.reset_peak_memory_stats(dev)
        self.line.say(plan.line())
        return plan

    def _does_not_fit(self, plan: MemoryPlan) -> DFlashError:
        cfg, s = self.cfg, plan.shape
        return DFlashError(
            f"the largest step does not fit {self.device} ({plan.budget_bytes / 2 ** 30:.1f} GiB of "
            f"{plan.total_bytes / 2 ** 30:.1f} GiB usable) even one row at a time with all {plan.num_layers} "
            f"drafter layers recomputed: rows of {s.row_len:,} tokens with up to {s.anchors} anchors each "
            f"({cfg.loss.max_anchors} anchors a sample); pass a smaller --max-anchors or --max-length, or a smaller "
            f"--tokens-per-batch (the batches in flight are held beside the step)")

    def _schedule_length(self) -> tuple[int, int]:
        """(optimizer steps per epoch, steps in the whole run)."""
        data, optim = self.cfg.data, self.cfg.optim
        per_epoch = self.loader.steps_per_epoch() // optim.grad_accum
        if per_epoch == 0:
            rows = self.loader.epoch_plan(0).rows_per_rank
            raise DFlashError(f"{data.store}: too little data for one step per rank ({rows} rows of {data.max_length} "
                              f"tokens per rank; a step takes {data.rows_per_batch * optim.grad_accum})")
        return per_epoch, optim.steps if optim.steps is not None else max(1, round(optim.epochs * per_epoch))

    # -- resume and save ---------------------------------------------------------------------------------

    def _resumed_config(self, cfg: TrainConfig) -> dict[str, Any] | None:
        """The flat config of the checkpoint --resume will continue (its trainer_state.json only), or None."""
        path = latest_checkpoint(self.run_dir) if cfg.output.resume else None
        return json.loads((path / "trainer_state.json").read_text())["config"] if path is not None else None

    def resume(self) -> None:
        """Continue from the run directory's latest checkpoint, exactly where it stopped."""
        path = latest_checkpoint(self.run_dir)
        if path is None:
            raise DFlashError(f"--resume: no checkpoint in {self.run_dir / 'checkpoints'}")
        ck = load_checkpoint(path, map_location=self.device)
        ts = ck["trainer_state"]
        check_resume(ts, self.cfg, self.store_fp)
        LoaderState(**ts["loader"]).check_compatible(self.loader.state(0, 0))
        self.model.load_state_dict(ck["model"])
        self.opt.load_state_dict(ck["optimizer"])
        if self.ema is not None and ck["ema"] is not None:
            self.ema = {k: v.to(self.device) for k, v in ck["ema"].items()}
        self.step, self.epoch, self.batch_in_epoch = ts["step"], ts["loader"]["epoch"], ts["loader"]["batch"]
        self.line.say(f"resumed from {path} at step {self.step}")

    def trainer_state(self) -> dict[str, Any]:
        """What a checkpoint records besides the tensors: where the run is, and what it was run with."""
        return {"step": self.step, "config": self.cfg.to_dict(), "drafter": self.dcfg.to_dict(),
                "store_fingerprint": self.store_fp,
                "loader": self.loader.state(self.epoch, self.batch_in_epoch).to_dict(),
                "world_size": self.proc.world, "gamma": self.gamma, "time": time.time()}

    def save(self) -> Path | None:
        """A checkpoint of this step (written by rank 0; every rank holds the same weights)."""
        if not self.proc.is_main:
            return None
        return save_checkpoint(self.run_dir, self.step, model_state=self.model.state_dict(),
                               optim_state=self.opt.state_dict(), ema_state=self.ema,
                               trainer_state=self.trainer_state(), keep=self.cfg.output.keep_checkpoints)

    # -- the loop ----------------------------------------------------------------------------------------

    def train(self) -> dict[str, Any]:
        """Step until the last step, a signal or --stop-after; log, evaluate and save on the way."""
        cfg = self.cfg
        self._start()
        with stop_signals(self.stop), self._steps() as steps:
            for place, batches in steps:
                try:
                    self.train_step(place, batches)
                except torch.OutOfMemoryError:
                    self.opt.zero_grad(set_to_none=True)
                    raise self._out_of_memory() from None
                if self._due(cfg.output.log_every) or self.step == self.total or self.stop.set:
                    self.log()
                else:
                    self._show_progress()
                if self._due(cfg.output.eval_every) and len(self.eval_rows):
                    self.evaluate()
                if self._due(cfg.output.save_every) and not self.stop.set:
                    self.save()
                if self.batch_in_epoch + cfg.optim.grad_accum > self.in_epoch:  # no further full step this epoch
                    self._next_epoch()
                if self.step >= self.total or self.stop.set:
                    break
        return self._finish()

    def _out_of_memory(self) -> DFlashError:
        """What to change when a step does not fit the device: memory follows the step's block tokens (anchors
        x block size), the drafter's width and depth, not its input tokens (BENCHMARKS.md, short samples)."""
        cfg, d = self.cfg, self.dcfg
        blocks = self.last_block_tokens
        ckpt = latest_checkpoint(self.run_dir)
        return DFlashError(
            f"out of memory on {self.device} in step {self.step + 1}: {blocks:,} block tokens in a batch "
            f"({cfg.loss.max_anchors} anchors a sample over {cfg.data.tokens_per_batch:,} tokens) through "
            f"{d.num_layers} drafter layers of width {d.hidden_size}; pass --activation-checkpointing (or "
            f"--checkpoint-layers N), or halve --tokens-per-batch and double --grad-accum (the same tokens a step); "
            + (f"the last checkpoint ({ckpt.name}) is intact: add --resume to go on from it"
               if ckpt is not None else "no checkpoint was written yet"))

    def _due(self, every: int) -> bool:
        """Every `every` steps (never when 0)."""
        return bool(every) and self.step % every == 0

    def train_step(self, place: tuple[int, int, int], batches: list) -> None:
        """One optimizer step over --grad-accum batches, then the ranks agree whether to stop.

        place: (epoch, index of the last batch, batches in the epoch). Anchors and feature noise are
        drawn from (seed, rank, step), so a resumed run replays them.
        """
        cfg, loss, optim, world = self.cfg, self.cfg.loss, self.cfg.optim, self.proc.world
        self.epoch, last, self.in_epoch = place
        self.opt.zero_grad(set_to_none=True)
        g_anchors = step_generator(cfg.seed, self.proc.rank, self.step)
        g_noise = step_generator(cfg.seed, self.proc.rank, self.step, self.device, NOISE_STREAM)
        for i, b in enumerate(batches):
            anchors = draw_anchors(b, loss.max_anchors, g_anchors, cfg.model.block_size)
            self.last_block_tokens = int((anchors >= 0).sum()) * cfg.model.block_size
            parts, normalizer = self._row_chunks(b, anchors)
            for j, (part, part_anchors, staged) in enumerate(parts):
                # gradients are all-reduced once, with the last batch's last chunk
                sync = world == 1 or (i == len(batches) - 1 and j == len(parts) - 1)
                with contextlib.nullcontext() if sync else self.ddp.no_sync():
                    out = run_blocks(self.ddp, self.frozen, part, part_anchors, block_size=cfg.model.block_size,
                                     mask_token_id=self.dcfg.mask_token_id, gamma=self.gamma,
                                     kl_weight=self.kl_weight, cap_weight=loss.cap_weight,
                                     feature_noise=loss.feature_noise, loss_chunk=cfg.runtime.loss_chunk, g=g_noise,
                                     autocast=self.autocast, staged=staged, normalizer=normalizer)
                    (out.loss / len(batches)).backward()
                # a chunk's loss is its share of the batch's (normalised over the whole batch): one batch
                self.metrics.add(out, part.tokens.numel(), micro=int(j == len(parts) - 1))
        self.lr = lr_at(optim, self.step, self.total)
        for group in self.opt.param_groups:
            group["lr"] = self.lr
        gnorm = torch.nn.utils.clip_grad_norm_(self.model.parameters(),
                                               optim.grad_clip if optim.grad_clip > 0 else float("inf"))
        self.opt.step()
        if self.ema is not None:
            with torch.no_grad():
                for k, v in self.model.state_dict().items():
                    self.ema[k].mul_(optim.ema).add_(v.float(), alpha=1 - optim.ema)
        self.step += 1
        self.steps_this_run += 1
        self.batch_in_epoch = last + 1
        self.metrics.add_step(gnorm)
        self._agree_on_stop()

    def _row_chunks(self, b: Batch, anchors_RA: torch.Tensor) -> tuple[list, torch.Tensor | None]:
        """The batch as forward/backward passes: [(rows, their anchors, their staged blocks or None)] and the
        loss normaliser over the whole batch (None: one pass, normalised by itself)."""
        R = b.tokens.shape[0]
        rows = self.memory_plan.chunk_rows if self.memory_plan is not None else R
        if R <= rows:
            return [(b, anchors_RA, None)], None
        cfg = self.cfg
        parts = []
        for r0 in range(0, R, rows):
            part, a = b.rows(r0, r0 + rows), anchors_RA[r0:r0 + rows]
            staged = stage_blocks(part, a, block_size=cfg.model.block_size, mask_token_id=self.dcfg.mask_token_id,
                                  gamma=self.gamma, layer_kinds=self.dcfg.layer_mask_kinds(), device=self.device)
            parts.append((part, a, staged))
        normalizer = torch.stack([st.weights_N.float().sum() for *_, st in parts]).sum().clamp_min(
            torch.finfo(torch.float32).tiny)   # all-zero weights: a zero loss, as in one pass
        return parts, normalizer

    def _agree_on_stop(self) -> None:
        stop = self.stop
        if self.dist is None:
            stop.set = stop.requested
        elif self.step % 10 == 0 or self.step == self.total:
            # Ranks agree on a signal every 10 steps (the same steps everywhere), not every step: each
            # agreement is a host sync.
            flag = torch.tensor([float(stop.requested)], device=self.device)
            self.dist.all_reduce(flag, op=self.dist.ReduceOp.MAX)
            stop.set = bool(flag.item())
        if self.cfg.output.stop_after is not None and self.steps_this_run >= self.cfg.output.stop_after:
            stop.set = True

    def _next_epoch(self) -> None:
        self.epoch, self.batch_in_epoch = self.epoch + 1, 0
        if not self.cfg.output.eval_every and len(self.eval_rows) and self.step < self.total and self._epoch_eval_due():
            self.evaluate()

    def _epoch_eval_due(self) -> bool:
        """--eval-every 0: the held-out estimate at an epoch's end, the first time, and later only once the run
        has trained at least (1 - EPOCH_EVAL_SHARE) / EPOCH_EVAL_SHARE times the last estimate's own wall time
        since it ended; so on stores whose epochs are short next to an estimate (on the GPU, 40 s an estimate
        against 80 s an epoch on 40,000 short replies: a third of the run) it takes at most that share. The
        ranks agree (one collective an epoch): an estimate is a collective too."""
        if self.eval_ended is None:
            due = True
        else:
            due = time.time() - self.eval_ended >= self.last_eval_seconds * (1 - EPOCH_EVAL_SHARE) / EPOCH_EVAL_SHARE
        if self.dist is not None:
            flag = torch.tensor([float(due)], device=self.device)
            self.dist.all_reduce(flag, op=self.dist.ReduceOp.MAX)
            due = bool(flag.item())
        return due

    # -- logging and evaluation --------------------------------------------------------------------------

    def _start(self) -> None:
        """config.json and the metric sinks (rank 0), the timers, then the model in training mode."""
        cfg, proc = self.cfg, self.proc
        if proc.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            (self.run_dir / "config.json").write_text(json.dumps({
                "train": cfg.to_dict(), "drafter": self.dcfg.to_dict(), "gamma": self.gamma, "kl_weight": self.kl_weight,
                "feature_noise_over_rms": self.noise_over_rms, "anchor_coverage": self.anchor_coverage,
                "world_size": proc.world,
                "memory_plan": self.memory_plan.to_dict() if self.memory_plan is not None else None,
                "steps_total": self.total, "steps_per_epoch": self.per_epoch,
                "store": {"url": cfg.data.store, "fingerprint": self.store_fp, "meta": self.reader.meta.to_dict()},
                "tool_version": __version__}, indent=1))
            self.records = JsonlLog(self.run_dir / "metrics.jsonl")
            self.trackers = Trackers(self.run_dir, wandb_project=cfg.output.wandb,
                                     tensorboard=cfg.output.tensorboard, config=cfg.to_dict())
        self.metrics = IntervalMetrics(self.device, self.dcfg)
        self.t_run, self.started_step, self.t_log = time.time(), self.step, time.time()
        self.loader.data_wait = 0.0
        self.first_log = True
        self.eval_rows = self.loader.eval_rows()[: cfg.output.eval_max_samples]
        self.heldout = HeldoutSet(
            reader=self.reader, rows=self.eval_rows[proc.rank::proc.world], frozen=self.frozen, drafter=self.dcfg,
            gamma=self.gamma, max_anchors=cfg.loss.max_anchors, loss_chunk=cfg.runtime.loss_chunk,
            device=self.device, autocast=self.autocast, world=proc.world,
            tree_budgets=tuple(cfg.output.eval_tree_budget), new_tokens=cfg.output.eval_new_tokens)
        self.model.train()

    @contextlib.contextmanager
    def _steps(self):
        """The loader's one stream of batches across epochs (its prefetch never drains at an epoch
        boundary), grouped into steps of --grad-accum batches of one epoch; closed with the loader."""
        groups = _epoch_groups(self.loader.iter_from(self.epoch, self.batch_in_epoch), self.cfg.optim.grad_accum)
        try:
            yield groups if self.step < self.total else ()
        finally:
            groups.close()  # stops the loader's prefetch thread now
            self.loader.close()

    def log(self) -> None:
        """Reduce the interval's sums over ranks and write them (a host sync: every --log-every steps)."""
        rec = self.metrics.reduce(self.proc.world, self.dist)
        loader, now, cuda = self.loader, time.time(), self.proc.kind == "cuda"
        rec.update(step=self.step, epoch=self.epoch + self.batch_in_epoch / max(1, self.in_epoch), lr=self.lr,
                   data_wait_frac=loader.data_wait / max(
                       now - self.t_log - (loader.startup_wait if self.first_log else 0.0), 1e-9),
                   peak_mem_gb=torch.cuda.max_memory_allocated(self.device) / 2 ** 30 if cuda else None,
                   eta_s=(self.total - self.step) * (now - self.t_run) / max(1, self.step - self.started_step),
                   corrupt_segments_skipped=len(loader.corrupt))
        if self.first_log:  # the wait for the first batch (workers starting) is not data wait
            rec["data_startup_s"], self.first_log = loader.startup_wait, False
        rec["mfu"] = rec.pop("flops_per_s") / (PEAK_BF16_FLOPS * self.proc.world) if cuda else None
        loader.data_wait, self.t_log = 0.0, now
        self.metrics.clear()
        if self.proc.is_main:
            self.records.write({"type": "train", "time": round(now, 3), **rec})
            self.trackers.log(rec, self.step)
            self.line.update(render_train_line(rec, self.total), force=True)

    def _show_progress(self) -> None:
        # Between logged steps: a line with no device sync (on a terminal every step, in a log every
        # 30 s), so a slow first interval never looks like a hang.
        if self.proc.is_main:
            el = time.time() - self.t_run
            eta = (self.total - self.step) * el / max(1, self.step - self.started_step)
            self.line.update(f"step {self.step:,}/{self.total:,}  {el:.0f}s  data wait {self.loader.data_wait:.1f}s  "
                             f"ETA {fmt_duration(eta)}")

    def evaluate(self) -> dict[str, Any]:
        """The held-out estimate (every rank its share of the held-out samples), logged by rank 0."""
        self.model.eval()
        t0 = time.time()
        res = heldout_estimate(self.model, self.heldout)
        self.model.train()
        res["step"] = self.step
        t1 = time.time()
        self.eval_ended, self.last_eval_seconds = t1, t1 - t0
        if self.proc.is_main:  # its wall time: what the estimate costs the run, e.g. to choose --eval-every
            self.records.write({"type": "eval", "time": round(t1, 3), "seconds": round(t1 - t0, 3), **res})
            self.trackers.log({f"eval/{k}": v for k, v in res.items() if isinstance(v, (int, float))}, self.step)
            self.line.say(render_eval_line(res))
            if not self.last_eval and (hint := data_hint(res.get("target_agreement", 1.0))):
                self.line.say(hint)
        self.last_eval = res
        return res

    def _finish(self) -> dict[str, Any]:
        """The last checkpoint; when the run is complete, a last evaluation and the exported drafter."""
        ckpt = self.save()
        finished = self.step >= self.total
        summary: dict[str, Any] = {"step": self.step, "steps_total": self.total, "finished": finished,
                                   "checkpoint": str(ckpt), "seconds": time.time() - self.t_run,
                                   "corrupt_segments_skipped": self.loader.corrupt}
        if finished:
            if not self.last_eval.get("step") == self.step and len(self.eval_rows):
                self.evaluate()
            summary["eval"] = self.last_eval
            if self.proc.is_main:
                summary["final"] = str(self._export())
        if self.proc.is_main:
            (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
            self.records.close()
            self.trackers.close()
            self.line.done(self._final_words(summary, ckpt))
        return summary

    def _export(self) -> Path:
        from dflash_pipeline.train.export import export_drafter

        return export_drafter(self.ema or self.model.state_dict(), self.dcfg, self.run_dir / "final", extra={
            "dflash_pipeline": {"store_fingerprint": self.store_fp, "step": self.step, "ema": self.cfg.optim.ema,
                                "init_from": self.cfg.model.init_from, "eval": self.last_eval,
                                "tool_version": __version__}})

    def _final_words(self, summary: dict[str, Any], ckpt: Path | None) -> str:
        if summary["finished"]:
            tau = self.last_eval.get("tau_chain", 0)
            return (f"trained {self.step} steps in {fmt_duration(summary['seconds'])}; drafter exported to "
                    f"{summary['final']}" + (f"; held-out acceptance estimate tau {tau:.2f}" if self.last_eval else ""))
        why = f"signal {self.stop.signal}" if self.stop.signal else f"--stop-after {self.cfg.output.stop_after}"
        return f"stopped at step {self.step}/{self.total} ({why}); checkpoint {ckpt}; continue with --resume"


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
