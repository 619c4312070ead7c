"""Online against offline training, timed in one process on the same batches (part `online` of quality.py).

An online DFlash trainer runs the target's forward pass in every step to get the features the drafter
reads; our pipeline runs it once (`dflash extract`) and streams the store. To time the two honestly,
this runs the same loop twice over the same batches of the store's loader, with the same drafter step
as `dflash train` (`run_blocks`, AdamW, clipping, the trainer's lr schedule):

  offline  features and teacher top-k as the loader decoded them from the store;
  online   features and top-k computed by the target in the step: the batch's samples, one right-padded
           sequence each, through extraction's own `TargetRunner` (hooks on the chosen layers, top-k of
           the log-softmax from the final hidden state), scattered back into the packed rows.

Online, the loader decodes only one layer (its features are replaced), so it does the least work an
online trainer's loader does plus little. The first `warmup` steps of each mode (compilation, kernel
selection) are not timed. The times per step, with extraction's and generation's measured times,
give both totals for the run lengths of `bench/quality.py` (offline: generate + extract + train;
online: generate + train with the target in the loop).

Legend: R rows, S row length, N real tokens, L captured layers, H hidden, K top-k, F = L*H.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

from common import int_list  # noqa: E402
from packed import sample_spans, span_index  # noqa: E402

from dflash_pipeline.train.batch import Batch  # noqa: E402
from dflash_pipeline.launch import resolve_device  # noqa: E402


def target_features(runner, batch: Batch, topk: int) -> Batch:
    """`batch` with its features (and top-k, when `topk`) computed by the target instead of read."""
    h = batch.host_fields()
    R, S = h["tokens"].shape
    spans = sample_spans(h["doc"])
    index_nT = span_index(spans, S, pad=0)
    lengths = [n for _, _, n in spans]
    ids_nT = h["tokens"].reshape(-1)[index_nT]
    out = runner.run_batch(ids_nT, lengths)  # real tokens, samples concatenated in span order
    keep_N = torch.cat([index_nT[i, :n] for i, n in enumerate(lengths)]).to(batch.tokens.device, non_blocking=True)
    N, L, H = out.hidden_NLH.shape
    device = batch.tokens.device
    # Fresh tensors written outside inference mode: autograd may save them for backward.
    feats = torch.zeros((R * S, L * H), dtype=batch.features.dtype, device=device)
    feats[keep_N] = out.hidden_NLH.reshape(N, L * H).to(device, feats.dtype)
    ids, lps = batch.topk_ids, batch.topk_logprobs
    if topk:
        ids = torch.zeros((R * S, topk), dtype=torch.long, device=device)
        lps = torch.zeros((R * S, topk), dtype=torch.float32, device=device)
        ids[keep_N] = out.topk_ids_NK.to(device, torch.long)
        lps[keep_N] = out.topk_logprobs_NK.to(device, torch.float32)
        ids, lps = ids.view(R, S, topk), lps.view(R, S, topk)
    return Batch(batch.tokens, batch.loss_mask, batch.pos, batch.doc, feats.view(R, S, L * H), ids, lps,
                 batch.num_tokens, batch.sample_ids, h)


def run_modes(*, store: str, target: str | None, out: str | Path, steps: int, warmup: int = 10,
              modes: tuple[str, ...] = ("offline", "online"), device: str = "auto", num_workers: int = 2,
              **train_kw) -> dict[str, Any]:
    """Time `steps` steps (after `warmup`) of each mode; returns and writes OUT/online.json."""
    from dflash_pipeline.extract.target import TargetRunner, embedding_scale, load_target, resolve_target
    from dflash_pipeline.schemas.config import TrainConfig
    from dflash_pipeline.store.reader import StoreReader
    from dflash_pipeline.train.from_store import check_store_fits, drafter_config_for, resolve_batch
    from dflash_pipeline.train.step import Frozen

    dev = resolve_device(device)
    cuda = dev.type == "cuda"
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = TrainConfig(store=store, out=str(out), steps=warmup + steps, device=dev.type, num_workers=num_workers,
                      **train_kw)
    reader = StoreReader(store)
    check_store_fits(cfg, reader)
    cfg = resolve_batch(cfg, reader)[0]   # options left to the store, as `dflash train` does
    dcfg = drafter_config_for(cfg.model, reader)
    dtype = torch.bfloat16 if cuda else torch.float32
    t = time.time()
    model = load_target(resolve_target(target), dtype, dev)
    load_s = time.time() - t
    kl_weight = cfg.loss.kl_for(reader.meta.topk)
    topk = reader.meta.topk if kl_weight > 0 else 0
    runner = TargetRunner(model, dcfg.target_layer_ids, topk=topk)
    ft = runner.frozen_tensors()
    frozen = Frozen(ft["embed"].to(dtype), ft.get("lm_head", ft["embed"]).to(dtype), embedding_scale(model))
    result: dict[str, Any] = {"steps": steps, "warmup": warmup, "device": str(dev), "target_load_s": load_s,
                              "train": {k: v for k, v in cfg.to_dict().items() if k in train_kw}, "modes": {}}
    try:
        for mode in modes:
            result["modes"][mode] = _time_mode(mode, cfg, reader, dcfg, frozen, runner, topk, dev, warmup, steps)
            print(f"{mode}: {result['modes'][mode]['step_s'] * 1e3:.1f} ms/step, "
                  f"{result['modes'][mode]['input_tok_s'] / 1e3:.1f}K tok/s", file=sys.stderr, flush=True)
    finally:
        runner.close()
    if {"offline", "online"} <= set(result["modes"]):
        result["online_over_offline_step"] = result["modes"]["online"]["step_s"] / result["modes"]["offline"]["step_s"]
    (out / "online.json").write_text(json.dumps(result, indent=1))
    return result


def _time_mode(mode, cfg, reader, dcfg, frozen, runner, topk, dev, warmup, steps) -> dict[str, Any]:
    from dflash_pipeline.method import default_gamma
    from dflash_pipeline.train.loader import StreamingLoader
    from dflash_pipeline.train.model import DFlashDrafter, DrafterOptions, init_drafter_weights
    from dflash_pipeline.train.step import NOISE_STREAM, draw_anchors, run_blocks, step_generator
    from dflash_pipeline.train.trainer import lr_at

    cuda = dev.type == "cuda"
    model, loss, optim, data = cfg.model, cfg.loss, cfg.optim, cfg.data
    gamma = loss.gamma if loss.gamma is not None else default_gamma(model.block_size)
    kl_weight = loss.kl_for(reader.meta.topk)
    torch.manual_seed(cfg.seed)
    drafter = DFlashDrafter(dcfg, DrafterOptions(compile_kernels=None if cfg.runtime.compile else False))
    init_drafter_weights(drafter, generator=torch.Generator().manual_seed(cfg.seed))
    drafter.to(dev)
    opt = torch.optim.AdamW(drafter.parameters(), lr=optim.lr, betas=optim.betas, weight_decay=optim.weight_decay,
                            fused=cuda)
    # Online, the loader's features are replaced: let it decode one layer, not all of them.
    layers = dcfg.target_layer_ids[:1] if mode == "online" else dcfg.target_layer_ids
    loader = StreamingLoader(reader, layers=layers, rank=0, world=1, seed=cfg.seed, row_len=data.max_length,
                             rows_per_batch=data.rows_per_batch, eval_fraction=data.eval_fraction,
                             num_workers=cfg.runtime.num_workers, device=dev)
    total = warmup + steps
    tokens, t0, marks = 0, None, []
    step = 0
    try:
        for _, batch in loader.iter_from(0):
            if step == warmup:
                if cuda:
                    torch.cuda.synchronize(dev)
                t0, loader.data_wait = time.perf_counter(), 0.0
            if mode == "online":
                # The target's share of the step, from events (a sync here would stall the host).
                a = _mark(cuda)
                batch = target_features(runner, batch, topk)
                if step >= warmup:
                    marks.append((a, _mark(cuda)))
            if step >= warmup:
                tokens += batch.num_tokens
            opt.zero_grad(set_to_none=True)
            anchors = draw_anchors(batch, loss.max_anchors, step_generator(cfg.seed, 0, step), model.block_size)
            res = run_blocks(drafter, frozen, batch, anchors, block_size=model.block_size,
                             mask_token_id=dcfg.mask_token_id, gamma=gamma, kl_weight=kl_weight,
                             cap_weight=loss.cap_weight, feature_noise=loss.feature_noise,
                             loss_chunk=cfg.runtime.loss_chunk,
                             g=step_generator(cfg.seed, 0, step, dev, NOISE_STREAM), autocast=cuda)
            res.loss.backward()
            for group in opt.param_groups:
                group["lr"] = lr_at(optim, step, total)
            torch.nn.utils.clip_grad_norm_(drafter.parameters(), optim.grad_clip)
            opt.step()
            step += 1
            if step >= total:
                break
        last_loss = float(res.loss.detach())  # waits for the last step
        seconds = time.perf_counter() - t0
    finally:
        loader.close()
    target_s = sum(_elapsed(a, b) for a, b in marks)
    return {"step_s": seconds / steps, "input_tok_s": tokens / seconds, "target_s_per_step": target_s / steps,
            "data_wait_s": loader.data_wait, "last_loss": last_loss, "steps": steps}


def _mark(cuda: bool):
    if not cuda:
        return time.perf_counter()
    ev = torch.cuda.Event(enable_timing=True)
    ev.record()
    return ev


def _elapsed(a, b) -> float:
    return b - a if isinstance(a, float) else a.elapsed_time(b) / 1e3


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--store", required=True)
    p.add_argument("--target", default=None)
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--modes", default="offline,online")
    p.add_argument("--device", default="auto")
    p.add_argument("--num-workers", type=int, default=2)
    for name, typ in (("num-layers", int), ("block-size", int), ("gamma", float), ("max-anchors", int),
                      ("tokens-per-batch", int), ("max-length", int), ("kl-weight", float), ("cap-weight", float),
                      ("feature-noise", float), ("sliding-window", int), ("lr", float), ("seed", int),
                      ("eval-fraction", float)):
        p.add_argument(f"--{name}", type=typ, default=None)
    p.add_argument("--swa-layers", type=int_list, default=None, help="comma-separated layer ids, e.g. 0,1,2,3")
    p.add_argument("--no-compile", action="store_true")
    a = p.parse_args(argv)
    fixed = {"store", "target", "out", "steps", "warmup", "modes", "device", "num_workers", "swa_layers", "no_compile"}
    kw = {k: v for k, v in vars(a).items() if v is not None and k not in fixed}
    if a.swa_layers:
        kw["swa_layers"] = a.swa_layers
    if a.no_compile:
        kw["compile"] = False
    run_modes(store=a.store, target=a.target, out=a.out, steps=a.steps, warmup=a.warmup,
              modes=tuple(m for m in a.modes.split(",") if m), device=a.device, num_workers=a.num_workers, **kw)


if __name__ == "__main__":
    main()
