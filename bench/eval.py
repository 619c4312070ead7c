"""Decoding benchmark on one GPU: the static-cache, graphed runner of `dflash eval` against transformers.

  plain   a SmolLM2-135M-shaped target (random weights, bf16; `--target DIR` for a real one) decoding
          at batch 1: our graphed decode loop (`target_generate` on the runner, one host transfer per
          token) against transformers' own `generate()` with its default cache, same prompts, same
          run. ms per decoded token for each (generate's: (t(N) - t(1)) / (N - 1), prefill excluded).
          Goal: ours >= 5x faster.
  steps   a random Qwen3-8B-shaped target (36 layers, hidden 4096, 32/8 heads, head_dim 128,
          intermediate 12288, vocab 151,936) at a context of `--context` tokens: the graphed decode
          step against its memory-bandwidth bound (bytes of every weight the step reads, i.e. all but
          the input embedding, over 4.8 TB/s; goal within 1.3x), the block-16 verify step against one
          decode step (goal within 1.2x), the drafter's block step (5 layers, Qwen3-8B width), and the
          speedup that a tau would give from those step times, tau = 2..7. transformers' own
          `generate()` per-token time on the same target for reference.
  e2e     `dflash eval` (run_eval: load, check, warm up, decode) of a SmolLM2-shaped random target and a
          random 5-layer drafter over `--prompts` prompts x `--new-tokens` tokens; wall time
          (goal: 80 x 256 in < 3 minutes) and the report's speeds, tau and step times.

    python bench/assets.py     # here, once: .bench_assets/tokenizer (carry it to the GPU machine)
    python bench/eval.py --tokenizer .bench_assets/tokenizer --work /tmp/bench-eval [--json OUT.json]
        [--skip plain,steps,e2e] [--target DIR] [--context 1024] [--prompts 80] [--new-tokens 256]
    python bench/eval.py --smoke --tokenizer .bench_assets/tokenizer   # tiny shapes on the CPU
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

from common import save_json  # noqa: E402

from dflash_pipeline.decoding.attention import kernel_for  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPE = torch.bfloat16 if DEVICE == "cuda" else torch.float32
HBM_BYTES_S = 4.8e12  # H200 datasheet

SMOLLM2 = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
               num_key_value_heads=3, vocab_size=49152, max_position_embeddings=8192, tie_word_embeddings=True,
               rope_theta=100000.0, rms_norm_eps=1e-5)
QWEN3_8B = dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=40960,
                rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=False)
SMOKE_SMOL = dict(SMOLLM2, hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
                  num_key_value_heads=2)
SMOKE_QWEN = dict(QWEN3_8B, hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, vocab_size=2048)


def random_target(shape: dict, family: str = "llama"):
    """A random-weight causal LM of `shape` on DEVICE in DTYPE (speed does not depend on the weights)."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

    cfg = (LlamaConfig if family == "llama" else Qwen3Config)(**shape, bos_token_id=None, eos_token_id=None,
                                                              pad_token_id=None)
    torch.manual_seed(0)
    with torch.device(DEVICE):
        model = AutoModelForCausalLM.from_config(cfg, dtype=DTYPE)
    return model.eval().requires_grad_(False)


def random_drafter(target_cfg: dict, num_layers: int, block_size: int, num_target_layers: int):
    from dflash_pipeline.method import default_layer_ids
    from dflash_pipeline.train.model import DFlashDrafter, DrafterConfig, init_drafter_weights

    heads = target_cfg["num_attention_heads"]
    cfg = DrafterConfig(hidden_size=target_cfg["hidden_size"], intermediate_size=target_cfg["intermediate_size"],
                        num_layers=num_layers, num_heads=heads, num_kv_heads=target_cfg["num_key_value_heads"],
                        head_dim=target_cfg.get("head_dim") or target_cfg["hidden_size"] // heads,
                        vocab_size=target_cfg["vocab_size"], block_size=block_size, mask_token_id=16,
                        target_layer_ids=default_layer_ids(num_target_layers, 5), num_target_layers=num_target_layers)
    with torch.device(DEVICE):
        model = DFlashDrafter(cfg)
    init_drafter_weights(model)
    return model.to(DTYPE).eval().requires_grad_(False), cfg


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def median_ms(fn, iters: int, warmup: int = 3) -> float:
    """Median time of fn() in ms: CUDA events around each call, the host clock on the CPU."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if DEVICE == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        else:
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e3)
    return sorted(times)[len(times) // 2]


def hf_ms_per_token(model, prompts: list[list[int]], new_tokens: int) -> float:
    """transformers' generate() at batch 1, default cache: decode ms per token, prefill excluded."""
    def run(n: int) -> float:
        sync()
        t = time.perf_counter()
        with torch.inference_mode():
            for p in prompts:
                model.generate(torch.tensor([p], device=DEVICE), max_new_tokens=n, min_new_tokens=n, do_sample=False)
        sync()
        return time.perf_counter() - t

    run(2)  # warm-up
    return (run(new_tokens) - run(1)) / (len(prompts) * (new_tokens - 1)) * 1e3


def bench_plain(model, prompts: list[list[int]], new_tokens: int, hf_tokens: int) -> dict:
    """Our graphed plain decoding against transformers' generate(), same prompts, same process."""
    from dflash_pipeline.decoding.graphs import StepTimer
    from dflash_pipeline.eval.graphed import GraphedTarget
    from dflash_pipeline.eval.speculative import target_generate

    hf = hf_ms_per_token(model, prompts, hf_tokens)
    target = GraphedTarget(model, [], max_len=max(map(len, prompts)) + new_tokens + 16, block_size=16)
    kw = dict(max_new_tokens=new_tokens, temperature=0.0, stop_ids=frozenset())
    target.runner.prepare((1,))  # every decode graph (one per slot bucket), outside the timed runs
    target_generate(target, prompts[0], **{**kw, "max_new_tokens": 4})
    timer = StepTimer(target.device)
    gens = [target_generate(target, p, timer=timer, **kw) for p in prompts]
    target.close()
    ours = sum(g.seconds for g in gens) / sum(g.decoded_tokens for g in gens) * 1e3
    return {"ours_ms_per_token": ours, "ours_tok_s": 1e3 / ours, "ours_decode_step_ms": timer.summary()["target_decode"],
            "hf_generate_ms_per_token": hf, "hf_generate_tok_s": 1e3 / hf, "speedup_vs_hf": hf / ours,
            "prompts": len(prompts), "new_tokens": new_tokens, "goal": "speedup_vs_hf >= 5"}


def decode_bound_ms(model, slots: int) -> tuple[float, float]:
    """(weights read by a decode step, + the K/V it attends) in bytes / 4.8 TB/s, as ms. The input
    embedding is a lookup of one row, so it is not read whole (unless tied to the LM head)."""
    emb = model.get_input_embeddings().weight
    tied = model.get_output_embeddings().weight.data_ptr() == emb.data_ptr()
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    weights -= 0 if tied else emb.numel() * emb.element_size()
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv = cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * slots * head_dim * emb.element_size()
    return weights / HBM_BYTES_S * 1e3, (weights + kv) / HBM_BYTES_S * 1e3


def bench_steps(model, shape: dict, context: int, block: int, iters: int, hf_tokens: int,
                compile: bool | str = False, fuse: bool = True) -> dict:
    """Graphed decode / verify / drafter step times of one target shape, against the decode bound;
    compile: the steps' forward through torch.compile before capture (fused elementwise kernels; a string:
    the target's layers in that torch.compile mode);
    fuse: the runner's fused q|k|v and gate|up products (False: transformers' seven per layer)."""
    from dflash_pipeline.decoding.drafter import StaticDrafter
    from dflash_pipeline.decoding.runner import DecodingRunner
    from dflash_pipeline.eval.models import Target

    L = shape["num_hidden_layers"]
    prompt = torch.randint(0, shape["vocab_size"], (context,), generator=torch.Generator().manual_seed(0)).tolist()
    hf = hf_ms_per_token(model, [prompt[:128]], hf_tokens) if hf_tokens else None
    drafter, dcfg = random_drafter(shape, 5, block, L)
    head = Target(model)  # the frozen embedding and LM head the drafter borrows
    runner = DecodingRunner(model, max_len=context + block, layer_ids=dcfg.target_layer_ids, compile=compile,
                            fuse=fuse)
    runner.prefill(0, prompt)

    def step(q: int) -> None:
        runner.set_length(0, context)  # every timed step sees the same context
        runner.step(q)

    decode, verify = median_ms(lambda: step(1), iters), median_ms(lambda: step(block), iters)
    static = StaticDrafter(drafter, embed=head.embed, head=head.logits, vocab_size=shape["vocab_size"],
                           feature_dtype=runner.dtype, max_len=context + block, block_size=block, compile=compile)
    t0 = time.perf_counter()
    static.step()  # the first call captures (and compiles)
    capture_s = time.perf_counter() - t0
    static.io.start_R.fill_(context)
    static.io.n_new_R.fill_(block)  # the widest context append a round can have
    draft = median_ms(static.step, iters)
    attended = runner.attended_slots(1)
    bound, bound_kv = decode_bound_ms(model, attended)
    runner.close()
    return {
        "compiled": compile, "fused_layers": runner.fused_layers, "drafter_first_call_s": capture_s,
        "context": context, "block": block, "attended_slots": attended,
        "decode_ms": decode, "verify_ms": verify, "drafter_ms": draft,
        "decode_bound_ms": bound, "decode_bound_with_kv_ms": bound_kv,
        "decode_over_bound": decode / bound, "verify_over_decode": verify / decode,
        "speedup_at_tau": {tau: tau * decode / (verify + draft) for tau in range(2, 8)},
        "hf_generate_ms_per_token": hf, "hf_note": "transformers generate() at a 128-token prompt, default cache",
        "note": "decode / verify / drafter: median of graph replays timed with CUDA events",
        "goals": "decode_over_bound <= 1.3, verify_over_decode <= 1.2",
    }


def save_random_target(path: str, tokenizer_dir: str, shape: dict) -> str:
    """A random SmolLM2-shaped HF folder with the tokenizer files, as `dflash eval --target` reads it."""
    if not os.path.exists(os.path.join(path, "config.json")):
        # Written under a temporary name, renamed once whole: a run stopped half way (no tokenizer files
        # yet, say) leaves nothing that the next run would take for a finished folder.
        tmp = f"{path}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        model = random_target(shape)
        with torch.no_grad():  # real embeddings are far larger than the init's; keeps logits un-flat
            model.get_input_embeddings().weight.normal_(0.0, 0.5)
        model.save_pretrained(tmp)
        for f in os.listdir(tokenizer_dir):
            if f.startswith("tokenizer") or f in ("special_tokens_map.json", "chat_template.jinja"):
                shutil.copy(os.path.join(tokenizer_dir, f), tmp)
        del model
        shutil.rmtree(path, ignore_errors=True)
        os.replace(tmp, path)
    return path


def write_prompts(path: str, n: int, seed: int = 0) -> str:
    rng = random.Random(seed)
    words = ["the", "model", "cache", "token", "graph", "river", "stone", "paint", "seven", "blue"]
    with open(path, "w") as f:
        for i in range(n):
            text = " ".join(rng.choice(words) for _ in range(rng.randint(8, 60)))
            f.write(json.dumps({"prompt": f"Continue this text: {text}"}) + "\n")
    return path


def bench_e2e(work: str, tokenizer_dir: str, shape: dict, prompts: int, new_tokens: int, block: int,
              target_dir: str | None = None) -> dict:
    """`dflash eval` (run_eval) end to end, wall time included loading, warm-up and graph capture."""
    from transformers import AutoConfig

    from dflash_pipeline.eval.run import EvalConfig, run_eval
    from dflash_pipeline.extract.target import text_config
    from dflash_pipeline.progress import LiveLine
    from dflash_pipeline.train.export import export_drafter

    target = target_dir or save_random_target(os.path.join(work, "smollm2-random"), tokenizer_dir, shape)
    c = text_config(AutoConfig.from_pretrained(target))
    tshape = dict(hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                  num_attention_heads=c.num_attention_heads, num_key_value_heads=c.num_key_value_heads,
                  head_dim=getattr(c, "head_dim", None), vocab_size=c.vocab_size)
    drafter, dcfg = random_drafter(tshape, 5, block, c.num_hidden_layers)
    drafter_dir = export_drafter(drafter, dcfg, os.path.join(work, "drafter-random"), dtype=DTYPE)
    del drafter
    cfg = EvalConfig(drafter=str(drafter_dir), target=target, num_prompts=prompts, max_new_tokens=new_tokens,
                     prompts=[write_prompts(os.path.join(work, "prompts.jsonl"), prompts)], gpus="1")  # one H200
    t = time.perf_counter()
    report = run_eval(cfg, LiveLine(log_every=10.0))
    wall = time.perf_counter() - t
    keep = ("decoding", "prompts", "generated_tokens", "tau", "speedup", "tok_s_spec", "tok_s_target", "step_ms",
            "speedup_from_step_times", "lossless", "mismatches")
    return {"wall_s": wall, "goal": "wall_s < 180 for 80 prompts x 256 tokens", **{k: report.get(k) for k in keep}}


def random_prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (length,), generator=g).tolist() for _ in range(n)]


def table(out: dict) -> list[str]:
    """The summary lines printed last."""
    lines = []
    if "plain" in out:
        p = out["plain"]
        lines.append(f"plain decoding, SmolLM2-shaped, batch 1: ours {p['ours_ms_per_token']:.2f} ms/token "
                     f"({p['ours_tok_s']:.0f} tok/s, graph step {p['ours_decode_step_ms']:.2f} ms), transformers "
                     f"generate {p['hf_generate_ms_per_token']:.2f} ms/token -> {p['speedup_vs_hf']:.1f}x (goal >= 5x)")
    if "steps" in out:
        s = out["steps"]
        lines.append(f"Qwen3-8B-shaped, context {s['context']}: decode {s['decode_ms']:.2f} ms vs bound "
                     f"{s['decode_bound_ms']:.2f} ms ({s['decode_over_bound']:.2f}x, goal <= 1.3; with K/V "
                     f"{s['decode_bound_with_kv_ms']:.2f} ms); verify-{s['block']} {s['verify_ms']:.2f} ms "
                     f"({s['verify_over_decode']:.2f}x decode, goal <= 1.2); drafter {s['drafter_ms']:.2f} ms; "
                     f"transformers generate {s['hf_generate_ms_per_token']:.1f} ms/token; q|k|v and gate|up "
                     f"fused in {s.get('fused_layers', 0)} layers")
        lines.append("  speedup from step times: " + ", ".join(
            f"tau {t} -> {v:.2f}x" for t, v in s["speedup_at_tau"].items()))
    if "steps_compiled" in out:
        s = out["steps_compiled"]
        if "error" in s:
            lines.append(f"  compiled steps failed: {s['error']}")
        else:
            mode = s["compiled"] if isinstance(s.get("compiled"), str) else "default mode"
            lines.append(f"  compiled (torch.compile before capture, {mode}): decode {s['decode_ms']:.2f} ms "
                         f"({s['decode_over_bound']:.2f}x bound), verify {s['verify_ms']:.2f} ms "
                         f"({s['verify_over_decode']:.2f}x decode), drafter {s['drafter_ms']:.2f} ms; "
                         + ", ".join(f"tau {t} -> {v:.2f}x" for t, v in s["speedup_at_tau"].items()))
    if "e2e" in out:
        e = out["e2e"]
        ms = e["step_ms"] or {}
        lines.append(f"dflash eval end to end ({e['decoding']}): {e['prompts']} prompts, {e['generated_tokens']} "
                     f"tokens in {e['wall_s']:.0f} s (goal < 180 s for 80 x 256); tau {e['tau']:.2f}, "
                     f"{e['tok_s_target']:.0f} tok/s target alone, {e['tok_s_spec']:.0f} tok/s speculative; step ms "
                     + " / ".join(f"{k} {v:.2f}" for k, v in ms.items() if v is not None)
                     + f"; lossless {e['lossless']}")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer", default=".bench_assets/tokenizer", help="tokenizer files for the e2e target")
    ap.add_argument("--work", default="/tmp/dflash-bench-eval")
    ap.add_argument("--target", default=None, help="a real target folder for plain and e2e (default: random)")
    ap.add_argument("--skip", default="", help="comma-separated parts to skip: plain, steps, e2e, compiled (the "
                    "steps again with torch.compile, run last)")
    ap.add_argument("--context", type=int, default=1024, help="steps: context length of the timed steps")
    ap.add_argument("--prompts", type=int, default=80)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--json", default=None)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU: checks the script runs")
    ap.add_argument("--no-fuse", action="store_true", help="steps: transformers' separate q, k, v, gate and up "
                    "products instead of the runner's fused ones")
    ap.add_argument("--compile-mode", default=None, help="compiled: torch.compile's mode for the target's layers, "
                    "e.g. max-autotune-no-cudagraphs (Triton matrix-product templates tuned against cuBLAS)")
    args = ap.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    os.makedirs(args.work, exist_ok=True)
    smol, qwen = (SMOKE_SMOL, SMOKE_QWEN) if args.smoke else (SMOLLM2, QWEN3_8B)
    if args.smoke:
        args.context, args.prompts, args.new_tokens = 64, 3, 12
    iters = 10 if args.smoke else 50
    out = {"date": time.strftime("%Y-%m-%d"), "device": torch.cuda.get_device_name(0) if DEVICE == "cuda" else "cpu",
           "dtype": str(DTYPE).removeprefix("torch."), "smoke": args.smoke,
           "decode_attention": kernel_for(DEVICE)}

    def done(part: str, result: dict) -> None:
        """Keep a finished part: into the JSON and the log at once, so a time limit loses only the rest."""
        out[part] = result
        save_json(args.json, out)
        print("\n".join(table({part: result})), flush=True)
    if "plain" not in skip:
        if args.target:
            from dflash_pipeline.extract.target import load_target

            model = load_target(args.target, DTYPE, DEVICE)
        else:
            model = random_target(smol)
        prompts = random_prompts(4, 16 if args.smoke else 128, model.config.vocab_size)
        done("plain", bench_plain(model, prompts, args.new_tokens, min(args.new_tokens, 64)))
        del model
    qwen_model = None
    if "steps" not in skip:
        qwen_model = random_target(qwen, "qwen3")
        done("steps", bench_steps(qwen_model, qwen, args.context, 16, iters, hf_tokens=4 if args.smoke else 16,
                                  fuse=not args.no_fuse))
    if "e2e" not in skip:
        done("e2e", bench_e2e(args.work, args.tokenizer, smol, args.prompts, args.new_tokens, 16, args.target))
    if "compiled" not in skip:  # last: compiling takes minutes, the other parts are safe by then
        try:  # the same steps with the elementwise chains fused by torch.compile
            qwen_model = qwen_model or random_target(qwen, "qwen3")
            result = bench_steps(qwen_model, qwen, args.context, 16, iters, hf_tokens=0,
                                 compile=args.compile_mode or True, fuse=not args.no_fuse)
        except Exception as e:  # report it in the table instead of losing the run
            result = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
        done("steps_compiled", result)
    print("\n== summary\n" + "\n".join(table(out)))


if __name__ == "__main__":
    main()
