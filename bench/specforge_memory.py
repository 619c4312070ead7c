"""SpecForge 0.2's DFlash training step at a batch of the default recipe's shape: peak GPU memory and step
time for each size of its loss's chunks (`objective_chunk_blocks`), no store or target needed.

Why: at 64 anchors a sample and 49,152-token batches of the regenerated replies (~130-170 samples), its
loss held the LM head's output for the whole batch in one chunk and ran an 80 GB GPU out of memory
(BENCHMARKS.md, 2026-12-07). `bench/specforge_dflash.py` now sets the chunk per batch from a logits budget;
this measures what that costs and saves, on the same drafter shape (SmolLM2-135M's, 5 layers, vocab 49,152).

The batch is synthetic: `--samples` sequences whose lengths are drawn (seeded) around `--mean-len` and
capped at `--max-len`, one of them at `--max-len` (the padding a packed row's longest sample gives), the
first `--prompt-frac` of each unsupervised; random features and tokens (speed and memory do not depend on
the values). A chunk size that runs out of memory is reported as such, and the next one still runs.

    python bench/specforge_memory.py [--chunks 128,9,4] [--steps 6] [--json OUT.json]
    python bench/specforge_memory.py --smoke        # a tiny shape on the CPU (the test's)
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
import time
from types import SimpleNamespace

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

from common import int_list, save_json  # noqa: E402
from specforge_dflash import import_specforge, logits_bytes_per_anchor, objective_chunk_blocks, online_model  # noqa: E402

from dflash_pipeline.train.model import DrafterConfig  # noqa: E402
from dflash_pipeline.launch import resolve_device  # noqa: E402


def sample_lengths(n: int, mean_len: int, max_len: int, seed: int) -> list[int]:
    """`n` lengths, geometric-like around `mean_len`, in [8, max_len], the first at `max_len`."""
    g = torch.Generator().manual_seed(seed)
    draws = torch.empty(n).exponential_(1.0 / mean_len, generator=g).round().clamp(8, max_len).long().tolist()
    draws[0] = max_len
    return draws


def make_batch(lengths: list[int], F: int, V: int, prompt_frac: float, device, dtype, seed: int):
    """(input_ids [n, T], hidden [n, T, F], loss_mask [n, T]) zero-padded to the longest, as the adaptor feeds."""
    g = torch.Generator().manual_seed(seed)
    n, T = len(lengths), max(lengths)
    ids = torch.randint(0, V, (n, T), generator=g)
    hidden = torch.randn(n, T, F, generator=g).to(dtype)
    mask = torch.zeros(n, T)
    for i, length in enumerate(lengths):
        ids[i, length:], hidden[i, length:] = 0, 0
        mask[i, int(length * prompt_frac):length] = 1.0
    return ids.to(device), hidden.to(device), mask.to(device)


def smollm2_drafter(layers: int, block: int, V: int = 49152) -> DrafterConfig:
    return DrafterConfig(hidden_size=576, intermediate_size=1536, num_layers=layers, num_heads=9, num_kv_heads=3,
                         head_dim=64, vocab_size=V, block_size=block, mask_token_id=V - 1,
                         target_layer_ids=[1, 15, 28], num_target_layers=30, rope_theta=100000.0)


def measure(model, opt, batch, chunk: int, steps: int, device) -> dict:
    """Peak memory and median step time of `steps` SpecForge steps at loss chunks of `chunk` anchors."""
    cuda = device.type == "cuda"
    model.objective_chunk_blocks = chunk
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    try:
        for _ in range(steps):
            t = time.perf_counter()
            loss, _, _ = model(input_ids=batch[0], hidden_states=batch[1], loss_mask=batch[2])
            loss.backward()
            opt.step()
            if cuda:
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - t)
    except torch.OutOfMemoryError as e:
        asked = re.search(r"Tried to allocate [0-9.]+ [KMG]iB", str(e))
        first = asked.group(0) if asked else str(e).split(". ")[0]
        model.zero_grad(set_to_none=True)
        return {"chunk": chunk, "oom": True, "error": first, "steps_done": len(times),
                "peak_gb": torch.cuda.max_memory_allocated(device) / 1e9 if cuda else None}
    rest = sorted(times[1:] or times)  # the first step compiles flex attention's kernels
    return {"chunk": chunk, "oom": False, "loss": float(loss.detach()), "step_s": rest[len(rest) // 2],
            "peak_gb": torch.cuda.max_memory_allocated(device) / 1e9 if cuda else None, "steps": steps}


def run(*, samples: int, mean_len: int, max_len: int, anchors: int, block: int, layers: int, chunks: list[int],
        budget_gib: float, steps: int, prompt_frac: float, V: int, seed: int, device: str) -> dict:
    _, _, BF16Optimizer = import_specforge()
    dev = resolve_device(device)
    cuda = dev.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    dcfg = smollm2_drafter(layers, block, V)
    H = dcfg.hidden_size
    g = torch.Generator().manual_seed(seed)
    frozen = SimpleNamespace(embed_VH=(torch.randn(V, H, generator=g) * 0.02).to(dev),
                             head_VH=(torch.randn(V, H, generator=g) * 0.02).to(dev), embed_scale=1.0)
    model = online_model(dcfg, frozen, dev, num_anchors=anchors, gamma=7.0, seed=seed)
    opt = BF16Optimizer(model, lr=1e-4, weight_decay=0.0, max_grad_norm=1.0, total_steps=1000, warmup_ratio=0.0)
    lengths = sample_lengths(samples, mean_len, max_len, seed)
    batch = make_batch(lengths, len(dcfg.target_layer_ids) * H, V, prompt_frac, dev, dtype, seed)
    budget_chunk = objective_chunk_blocks(samples, block, V, budget_gib * 2**30)
    order = list(dict.fromkeys([*chunks, budget_chunk]))
    torch.manual_seed(seed)
    results = [measure(model, opt, batch, c, steps, dev) for c in order]
    gpu = torch.cuda.get_device_name(dev) if cuda else "cpu"
    out = {"gpu": gpu, "torch": torch.__version__, "samples": samples, "tokens": sum(lengths),
           "longest": max(lengths), "anchors": anchors, "block": block, "layers": layers, "vocab": V,
           "budget_gib": budget_gib, "budget_chunk": budget_chunk,
           "logits_gib_per_anchor": logits_bytes_per_anchor(samples, block, V) / 2**30, "results": results}
    base = next((r for r in results if r["chunk"] >= anchors and not r["oom"]), None)
    for r in results:
        if base and not r["oom"] and r is not base:
            r["step_vs_one_chunk"] = r["step_s"] / base["step_s"]
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=140)
    ap.add_argument("--mean-len", type=int, default=350)
    ap.add_argument("--max-len", type=int, default=3072)
    ap.add_argument("--anchors", type=int, default=64)
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--layers", type=int, default=5)
    ap.add_argument("--chunks", type=int_list, default=[128, 16, 4],
                    help="loss chunk sizes to measure (anchors); the budget's own is added")
    ap.add_argument("--budget-gib", type=float, default=2.0)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--prompt-frac", type=float, default=0.2)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--smoke", action="store_true", help="a tiny shape on the CPU")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    kw = dict(samples=a.samples, mean_len=a.mean_len, max_len=a.max_len, anchors=a.anchors, block=a.block,
              layers=a.layers, chunks=a.chunks, budget_gib=a.budget_gib, steps=a.steps, prompt_frac=a.prompt_frac,
              V=a.vocab, seed=a.seed, device=a.device)
    if a.smoke:
        kw.update(samples=4, mean_len=20, max_len=48, anchors=6, block=4, layers=1, chunks=[128, 2], steps=2,
                  V=256, budget_gib=4 * 4 * 256 * 2 * 3 / 2**30, device="cpu")
    out = run(**kw)
    for r in out["results"]:
        line = f"chunk {r['chunk']:>4}: " + ("OUT OF MEMORY (" + r["error"] + ")" if r["oom"] else
                                            f"{r['step_s'] * 1e3:.0f} ms/step")
        if r.get("peak_gb") is not None:
            line += f", peak {r['peak_gb']:.1f} GB"
        if "step_vs_one_chunk" in r:
            line += f", {r['step_vs_one_chunk']:.2f}x the one-chunk step"
        print(line)
    print(f"{out['samples']} samples, {out['tokens']} tokens (longest {out['longest']}), {out['anchors']} anchors x "
          f"{out['block']}: {out['logits_gib_per_anchor']:.3f} GiB of bf16 logits per anchor; budget "
          f"{out['budget_gib']} GiB -> chunk {out['budget_chunk']} on {out['gpu']}")
    save_json(a.json, out)


if __name__ == "__main__":
    main()
