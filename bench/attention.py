"""The target's attention over extraction's batch shapes: with transformers' padding mask, or causal only.

Extraction's batches are right-padded rows whose padded length changes from batch to batch (samples
sorted by length, a token budget per batch). transformers' SDPA path with a padding mask copies K and V
per query head and runs a masked kernel; without the mask, right padding under the causal mask is
already invisible to real tokens (what `dflash extract` now does). This measures both, per distinct
shape, the first call (which includes building a kernel for a new shape, e.g. cuDNN's per-shape graph)
and the warm calls, for Qwen3-8B's attention (32 query heads, 8 KV heads, head dim 128, bf16), and the
causal case under each SDPA backend forced.

    python bench/attention.py [--shapes 24] [--tokens-per-batch 16384] [--json OUT.json]
    python bench/attention.py --smoke    # tiny shapes on the CPU
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, os.path.dirname(__file__))

from common import save_json  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def _timed(fn) -> float:
    _sync()
    t = time.perf_counter()
    fn()
    _sync()
    return time.perf_counter() - t


def shapes(n: int, tokens_per_batch: int, lo: int, hi: int) -> list[tuple[int, int]]:
    """(rows, padded length) of n batches with distinct lengths spread over [lo, hi]."""
    out = []
    for i in range(n):
        S = lo + (hi - lo) * i // max(1, n - 1)
        out.append((max(1, tokens_per_batch // S), S))
    return out


def make_inputs(B: int, S: int, heads: int, kv: int, D: int, dtype):
    g = torch.Generator(device=DEVICE).manual_seed(S)
    q = torch.randn(B, heads, S, D, generator=g, device=DEVICE, dtype=dtype)
    k = torch.randn(B, kv, S, D, generator=g, device=DEVICE, dtype=dtype)
    v = torch.randn(B, kv, S, D, generator=g, device=DEVICE, dtype=dtype)
    # Right padding: row r has S - r * S // (2B) real tokens (the longest row is full).
    lengths = torch.tensor([S - r * S // (2 * B) for r in range(B)], device=DEVICE)
    return q, k, v, lengths


def padded_mask_call(q, k, v, lengths):
    """What transformers' SDPA does for a padded batch: a [B, 1, S, S] causal & padding mask, and K/V
    repeated to the query heads (SDPA's native GQA is only used without a mask)."""
    B, H, S, _ = q.shape
    rep = H // k.shape[1]
    pos = torch.arange(S, device=q.device)
    mask = (pos[None, :] <= pos[:, None])[None, None] & (pos < lengths[:, None])[:, None, None, :]
    k2 = k.repeat_interleave(rep, dim=1)
    v2 = v.repeat_interleave(rep, dim=1)
    return F.scaled_dot_product_attention(q, k2, v2, attn_mask=mask)


def causal_call(q, k, v, lengths):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def measure(name: str, call, shape_list, heads, kv, D, dtype, backend=None, warm_reps: int = 3) -> dict:
    cold, warm = [], []
    for B, S in shape_list:
        inputs = make_inputs(B, S, heads, kv, D, dtype)

        def run(inputs=inputs):
            if backend is None:
                call(*inputs)
            else:
                with sdpa_kernel([backend]):
                    call(*inputs)

        try:
            cold.append(_timed(run))
            warm.append(sorted(_timed(run) for _ in range(warm_reps))[warm_reps // 2])
        except RuntimeError as e:  # a backend that does not take these inputs
            return {"variant": name, "error": str(e).splitlines()[0][:200]}
        del inputs
    tokens = sum(B * S for B, S in shape_list)
    res = {"variant": name, "first_call_s": sum(cold), "warm_s": sum(warm),
           "first_call_extra_s": sum(cold) - sum(warm), "warm_tok_per_s": tokens / sum(warm),
           "shapes": len(shape_list)}
    print(f"  {name:<28} first calls {res['first_call_s']:.3f} s, warm {res['warm_s']:.3f} s "
          f"(first-call extra {res['first_call_extra_s'] * 1e3 / len(shape_list):.1f} ms per shape), "
          f"warm {res['warm_tok_per_s']:,.0f} tok/s", flush=True)
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", type=int, default=24)
    ap.add_argument("--tokens-per-batch", type=int, default=16384)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--json")
    args = ap.parse_args()
    heads, kv, D, dtype = 32, 8, 128, torch.bfloat16
    lo, hi, tpb = 640, 8192, args.tokens_per_batch
    if args.smoke or DEVICE == "cpu":
        heads, kv, D, dtype, lo, hi, tpb = 4, 2, 16, torch.float32, 32, 256, 512
    shape_list = shapes(args.shapes, tpb, lo, hi)
    name = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu"
    print(f"{name}: attention over {len(shape_list)} distinct batch shapes ({lo}..{hi} tokens per row, "
          f"{tpb} tokens per batch), {heads}/{kv} heads, head dim {D}, {dtype}", flush=True)
    variants = [("padded mask (transformers)", padded_mask_call, None), ("causal, no mask", causal_call, None)]
    if DEVICE == "cuda":
        variants += [("causal, cuDNN", causal_call, SDPBackend.CUDNN_ATTENTION),
                     ("causal, flash", causal_call, SDPBackend.FLASH_ATTENTION),
                     ("causal, mem-efficient", causal_call, SDPBackend.EFFICIENT_ATTENTION),
                     ("padded mask, cuDNN", padded_mask_call, SDPBackend.CUDNN_ATTENTION)]
    # Each variant gets its own lengths (8 apart), so that no variant finds a kernel another one built.
    results = [measure(n, c, [(B, S + 8 * i) for B, S in shape_list], heads, kv, D, dtype, b)
               for i, (n, c, b) in enumerate(variants)]
    for r in results:
        if "error" in r:
            print(f"  {r['variant']:<28} not run: {r['error']}")
    save_json(args.json, {"device": name, "torch": torch.__version__, "shapes": shape_list, "results": results})


if __name__ == "__main__":
    main()
