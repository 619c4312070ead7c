"""SpecForge 0.2's DFlash trainer, fed from our feature store, and its drafter in our export format.

The side by side of `bench/quality.py` asks: at equal data, steps, batch, lr schedule and block size,
does our trainer give a drafter as good as SpecForge's, and are our steps faster? So SpecForge's own
pieces train here, unchanged: `DFlashDraftModel` (the drafter), `OnlineDFlashModel` (anchors, masks,
chunked checkpointed CE with position decay) and `BF16Optimizer` (AdamW over fp32 masters of bf16
weights, clipping, warmup + cosine). What is ours is only the plumbing around them:

- the batches are our loader's (`StreamingLoader`, same seed, rows, held-out split), so both trainers
  see the same samples in the same order. SpecForge does not pack: each sample is one sequence of its
  batch. A packed row is therefore split back into its samples, zero-padded to the longest (loss mask
  0 there). Its `num_anchors` is per sequence, as our `--max-anchors` is per sample, so the anchor
  budget is the same number on both sides;
- the target's frozen embedding and LM head come from the store (SpecForge loads them from the target);
- facts read from SpecForge's code: `hidden_states` is [batch, seq, n*H], the target layers concatenated
  in layer-id order, layer k = HF `hidden_states[k + 1]` (its `extract_context_feature` offset), i.e.
  exactly our store's `hidden` row; labels are same-position; a block sees context strictly before its
  anchor; the loss is CE weighted exp(-(k-1)/gamma), divided by the weight sum (ours without KL);
  masks are FlexAttention block masks (`_attn_implementation = "flex_attention"` on the GPU; on the CPU
  its dense-mask path with eager attention);
- the drafter's parameter names are those of the DFlash export (the authors' layout), so conversion is
  a check that nothing is missing or extra, then our `export_drafter` with the config of the same
  drafter (`tests/test_quality.py` checks that the converted drafter drafts what SpecForge's does).

Differences that stay SpecForge's own (reported in the result): bf16 weights with fp32 masters instead
of autocast over fp32 weights; its anchors drawn on the device. (Its AdamW beta2, 0.999, is our default
too since 2026-12-07; its cosine to 0 and Qwen3-style initialisation are ours by default as well.)

Legend: R rows, S row length, n samples of a batch, T longest sample, F = L*H features, V vocab, H hidden.
"""

from __future__ import annotations

import argparse
import json
import math
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

from dflash_pipeline.errors import DFlashError  # noqa: E402
from dflash_pipeline.launch import resolve_device  # noqa: E402
from dflash_pipeline.train.model import DrafterConfig  # noqa: E402

SPECFORGE_VERSION = "0.2"


def import_specforge():
    """(DFlashDraftModel, OnlineDFlashModel, BF16Optimizer), or one clear error without the wheel."""
    try:
        from specforge.algorithms.common.dflash_family_model import OnlineDFlashModel
        from specforge.modeling.draft.dflash import DFlashDraftModel
        from specforge.optimizer import BF16Optimizer
    except ImportError as e:
        raise DFlashError(f"SpecForge is not importable ({e}); install its wheel without dependencies: "
                          f"pip install --no-deps 'specforge=={SPECFORGE_VERSION}.*'") from None
    return DFlashDraftModel, OnlineDFlashModel, BF16Optimizer


def specforge_config(dcfg: DrafterConfig, attn_implementation: str):
    """The Qwen3Config SpecForge's `DFlashDraftModel` reads, for the drafter `dcfg` describes."""
    from transformers import Qwen3Config

    sliding = "sliding_attention" in dcfg.layer_types
    if sliding and not dcfg.sliding_causal:
        raise DFlashError("SpecForge's sliding layers are causal inside the block; a bidirectional "
                          "sliding drafter has no SpecForge counterpart")
    if sliding and dcfg.sliding_window < dcfg.block_size:
        # Its mask applies the window to context keys only, ours to block keys too: equal when W >= B.
        raise DFlashError(f"sliding window {dcfg.sliding_window} < block size {dcfg.block_size}: SpecForge's "
                          "sliding mask differs from ours there")
    cfg = Qwen3Config(
        hidden_size=dcfg.hidden_size, intermediate_size=dcfg.intermediate_size,
        num_hidden_layers=dcfg.num_layers, num_attention_heads=dcfg.num_heads,
        num_key_value_heads=dcfg.num_kv_heads, head_dim=dcfg.head_dim, rms_norm_eps=dcfg.rms_norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": dcfg.rope_theta},
        max_position_embeddings=dcfg.max_position_embeddings, vocab_size=dcfg.vocab_size,
        layer_types=list(dcfg.layer_types), use_sliding_window=sliding,
        sliding_window=dcfg.sliding_window if sliding else None, max_window_layers=dcfg.num_layers,
        attention_bias=False, tie_word_embeddings=False,
    )
    # The DFlash fields as attributes: config classes of some transformers versions drop unknown kwargs.
    cfg.block_size, cfg.num_target_layers = dcfg.block_size, dcfg.num_target_layers
    cfg.dflash_config = {"block_size": dcfg.block_size, "mask_token_id": dcfg.mask_token_id,
                         "target_layer_ids": list(dcfg.target_layer_ids)}
    cfg._attn_implementation = attn_implementation
    return cfg


def build_draft(dcfg: DrafterConfig, attn_implementation: str, seed: int = 0):
    """SpecForge's drafter for `dcfg`, initialised its own way (Qwen3's `_init_weights`)."""
    DFlashDraftModel, _, _ = import_specforge()
    torch.manual_seed(seed)
    return DFlashDraftModel(specforge_config(dcfg, attn_implementation))


def export_state(draft, dcfg: DrafterConfig) -> dict[str, torch.Tensor]:
    """SpecForge's drafter weights without its RoPE buffers: the export's own names (export_drafter checks
    them against `dcfg`, names and shapes)."""
    return {k: v for k, v in draft.state_dict().items() if not k.endswith("rotary_emb.inv_freq")}


def export_specforge(draft, dcfg: DrafterConfig, out: str | Path, extra: dict | None = None) -> Path:
    """SpecForge's drafter as config.json + model.safetensors in our export format (bf16)."""
    from dflash_pipeline.train.export import export_drafter

    try:
        return export_drafter(export_state(draft, dcfg), dcfg, out, extra=extra)
    except ValueError as e:
        raise DFlashError(f"SpecForge drafter does not map onto the DFlash export: {e}") from None


def unpack_rows(batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Packed rows -> one sequence per sample, zero-padded: input_ids [n, T], hidden [n, T, F], loss_mask [n, T]."""
    R, S = batch.tokens.shape
    index_nT = span_index(sample_spans(batch.host_fields()["doc"]), S, pad=R * S)
    index_nT = index_nT.to(batch.tokens.device, non_blocking=True)

    def gather(x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(R * S, *x.shape[2:])
        return torch.cat([flat, flat.new_zeros((1, *flat.shape[1:]))])[index_nT]  # the extra row: padding

    return gather(batch.tokens), gather(batch.features), gather(batch.loss_mask).to(torch.float32)


def logits_bytes_per_anchor(n_samples: int, block_size: int, vocab: int) -> int:
    """Bytes of bf16 logits one anchor adds to a chunk of SpecForge's loss: its block across every sequence."""
    return max(1, n_samples) * block_size * vocab * 2


def objective_chunk_blocks(n_samples: int, block_size: int, vocab: int, budget_bytes: float,
                           default: int = 128) -> int:
    """SpecForge's `objective_chunk_blocks` for a batch of `n_samples` sequences: the most anchors per chunk
    whose bf16 logits (samples x anchors x block x vocab) stay within `budget_bytes` (at least one), and never
    more than SpecForge's own default. Its loss computes one chunk of anchors across every sequence of the
    batch at a time, checkpointed: with SpecForge's 128 at 64 anchors, a 49,152-token batch of ~140 samples
    is one chunk of ~14 GB of logits, and its backward asked for 13-16 GiB more on an 80 GB GPU (2026-12-07).
    Chunking changes neither the loss nor the anchors drawn: only how much of the head's output exists at once."""
    return max(1, min(default, int(budget_bytes // logits_bytes_per_anchor(n_samples, block_size, vocab))))


def frozen_modules(frozen, dtype: torch.dtype) -> tuple[torch.nn.Module, torch.nn.Module]:
    """The target's embedding and LM head as the frozen modules `OnlineDFlashModel` takes."""
    if frozen.embed_scale != 1.0:
        raise DFlashError("SpecForge's DFlash trainer does not scale embeddings (a Gemma-style target)")
    V, H = frozen.embed_VH.shape
    embed = torch.nn.Embedding(V, H, _weight=frozen.embed_VH.detach().to(dtype).clone(), _freeze=True)
    head = torch.nn.Linear(H, V, bias=False, device=frozen.head_VH.device, dtype=dtype)
    head.weight = torch.nn.Parameter(frozen.head_VH.detach().to(dtype).clone(), requires_grad=False)
    return embed, head


def online_model(dcfg: DrafterConfig, frozen, dev: torch.device, *, num_anchors: int, gamma: float, seed: int = 0):
    """SpecForge's `OnlineDFlashModel` around a fresh drafter for `dcfg` and the target's frozen embedding and
    head, in training mode on `dev`: bf16 with FlexAttention on CUDA, fp32 with its eager/SDPA path on the CPU."""
    _, OnlineDFlashModel, _ = import_specforge()
    cuda = dev.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    embed, head = frozen_modules(frozen, dtype)
    model = OnlineDFlashModel(build_draft(dcfg, "flex_attention" if cuda else "eager", seed), head, embed,
                              dcfg.mask_token_id, block_size=dcfg.block_size,
                              attention_backend="flex_attention" if cuda else "sdpa", num_anchors=num_anchors,
                              loss_decay_gamma=gamma).to(device=dev, dtype=dtype)
    model.train()
    return model


def train_specforge(*, store: str, out: str | Path, steps: int, block_size: int = 16, gamma: float | None = None,
                    max_anchors: int = 512, tokens_per_batch: int = 12288, max_length: int = 3072,
                    num_layers: int = 5, lr: float = 6e-4, warmup_ratio: float = 0.04, grad_clip: float = 1.0,
                    eval_fraction: float = 0.02, eval_max_samples: int = 256, seed: int = 0, num_workers: int = 2,
                    log_every: int = 10, device: str = "auto", sliding_window: int | None = None,
                    swa_layers: list[int] | None = None, logits_budget_gib: float = 2.0,
                    progress=None) -> dict[str, Any]:
    """Train SpecForge's DFlash drafter on `store` for `steps`; export it to OUT/final; OUT/summary.json.

    The summary has the shape of `dflash train`'s (`eval` from our held-out evaluation of the exported
    drafter, `final`), plus steady-state step time and tokens/s measured like the trainer's log.
    `logits_budget_gib` bounds the LM head's output per chunk of SpecForge's loss (its own
    `objective_chunk_blocks`, set per batch by `objective_chunk_blocks`).
    """
    from dflash_pipeline.progress import JsonlLog, LiveLine
    from dflash_pipeline.schemas.config import TrainConfig
    from dflash_pipeline.store.reader import StoreReader
    from dflash_pipeline.method import default_gamma
    from dflash_pipeline.train.from_store import check_store_fits, drafter_config_for, frozen_tensors
    from dflash_pipeline.train.loader import StreamingLoader

    _, _, BF16Optimizer = import_specforge()
    line = progress or LiveLine()
    dev = resolve_device(device)
    cuda = dev.type == "cuda"
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tcfg = TrainConfig(store=store, out=str(out), steps=steps, num_layers=num_layers, block_size=block_size,
                       max_anchors=max_anchors, gamma=gamma, tokens_per_batch=tokens_per_batch,
                       max_length=max_length, lr=lr, warmup_ratio=warmup_ratio, grad_clip=grad_clip,
                       eval_fraction=eval_fraction, seed=seed, sliding_window=sliding_window,
                       swa_layers=list(swa_layers or []), device=dev.type)
    reader = StoreReader(store)
    check_store_fits(tcfg, reader)
    dcfg = drafter_config_for(tcfg.model, reader)
    gamma = gamma if gamma is not None else default_gamma(block_size)
    dtype = torch.bfloat16 if cuda else torch.float32
    model = online_model(dcfg, frozen_tensors(reader, dev, dtype), dev, num_anchors=max_anchors, gamma=gamma,
                         seed=seed)
    draft = model.draft_model
    opt = BF16Optimizer(model, lr=lr, weight_decay=0.0, max_grad_norm=grad_clip, total_steps=steps,
                        warmup_ratio=warmup_ratio)
    loader = StreamingLoader(reader, layers=dcfg.target_layer_ids, rank=0, world=1, seed=seed, row_len=max_length,
                             rows_per_batch=tcfg.data.rows_per_batch, eval_fraction=eval_fraction,
                             num_workers=num_workers, device=dev)
    line.say(f"SpecForge {SPECFORGE_VERSION} DFlash: {num_layers} layers, block {block_size}, gamma {gamma}, "
             f"{max_anchors} anchors per sample, {steps} steps of {tokens_per_batch} tokens on {dev}")
    metrics = JsonlLog(out / "metrics.jsonl")
    torch.manual_seed(seed)  # its anchors come from the global generator
    budget = logits_budget_gib * 2**30
    chunks_used: set[int] = set()
    t_run = time.time()
    intervals, t_log, tokens, loss_sum, acc_sum, k = [], time.time(), 0, 0.0, 0.0, 0
    step = 0
    try:
        for _, batch in loader.iter_from(0):
            ids_nT, hidden_nTF, mask_nT = unpack_rows(batch)
            model.objective_chunk_blocks = objective_chunk_blocks(ids_nT.shape[0], block_size, dcfg.vocab_size, budget)
            chunks_used.add(model.objective_chunk_blocks)
            loss, acc, _ = model(input_ids=ids_nT, hidden_states=hidden_nTF.to(dtype), loss_mask=mask_nT)
            loss.backward()
            opt.step()
            step += 1
            tokens += batch.num_tokens
            loss_sum, acc_sum, k = loss_sum + loss.detach(), acc_sum + acc.detach(), k + 1
            if step % log_every == 0 or step == steps:
                rec = {"type": "train", "step": step, "loss": float(loss_sum / k), "acc": float(acc_sum / k),
                       "lr": opt.get_learning_rate(), "grad_norm": float(opt.last_grad_norm)}
                now = time.time()  # the float() above waited for the device: the interval is complete
                rec["input_tok_s"] = tokens / (now - t_log)
                rec["step_s"] = (now - t_log) / k
                rec["objective_chunk_blocks"] = model.objective_chunk_blocks
                if cuda:
                    rec["peak_mem_gb"] = torch.cuda.max_memory_allocated(dev) / 1e9
                intervals.append(rec)
                metrics.write(rec)
                line.update(f"specforge step {step}/{steps} loss {rec['loss']:.3f} acc {rec['acc']:.3f} "
                            f"{rec['input_tok_s'] / 1e3:.1f}K tok/s"
                            + (f" mem {rec['peak_mem_gb']:.1f}G" if cuda else ""), force=True)
                t_log, tokens, loss_sum, acc_sum, k = now, 0, 0.0, 0.0, 0
            if step >= steps:
                break
    finally:
        loader.close()
    seconds = time.time() - t_run
    final = export_specforge(draft, dcfg, out / "final", extra={"dflash_pipeline": {
        "trained_by": f"specforge {SPECFORGE_VERSION} OnlineDFlashModel", "step": step}})
    res = exported_heldout_estimate(final, reader, loader.eval_rows()[:eval_max_samples], gamma=gamma,
                                    device=dev, max_anchors=max_anchors, loss_chunk=tcfg.runtime.loss_chunk)
    metrics.write({"type": "eval", **res, "step": step})
    metrics.close()
    summary = {"step": step, "steps_total": steps, "finished": step >= steps, "seconds": seconds,
               "final": str(final), "eval": res, "trainer": f"specforge {SPECFORGE_VERSION}",
               "steady": steady_state(intervals), "gamma": gamma,
               "peak_mem_gb": torch.cuda.max_memory_allocated(dev) / 1e9 if cuda else None,
               "objective_chunk_blocks": {"min": min(chunks_used, default=None),
                                          "max": max(chunks_used, default=None),
                                          "logits_budget_gib": logits_budget_gib},
               "differences": {"weights": "bf16 with fp32 masters (BF16Optimizer)", "anchors": "drawn on the device"}}
    (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    line.done(f"SpecForge trained {step} steps in {seconds:.0f}s; held-out tau_chain {res['tau_chain']:.2f}")
    return summary


def steady_state(intervals: list[dict[str, Any]]) -> dict[str, Any]:
    """Median tokens/s and step time over the logged intervals after the first (compilation, start-up)."""
    rest = intervals[1:] or intervals
    if not rest:
        return {}
    tok = sorted(r["input_tok_s"] for r in rest)
    st = sorted(r["step_s"] for r in rest if r.get("step_s") is not None)
    return {"input_tok_s": tok[len(tok) // 2], "step_s": st[len(st) // 2] if st else None,
            "intervals": len(rest)}


def exported_heldout_estimate(drafter_dir: Path, reader, rows, *, gamma: float, device: torch.device,
                              max_anchors: int, loss_chunk: int, new_tokens: int = 0,
                              tree_budgets: tuple[int, ...] = ()) -> dict[str, Any]:
    """Our held-out estimate (greedy-chain tau, accuracy per slot) of an exported drafter, computed as
    `dflash train` computes it for its own drafters."""
    from dflash_pipeline.train.export import load_exported
    from dflash_pipeline.train.from_store import frozen_tensors
    from dflash_pipeline.train.heldout import HeldoutSet, heldout_estimate

    if not len(rows):
        return {"tau_chain": math.nan, "samples": 0}
    cuda = device.type == "cuda"
    model, dcfg = load_exported(drafter_dir, dtype=torch.float32, device=device)
    model.eval()
    frozen = frozen_tensors(reader, device, torch.bfloat16 if cuda else torch.float32)
    held = HeldoutSet(reader=reader, rows=rows, frozen=frozen, drafter=dcfg, gamma=gamma, max_anchors=max_anchors,
                      loss_chunk=loss_chunk, device=device, autocast=cuda, new_tokens=new_tokens,
                      tree_budgets=tuple(tree_budgets))
    return heldout_estimate(model, held)


def main(argv: list[str] | None = None) -> None:
    """`python bench/specforge_dflash.py --store S --out DIR --steps N [...]`: one SpecForge training run."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--store", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, required=True)
    for name, typ in (("block-size", int), ("gamma", float), ("max-anchors", int), ("tokens-per-batch", int),
                      ("max-length", int), ("num-layers", int), ("lr", float), ("warmup-ratio", float),
                      ("grad-clip", float), ("eval-fraction", float), ("seed", int), ("num-workers", int),
                      ("log-every", int), ("sliding-window", int), ("logits-budget-gib", float)):
        p.add_argument(f"--{name}", type=typ, default=None)
    p.add_argument("--swa-layers", type=int_list, default=None, help="comma-separated layer ids, e.g. 0,1,2,3")
    p.add_argument("--device", default="auto")
    a = p.parse_args(argv)
    kw = {k: v for k, v in vars(a).items() if v is not None}
    try:
        train_specforge(**kw)
    except DFlashError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
