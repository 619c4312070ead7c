"""Frozen-head loss benchmark: our fused chunked loss (loss, gradient and metrics from one matmul per
chunk) against the naive materialised one (full logits, autograd), measured in the same run.

    python bench/loss.py [--n 4096 --hidden 64 --vocab 49152] [--kl 0.3 --cap 0.1] [--json OUT.json]

On a GPU use the step's shapes (e.g. --n 32768 --hidden 4096 --vocab 151936; the naive baseline then
needs ~60 GB). With a small hidden size the time is dominated by the passes over [chunk, vocab],
which is what this measures on a CPU.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

from common import save_json  # noqa: E402

from dflash_pipeline.train.loss import fused_head_loss, naive_head_loss  # noqa: E402


def timed(fn, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat + 1):  # first call warms up
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t)
    return best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--kl", type=float, default=0.0)
    ap.add_argument("--cap", type=float, default=0.0)
    ap.add_argument("--chunk", type=int, default=1024)
    ap.add_argument("--repeat", type=int, default=4)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    g = torch.Generator(device=dev).manual_seed(0)
    N, H, V = args.n, args.hidden, args.vocab
    h = torch.randn(N, H, device=dev, generator=g, dtype=dtype).requires_grad_()
    W = (torch.randn(V, H, device=dev, generator=g) * 0.1).to(dtype)
    labels = torch.randint(0, V, (N,), device=dev, generator=g)
    w = torch.rand(N, device=dev, generator=g)
    ids = torch.randint(0, V, (N, 32), device=dev, generator=g)
    lp = torch.log_softmax(torch.randn(N, 32, device=dev, generator=g), -1)

    def run(fn, **kw):
        h.grad = None
        fn(h, W, labels, w, ids, lp, kl_weight=args.kl, cap_weight=args.cap, **kw).loss.backward()

    fused = timed(lambda: run(fused_head_loss, chunk_size=args.chunk), args.repeat)
    naive = timed(lambda: run(naive_head_loss), args.repeat)
    res = {"device": torch.cuda.get_device_name(0) if dev == "cuda" else "cpu", "n": N, "hidden": H, "vocab": V,
           "kl": args.kl, "cap": args.cap, "fused_s": fused, "naive_s": naive, "speedup": naive / fused}
    print(f"{res['device']}: N={N} H={H} V={V} kl={args.kl} cap={args.cap}: fused {fused * 1e3:.0f} ms, "
          f"naive {naive * 1e3:.0f} ms -> {naive / fused:.2f}x")
    save_json(args.json, res)


if __name__ == "__main__":
    main()
