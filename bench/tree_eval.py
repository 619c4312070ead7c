"""DDTree budget sweep of `dflash eval` on one GPU: per tree budget, tau, tok/s, the speedup over plain
decoding and the tree's verify step time, all measured in one run on the same prompts.

What a user picks a budget by is the measured speedup; what it is made of is tau (more nodes, more
accepted) against the verify step of N + 1 tokens (more nodes, a longer step). The library behind
`dflash eval --tree-budget 0,16,64,256` (`decode_prompts` and `build_report`, or `run_eval` for a real
pair) decodes every prompt with the target alone and then with the drafter at each budget (0: the
chain), on the graphed runner, so the numbers below come from the same process, the same captured
graphs and the same prompts:

  tau, tok/s, speedup    measured, per budget (speedup: over plain decoding of the same prompts)
  verify_ms, tree_ms     median tree verify step (q = N + 1) and tree construction, CUDA events
  verify_over_decode     the verify step over one plain decode step: the cost of the budget
  speedup_at_tau         tau * decode / (verify + drafter + tree) at tau = 2..8: the speedup those
                         step times allow, to read against a tau measured elsewhere (e.g. training's
                         held-out tau_tree_N, or a real pair below)

By default the target is random (Qwen3-8B-shaped; `--shape smollm2` for SmolLM2-135M's) and so is the
drafter: no weights reach the GPU machine, and speed does not depend on the weights. A random drafter
never agrees with the target, so its logits are steered after its (real, graphed) step towards the
target's greedy continuation with a known profile (`--top1 0.8`: the right token is the first guess at
a slot 80% of the time, else the second, third, ... guess with probability halving per rank): tau is
then synthetic, but it is tau > 1 with second guesses that a tree can use, every round runs the whole
machinery (paths of every length compacted on the device), and the measured speedups include every
overhead. `--top1 0` leaves the drafter as it is (tau near 1: the pure cost of each budget). With a real
pair (`--target MODEL --drafter DIR`, e.g. the SmolLM2 GGUF and a drafter trained by bench/quality.py)
the same sweep runs through `run_eval` on real prompts and tau is real.

    python bench/tree_eval.py --json OUT.json [--budgets 0,16,64,256] [--shape qwen3-8b|smollm2]
        [--context 512] [--prompts 16] [--new-tokens 256] [--top1 0.8]
    python bench/tree_eval.py --target MODEL --drafter DIR [--prompt-file FILE.jsonl] --json OUT.json
    python bench/tree_eval.py --smoke      # tiny shapes on the CPU: checks this script
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

from common import int_list, save_json  # noqa: E402
from eval import (  # noqa: E402
    DEVICE, DTYPE, QWEN3_8B, SMOKE_QWEN, SMOKE_SMOL, SMOLLM2, random_drafter, random_prompts, random_target,
)

SHAPES = {"qwen3-8b": (QWEN3_8B, "qwen3"), "smollm2": (SMOLLM2, "llama")}
SMOKE_SHAPES = {"qwen3-8b": (SMOKE_QWEN, "qwen3"), "smollm2": (SMOKE_SMOL, "llama")}
TAUS = range(2, 9)


class SyntheticAcceptance:
    """The random drafter's own step (graphed, its real cost), its logits then steered so that the target's
    greedy continuation sits at a known rank in every slot: rank 0 with probability `top1`, else 1, 2, ...
    with probability halving at each rank, absent from the top MAX_RANK + 1 beyond. The steering of every
    (anchor position, slot) is drawn once per prompt and kept on the device, so every budget meets the
    same drafter and a round adds one gather-scatter and no host synchronisation."""

    MAX_RANK = 7

    def __init__(self, inner, top1: float):
        self.inner, self.top1, self.block_size = inner, top1, inner.block_size
        self.cols_TDR = self.vals_TDR = None

    def follow(self, sequence: list[int], vocab: int, seed: int, device) -> None:
        """Steer towards `sequence` (prompt + the target's greedy continuation) from now on."""
        g = torch.Generator().manual_seed(seed)
        T, D, R = len(sequence), self.block_size - 1, self.MAX_RANK + 1
        seq = torch.tensor(sequence + [0] * (D + 1))
        right_TD = seq[torch.arange(T)[:, None] + 1 + torch.arange(D)]
        miss = torch.rand(T, D, generator=g) >= self.top1
        later = 1 + (torch.rand(T, D, generator=g).log() / math.log(0.5)).floor().long()  # 1: 1/2, 2: 1/4, ...
        rank_TD = torch.where(miss, later, 0).clamp_max(R)
        # R forced tokens per slot at logits 40, 38, 36, ...: wrong ones (right + 1 + j) % V around the right
        # token at its rank; an absent right token (rank R) is pushed down instead.
        j_R = torch.arange(R)
        wrong_TDR = (right_TD[..., None] + 1 + j_R) % vocab
        vals_TDR = 40.0 - 2.0 * (j_R + (j_R >= rank_TD[..., None]).long())
        self.cols_TDR = torch.cat([wrong_TDR, right_TD[..., None]], -1).to(device)
        self.vals_TDR = torch.cat([vals_TDR, torch.where(rank_TD < R, 40.0 - 2.0 * rank_TD, -40.0)[..., None]],
                                  -1).to(device)

    def reset(self) -> None:
        self.inner.reset()

    def draft(self, context, anchor: int, start: int) -> torch.Tensor:
        logits_DV = self.inner.draft(context, anchor, start).clone()
        return logits_DV.scatter_(1, self.cols_TDR[start], self.vals_TDR[start].to(logits_DV.dtype))


def sweep_random(shape: dict, family: str, budgets: list[int], *, context: int, prompts: int, new_tokens: int,
                 block: int, top1: float) -> dict:
    """A random target and drafter held in memory (no files), every prompt decoded by the target alone and
    at every budget (`decode_prompts`, one prompt at a time so that the synthetic drafter can follow each
    prompt's greedy continuation); the report dict, as `evaluate` builds it."""
    from dflash_pipeline.eval.graphed import GraphedTarget
    from dflash_pipeline.eval.prompts import as_prompt
    from dflash_pipeline.eval.run import EvalConfig, build_report, decode_prompts, make_participants
    from dflash_pipeline.eval.speculative import target_generate
    from dflash_pipeline.progress import LiveLine

    model = random_target(shape, family)
    with torch.no_grad():  # real embeddings are far larger than the init's; keeps logits un-flat (few ties)
        model.get_input_embeddings().weight.normal_(0.0, 0.5)
    drafter_model, _ = random_drafter(shape, 5, block, shape["num_hidden_layers"])
    prompts_ = [as_prompt(p) for p in enumerate(random_prompts(prompts, context, shape["vocab_size"]))]
    cfg = EvalConfig(drafter="(random, in memory)", max_new_tokens=new_tokens, block_size=block, tree_budget=budgets)
    progress = LiveLine(log_every=10.0)
    target, drafter = make_participants(model, drafter_model, prompts_, cfg, progress)
    steered = SyntheticAcceptance(drafter, top1) if top1 > 0 else None
    kw = dict(max_new_tokens=new_tokens, temperature=0.0, stop_ids=frozenset())  # every prompt: new_tokens tokens
    results, times = [], {}
    try:
        for i, prompt in enumerate(prompts_):
            if steered is not None:
                greedy = target_generate(target, prompt.ids, **kw).tokens
                steered.follow(prompt.ids + greedy, shape["vocab_size"], seed=i, device=target.device)
            res, t = decode_prompts(target, steered or drafter, [(i, prompt)], warmup=i == 0, budgets=budgets, **kw)
            results += res
            for name, ms in t.items():
                times.setdefault(name, []).extend(ms)
            progress.say(f"prompt {i + 1}/{len(prompts_)}: tau " + ", ".join(
                f"{r.budget}: {sum(s.committed for s in r.spec.steps) / max(len(r.spec.steps), 1):.2f}" for r in res[0]))
    finally:
        target.close()
    report = build_report(results, times, block_size=drafter.block_size, temperature=0.0, dtype=target.dtype,
                          cuda=target.device.type == "cuda")
    report["decoding"] = "graphed" if isinstance(target, GraphedTarget) else "eager"
    return report


def sweep_real(target: str, drafter: str, budgets: list[int], *, prompt_file: str | None, prompts: int,
               new_tokens: int) -> dict:
    """`run_eval` of a real target and drafter (as `dflash eval --tree-budget` runs it): the report dict."""
    from dflash_pipeline.eval.run import EvalConfig, run_eval
    from dflash_pipeline.progress import LiveLine

    cfg = EvalConfig(drafter=drafter, target=target, prompts=[prompt_file] if prompt_file else None,
                     num_prompts=prompts, max_new_tokens=new_tokens, tree_budget=budgets, gpus="1")
    return run_eval(cfg, LiveLine(log_every=10.0))


def per_budget(report: dict) -> dict[str, dict]:
    """What the sweep is read by, per budget, from the report's `per_budget` (see the module docstring)."""
    out = {}
    for b, r in report["per_budget"].items():
        ms = r["step_ms"] or {}
        decode, verify, draft = ms.get("target_decode"), ms.get("target_verify"), ms.get("drafter")
        tree = ms.get("tree_build") or 0.0
        round_ms = None if None in (verify, draft) else verify + draft + tree
        out[b] = {
            "tau": r["tau"], "tok_s_spec": r["tok_s_spec"], "tok_s_target": r["tok_s_target"], "speedup": r["speedup"],
            "verify_ms": verify, "tree_ms": ms.get("tree_build"), "drafter_ms": draft, "decode_ms": decode,
            "verify_over_decode": verify / decode if verify and decode else None,
            "speedup_from_step_times": r["speedup_from_step_times"],
            "speedup_at_tau": {t: t * decode / round_ms for t in TAUS} if decode and round_ms else None,
            "lossless": r["lossless"], "num_mismatches": r["num_mismatches"],
            "num_tie_divergences": r["num_tie_divergences"],
        }
    return out


def _f(x, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


def table(res: dict) -> list[str]:
    """The summary lines: one per budget."""
    lines = [f"{'budget':>6} {'tau':>6} {'tok/s':>8} {'speedup':>8} {'verify ms':>10} {'x decode':>9} "
             f"{'tree ms':>8} {'drafter ms':>10} {'lossless':>9}  speedup at tau " + " ".join(f"{t:>5}" for t in TAUS)]
    for b, r in res["budgets"].items():
        at = r["speedup_at_tau"] or {}
        lines.append(f"{b:>6} {_f(r['tau']):>6} {_f(r['tok_s_spec'], '.1f'):>8} {_f(r['speedup']):>7}x "
                     f"{_f(r['verify_ms'], '.3f'):>10} {_f(r['verify_over_decode']):>8}x {_f(r['tree_ms'], '.3f'):>8} "
                     f"{_f(r['drafter_ms'], '.3f'):>10} {str(r['lossless']):>9}                "
                     + " ".join(f"{_f(at.get(t)):>5}" for t in TAUS))
    first = next(iter(res["budgets"].values()))
    lines.append(f"plain decoding: {_f(first['tok_s_target'], '.1f')} tok/s, decode step {_f(first['decode_ms'], '.3f')} "
                 f"ms ({res['what']}, {res['prompts']} prompts x {res['new_tokens']} new tokens)")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--budgets", type=int_list, default=[0, 16, 64, 256], help="tree budgets; 0 is the chain")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-8b", help="the random target's shape")
    ap.add_argument("--context", type=int, default=512, help="random prompts: tokens per prompt")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--block-size", type=int, default=16, help="the random drafter's block size")
    ap.add_argument("--top1", type=float, default=0.8, help="random drafter: how often the target's token is its "
                    "first guess at a slot (synthetic acceptance, see the module docstring); 0: the drafter as it is")
    ap.add_argument("--target", default=None, help="a real target (HF folder or .gguf); needs --drafter")
    ap.add_argument("--drafter", default=None, help="an exported drafter folder trained for --target")
    ap.add_argument("--prompt-file", default=None, help="prompts of the real pair (default: the embedded ShareGPT)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU: checks the script runs")
    args = ap.parse_args()
    if bool(args.target) != bool(args.drafter):
        ap.error("--target and --drafter go together (a real pair); give neither for random weights")
    if args.smoke:
        args.context, args.prompts, args.new_tokens, args.block_size = 16, 2, 12, 4
        args.budgets = [b for b in args.budgets if b <= 16] or [0, 4]
    res = {"date": time.strftime("%Y-%m-%d"), "device": torch.cuda.get_device_name(0) if DEVICE == "cuda" else "cpu",
           "dtype": str(DTYPE).removeprefix("torch."), "smoke": args.smoke, "prompts": args.prompts,
           "new_tokens": args.new_tokens}
    t0 = time.perf_counter()
    if args.target:
        report = sweep_real(args.target, args.drafter, args.budgets, prompt_file=args.prompt_file,
                            prompts=args.prompts, new_tokens=args.new_tokens)
        res["what"] = f"target {args.target}, drafter {args.drafter}"
    else:
        shape, family = (SMOKE_SHAPES if args.smoke else SHAPES)[args.shape]
        report = sweep_random(shape, family, args.budgets, context=args.context, prompts=args.prompts,
                              new_tokens=args.new_tokens, block=args.block_size, top1=args.top1)
        steer = f"synthetic acceptance top1 {args.top1:g}" if args.top1 > 0 else "drafter unsteered"
        res["what"] = f"random {args.shape}-shaped target and 5-layer drafter ({steer}), block {args.block_size}, " \
                      f"context {args.context}"
    res.update(wall_s=time.perf_counter() - t0, decoding=report["decoding"],
               step_ms_clock=report.get("step_ms_clock"), budgets=per_budget(report))
    save_json(args.json, res)
    print("\n== tree budget sweep\n" + "\n".join(table(res)))


if __name__ == "__main__":
    main()
