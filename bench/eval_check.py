"""`dflash eval` on GPUs: the lossless check per dtype and the prompts divided over every GPU.

What the CPU tests cannot show, on a random SmolLM2-shaped target (bf16 weights; no real weights reach
the GPU machine) and a random 5-layer drafter, over two prompt files (run_eval, graphed decoding):

  bf16   the default dtype on a GPU: the verify and decode kernels differ, so tie divergences may
         occur; the run must still be lossless (no divergence at a clear margin, exit code 0). The ties
         are listed with their margins, each within the rule's 12 ulp of bf16 at its logit.
  fp32   `--dtype fp32`: exact, token for token (lossless, and no tie by the rule).
  gpus   with 2+ GPUs, the bf16 run on every GPU: one merged report (processes = GPUs) and the same
         tokens for every prompt as on one GPU (the per-prompt records compared).

    python bench/assets.py     # here, once: .bench_assets/tokenizer (carry it to the GPU machine)
    python bench/eval_check.py --tokenizer .bench_assets/tokenizer --work /tmp/eval-check [--json OUT.json]
        [--prompts 16] [--new-tokens 256]
    python bench/eval_check.py --smoke --tokenizer .bench_assets/tokenizer   # tiny shapes, 2 CPU processes
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

from common import save_json  # noqa: E402
from eval import DEVICE, DTYPE, SMOKE_SMOL, SMOLLM2, random_drafter, save_random_target, write_prompts  # noqa: E402


def code_prompts(path: str, n: int) -> str:
    """A second prompt file, so that the report's per-file numbers are exercised."""
    with open(path, "w") as f:
        for i in range(n):
            f.write(json.dumps({"prompt": f"def f{i}(x):\n    # return x times {i} plus the sum of 1..{i}"}) + "\n")
    return path


def one_run(name: str, files: list[str], target: str, drafter: str, work: str, args, **kw) -> dict:
    from dflash_pipeline.eval.run import EvalConfig, run_eval
    from dflash_pipeline.progress import LiveLine

    records = os.path.join(work, f"records-{name}.jsonl")
    cfg = EvalConfig(drafter=drafter, target=target, prompts=files, num_prompts=args.prompts,
                     max_new_tokens=args.new_tokens, records=records, **kw)
    t = time.perf_counter()
    rep = run_eval(cfg, LiveLine(log_every=10.0))
    out = {k: rep.get(k) for k in ("lossless", "lossless_rule", "dtype", "processes", "devices", "decoding", "prompts",
                                   "generated_tokens", "tau", "speedup", "tok_s_spec", "tok_s_target",
                                   "num_tie_divergences")}
    out["wall_s"] = time.perf_counter() - t
    out["per_file"] = {f: {k: v[k] for k in ("prompts", "tau", "speedup", "num_tie_divergences")}
                       for f, v in rep["per_file"].items()}
    out["ties"] = [{k: d[k] for k in ("file", "prompt", "position", "top1", "top2", "margin", "against")}
                   for d in rep["tie_divergences"][:20]]
    out["failures"] = rep["mismatch_details"][:5]
    with open(records) as f:
        out["tokens"] = [json.loads(line)["tokens"] for line in f]
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer", default=".bench_assets/tokenizer")
    ap.add_argument("--work", default="/tmp/dflash-eval-check")
    ap.add_argument("--prompts", type=int, default=16, help="prompts per file (two files)")
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--json", default=None)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU, two processes for 'gpus'")
    args = ap.parse_args()
    os.makedirs(args.work, exist_ok=True)
    shape = SMOKE_SMOL if args.smoke else SMOLLM2
    if args.smoke:
        args.prompts, args.new_tokens = 3, 12

    from dflash_pipeline.train.export import export_drafter

    target = save_random_target(os.path.join(args.work, "smollm2-random"), args.tokenizer, shape)
    model, dcfg = random_drafter(shape, 5, 16, shape["num_hidden_layers"])
    drafter = str(export_drafter(model, dcfg, os.path.join(args.work, "drafter-random"), dtype=DTYPE))
    del model
    files = [write_prompts(os.path.join(args.work, "chat.jsonl"), args.prompts),
             code_prompts(os.path.join(args.work, "code.jsonl"), args.prompts)]
    gpus = torch.cuda.device_count() if DEVICE == "cuda" else 0
    out = {"date": time.strftime("%Y-%m-%d"), "device": torch.cuda.get_device_name(0) if gpus else "cpu",
           "gpus": gpus, "smoke": args.smoke}
    device = {"device": "cuda"} if gpus else {"device": "cpu"}
    runs = [("bf16", dict(dtype="bf16", gpus="1", **device)), ("fp32", dict(dtype="fp32", gpus="1", **device))]
    if gpus >= 2 or args.smoke:
        runs.append(("gpus", dict(dtype="bf16", gpus="all", num_procs=2, **device)))
    for name, kw in runs:
        out[name] = one_run(name, files, target, drafter, args.work, args, **kw)
        save_json(args.json, out)
        print("\n".join(summary(out, name)), flush=True)
    print("\n== summary\n" + "\n".join(line for name, _ in runs for line in summary(out, name)))


def summary(out: dict, name: str) -> list[str]:
    r = out[name]
    lines = [f"{name}: {r['processes']} process(es) on {r['devices']}, {r['decoding']}, {r['dtype']}: lossless "
             f"{r['lossless']}, {r['num_tie_divergences']} tie divergences, {len(r['failures'])} failures shown; "
             f"tau {r['tau']:.2f}, speedup {r['speedup']:.2f}x, {r['wall_s']:.0f} s; per file "
             + ", ".join(f"{os.path.basename(f)} tau {v['tau']:.2f}" for f, v in r["per_file"].items())]
    if r["ties"]:
        lines.append(f"  first ties (margin, top1): " + ", ".join(f"{t['margin']:.4g} at {t['top1']:.4g}"
                                                                  for t in r["ties"][:8]))
    want = {"bf16": "want: lossless True", "fp32": "want: lossless True, 0 ties",
            "gpus": "want: lossless True, processes = GPUs, every prompt's tokens equal the bf16 one-GPU run"}[name]
    if name == "gpus":
        same = sum(a == b for a, b in zip(r["tokens"], out["bf16"]["tokens"]))
        r["same_tokens_as_one_gpu"] = f"{same}/{len(r['tokens'])}"
        lines.append(f"  same tokens as one GPU: {same}/{len(r['tokens'])} prompts")
    return lines + [f"  ({want})"]


if __name__ == "__main__":
    main()
