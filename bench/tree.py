"""DDTree builder benchmark: what a tree costs per decoding round, and per held-out sequence in training.

    python bench/tree.py [--depth 15 --vocab 151936 --budgets 16,64,256 --anchors 3000] [--json OUT.json]
    python bench/tree.py --smoke        # tiny shapes on the CPU: checks this script

Measures, on the GPU when there is one:
- one anchor's tree (`build_tree`), as `dflash eval --tree-budget N` builds it every round: eagerly, and
  replayed from a CUDA graph (capturing it also proves the builder never waits for the host);
- the held-out estimate's trees (`reference_depths`) for the anchors of one long sequence, per budget;
- the whole builder under CUDA's sync debug mode set to "error": any device-to-host sync fails the run.
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

from dflash_pipeline.decoding.tree import build_trees, reference_depths, slot_topk, topk_for_budget  # noqa: E402


def timed(fn, repeat: int, cuda: bool) -> float:
    """Median seconds of `repeat` calls after one warm-up."""
    fn()
    times = []
    for _ in range(repeat):
        if cuda:
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--depth", type=int, default=15)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--budgets", default="16,64,256")
    ap.add_argument("--anchors", type=int, default=3000, help="anchors of one held-out sequence")
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.smoke:
        args.depth, args.vocab, args.budgets, args.anchors, args.repeat = 4, 64, "4,16", 40, 2
    cuda = torch.cuda.is_available() and not args.smoke
    dev = torch.device("cuda" if cuda else "cpu")
    budgets = [int(b) for b in args.budgets.split(",")]
    g = torch.Generator(device=dev).manual_seed(0)
    K = topk_for_budget(max(budgets), args.vocab)
    D, A = args.depth, args.anchors
    # Peaked per-slot distributions, like a trained drafter's (a few likely tokens per slot).
    lp, ids = [], []
    for a in range(0, A, 256):
        logits = torch.randn(min(256, A - a), D, args.vocab, device=dev, generator=g) * 4
        p, i = slot_topk(logits, K)
        lp.append(p)
        ids.append(i)
    lp, ids = torch.cat(lp), torch.cat(ids)
    ref = torch.where(torch.rand(A, D, device=dev, generator=g) < 0.7, ids[..., 0], ids[..., 1])
    res = {"device": torch.cuda.get_device_name(0) if cuda else "cpu", "depth": D, "vocab": args.vocab,
           "topk": K, "anchors": A, "budgets": {}}
    for N in budgets:
        one = lambda: build_trees(lp[:1], ids[:1], N)  # noqa: E731
        row = {"one_tree_eager_ms": timed(one, args.repeat, cuda) * 1e3}
        if cuda:
            torch.cuda.set_sync_debug_mode("error")
            try:
                one()
            finally:
                torch.cuda.set_sync_debug_mode(0)
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                one()  # warm-up on the capture stream
            torch.cuda.current_stream().wait_stream(s)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                captured = build_trees(lp[:1], ids[:1], N)
            graph.replay()
            eager = one()
            assert torch.equal(captured.tokens_AN, eager.tokens_AN) and torch.equal(captured.parents_AN,
                                                                                    eager.parents_AN)
            row["one_tree_graph_ms"] = timed(graph.replay, args.repeat, cuda) * 1e3
        row["sequence_s"] = timed(lambda: reference_depths(lp, ids, ref, N), max(1, args.repeat // 5), cuda)
        row["mean_depth"] = float(reference_depths(lp, ids, ref, N).float().mean())
        res["budgets"][N] = row
        print(f"{res['device']}: budget {N}: one tree {row['one_tree_eager_ms']:.2f} ms eager"
              + (f", {row['one_tree_graph_ms']:.3f} ms graphed" if cuda else "")
              + f"; {A} anchors' trees {row['sequence_s'] * 1e3:.0f} ms (mean accepted {row['mean_depth']:.2f})")
    save_json(args.json, res)


if __name__ == "__main__":
    main()
