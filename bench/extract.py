"""Extraction benchmark on one GPU: `dflash extract` throughput against the bare forward pass.

Builds a random-weight target (speed does not depend on the weights), bf16, saves it as an HF folder:
  --shape qwen3-8b      Qwen3-8B: 36 layers, hidden 4096, 32/8 heads, intermediate 12288, vocab 151,936;
  --shape qwen3.5-27b   Qwen3.5-27B / 3.6-27B text model: 64 layers of 3 Gated DeltaNet (linear attention)
                        + 1 gated attention, hidden 5120, vocab 248,320 (bench/common.py has every field);
                        `--num-layers` keeps the pattern with fewer layers. All 64 layers fit one H200
                        beside extraction (54 GB of weights), but their checkpoint does not fit the
                        single-H200 machine's 64 GiB disk beside a store: 32 layers (27 GB) do;
and measures in the same run:
  baseline  the bare forward pass (base model, no hooks, no LM head) over the same batches, as
            transformers runs it (padding mask) and causal only (no padding mask, as extraction runs
            it), and the causal LM's whole forward (`model(input_ids)`: logits for every token); each
            after a warm-up over every batch shape;
  compute   extraction's GPU work alone (forward with hooks, top-k, encode, statistics; no store, no
            host threads), each stage timed: separates GPU-side cost from host-side stalls;
  extract   `dflash extract` (5 features, top-32, store on local disk) with the bf16 and fp8 codecs,
            steady-state tokens/s from its run record (model loading excluded); with --repeat a
            second time in the same process, when every batch shape's kernels are built (what a
            long run sees once its shapes repeat; the first run meets each shape first).
Reports tok/s, the ratios extract / baseline, against each forward (goal: >= 0.9), and bytes per
token of the store. For a hybrid target the JSON also says whether transformers runs Gated DeltaNet
with its fast kernels (flash-linear-attention, causal-conv1d; its own availability checks) or with its
slow PyTorch fallback (`linear_attention_kernels`).

    python bench/assets.py    # here, once: .bench_assets/tokenizer (carry it to the GPU machine)
    python bench/extract.py --tokenizer .bench_assets/tokenizer --work /tmp/bench [--tokens 400000] \
        [--gpus 1,2] [--repeat] [--skip whole,compute] [--json OUT.json]
    python bench/extract.py --tokenizer .bench_assets/tokenizer --shape qwen3.5-27b --num-layers 32 \
        --tokens 100000 --codecs bf16 --skip whole,compute --json OUT.json
    python bench/extract.py --smoke [--shape qwen3.5-27b] --tokenizer .bench_assets/tokenizer   # CPU, tiny
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

from common import QWEN3_5_27B, QWEN3_5_TINY, save_json  # noqa: E402

SMOKE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, vocab_size=49152, max_position_embeddings=8192, tie_word_embeddings=False)
QWEN3_8B = dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=40960,
                rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=False)
# --shape: (config class, full shape, smoke shape)
SHAPES = {"qwen3-8b": ("Qwen3Config", QWEN3_8B, SMOKE), "qwen3.5-27b": ("Qwen3_5TextConfig", QWEN3_5_27B, QWEN3_5_TINY)}


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
MAX_LENGTH = 8192
DTYPE = torch.bfloat16 if DEVICE == "cuda" else torch.float32


def build_target(path: str, tokenizer_dir: str, shape: dict, config_class: str = "Qwen3Config") -> None:
    import transformers
    from transformers import AutoModelForCausalLM

    if os.path.exists(os.path.join(path, "config.json")):
        return
    cfg = getattr(transformers, config_class)(**shape)
    with torch.device(DEVICE):
        model = AutoModelForCausalLM.from_config(cfg, dtype=DTYPE)
    model.save_pretrained(path)
    for f in os.listdir(tokenizer_dir):
        if f.startswith("tokenizer") or f in ("special_tokens_map.json", "chat_template.jinja"):
            shutil.copy(os.path.join(tokenizer_dir, f), path)
    del model
    _free_gpu()


def write_data(path: str, tokens: int, seed: int = 0) -> None:
    """Plain-text records of random words, lengths 300..4000 words (about as many tokens)."""
    rng = random.Random(seed)
    words = [f"w{i}" for i in range(5000)] + ["the", "of", "and", "model", "token", "cache"]
    total = 0
    with open(path, "w") as f:
        while total < tokens:
            n = rng.randint(300, 4000)
            f.write(json.dumps({"text": " ".join(rng.choice(words) for _ in range(n))}) + "\n")
            total += n * 2  # SmolLM's tokenizer splits "w123" into ~2 tokens


def store_batches(store: str, tokens_per_batch: int) -> list[tuple[torch.Tensor, list[int]]]:
    """The padded batches `dflash extract` ran, rebuilt from the store's plan: (input ids, lengths)."""
    from dflash_pipeline.extract.engine import padded_length
    from dflash_pipeline.extract.pipeline import make_batches
    from dflash_pipeline.extract.plan import PlanReader, read_plan
    from dflash_pipeline.store.backends import KV, open_zarr_store

    kv = KV(open_zarr_store(store, read_only=True))
    plan, reader = read_plan(kv), PlanReader(kv)
    batches = []
    for s in plan.segments:
        sp = reader.segment(s["segment"])
        lengths = [len(x) for x in sp.input_ids]
        for b in make_batches(lengths, tokens_per_batch, MAX_LENGTH):
            lens = [lengths[i] for i in b]
            ids = torch.zeros((len(b), padded_length(max(lens), MAX_LENGTH)), dtype=torch.long)
            for r, i in enumerate(b):
                ids[r, :lens[r]] = torch.from_numpy(sp.input_ids[i].astype("int64"))
            batches.append((ids, lens))
    return batches


def bare_forward(path: str, store: str, tokens_per_batch: int, with_head: bool = False,
                 causal_only: bool = False) -> float:
    """Baseline: the base model's forward over the batches extraction ran (same padding), as
    transformers runs it (a padding mask). with_head: the causal LM's whole forward instead,
    `model(input_ids)` with its logits for every token (what running the target costs; extraction also
    needs the head's output, for the top-k). causal_only: no padding mask, plain causal attention (the
    right padding is invisible to real tokens either way; what extraction runs). Every batch shape is
    run once before the timed pass, so kernels built per shape are not in the time."""
    from dflash_pipeline.extract.target import base_model, load_target, right_padded_batch

    model = load_target(path, DTYPE, DEVICE)
    fwd = model if with_head else base_model(model)
    batches = store_batches(store, tokens_per_batch)

    def run(ids, lens):
        if causal_only:
            with right_padded_batch():
                out = fwd(input_ids=ids.to(DEVICE, non_blocking=True), use_cache=False)
        else:
            mask = (torch.arange(ids.shape[1]) < torch.tensor(lens)[:, None]).long()
            out = fwd(input_ids=ids.to(DEVICE, non_blocking=True), attention_mask=mask.to(DEVICE, non_blocking=True),
                      use_cache=False)
        del out  # the logits of one batch (5 GB at 16K tokens x 152K words) are freed before the next

    with torch.inference_mode():
        for ids, lens in batches:  # warm-up: every shape once
            run(ids, lens)
        _sync()
        t = time.perf_counter()
        n = 0
        for ids, lens in batches:
            run(ids, lens)
            n += sum(lens)
        dt = _elapsed(t)
    del model
    fwd = None  # noqa: F841  (the closure held it)
    _free_gpu()
    return n / dt


def compute_only(path: str, store: str, tokens_per_batch: int, codec_name: str, profile=None) -> dict:
    """Extraction's GPU work alone, no store, no host threads: the target forward with hooks, then
    each stage of `dflash extract`'s loop timed on its own (CUDA events), over the same batches. Against
    the bare forward and the full extraction it separates GPU-side cost from host-side stalls."""
    from dflash_pipeline.extract.profiling import BatchProfiler
    from dflash_pipeline.extract.target import TargetRunner, decoder_layers, load_target
    from dflash_pipeline.method import default_layer_ids
    from dflash_pipeline.store.codecs import get_codec, hidden_layer_stats

    prof = BatchProfiler(profile, label="compute only")
    model = load_target(path, DTYPE, DEVICE)
    runner = TargetRunner(model, default_layer_ids(len(decoder_layers(model)), 5), 32)
    codec = get_codec(codec_name)
    batches = store_batches(store, tokens_per_batch)
    stages = {"forward+hooks+topk": 0.0, "encode": 0.0, "stats": 0.0}
    n = 0
    for warm in (True, False):
        todo = batches  # the warm-up runs every shape once
        _sync()
        t = time.perf_counter()
        for i, (ids, lens) in enumerate(todo):
            if not warm:
                prof.before(i, n)
            if DEVICE == "cuda":
                ev = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
                ev[0].record()
            out = runner.run_batch(ids, lens)
            if DEVICE == "cuda":
                ev[1].record()
            codec.encode(out.hidden_NLH)
            if DEVICE == "cuda":
                ev[2].record()
            hidden_layer_stats(out.hidden_NLH)
            if DEVICE == "cuda":
                ev[3].record()
                ev[3].synchronize()
                if not warm:
                    for k, name in enumerate(stages):
                        stages[name] += ev[k].elapsed_time(ev[k + 1]) / 1e3
            if not warm:
                n += sum(lens)
        dt = _elapsed(t)
    prof.finish(n)
    del model, runner
    _free_gpu()
    return {"tok_per_s": n / dt, "seconds": dt, "stage_seconds": stages}


def linear_attention_kernels() -> dict:
    """Which Gated DeltaNet kernels transformers runs, by its own availability checks (both exist in 5.17
    and 5.24): the fast ones (flash-linear-attention's chunked delta rule, causal-conv1d) or its
    reference PyTorch path, which it falls back to, with a warning, when either package is missing."""
    from transformers.utils import import_utils

    fla = bool(import_utils.is_flash_linear_attention_available())
    conv = bool(import_utils.is_causal_conv1d_available())
    return {"flash_linear_attention": fla, "causal_conv1d": conv,
            "path": "fast kernels" if fla and conv else
                    "PyTorch fallback (slow)" if not (fla or conv) else "mixed: " + ("fla" if fla else "causal-conv1d")}


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _elapsed(t0: float) -> float:
    """Seconds since t0, once the GPU has finished what was queued."""
    _sync()
    return time.perf_counter() - t0


def _free_gpu() -> None:
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def main() -> None:
    global MAX_LENGTH
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer", required=True, help="a tokenizer folder (the embedded SmolLM2's)")
    ap.add_argument("--work", default="/tmp/dflash-bench")
    ap.add_argument("--tokens", type=int, default=400_000)
    ap.add_argument("--tokens-per-batch", type=int, default=16384)
    ap.add_argument("--codecs", default="bf16,fp8")
    ap.add_argument("--gpus", default="1", help="GPU counts to run extraction on, e.g. 1,2 (speedup reported)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--profile-window", default=None, metavar="FIRST:COUNT",
                    help="profile these batches of the one-GPU extraction and of compute-only (same batches)")
    ap.add_argument("--profile-dir", default=None, help="where the profile reports go (default: --work)")
    ap.add_argument("--extra-batch-tokens", type=int, default=None,
                    help="also run one GPU with batches of this many tokens, against forwards over the same batches")
    ap.add_argument("--writer-processes", type=int, default=None,
                    help="as `dflash extract --writer-processes` (default: its default); 0 for threads")
    ap.add_argument("--store-dir", default=None, help="where the stores go (default: --work); e.g. /dev/shm to "
                    "take the disk out of the measurement")
    ap.add_argument("--keep", action="store_true", help="keep the stores (e.g. to measure training's data wait on them)")
    ap.add_argument("--repeat", action="store_true",
                    help="run the one-GPU extraction twice in this process; the second finds every batch "
                         "shape's kernels built, as a long run does once its shapes repeat")
    ap.add_argument("--skip", default="", help="comma list of measurements to leave out: whole, compute")
    ap.add_argument("--smoke", action="store_true", help="tiny target and data (CPU is fine): check the script runs")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-8b", help="the random target's shape")
    ap.add_argument("--num-layers", type=int, default=None,
                    help="decoder layers of the target (default: the shape's; a hybrid keeps its 3:1 pattern)")
    args = ap.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    config_class, full_shape, smoke_shape = SHAPES[args.shape]
    shape = dict(smoke_shape if args.smoke else full_shape)
    if args.num_layers:
        shape["num_hidden_layers"] = args.num_layers
    if args.smoke:
        args.tokens = min(args.tokens, 30000)
        MAX_LENGTH = 1024  # a hybrid's PyTorch Gated DeltaNet path crawls through 8K-token rows on a CPU
    from dflash_pipeline.extract.pipeline import run_extract
    from dflash_pipeline.schemas.config import ExtractConfig

    os.makedirs(args.work, exist_ok=True)
    # bench/gpu_all.sh's eval part reads the Qwen3-8B target under its old name
    name = ("qwen3-8b-random" if args.shape == "qwen3-8b" and not args.num_layers else
            f"{args.shape}{'-smoke' if args.smoke else ''}-{shape['num_hidden_layers']}l-random")
    target = os.path.join(args.work, name)
    data = os.path.join(args.work, "data.jsonl")
    t = time.time()
    build_target(target, args.tokenizer, shape, config_class)
    write_data(data, args.tokens)
    print(f"target and data ready in {time.time() - t:.0f}s", flush=True)
    results = {"date": time.strftime("%Y-%m-%d"), "writer_processes": args.writer_processes,
               "tokens_requested": args.tokens,
               "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
               "gpus": args.gpus, "shape_name": args.shape, "shape": shape, "tokens_per_batch": args.tokens_per_batch,
               "runs": {}}
    if "linear_num_value_heads" in shape:
        results["linear_attention_kernels"] = linear_attention_kernels()
        print(f"Gated DeltaNet kernels: {results['linear_attention_kernels']}", flush=True)
    def dump() -> None:
        save_json(args.json, results)

    baseline = None
    gpu_counts = [int(g) for g in args.gpus.split(",")]

    def extract_run(store: str, codec: str, n: int, tokens_per_batch: int) -> dict:
        shutil.rmtree(store, ignore_errors=True)
        cfg = ExtractConfig(out=store, target=target, data=[data], max_length=MAX_LENGTH, topk=32, codec=codec,
                            tokens_per_batch=tokens_per_batch, segment_tokens=max(32768, tokens_per_batch),
                            gpus=str(n), dtype="bf16" if DEVICE == "cuda" else "fp32", tokenize_workers=1,
                            device="cuda" if DEVICE == "cuda" else "cpu", writer_processes=args.writer_processes,
                            num_procs=n if DEVICE == "cpu" else None)
        rec = run_extract(cfg)
        ws = [w for w in rec["workers"] if w.get("tokens")]
        return {"codec": codec, "gpus": n, "tokens": rec["tokens_this_run"], "tokens_per_batch": tokens_per_batch,
                "tok_per_s": sum(w["tokens"] for w in ws) / max(w["seconds"] for w in ws),
                "steady_tok_per_s": sum(w.get("steady_tokens_per_second", 0.0) for w in ws),
                "bytes_per_token": rec["store"]["bytes_per_token"], "compression_ratio": rec["store"]["compression_ratio"],
                "codec_rel_rmse": rec["store"]["codec_rel_rmse"], "workers": ws, "store_dir": args.store_dir or args.work}

    def window(name: str):
        """--profile-window FIRST:COUNT -> the same batches profiled in the pipeline and compute-only."""
        from pathlib import Path

        from dflash_pipeline.extract.profiling import ProfileWindow

        if not args.profile_window:
            return None
        first, count = (int(x) for x in args.profile_window.split(":"))
        return ProfileWindow(first, count, Path(args.profile_dir or args.work) / f"profile-{name}.json")

    for codec in args.codecs.split(","):
        store = os.path.join(args.store_dir or args.work, f"store-{codec}")
        for n in gpu_counts:
            w = window(f"pipeline-{codec}") if n == 1 else None
            if w is not None:  # the one-GPU run is in this process: its engine reads the variable
                os.environ["DFLASH_PROFILE"] = f"{w.first}:{w.count}:{w.path}"
            # End to end (tok_per_s): model loaded to the last segment committed, slowest process.
            # Steady state: after each process's first segment until its GPU finished (warm-up and the
            # final write left out; what a run of hours sees).
            results["runs"][f"{codec}-{n}gpu"] = extract_run(store, codec, n, args.tokens_per_batch)
            os.environ.pop("DFLASH_PROFILE", None)
            dump()  # what is measured so far survives a time limit
            if n == 1 and args.repeat:
                # The one-GPU run is in this process: a second one finds every batch shape's kernels
                # built, as a long run does once its shapes repeat (the baselines are warm too).
                results["runs"][f"{codec}-1gpu-repeat"] = extract_run(store, codec, 1, args.tokens_per_batch)
                dump()
            if baseline is None:
                results["causal_forward_tok_per_s_1gpu"] = bare_forward(target, store, args.tokens_per_batch,
                                                                        causal_only=True)
                dump()
                baseline = bare_forward(target, store, args.tokens_per_batch)
                results["bare_forward_tok_per_s_1gpu"] = baseline
                dump()
                if "whole" not in skip:
                    results["full_forward_tok_per_s_1gpu"] = bare_forward(target, store, args.tokens_per_batch, True)
                    dump()
                if "compute" not in skip:
                    results["compute_only"] = compute_only(target, store, args.tokens_per_batch, codec,
                                                           window(f"compute-{codec}"))
                    dump()
        if not args.keep:
            shutil.rmtree(store, ignore_errors=True)
    if args.extra_batch_tokens:
        # One more one-GPU run with larger batches (segments at least as large), against the bare and
        # whole forwards over its own batches: what the per-batch fixed costs weigh.
        tpb = args.extra_batch_tokens
        codec = args.codecs.split(",")[0]
        store = os.path.join(args.store_dir or args.work, f"store-{codec}-tpb{tpb}")
        r = extract_run(store, codec, 1, tpb)
        results["extra_batch_run"] = r
        dump()
        r["bare_forward_tok_per_s"] = bare_forward(target, store, tpb)
        r["full_forward_tok_per_s"] = bare_forward(target, store, tpb, True)
        r["steady_ratio_vs_bare_forward"] = r["steady_tok_per_s"] / r["bare_forward_tok_per_s"]
        r["steady_ratio_vs_full_forward"] = r["steady_tok_per_s"] / r["full_forward_tok_per_s"]
        dump()
        shutil.rmtree(store, ignore_errors=True)
    full, causal = results.get("full_forward_tok_per_s_1gpu", float("nan")), results["causal_forward_tok_per_s_1gpu"]
    print(f"\n{results['gpu']}: bare forward (1 GPU, no LM head, padding mask) {baseline:,.0f} tok/s; the same "
          f"without the padding mask (causal only) {causal:,.0f} tok/s; the causal LM's whole forward (logits for "
          f"every token) {full:,.0f} tok/s")
    co = results.get("compute_only")
    if co:
        print(f"  extraction's GPU work alone (no store): {co['tok_per_s']:,.0f} tok/s = "
              f"{co['tok_per_s'] / baseline:.3f} x bare forward; stages (s): "
              + ", ".join(f"{k} {v:.2f}" for k, v in co["stage_seconds"].items()))
    for name, r in results["runs"].items():
        n = r["gpus"]
        r["ratio_vs_bare_forward"] = r["tok_per_s"] / (baseline * n)
        r["steady_ratio_vs_bare_forward"] = r["steady_tok_per_s"] / (baseline * n)
        r["steady_ratio_vs_full_forward"] = r["steady_tok_per_s"] / (full * n)
        r["steady_ratio_vs_causal_forward"] = r["steady_tok_per_s"] / (causal * n)
        one = results["runs"].get(f"{r['codec']}-1gpu")
        if name.endswith("-repeat"):
            print("  the same again in this process, every batch shape seen before:")
        if n > 1 and one:
            r["speedup_vs_1gpu"] = r["tok_per_s"] / one["tok_per_s"]
            r["steady_speedup_vs_1gpu"] = r["steady_tok_per_s"] / max(one["steady_tok_per_s"], 1e-9)
        w0 = r["workers"][0]
        print(f"  dflash extract {r['codec']:5s} x{n} GPU: steady {r['steady_tok_per_s']:,.0f} tok/s = "
              f"{r['steady_ratio_vs_bare_forward']:.3f} x {n} x bare forward; end to end {r['tok_per_s']:,.0f} tok/s "
              f"({r['ratio_vs_bare_forward']:.3f}); steady vs whole forward with logits "
              f"{r['steady_ratio_vs_full_forward']:.3f}; vs causal-only bare forward {r['steady_ratio_vs_causal_forward']:.3f}; "
              f"{r['bytes_per_token']:,.0f} B/token ({r['compression_ratio']:.2f}x)"
              + (f"; speedup over 1 GPU: steady {r['steady_speedup_vs_1gpu']:.2f}x, end to end {r['speedup_vs_1gpu']:.2f}x"
                 if "speedup_vs_1gpu" in r else ""))
        print(f"    rank 0: {w0['seconds']:.1f}s (first segment {w0.get('first_segment_s', 0):.1f}s, drain "
              f"{w0.get('drain_s', 0):.1f}s), GPU busy {w0.get('gpu_busy_s') or 0:.1f}s, blocked on staging "
              f"{w0['wait_staging_s']:.1f}s, on writes {w0['wait_write_s']:.1f}s; GPU loop host time (s): "
              + ", ".join(f"{k} {v:.2f}" for k, v in w0.get("host_loop_s", {}).items())
              + "; GPU idle between batches (s): " + ", ".join(f"{k} {v:.2f}" for k, v in (w0.get("gpu_gap_s") or {}).items()))
    r = results.get("extra_batch_run")
    if r and "steady_ratio_vs_full_forward" in r:
        w0 = r["workers"][0]
        print(f"  with {r['tokens_per_batch']:,}-token batches: bare forward {r['bare_forward_tok_per_s']:,.0f}, whole "
              f"forward {r['full_forward_tok_per_s']:,.0f}, dflash extract steady {r['steady_tok_per_s']:,.0f} tok/s = "
              f"{r['steady_ratio_vs_bare_forward']:.3f} x bare, {r['steady_ratio_vs_full_forward']:.3f} x whole; "
              "GPU idle between batches (s): "
              + ", ".join(f"{k} {v:.2f}" for k, v in (w0.get("gpu_gap_s") or {}).items()))
    dump()


if __name__ == "__main__":
    main()
