"""How far apart do the target's passes put the same logits? The calibration behind the bf16 tie rule.

`dflash eval`'s lossless check (`dflash_pipeline.eval.lossless`) excuses a divergence between plain
and speculative greedy decoding where the reference's top-2 logit margin is within TIE_ULPS ulp of the
dtype at that logit's magnitude: the one-token decode step, the block verify step and the tree verify
step are different kernels, and in bf16 they may order two near-equal logits differently. The constant
is only right if it covers how much the passes really differ, and no more (every position whose margin
is under it is one where a real bug would pass as a tie). This measures it.

For each prompt the target decodes greedily with one-token steps on the static-cache runner (path
`decode`, the reference), recording at every position the top-2 tokens (a, b) and their margin
m = l[a] - l[b]. The same tokens then go through the other passes, which give logits at the same
positions: `verify16` (blocks of 16, as a chain verify), `verify65` (chain blocks of 65, a budget-64
tree verify's shape), `tree64` (blocks of 65 laid out as a tree: each path token with a sibling beside
it, an ancestor mask, positions by depth, the path compacted afterwards, as tree decoding runs it), and
`forward` (one plain transformers forward over prompt + output, as the check itself uses after a tie). Per pass it reports |m - m'| where m' = l'[a] - l'[b], in ulp of the dtype
at max(|l[a]|, |l[b]|): quantiles and max, and the smallest TIE_ULPS that covers every position seen.
Also how many positions have a margin under N ulp (the rule's blind spot at N).

    python bench/tie_rule.py [--target MODEL] [--dtype bf16] [--prompts N] [--new-tokens N] [--split-decode]
                             [--compile [MODE]] [--json OUT]
    python bench/tie_rule.py --smoke      # tiny random model, CPU: checks the script
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

from common import save_json  # noqa: E402

from dflash_pipeline.eval.lossless import TIE_ULPS, logit_ulp  # noqa: E402

PASSES = ("verify16", "verify65", "tree64", "forward")


def greedy_reference(runner, prompt: list[int], n: int):
    """Decode n tokens with one-token steps; (tokens, top-2 ids [n, 2], their logits [n, 2])."""
    logits, _ = runner.prefill(0, prompt)
    tokens, top_ids, top_vals = [], [], []
    io = runner.inputs(1)
    for i in range(n):
        row = logits[-1] if i == 0 else io.logits_RqV[0, 0]
        v, k = row.topk(2)
        top_ids.append(k.tolist())
        top_vals.append(v.tolist())
        tokens.append(int(k[0]))
        if i == n - 1:
            break
        runner.set_length(0, len(prompt) + i)
        io.ids_Rq[0, 0] = tokens[-1]
        runner.step(1)
    return tokens, torch.tensor(top_ids), torch.tensor(top_vals)


def blocked_logits(runner, prompt: list[int], tokens: list[int], q: int) -> torch.Tensor:
    """The logits predicting tokens[0..n) from block steps of q tokens: a block starts with the last
    committed token, as a verify step does ([n, V]). The first prediction comes from the prefill."""
    runner.prefill(0, prompt[:-1])
    out, committed = [], len(prompt) - 1
    seq = prompt + tokens
    io = runner.inputs(q)
    while committed < len(seq) - 1:
        runner.set_length(0, committed)
        block = seq[committed:committed + q]
        ids = torch.tensor(block + [0] * (q - len(block)))
        io.ids_Rq[0].copy_(ids.to(io.ids_Rq.device))
        runner.step(q)
        out.append(io.logits_RqV[0, :len(block)].clone())
        committed += len(block)
    return torch.cat(out)[: len(tokens)]


def tree_logits(runner, prompt: list[int], tokens: list[int], depth: int = 32) -> torch.Tensor:
    """The same predictions from tree verify steps (q = 2 * depth + 1, a budget-64 tree at depth 32): the
    block is the last committed token (root), then for each depth d the path's token and a sibling of it
    (same parent, same position d, a token the path does not take), interleaved as a tree's nodes sit in
    its block. A path node sees the root and the path above it, a sibling the path above it and itself.
    The path's K/V are then made contiguous (`compact`), as tree decoding commits an accepted path."""
    q = 2 * depth + 1
    io = runner.inputs(q)
    default_offsets, default_mask = io.offsets_Rq.clone(), io.block_mask_Rqq.clone()
    offsets = torch.zeros(q, dtype=torch.long)
    mask = torch.zeros(q, q, dtype=torch.bool)
    mask[0, 0] = True
    for d in range(1, depth + 1):
        p, s = 2 * d - 1, 2 * d          # the path node and its sibling at depth d
        offsets[p] = offsets[s] = d
        ancestors = [0] + [2 * k - 1 for k in range(1, d)]
        mask[p, ancestors + [p]] = True
        mask[s, ancestors + [s]] = True
    io.offsets_Rq[0].copy_(offsets.to(io.offsets_Rq.device))
    io.block_mask_Rqq[0].copy_(mask.to(io.block_mask_Rqq.device))
    runner.prefill(0, prompt[:-1])
    out, committed = [], len(prompt) - 1
    seq = prompt + tokens
    V = io.logits_RqV.shape[-1]
    try:
        while committed < len(seq) - 1:
            runner.set_length(0, committed)
            path = seq[committed:committed + depth + 1]        # root + up to `depth` path tokens
            ids = torch.zeros(q, dtype=torch.long)
            ids[0] = path[0]
            for d in range(1, depth + 1):
                tok = path[d] if d < len(path) else 0
                ids[2 * d - 1], ids[2 * d] = tok, (tok + 1 + d) % V   # the sibling: any other token
            io.ids_Rq[0].copy_(ids.to(io.ids_Rq.device))
            runner.step(q)
            rows = [0] + [2 * d - 1 for d in range(1, len(path))]
            out.append(io.logits_RqV[0, rows].clone())
            runner.compact(0, [committed + r for r in rows], committed)
            committed += len(path)
    finally:
        io.offsets_Rq.copy_(default_offsets)
        io.block_mask_Rqq.copy_(default_mask)
    return torch.cat(out)[: len(tokens)]


def forward_logits(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    ids = torch.tensor([prompt + tokens[:-1]], device=model.device)
    with torch.inference_mode():
        return model(ids, use_cache=False).logits[0, len(prompt) - 1:].float()


def margins_ulp(top_vals: torch.Tensor, dtype) -> list[float]:
    """The reference's top-2 margin m at each position, in ulp of `dtype` at that logit's magnitude."""
    return in_ulp(top_vals[:, 0] - top_vals[:, 1], top_vals, dtype)


def margin_gaps(top_ids: torch.Tensor, top_vals: torch.Tensor, other: torch.Tensor, dtype) -> list[float]:
    """|m - m'| in ulp of `dtype` at each position's logit magnitude."""
    o = other.gather(1, top_ids.to(other.device)).cpu()
    return in_ulp((top_vals[:, 0] - top_vals[:, 1]) - (o[:, 0] - o[:, 1]), top_vals, dtype)


def in_ulp(diffs: torch.Tensor, top_vals: torch.Tensor, dtype) -> list[float]:
    """|diff| per position over the ulp of `dtype` at max(|top1|, |top2|) there (the rule's unit)."""
    mags = top_vals.abs().max(dim=1).values
    return [abs(float(d)) / logit_ulp(float(x), dtype) for d, x in zip(diffs, mags)]


def quantiles(xs: list[float]) -> dict[str, float]:
    s = sorted(xs)
    pick = lambda p: s[min(len(s) - 1, int(math.ceil(p * len(s))) - 1)]  # noqa: E731
    return {"n": len(s), "p50": pick(0.5), "p90": pick(0.9), "p99": pick(0.99), "p999": pick(0.999), "max": s[-1]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default=None, help="model folder or .gguf (default: the embedded SmolLM2)")
    ap.add_argument("--prompts-file", default=None, help="prompts JSONL (default: the embedded held-out split)")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp16", "fp32"))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--split-decode", action="store_true", help="one-token steps on the split decode kernel, as "
                    "`dflash generate` runs them (speculative decoding does not: this measures why)")
    ap.add_argument("--compile", nargs="?", const=True, default=False, metavar="MODE",
                    help="the runner's compiled layers, as `dflash eval --compile` runs them; MODE is torch.compile's "
                    "mode (e.g. max-autotune-no-cudagraphs: Inductor's own matrix products, whose reductions order "
                    "sums differently from cuBLAS's)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--smoke", action="store_true")
    a = ap.parse_args()
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[a.dtype]
    from dflash_pipeline.decoding.runner import DecodingRunner

    if a.smoke:
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                             num_attention_heads=4, num_key_value_heads=2)).to(a.device, dtype).eval()
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (7, 20)]
        a.new_tokens, label = 40, "tiny random Llama"
    else:
        from transformers import AutoTokenizer

        from dflash_pipeline.eval.prompts import load_prompts
        from dflash_pipeline.extract.target import load_target, resolve_target

        path = resolve_target(a.target)
        model = load_target(path, dtype, a.device, quiet=True)
        prompts = [p.ids for p in load_prompts([a.prompts_file] if a.prompts_file else None,
                                               AutoTokenizer.from_pretrained(path), a.prompts)]
        label = str(a.target or "embedded SmolLM2-135M-Instruct")
    n = a.new_tokens
    gaps: dict[str, list[float]] = {p: [] for p in PASSES}
    margins: list[float] = []
    t0 = time.time()
    max_len = max(len(p) for p in prompts) + n + 80
    decoded = []
    with DecodingRunner(model, max_len=max_len, split_decode=a.split_decode, compile=a.compile) as runner:  # the model attends over the runner's cache here
        kernels, fused_layers = runner.decode_attention, runner.fused_layers
        for i, prompt in enumerate(prompts):
            tokens, top_ids, top_vals = greedy_reference(runner, prompt, n)
            decoded.append((prompt, tokens, top_ids, top_vals))
            margins += margins_ulp(top_vals, dtype)
            for q in (16, 65):
                gaps[f"verify{q}"] += margin_gaps(top_ids, top_vals, blocked_logits(runner, prompt, tokens, q), dtype)
            gaps["tree64"] += margin_gaps(top_ids, top_vals, tree_logits(runner, prompt, tokens), dtype)
            print(f"prompt {i + 1}/{len(prompts)}: {len(prompt)} + {n} tokens; max gap so far (ulp) "
                  + ", ".join(f"{k} {max(v):.1f}" for k, v in gaps.items() if v) + f"  ({time.time() - t0:.0f}s)",
                  flush=True)
    for prompt, tokens, top_ids, top_vals in decoded:  # and its own attention again here
        gaps["forward"] += margin_gaps(top_ids, top_vals, forward_logits(model, prompt, tokens), dtype)
    every = [x for v in gaps.values() for x in v]
    need = math.ceil(max(every) - 1e-9)
    out = {"target": label, "device": torch.cuda.get_device_name() if a.device.startswith("cuda") else "cpu",
           "dtype": a.dtype, "decode_attention": kernels, "compile": a.compile,
           "fused_projection_layers": fused_layers, "torch": torch.__version__, "prompts": len(prompts),
           "new_tokens": n, "positions": len(margins), "tie_ulps_now": TIE_ULPS,
           "margin_gap_ulp": {k: quantiles(v) for k, v in gaps.items()},
           "tie_ulps_covering_every_gap": need,
           "positions_with_margin_within": {str(k): sum(m <= k for m in margins) for k in (0, 1, 2, 4, 8, 16)},
           "seconds": round(time.time() - t0, 1)}
    for k, q in out["margin_gap_ulp"].items():
        print(f"{k:9} |m - m'| ulp: p50 {q['p50']:.2f}  p99 {q['p99']:.2f}  p99.9 {q['p999']:.2f}  max {q['max']:.2f}")
    print(f"TIE_ULPS now {TIE_ULPS}; covering every gap seen: {need}. Positions with margin <= N ulp (of "
          f"{len(margins)}): " + ", ".join(f"{k}: {v}" for k, v in out["positions_with_margin_within"].items()))
    save_json(a.json, out)


if __name__ == "__main__":
    main()
