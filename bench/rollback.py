"""How to roll back a hybrid target's linear-attention layers after a rejected draft: cost of each way.

A random Qwen3.5-shaped target (Gated DeltaNet + attention, 3:1) decodes prompts with a drafter that
proposes the target's own greedy continuation but errs at every `--err-every`-th drafted slot, so
rounds end in rejections at a steady rate (tau ~3 at block 8). Each way of rolling back runs the same
prompts; seconds per prompt (median of --repeats), tau and whether the output equals plain decoding:
  crop-only    crop the attention layers, leave the linear ones as the verify left them (wrong; the
               floor of the cost)
  replay       `dflash eval`'s way (eval/rollback.py): restore the states saved before the verify, re-run
               only the linear-attention modules on their captured inputs of the committed positions
  forward      restore the states, crop the attention layers back to the verify's start, and run the
               target again over the committed tokens
  native       transformers' own, from 5.25: the verify records the recurrent state after each of its
               tokens (`recurrent_states_to_keep` = the block), computing them one by one with the
               recurrent kernel, and `crop` picks the committed one (absent on older transformers)

    python bench/rollback.py                                   # CPU, tiny shape (the docstring's numbers)
    python bench/rollback.py --device cuda --shape 27b --num-layers 8 --dtype bf16 --json OUT.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

from common import QWEN3_5_27B, QWEN3_5_TINY, save_json  # noqa: E402

from dflash_pipeline.eval.models import Target, TargetCache  # noqa: E402
from dflash_pipeline.eval.rollback import past_recording_options  # noqa: E402
from dflash_pipeline.eval.speculative import speculative_generate, target_generate  # noqa: E402


class CropOnly(Target):
    """Crops the attention layers and leaves the linear ones as the verify left them."""

    def crop(self, cache, length):
        drop = cache.length - length
        if drop > 0:
            cache.states.crop_others(drop)
            cache.length = length


def native(block: int):
    class NativeRollback(Target):
        def new_cache(self):
            from transformers import DynamicCache

            kv = DynamicCache(config=self.model.config)
            kv.activate_past_recording(recurrent_states_to_keep=block)
            return TargetCache(kv)  # no states: `Target.crop` is transformers' crop alone

    return NativeRollback


class ForwardReplay(Target):
    """Restores the saved states and runs the committed tokens through the whole target again."""

    def forward(self, ids, start, cache, **kw):
        cache.last_ids = list(ids)
        return super().forward(ids, start, cache, **kw)

    def crop(self, cache, length):
        drop = cache.length - length
        if drop <= 0:
            return
        base = cache.saved_at
        cache.states.crop_others(cache.length - base)
        cache.length = base
        cache.states.restore()
        Target.forward(self, cache.last_ids[: length - base], base, cache)


class ErringOracle:
    """Drafts the target's own continuation, wrong at every `every`-th drafted slot."""

    def __init__(self, sequence, vocab, block_size, every, device):
        self.sequence, self.vocab, self.block_size, self.every, self.count = list(sequence), vocab, block_size, every, 0
        self.device = device

    def reset(self):
        self.count = 0

    def draft(self, context, anchor, start):
        want = (self.sequence[start + 1:start + self.block_size] + [0] * self.block_size)[: self.block_size - 1]
        logits = torch.full((self.block_size - 1, self.vocab), -30.0, device=self.device)
        for j, token in enumerate(want):
            self.count += 1
            logits[j, (token + (self.count % self.every == 0)) % self.vocab] = 30.0
        return logits


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", choices=["tiny", "27b"], default="tiny")
    ap.add_argument("--num-layers", type=int, default=None, help="decoder layers (default: the shape's)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--block", type=int, default=8)
    ap.add_argument("--err-every", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--init-std", type=float, default=None,
                    help="weight init std (default 0.1 for tiny, so the linear layers weigh in; 0.02 for 27b)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig
    from transformers.utils import logging

    logging.set_verbosity_error()
    torch.set_num_threads(args.threads)
    shape = dict(QWEN3_5_27B if args.shape == "27b" else QWEN3_5_TINY)
    if args.num_layers:
        shape["num_hidden_layers"] = args.num_layers
    torch.manual_seed(0)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    with torch.device(args.device):
        std = args.init_std or (0.1 if args.shape == "tiny" else 0.02)
        model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**shape, initializer_range=std)).to(dtype).eval()
    vocab = shape["vocab_size"]
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, vocab, (args.prompt_len,), generator=g).tolist() for _ in range(args.prompts)]
    plain = Target(model)
    refs = [target_generate(plain, p, max_new_tokens=args.new_tokens, temperature=0.0, stop_ids=frozenset()).tokens
            for p in prompts]
    plain.close()
    # On a shared CPU the process's own CPU time (one thread) is steadier than the wall clock.
    clock = time.perf_counter if args.device.startswith("cuda") else time.process_time
    results = {"clock": clock.__name__, "shape": shape, "device": args.device, "dtype": args.dtype, "block": args.block,
               "err_every": args.err_every, "prompts": args.prompts, "new_tokens": args.new_tokens, "ways": {}}
    ways = [("crop-only", CropOnly), ("replay", Target), ("forward", ForwardReplay)]
    if past_recording_options():
        ways.append(("native", native(args.block)))
    for name, cls in ways:
        target = cls(model)
        times, same, steps, committed = [], 0, 0, 0
        for r in range(args.repeats):
            t0 = clock()
            for p, ref in zip(prompts, refs):
                drafter = ErringOracle(p + ref, vocab, args.block, args.err_every, args.device)
                out = speculative_generate(target, drafter, p, max_new_tokens=args.new_tokens, temperature=0.0,
                                           stop_ids=frozenset())
                if r == 0:
                    same += out.tokens == ref
                    steps += len(out.steps)
                    committed += sum(s.committed for s in out.steps)
            if args.device.startswith("cuda"):
                torch.cuda.synchronize()
            times.append((clock() - t0) / len(prompts))
        target.close()
        per_prompt = statistics.median(times)
        # Per round: crop-only leaves the reference early, so its drafts fail and it needs more rounds.
        results["ways"][name] = {"s_per_prompt": per_prompt, "ms_per_round": 1e3 * per_prompt * len(prompts) / steps,
                                 "tau": committed / steps, "equal_to_plain_decoding": f"{same}/{len(prompts)}"}
        print(f"{name:10s} {1e3 * per_prompt * len(prompts) / steps:6.1f} ms/round, {per_prompt:.3f} s/prompt, "
              f"tau {committed / steps:.2f}, equal to plain decoding on {same}/{len(prompts)} prompts", flush=True)
    save_json(args.json, results)


if __name__ == "__main__":
    main()
