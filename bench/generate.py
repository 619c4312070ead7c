"""Generation benchmark on one GPU: `dflash generate`'s engine against transformers, same prompts, same run.

Targets with random weights (speed does not depend on them), built in memory (bf16):
  smollm    SmolLM2-135M shape (Llama: 30 layers, hidden 576, 9/3 heads, vocab 49,152, tied head)
  qwen3-8b  Qwen3-8B shape (36 layers, hidden 4096, 32/8 heads, intermediate 12,288, vocab 151,936)
For each, at the same number of sequences in flight B (smollm 64, qwen3-8b 128 by default):
  hf        transformers' `generate()` with padding (left-padded batch) and its default cache: greedy,
            every sequence generating exactly --hf-new-tokens tokens (default: --new-tokens, as ours)
  cb        (smollm, or --cb-targets) transformers' continuous batching (`generate_batch`) over the same
            prompts, where the installed transformers runs it; its error is reported otherwise
  ours      the engine of `dflash generate` (rows on the decoding runner, sampling on the device,
            finished rows refilled): 2B requests over B rows, each exactly --new-tokens tokens; tok/s
            over the whole run (prefills included), the run's time per step (prefills, sampling and
            the host's bookkeeping included) and the graphed decode step alone
  compiled  ours again with `dflash generate --compile` (the step's decoder layers through torch.compile
            before capture): its tok/s, step and fraction of the bound; the time to build it
  bound     the memory-bandwidth bound of one decode step: bytes of weights read (every parameter but
            an untied input embedding, of which only B rows are read) plus the KV cache read (mean
            context per row x rows x KV bytes per token), over --bandwidth (4.8 TB/s for an H200);
            the graphed step's time against it, and the whole run's time per step against the bound at
            the run's mean context (goal: >= 40% for qwen3-8b at 128 sequences)
  memory    (qwen3-8b) the rows `dflash generate` plans for the GPU's free memory at --max-length 4096
            (its default), run with the costliest sampling and prompts that fill rows: peak memory
            against the plan and the device; it must not run out of memory
  pipeline  (smollm) the whole `dflash generate` command over a prompts file (the target saved as a
            folder with the tokenizer): tok/s from its run record
Goals (issue): ours >= 3x hf tok/s at the same B; qwen3-8b at 128 sequences >= 40% of the bound.

    python bench/assets.py    # here, once: .bench_assets/tokenizer (carry it to the GPU machine)
    python bench/generate.py --tokenizer .bench_assets/tokenizer --work /tmp/bench [--targets smollm,qwen3-8b] \
        [--skip hf,cb,compiled,memory,pipeline] [--cb-targets smollm] [--json OUT.json]
    python bench/generate.py --smoke --tokenizer .bench_assets/tokenizer   # tiny shapes on the CPU
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


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPE = torch.bfloat16 if DEVICE == "cuda" else torch.float32

SHAPES = {
    "smollm": ("llama", dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                             num_key_value_heads=3, head_dim=64, vocab_size=49152, max_position_embeddings=8192,
                             rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True)),
    "qwen3-8b": ("qwen3", dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                               num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=40960,
                               rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=False)),
    "smoke": ("qwen3", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=16, vocab_size=49152, max_position_embeddings=4096,
                            tie_word_embeddings=False)),
}


def _config(name: str):
    import transformers

    kind, shape = SHAPES[name]
    # No EOS: random weights would stop sequences at random; every sequence runs to its token count.
    return getattr(transformers, "LlamaConfig" if kind == "llama" else "Qwen3Config")(
        **shape, eos_token_id=None, bos_token_id=None, pad_token_id=None)


def random_model(name: str):
    """A random-weight target of shape `name`, built on the device (no checkpoint written or read)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    with torch.device(DEVICE):
        model = AutoModelForCausalLM.from_config(_config(name), dtype=DTYPE, attn_implementation="sdpa")
    return model.eval().requires_grad_(False)


def save_target(model, path: str, tokenizer_dir: str) -> None:
    """The model as an HF folder with the tokenizer files, as `dflash generate --target` reads it."""
    model.save_pretrained(path)
    for f in os.listdir(tokenizer_dir):
        if f.startswith("tokenizer") or f in ("special_tokens_map.json", "chat_template.jinja"):
            shutil.copy(os.path.join(tokenizer_dir, f), path)


def _free() -> None:
    from extract import _free_gpu

    _free_gpu()


def _sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def make_prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """Random token prompts, lengths uniform in [length / 2, length]."""
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab) for _ in range(rng.randint(length // 2, length))] for _ in range(n)]


def bytes_per_step(model, rows: int, mean_context: float) -> dict:
    """Bytes one decode step must read: weights (not an untied input embedding) and the KV cache."""
    from dflash_pipeline.extract.target import text_config

    cfg = text_config(model.config)
    emb = model.get_input_embeddings().weight
    head = model.get_output_embeddings().weight
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    if head.data_ptr() != emb.data_ptr():
        weights -= emb.numel() * emb.element_size()
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv_per_token = cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * head_dim * emb.element_size()
    kv = kv_per_token * mean_context * rows
    return {"weight_bytes": weights, "kv_bytes_per_token": kv_per_token, "kv_bytes": kv, "total": weights + kv}


# ---------------------------------------------------------------- transformers' generate() with padding


def run_hf(model, prompts: list[list[int]], new_tokens: int) -> dict:
    B = len(prompts)
    width = max(map(len, prompts))
    ids = torch.zeros((B, width), dtype=torch.long)
    mask = torch.zeros((B, width), dtype=torch.long)
    for r, p in enumerate(prompts):  # left padding: every row's next token at the same column
        ids[r, width - len(p):] = torch.tensor(p)
        mask[r, width - len(p):] = 1
    ids, mask = ids.to(DEVICE), mask.to(DEVICE)
    kw = dict(do_sample=False, pad_token_id=0, eos_token_id=None)
    with torch.no_grad():
        model.generate(ids, attention_mask=mask, max_new_tokens=2, min_new_tokens=2, **kw)  # warm-up
        _sync()
        t0 = time.perf_counter()
        out = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **kw)
        _sync()
        seconds = time.perf_counter() - t0
    made = (out.shape[1] - width) * B
    return {"batch": B, "new_tokens": new_tokens, "seconds": seconds, "tokens_per_second": made / seconds,
            "step_ms": 1000 * seconds / new_tokens}


# ---------------------------------------------------------------- transformers' continuous batching


def run_cb(model, prompts: list[list[int]], new_tokens: int, batch: int) -> dict:
    try:
        from transformers import GenerationConfig

        gen = GenerationConfig(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                               eos_token_id=None, pad_token_id=0)
        kwargs = {}
        try:
            from transformers.generation import ContinuousBatchingConfig

            kwargs["continuous_batching_config"] = ContinuousBatchingConfig(max_requests_per_batch=batch)
        except (ImportError, TypeError):
            pass
        # transformers' own SDPA (load_target registered another name, which continuous batching refuses)
        model.set_attn_implementation("sdpa")
        model.generate_batch(prompts[:2], gen, progress_bar=False, **kwargs)  # warm-up (graphs, if any)
        _sync()
        t0 = time.perf_counter()
        out = model.generate_batch(prompts, gen, progress_bar=False, **kwargs)
        _sync()
        seconds = time.perf_counter() - t0
        made = sum(len(o.generated_tokens) for o in out.values())
        return {"requests": len(prompts), "seconds": seconds, "tokens_per_second": made / seconds}
    except Exception as e:  # an API this transformers does not have, or a failure inside it: reported
        return {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"}
    finally:
        _free()


# ---------------------------------------------------------------- ours


class _FixedRequests:
    """Every prompt once, each exactly `new_tokens` tokens (no stop token)."""

    def __init__(self, prompts, new_tokens):
        from dflash_pipeline.generate.engine import Request

        self.todo = [Request(i, p, i, new_tokens, "length") for i, p in enumerate(prompts)]
        self.done = 0

    def next_request(self):
        return self.todo.pop(0) if self.todo else None

    def finished(self, done):
        self.done += 1

    def exhausted(self):
        return not self.todo


def run_ours(model, prompts: list[list[int]], new_tokens: int, rows: int, capacity: int, compile: bool = False) -> dict:
    from dflash_pipeline.generate.engine import Engine
    from dflash_pipeline.generate.rows import make_rows

    t_build = time.perf_counter()
    runner = make_rows(model, rows, capacity, torch.device(DEVICE), compile=compile)
    build_s = time.perf_counter() - t_build   # graphs captured (and layers compiled) before the first prompt
    Engine(runner, stop_ids=[]).run(_FixedRequests(prompts[:rows], 4))  # warm-up: kernels built at first use
    engine = Engine(runner, stop_ids=[])
    _sync()
    t0 = time.perf_counter()
    stats = engine.run(_FixedRequests(prompts, new_tokens))
    _sync()
    seconds = time.perf_counter() - t0
    engine_stats = stats.to_dict()
    # The decode step alone: steps of the full batch with no prefill between them.
    steps = 32
    tokens_R = torch.zeros(rows, dtype=torch.long, device=DEVICE)
    runner.prefill_rows(list(range(rows)), [torch.as_tensor(p, device=DEVICE) for p in prompts[:rows]])
    _sync()
    t1 = time.perf_counter()
    for _ in range(steps):
        runner.step(tokens_R)
    _sync()
    step_s = (time.perf_counter() - t1) / steps
    mean_prompt = sum(len(p) for p in prompts[:rows]) / rows
    kernels = runner.runner.decode_attention   # as the runner was configured (`dflash generate`'s)
    runner.close()   # the model gets its own attention back, for the baselines after this
    del runner, engine
    _free()
    return {"rows": rows, "compile": compile, "decode_attention": kernels, "build_seconds": build_s, "requests": len(prompts),
            "new_tokens": new_tokens, "seconds": seconds,
            "tokens_per_second": stats.tokens / seconds, "engine": engine_stats,
            "run_step_ms": 1000 * seconds / max(stats.steps, 1), "run_mean_context": engine_stats["mean_context"],
            "step_ms": 1000 * step_s, "step_mean_context": mean_prompt + steps / 2}


def run_memory(model, capacity: int) -> dict:
    """The rows `dflash generate` plans for this GPU's free memory, run at their most demanding: prompts
    that nearly fill a row (prefills at their largest, steps attending to every slot) in the first
    prefill groups, short ones after, top-p sampling over the whole vocabulary. Peak against plan.
    On the CPU (smoke) the same run without memory figures."""
    from types import SimpleNamespace

    from dflash_pipeline.generate.engine import Engine, Request
    from dflash_pipeline.generate.rows import PREFILL_CHUNK, PREFILL_TOKENS, open_rows
    from dflash_pipeline.progress import LiveLine

    _free()
    cuda = DEVICE == "cuda"
    base = torch.cuda.memory_allocated() if cuda else 0
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    out: dict = {"capacity": capacity, "weights_bytes": base,
                 "total_bytes": torch.cuda.get_device_properties(0).total_memory if cuda else 0}
    try:
        runner = open_rows(model, SimpleNamespace(max_length=capacity, batch_tokens=None, compile=False), torch.device(DEVICE),
                           LiveLine(enabled=True), conversations=1 << 20)
        R = runner.num_rows
        g = torch.Generator().manual_seed(0)
        vocab = min(model.get_input_embeddings().weight.shape[0], 49152)
        long_n = min(R, 2 * PREFILL_TOKENS // PREFILL_CHUNK)
        lengths = [capacity - 24] * long_n + [64] * (R + R // 4 - long_n)
        reqs = [Request(i, torch.randint(100, vocab, (n,), generator=g).tolist(), i, 16, "length")
                for i, n in enumerate(lengths)]
        t0 = time.perf_counter()
        Engine(runner, stop_ids=[], temperature=0.8, top_p=0.9).run(_ListRequests(reqs))
        _sync()
        out.update(rows=R, requests=len(reqs), seconds=time.perf_counter() - t0, ok=True)
        runner.close()
        del runner
    except Exception as e:  # out of memory above all: reported, the other parts' results kept
        out.update(ok=False, error=f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}")
    if cuda:
        out.update(peak_allocated=torch.cuda.max_memory_allocated(), peak_reserved=torch.cuda.max_memory_reserved(),
                   peak_beyond_weights=torch.cuda.max_memory_allocated() - base)
    _free()
    return out


class _ListRequests(_FixedRequests):
    def __init__(self, requests):
        self.todo, self.done = list(requests), 0


def run_pipeline(target_dir: str, work: str, prompts_n: int, new_tokens: int) -> dict:
    from dflash_pipeline.generate.pipeline import run_generate
    from dflash_pipeline.schemas.generate import GenerateConfig

    data = os.path.join(work, "prompts.jsonl")
    rng = random.Random(1)
    words = ["the", "model", "token", "cache", "river", "stone", "cloud", "why", "how", "explain"]
    with open(data, "w") as f:
        for i in range(prompts_n):
            f.write(json.dumps({"prompt": " ".join(rng.choice(words) for _ in range(rng.randint(20, 200)))}) + "\n")
    out = os.path.join(work, "generated")
    shutil.rmtree(out, ignore_errors=True)
    record = run_generate(GenerateConfig(out=out, data=[data], target=target_dir, max_new_tokens=new_tokens,
                                         max_length=1024, gpus="1", quiet=True))
    return {k: record[k] for k in ("seconds", "tokens_this_run", "tokens_per_second")} | {
        "rows": record["workers"][0].get("rows"), "total": record["total"]}


# ---------------------------------------------------------------- main


def bench_target(name: str, args, skip: set[str]) -> dict:
    """Every part for one target shape, in one process, the model built once."""
    B = int(dict(kv.split(":") for kv in args.batch.split(","))[name]) if not args.smoke else 4
    model = random_model(name)
    vocab = model.get_input_embeddings().weight.shape[0]
    prompts = make_prompts(2 * B, args.prompt_tokens, min(vocab, 49152))
    capacity = args.prompt_tokens + args.new_tokens + 16
    r: dict = {"batch": B}
    if "hf" not in skip:
        r["hf"] = run_hf(model, prompts[:B], args.hf_new_tokens or args.new_tokens)
        _free()
    r["ours"] = ours = run_ours(model, prompts, args.new_tokens, B, capacity)
    need = bytes_per_step(model, B, ours["step_mean_context"])
    run_need = bytes_per_step(model, B, ours["run_mean_context"])
    bound_ms = 1000 * need["total"] / args.bandwidth
    r["bound"] = {**need, "bound_step_ms": bound_ms, "fraction_of_bound": bound_ms / ours["step_ms"],
                  "run_bound_step_ms": 1000 * run_need["total"] / args.bandwidth,
                  "run_fraction_of_bound": 1000 * run_need["total"] / args.bandwidth / ours["run_step_ms"]}
    if "hf" in r:
        r["ours_over_hf"] = ours["tokens_per_second"] / r["hf"]["tokens_per_second"]
    if "compiled" not in skip and not args.smoke:
        r["ours_compiled"] = comp = run_ours(model, prompts, args.new_tokens, B, capacity, compile=True)
        _free()
        r["bound"]["compiled_fraction_of_bound"] = bound_ms / comp["step_ms"]
        r["bound"]["compiled_run_fraction_of_bound"] = 1000 * run_need["total"] / args.bandwidth / comp["run_step_ms"]
    if "cb" not in skip and name in args.cb_targets.split(","):
        r["cb"] = run_cb(model, prompts, args.new_tokens, B)
        if "tokens_per_second" in r["cb"]:
            r["ours_over_cb"] = ours["tokens_per_second"] / r["cb"]["tokens_per_second"]
    if name in ("qwen3-8b", "smoke") and "memory" not in skip:
        r["memory"] = run_memory(model, 4096 if not args.smoke else 256)
    if name in ("smollm", "smoke") and "pipeline" not in skip:
        path = os.path.join(args.work, f"{name}-random")
        shutil.rmtree(path, ignore_errors=True)
        save_target(model, path, args.tokenizer)
        del model
        _free()
        r["pipeline"] = run_pipeline(path, args.work, 4 * B, args.new_tokens)
    return r


def print_table(result: dict) -> None:
    print(f"\n{'target':10} {'B':>4} {'hf tok/s':>10} {'cb tok/s':>10} {'ours tok/s':>11} {'x hf':>6} "
          f"{'step ms':>8} {'bound ms':>9} {'of bound':>9} {'run of bound':>13} {'pipeline tok/s':>15}")
    nan = float("nan")
    for name, r in result["targets"].items():
        hf, cb, b = r.get("hf", {}), r.get("cb", {}), r["bound"]
        print(f"{name:10} {r['batch']:>4} {hf.get('tokens_per_second', nan):>10.0f} "
              f"{cb.get('tokens_per_second', nan):>10.0f} {r['ours']['tokens_per_second']:>11.0f} "
              f"{r.get('ours_over_hf', nan):>6.2f} {r['ours']['step_ms']:>8.2f} "
              f"{b['bound_step_ms']:>9.2f} {b['fraction_of_bound']:>9.0%} {b['run_fraction_of_bound']:>13.0%} "
              f"{r.get('pipeline', {}).get('tokens_per_second', nan):>15.0f}")
        if "ours_compiled" in r:
            c = r["ours_compiled"]
            print(f"  compiled: {c['tokens_per_second']:.0f} tok/s, step {c['step_ms']:.2f} ms, "
                  f"{b['compiled_fraction_of_bound']:.0%} of the bound (built in {c['build_seconds']:.0f} s)")
        if "error" in cb:
            print(f"  cb: {cb['error']}")
        if "memory" in r:
            m = r["memory"]
            print(f"  memory: {m.get('rows')} rows planned at max length {m['capacity']}: "
                  f"{'ok' if m['ok'] else 'FAILED ' + m.get('error', '')}, peak "
                  f"{m.get('peak_reserved', 0) / 2**30:.1f} GiB reserved of {m['total_bytes'] / 2**30:.1f} GiB")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer", required=True, help="a tokenizer folder (the embedded SmolLM2's)")
    ap.add_argument("--work", default="/tmp/dflash-bench")
    ap.add_argument("--targets", default="smollm,qwen3-8b")
    ap.add_argument("--batch", default="smollm:64,qwen3-8b:128", help="sequences in flight per target")
    ap.add_argument("--prompt-tokens", type=int, default=512, help="prompt lengths uniform in [N/2, N]")
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--hf-new-tokens", type=int, default=None, help="default: --new-tokens")
    ap.add_argument("--bandwidth", type=float, default=4.8e12, help="bytes/s of the GPU's memory (H200: 4.8e12)")
    ap.add_argument("--skip", default="", help="comma list of parts to leave out: hf, cb, compiled, memory, pipeline")
    ap.add_argument("--cb-targets", default="smollm,smoke", help="targets whose continuous-batching baseline runs: it "
                    "launches every kernel from Python (0.78K tok/s on the SmolLM2 shape, below generate()), so on the "
                    "8B shape at 128 sequences it would take minutes of the call for a number already known to lose")
    ap.add_argument("--json", default=None)
    ap.add_argument("--smoke", action="store_true", help="tiny target and workload (CPU is fine): check the script runs")
    args = ap.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    targets = args.targets.split(",")
    if args.smoke:
        targets = ["smoke"]
        args.prompt_tokens, args.new_tokens, args.hf_new_tokens = 24, 8, 4
    os.makedirs(args.work, exist_ok=True)
    result = {"device": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu", "torch": torch.__version__,
              "transformers": __import__("transformers").__version__, "args": vars(args), "targets": {}}
    for name in targets:
        result["targets"][name] = bench_target(name, args, skip)
        _free()
        save_json(args.json, result)
    print(json.dumps(result, indent=1, default=float))
    print_table(result)


if __name__ == "__main__":
    main()
