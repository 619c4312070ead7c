"""Where a graphed decode step's time goes: the kernels of one step of `DecodingRunner`, by GPU time.

The graphed step of a SmolLM2-shaped target took 3.3 ms (its weights alone need ~0.06 ms of memory
traffic) and a Qwen3-8B-shaped one 10.3 ms against a 3.15 ms bound: a cost per layer that does not
scale with the weights. This profiles the same step run eagerly (same kernels as the graph, which
only removes the launches) and prints the kernels by total GPU time, the number of kernels per step
and per layer, and the graph replay time next to the summed kernel time.

    python bench/profile_decode.py --shape smollm2|qwen3-8b [--context 1024] [--steps 20] [--json OUT]
        [--rows 128 --split-decode]   # a `dflash generate` step: rows of contexts spread over [context/2, context]
        [--compile]                   # the layers compiled before capture (`--compile` of eval and generate)
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

from common import save_json  # noqa: E402
from eval import QWEN3_8B, SMOKE_SMOL, SMOLLM2, median_ms, random_target  # noqa: E402


def profile(shape: dict, family: str, context: int, steps: int, top: int, rows: int = 1, split_decode: bool = False,
            compile: bool = False) -> dict:
    from torch.profiler import ProfilerActivity, profile as torch_profile

    from dflash_pipeline.decoding.runner import DecodingRunner

    cuda = torch.cuda.is_available()
    model = random_target(shape, family)
    prompt = torch.randint(0, shape["vocab_size"], (context,), generator=torch.Generator().manual_seed(0)).tolist()
    # one row: the whole context; several (a generation step): lengths spread over [context/2, context]
    lengths = [context] if rows == 1 else [context // 2 + (context // 2) * r // (rows - 1) for r in range(rows)]
    results = {}
    for graphs in ((True, False) if cuda else (False, False)):
        runner = DecodingRunner(model, rows=rows, max_len=context + 16, graphs=graphs, split_decode=split_decode,
                                compile=compile)
        for r, n in enumerate(lengths):
            runner.prefill(r, prompt[:n])

        def step() -> None:
            runner.set_lengths(lengths)
            runner.step(1)

        results["graph_ms" if graphs and cuda else "eager_ms"] = median_ms(step, 20)
        results.setdefault("graph_ms", float("nan"))
        if not graphs:
            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
            with torch_profile(activities=acts) as prof:
                for _ in range(steps):
                    step()
                if cuda:
                    torch.cuda.synchronize()
        runner.close()
    events = [e for e in prof.key_averages() if (e.device_type.name == "CUDA" if cuda else e.cpu_time_total > 0)]
    attr = "device_time_total" if cuda else "self_cpu_time_total"
    events.sort(key=lambda e: getattr(e, attr, 0.0), reverse=True)
    kernels = [e for e in events if cuda]
    total_us = sum(getattr(e, attr, 0.0) for e in kernels) / steps
    n_kernels = sum(e.count for e in kernels) / steps
    top_kernels = [{"name": e.key[:90], "us_per_step": getattr(e, attr, 0.0) / steps, "calls_per_step": e.count / steps}
                   for e in events[:top]]
    L = shape["num_hidden_layers"]
    out = {**results, "kernel_us_per_step": total_us, "kernels_per_step": n_kernels,
           "kernels_per_layer": n_kernels / L, "top": top_kernels, "context": context, "layers": L,
           "rows": len(lengths), "mean_context": sum(lengths) / len(lengths), "split_decode": split_decode,
           "compile": compile}
    print(f"graph {results['graph_ms']:.2f} ms, eager {results['eager_ms']:.2f} ms, kernels {total_us / 1e3:.2f} ms "
          f"in {n_kernels:.0f} kernels ({n_kernels / L:.1f} per layer)")
    for r in top_kernels:
        print(f"  {r['us_per_step']:9.1f} us  x{r['calls_per_step']:6.1f}  {r['name']}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="smollm2", choices=("smollm2", "qwen3-8b"))
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--json", default=None)
    ap.add_argument("--rows", type=int, default=1, help="rows in the step (a generation step: 128)")
    ap.add_argument("--split-decode", action="store_true", help="the split decode kernel, as `dflash generate`")
    ap.add_argument("--compile", action="store_true", help="the layers compiled before capture")
    ap.add_argument("--smoke", action="store_true")
    a = ap.parse_args()
    shape, family = {"smollm2": (SMOLLM2, "llama"), "qwen3-8b": (QWEN3_8B, "qwen3")}[a.shape]
    if a.smoke:
        shape, a.context, a.steps = SMOKE_SMOL, 64, 2
    save_json(a.json, profile(shape, family, a.context, a.steps, a.top, a.rows, a.split_decode, a.compile))


if __name__ == "__main__":
    main()
