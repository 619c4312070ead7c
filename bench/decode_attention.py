"""The decode-time attention alone: which kernel reads a static KV cache fastest at decoding's shapes.

`bench/profile_decode.py` found the attention of a graphed decode step to be 46% of a SmolLM2-shaped
step and 19% of a Qwen3-8B-shaped one (49-63 us per layer for a few MB of K/V): the memory-efficient
SDPA kernel that `decoding.attention.folded_attention` calls tiles over queries, and a decode step folds
only g*q = 3-4 queries onto each KV head, so its grid is one block per (row, KV head). This times, per
call and inside a CUDA graph as the runner runs them, the candidates on the same inputs (folded queries,
an additive mask over the attended slots, as `StepState` builds it):

  sdpa   `folded_attention` with DFLASH_DECODE_ATTENTION=sdpa (SDPA, memory-efficient or math backend)
  math   the same attention written out: Q K^T (one batched GEMM over the slots, which cuBLAS spreads
         over the whole GPU), + mask, softmax in fp32, P V (a long-K GEMM: split-K)
  math-upcast  the same with the scores in fp32 (Q, K upcast first): `math` rounds scores to bf16, which
         is 2-4x SDPA's error (measured 2026-12-02) and matters to the lossless check's tie rule
  math-f32out  the same with fp32 scores out of the bf16 GEMM itself (`torch.bmm(..., out_dtype=float32)`,
         CUDA): the library's `written_out_attention`, the default kernel on CUDA since the 2026-12-02 run
         (1.3-2.6x SDPA's speed at every shape; the upcast form was 3x slower than SDPA at 128 rows)
  split  the split-KV Triton kernel (decoding/split_attention.py), one-token steps only: each row's own
         slots, K/V once per KV head, the slots split over programs when rows x heads do not fill the GPU;
         the default for one-token steps on CUDA since 2026-12-02 (second run)
  flex   FlexAttention, compiled, the mask as a score_mod (its decoding kernel splits the slots over
         blocks for short queries)
  flex-sparse  the same with a block mask built from each row's length: a row reads only the K/V blocks
         that hold its slots, not the whole bucket the longest row sets (rows here span half the bucket
         to all of it)

for the decode step (q=1), the block-16 verify and a budget-64 tree verify (q=65), SmolLM2 and Qwen3-8B
head layouts at batch 1, and `dflash generate`'s steps (64 / 128 rows). Each candidate's output is checked
against an fp32 reference first. Choosing one for `folded_attention` is what this is for.

    python bench/decode_attention.py [--slots 1088] [--json OUT]     # the GPU
    python bench/decode_attention.py --smoke                          # tiny, CPU: checks the script
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

from common import save_json  # noqa: E402
from eval import DEVICE, median_ms  # noqa: E402

from dflash_pipeline.decoding.graphs import GraphedStep  # noqa: E402

# name: (rows, KV heads, queries per KV head g, new tokens q, head dim)
CASES = {
    "smollm2 decode": (1, 3, 3, 1, 64), "smollm2 verify 16": (1, 3, 3, 16, 64), "smollm2 tree 64": (1, 3, 3, 65, 64),
    "qwen3-8b decode": (1, 8, 4, 1, 128), "qwen3-8b verify 16": (1, 8, 4, 16, 128), "qwen3-8b tree 64": (1, 8, 4, 65, 128),
    "smollm2 generate x64": (64, 3, 3, 1, 64), "qwen3-8b generate x128": (128, 8, 4, 1, 128),
}


def inputs(R: int, hk: int, g: int, q: int, D: int, S: int, dtype: torch.dtype):
    """Folded queries [R, hk, g*q, D], K/V [R, hk, S, D] and the mask [R, 1, g*q, S] of rows whose committed
    lengths spread over the attended slots (the longest fills them), as `StepState` builds it."""
    from dflash_pipeline.decoding.attention import fold_mask, target_visible

    gen = torch.Generator().manual_seed(0)
    rnd = lambda *shape: torch.randn(*shape, generator=gen).to(DEVICE, dtype)  # noqa: E731
    lengths = torch.linspace(S // 2, S - q, R).long().to(DEVICE)
    causal = torch.ones(q, q, dtype=torch.bool, device=DEVICE).tril()[None].expand(R, q, q)
    mask = fold_mask(target_visible(lengths, causal, S), g, dtype)
    return rnd(R, hk, g * q, D), rnd(R, hk, S, D), rnd(R, hk, S, D), mask


def sdpa(q, k, v, mask, scale):
    """What `folded_attention` calls with DFLASH_DECODE_ATTENTION=sdpa, on the same folded layout."""
    from dflash_pipeline.train.masks import attend

    return attend(q, k, v, mask, scale)


def math(q, k, v, mask, scale):
    scores = torch.matmul(q * scale, k.transpose(2, 3)) + mask
    return torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(v.dtype), v)


def math_upcast(q, k, v, mask, scale):
    """`math` with the scores in fp32, Q and K upcast before Q K^T (a copy of K in fp32 per call): the
    library's first fp32-score form. `math` rounds the scores to bf16 before the softmax (a step of 0.125
    at a score of 16)."""
    scores = torch.matmul(q.float(), k.float().transpose(2, 3)) * scale + mask
    return torch.matmul(torch.softmax(scores, dim=-1).to(v.dtype), v)


def math_f32out(q, k, v, mask, scale):
    """`math` with the scores in fp32 straight out of the bf16 GEMM (`out_dtype`, CUDA; the upcast form
    elsewhere), no copy of K, the scale applied to the fp32 scores with the mask: the library's
    `written_out_attention`, what `folded_attention` runs on CUDA by default (DFLASH_DECODE_ATTENTION=auto)."""
    from dflash_pipeline.decoding.attention import written_out_attention

    return written_out_attention(q, k, v, mask, scale)


def split(q, k, v, mask, scale):
    """The split-KV Triton kernel (decoding/split_attention.py), what one-token steps run on CUDA by default:
    one program per (row, KV head, chunk of slots) that stops at the row's own length (read here from the
    mask's visible slots, outside the timed call: the runner keeps the lengths on the device)."""
    from dflash_pipeline.decoding.split_attention import split_decode_attention

    n = SPLIT_LENGTHS.get(id(mask))
    if n is None:
        raise ValueError("one-token steps only (q = 1)")
    return split_decode_attention(q, k, v, n, scale)


SPLIT_LENGTHS: dict[int, torch.Tensor] = {}   # id(mask) -> visible slots per row, for `split` (q = 1 cases)


def make_flex(compile: bool, sparse: bool, block: int = 128):
    """FlexAttention with the mask as a score_mod; `sparse`: also a block mask from each row's length, so that
    a row reads only the K/V blocks that hold its slots (the attended bucket is the longest row's)."""
    from torch.nn.attention.flex_attention import flex_attention

    run = torch.compile(flex_attention, dynamic=False) if compile else flex_attention

    def flex(q, k, v, mask, scale):
        def bias(score, b, h, i, j):
            return score + mask[b, 0, i, j]
        block_mask = row_blocks(mask, block) if sparse else None
        return run(q, k, v, score_mod=bias, block_mask=block_mask, scale=scale, enable_gqa=False)
    return flex


def row_blocks(mask: torch.Tensor, block: int = 128):
    """The block mask of `flex-sparse`: each row's queries read K/V blocks 0 .. the one holding its last
    visible slot (the mask's last finite column), nothing past it. Device ops only (graph-capturable)."""
    from torch.nn.attention.flex_attention import BlockMask

    R, _, G, S = mask.shape
    seen_RS = torch.isfinite(mask[:, 0]).any(dim=1)
    end_R = S - seen_RS.flip(1).int().argmax(dim=1)
    q_blocks, kv_blocks = -(-G // block), -(-S // block)
    n = (-(-end_R // block)).int()[:, None, None].expand(R, 1, q_blocks).contiguous()
    idx = torch.arange(kv_blocks, device=mask.device, dtype=torch.int32).expand(R, 1, q_blocks, kv_blocks)
    return BlockMask.from_kv_blocks(n, idx.contiguous(), BLOCK_SIZE=block, seq_lengths=(G, S))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--slots", type=int, default=1088, help="attended slots (the runner's bucket at ~1K context)")
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--json", default=None)
    ap.add_argument("--smoke", action="store_true")
    a = ap.parse_args()
    cases = {k: v for k, v in CASES.items() if not a.smoke or "generate" not in k}
    S, iters = (64, 3) if a.smoke else (a.slots, a.iters)
    cuda = DEVICE == "cuda"  # on the CPU the flex candidates run uncompiled: a check of their masks only
    dtype = torch.bfloat16 if cuda else torch.float32
    variants = {"sdpa": sdpa, "math": math, "math-upcast": math_upcast, "math-f32out": math_f32out,
                "split": split, "flex": make_flex(cuda, False), "flex-sparse": make_flex(cuda, True)}
    out = {"device": torch.cuda.get_device_name() if cuda else "cpu", "slots": S, "dtype": str(dtype),
           "torch": torch.__version__, "cases": {}}
    print(f"{'case':24} " + " ".join(f"{n + ' us':>10}" for n in variants) + "   max |err| vs fp32 per variant")
    for name, (R, hk, g, q, D) in cases.items():
        q_, k_, v_, mask = inputs(R, hk, g, q, D, S, dtype)
        visible_R = torch.isfinite(mask[:, 0, 0]).sum(-1)
        SPLIT_LENGTHS.clear()   # an earlier case's mask is gone and its id may be reused: only this case's
        if q == 1:
            SPLIT_LENGTHS[id(mask)] = visible_R
        scale = D ** -0.5
        # what a kernel must read: K and V of the visible slots (each row's own), and of the whole bucket
        slot_bytes = 2 * hk * D * k_.element_size()
        kv_bytes = {"kv_bytes_visible": int(visible_R.sum()) * slot_bytes, "kv_bytes_bucket": R * S * slot_bytes}
        ref = math(q_.float(), k_.float(), v_.float(), mask.float(), scale)
        row = {}
        for vname, fn in variants.items():
            try:
                err = (fn(q_, k_, v_, mask, scale).float() - ref).abs().max().item()
                # captured in a CUDA graph on its first (warm-up) call, as the decoding runner replays it
                step = GraphedStep(lambda fn=fn: fn(q_, k_, v_, mask, scale), torch.device(DEVICE), warmup=3)
                us = 1e3 * median_ms(step, iters)
                row[vname] = {"us": us, "max_abs_err": err}
            except Exception as e:  # a candidate that cannot run a shape says why, the others still run
                row[vname] = {"error": f"{type(e).__name__}: {e}"[:300]}
        out["cases"][name] = {"rows": R, "kv_heads": hk, "g": g, "q": q, "head_dim": D, **kv_bytes, **row}
        print(f"{name:24} " + " ".join(f"{r['us']:>10.1f}" if "us" in r else f"{'error':>10}" for r in row.values())
              + "   " + " ".join(f"{r.get('max_abs_err', float('nan')):.1e}" for r in row.values()))
        save_json(a.json, out)


if __name__ == "__main__":
    main()
