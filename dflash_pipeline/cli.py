"""The `dflash` command line. Parsing only: every command calls a plain library function.

Heavy imports (torch, transformers, zarr) happen inside the commands so `dflash --help` is instant.
A user's mistake (DFlashError) is printed as one line on stderr with exit code 2, never a traceback.
"""

from __future__ import annotations

import functools
import json
import os
import sys
from typing import Optional

import typer

from dflash_pipeline.method import DEFAULT_CAP_WEIGHT, DEFAULT_FEATURE_NOISE, DEFAULT_KL_WEIGHT, gamma_table_text

# Tokenization runs in our own worker processes; the tokenizers library's thread pool on top of that
# only slows it down (and warns after a fork).
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Train DFlash speculative-decoding drafters from an offline feature store.")
store_app = typer.Typer(add_completion=False, no_args_is_help=True, help="Inspect and check a feature store.")
app.add_typer(store_app, name="store")


def user_errors(fn):
    """Turn the library's user-facing errors into one line and a non-zero exit."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        from dflash_pipeline.errors import DFlashError

        try:
            return fn(*args, **kwargs)
        except DFlashError as e:
            print(f"error: {e}", file=sys.stderr)
            raise typer.Exit(e.exit_code) from None
        except KeyboardInterrupt:
            print("interrupted", file=sys.stderr)
            raise typer.Exit(130) from None

    return wrapper


def _quiet_zarr_warnings() -> None:
    import warnings

    warnings.filterwarnings("ignore", message=".*not part of the Zarr format 3 specification.*")


@store_app.command("stats")
@user_errors
def store_stats(
    store: str = typer.Argument(..., help="Store path or URL (s3://, gs://, memory://)."),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object instead of tables."),
    plot: Optional[str] = typer.Option(None, "--plot", help="Also write a PNG of the length histogram and layer scales."),
    sample: int = typer.Option(256, "--sample", help="Read at most this many segments' markers for sizes and statistics (0: all)."),
):
    """Samples, tokens, sizes, compression, codec error, per-layer statistics, top-k mass, lengths."""
    _quiet_zarr_warnings()
    from rich.console import Console

    from dflash_pipeline.store.stats import compute_stats, plot_stats, render_stats

    s = compute_stats(store, sample=sample or None)
    if plot:
        plot_stats(s, plot)
    if json_out:
        print(json.dumps(s, default=float))
    else:
        render_stats(s, Console())
        if plot:
            print(f"plot written to {plot}")


@store_app.command("verify")
@user_errors
def store_verify(
    store: str = typer.Argument(..., help="Store path or URL."),
    repair: bool = typer.Option(False, "--repair", help="Remove incomplete (uncommitted) segments and rebuild the manifest."),
    drop_corrupt: bool = typer.Option(False, "--drop-corrupt", help="With --repair: also remove corrupt committed segments, by name, so that extraction redoes them."),
    json_out: bool = typer.Option(False, "--json", help="Print the report as one JSON object."),
    threads: int = typer.Option(8, "--threads", help="Segments checked in parallel."),
):
    """Check every committed segment's shapes and checksums; exit 1 if any is corrupt."""
    _quiet_zarr_warnings()
    from dflash_pipeline.store.verify import render_verify, verify_store

    if drop_corrupt and not repair:
        from dflash_pipeline.errors import DFlashError

        raise DFlashError("--drop-corrupt only acts together with --repair")
    rep = verify_store(store, repair=repair, drop_corrupt=drop_corrupt, threads=threads)
    if json_out:
        print(json.dumps(rep.to_dict()))
    else:
        print(render_verify(rep))
    if rep.failed:
        raise typer.Exit(1)


def _int_list(text: Optional[str], option: str) -> Optional[list[int]]:
    if text is None or text == "":
        return None
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        from dflash_pipeline.errors import DFlashError

        raise DFlashError(f"{option} takes comma-separated integers, got '{text}'") from None


def _budgets(text: str, option: str) -> list[int]:
    """Tree budgets: comma-separated integers, or 'none' (an empty list)."""
    return [] if text.strip().lower() in ("", "none") else (_int_list(text, option) or [])


def _auto_int(text: str, option: str) -> Optional[int]:
    """'auto' (None) or an integer."""
    if text.strip().lower() == "auto":
        return None
    try:
        return int(text)
    except ValueError:
        from dflash_pipeline.errors import DFlashError

        raise DFlashError(f"{option} takes 'auto' or an integer, got '{text}'") from None


def _config(cls, **kwargs):
    """Build a config dataclass; its validation errors become one-line user errors."""
    from dflash_pipeline.errors import DFlashError

    try:
        return cls(**kwargs)
    except ValueError as e:
        raise DFlashError(str(e)) from None


@app.command("extract")
@user_errors
def extract(
    out: str = typer.Option(..., "--out", help="Store path or URL to create or resume."),
    target: Optional[str] = typer.Option(None, "--target", help="HF model folder, hub id in the local cache, or .gguf file. Default: the embedded SmolLM2-135M-Instruct."),
    data: Optional[list[str]] = typer.Option(None, "--data", help="JSONL/JSON/Parquet conversations (ShareGPT, OpenAI messages or text); repeatable. Default: the embedded ShareGPT conversations."),
    max_length: int = typer.Option(2048, "--max-length", help="Truncate samples to this many tokens."),
    limit: Optional[int] = typer.Option(None, "--limit", help="Use at most this many samples."),
    chat_template_kwargs: Optional[str] = typer.Option(None, "--chat-template-kwargs", help="JSON object of chat-template variables, e.g. '{\"enable_thinking\": false}' (Qwen3/3.5 thinking off): conversations are rendered and masked as the target is served with them."),
    layers: Optional[str] = typer.Option(None, "--layers", help="Decoder layer ids to capture, e.g. 1,9,17,25,33 (0-based outputs, before the final norm)."),
    num_features: int = typer.Option(5, "--num-features", help="Without --layers: capture this many layers, spread as DFlash does."),
    topk: int = typer.Option(32, "--topk", help="Teacher top-k log-probabilities kept per token (0: none)."),
    codec: str = typer.Option("bf16", "--codec", help="Hidden-state codec: bf16 (lossless) or fp8 (about 2x smaller)."),
    tokens_per_batch: int = typer.Option(16384, "--tokens-per-batch", help="Padded tokens per forward pass."),
    segment_tokens: int = typer.Option(32768, "--segment-tokens", help="Tokens per store segment (unit of work, commit and resume)."),
    gpus: str = typer.Option("all", "--gpus", help="'all' or how many GPUs to use (one process each)."),
    gpus_per_replica: int = typer.Option(1, "--gpus-per-replica", help="Split a target that does not fit one GPU over this many."),
    dtype: str = typer.Option("auto", "--dtype", help="Target compute dtype: auto (bf16 on GPU, fp32 on CPU), bf16, fp16 or fp32."),
    device: str = typer.Option("auto", "--device", help="auto, cuda or cpu."),
    writer_processes: Optional[int] = typer.Option(None, "--writer-processes", help="Processes that compress and write segments, apart from the GPU loop's (default: 2 per GPU, 0 on CPU: threads)."),
    quiet: bool = typer.Option(False, "--quiet", help="No progress output."),
):
    """Run the target over the data and write a feature store (crash-safe; re-run to resume)."""
    _quiet_zarr_warnings()
    from dflash_pipeline.schemas.config import ExtractConfig

    cfg = _config(ExtractConfig, out=out, target=target, data=list(data or []), max_length=max_length,
                  limit=limit, chat_template_kwargs=chat_template_kwargs, layers=_int_list(layers, "--layers"), num_features=num_features, topk=topk,
                  codec=codec, tokens_per_batch=tokens_per_batch, segment_tokens=segment_tokens, gpus=gpus,
                  gpus_per_replica=gpus_per_replica, dtype=dtype, device=device, quiet=quiet,
                  writer_processes=writer_processes)
    from dflash_pipeline.extract.pipeline import run_extract

    run_extract(cfg)


@app.command("generate")
@user_errors
def generate(
    out: str = typer.Option(..., "--out", help="Output folder: shards of regenerated conversations, run records (re-run to resume)."),
    data: Optional[list[str]] = typer.Option(None, "--data", help="JSONL/JSON/Parquet conversations (ShareGPT, OpenAI messages or prompt); repeatable. Default: the embedded ShareGPT conversations."),
    target: Optional[str] = typer.Option(None, "--target", help="HF model folder, hub id in the local cache, or .gguf file. Default: the embedded SmolLM2-135M-Instruct."),
    limit: Optional[int] = typer.Option(None, "--limit", help="Regenerate at most this many conversations."),
    max_new_tokens: int = typer.Option(2048, "--max-new-tokens", help="Tokens per reply; a reply that reaches it is kept and marked truncated."),
    max_length: Optional[int] = typer.Option(None, "--max-length", help="Prompt + reply tokens per sequence (default 4096, or the target's limit if lower); a longer conversation ends its replay there."),
    temperature: float = typer.Option(0.0, "--temperature", help="0: greedy."),
    top_p: float = typer.Option(1.0, "--top-p", help="Sample from the smallest set of tokens whose probability reaches P."),
    top_k: int = typer.Option(0, "--top-k", help="Sample from the K most likely tokens (0: all)."),
    seed: int = typer.Option(0, "--seed", help="Seed of the per-reply random streams (results do not depend on batching)."),
    turns: str = typer.Option("all", "--turns", help="all: regenerate every assistant turn given the regenerated history; first: only the first reply."),
    chat_template_kwargs: Optional[str] = typer.Option(None, "--chat-template-kwargs", help="JSON object of chat-template variables, e.g. '{\"enable_thinking\": false}'."),
    shard_size: int = typer.Option(256, "--shard-size", help="Conversations per output shard (unit of work, commit and resume)."),
    fmt: str = typer.Option("jsonl", "--format", help="Shard files: jsonl or parquet."),
    gpus: str = typer.Option("all", "--gpus", help="'all' or how many GPUs to use (one process each)."),
    batch_tokens: Optional[int] = typer.Option(None, "--batch-tokens", help="KV-cache tokens per GPU (sequences in flight x --max-length); default: what fits in memory."),
    dtype: str = typer.Option("auto", "--dtype", help="auto (bf16 on GPU, fp32 on CPU), bf16, fp16 or fp32."),
    device: str = typer.Option("auto", "--device", help="auto, cuda or cpu."),
    compile_steps: Optional[bool] = typer.Option(None, "--compile/--no-compile", help="torch.compile the decode step's layers before its graphs are captured (fused elementwise kernels: 1.48x faster 8B steps at 128 sequences; ~12 s at start for an 8B shape). Default: on with CUDA, off on CPUs."),
    quiet: bool = typer.Option(False, "--quiet", help="No progress output."),
):
    """Regenerate the assistant turns of conversations with the target (crash-safe; re-run to resume)."""
    from dflash_pipeline.schemas.generate import GenerateConfig

    cfg = _config(GenerateConfig, out=out, target=target, data=list(data or []), limit=limit,
                  max_new_tokens=max_new_tokens, max_length=max_length, temperature=temperature, top_p=top_p,
                  top_k=top_k, seed=seed, turns=turns, chat_template_kwargs=chat_template_kwargs,
                  shard_size=shard_size, format=fmt, gpus=gpus, batch_tokens=batch_tokens, dtype=dtype,
                  device=device, quiet=quiet, compile=compile_steps)
    from dflash_pipeline.generate.pipeline import run_generate

    run_generate(cfg)


@app.command("train")
@user_errors
def train(
    store: str = typer.Option(..., "--store", help="Feature store written by `dflash extract`."),
    out: str = typer.Option(..., "--out", help="Run directory: config.json, metrics.jsonl, checkpoints/, final/."),
    epochs: Optional[float] = typer.Option(None, "--epochs", help="Epochs over the store (default 1)."),
    steps: Optional[int] = typer.Option(None, "--steps", help="Optimizer steps instead of epochs."),
    num_layers: int = typer.Option(5, "--num-layers", help="Drafter decoder layers."),
    block_size: int = typer.Option(16, "--block-size", help="Tokens drafted per block (anchor + masks)."),
    max_anchors: Optional[int] = typer.Option(None, "--max-anchors", help="Anchors (blocks) per sample per step (default: 512, or on a store of short samples fewer over proportionally more tokens per batch, e.g. 64 over 49,152 on replies of ~300 tokens: the recipe that trained the best drafter, BENCHMARKS.md)."),
    gamma: Optional[float] = typer.Option(None, "--gamma", help=f"Loss decay exp(-(k-1)/gamma); default by block size B: {gamma_table_text()}."),
    kl_weight: Optional[float] = typer.Option(None, "--kl-weight", help=f"Share of forward KL to the stored teacher top-k, blended with CE (default {DEFAULT_KL_WEIGHT}; 0 on a store without top-k)."),
    cap_weight: float = typer.Option(DEFAULT_CAP_WEIGHT, "--cap-weight", help="Weight of CAP (entropy minimisation on already-correct slots); 0: none."),
    feature_noise: float = typer.Option(DEFAULT_FEATURE_NOISE, "--feature-noise", help="Uniform noise U(-s, s) added to the target features (absolute); 0: none."),
    sliding_window: Optional[int] = typer.Option(None, "--sliding-window", help="Window of the sliding-attention layers."),
    swa_layers: Optional[str] = typer.Option(None, "--swa-layers", help="Drafter layers with sliding-window attention, e.g. 0,1,2,3."),
    tokens_per_batch: Optional[int] = typer.Option(None, "--tokens-per-batch", help="Tokens per micro-batch (rows of --max-length; default: 4 rows of 3,072, more where --max-anchors' default is fewer)."),
    max_length: int = typer.Option(3072, "--max-length", help="Row length; longer samples are truncated."),
    grad_accum: int = typer.Option(1, "--grad-accum", help="Micro-batches per optimizer step."),
    lr: float = typer.Option(6e-4, "--lr"),
    warmup_ratio: float = typer.Option(0.04, "--warmup-ratio"),
    grad_clip: float = typer.Option(1.0, "--grad-clip"),
    adam_beta2: Optional[float] = typer.Option(None, "--adam-beta2", help="AdamW's second-moment decay (default 0.999, torch's and SpecForge's; 0.95 trained 0.98x the real tau at 1,500 steps and was the default before: runs started then resume with --adam-beta2 0.95)."),
    mask_token_id: Optional[int] = typer.Option(None, "--mask-token-id", help="Token id whose embedding marks the masked block slots (default: tokenizer's mask token, else the first free embedding row, else an unused special token)."),
    ema: Optional[float] = typer.Option(None, "--ema", help="Keep an EMA of the weights with this decay; it is what gets exported."),
    gpus: str = typer.Option("all", "--gpus", help="'all' or how many GPUs (one DDP process each)."),
    eval_fraction: float = typer.Option(0.02, "--eval-fraction", help="Share of samples held out for evaluation."),
    eval_every: int = typer.Option(0, "--eval-every", help="Evaluate every N steps (0: at epoch ends while the estimates take at most 5% of the run's time: one that would come sooner than 19x the last estimate's own time after it is skipped; the first epoch end and the last step always evaluate)."),
    eval_tree_budget: str = typer.Option("16,64", "--eval-tree-budget", help="Tree budgets of the held-out estimate: tau_tree_N, the acceptance length of `dflash eval --tree-budget N` estimated on held-out samples (as tau_chain is for the chain); 'none' to skip it."),
    eval_new_tokens: int = typer.Option(0, "--eval-new-tokens", help="The held-out estimate walks at most N tokens of each reply, as `dflash eval --max-new-tokens N` decodes: compare the two at equal N (0: whole replies, whose later tokens are often easier)."),
    log_every: int = typer.Option(10, "--log-every"),
    save_every: int = typer.Option(500, "--save-every"),
    resume: bool = typer.Option(False, "--resume", help="Continue from the run directory's latest checkpoint."),
    init_from: Optional[str] = typer.Option(None, "--init-from", help="Start from the weights of an exported drafter (a run's final/, `dflash export`'s output, a published DFlash drafter) with a fresh optimizer: fine-tune it on this store, or train on. Its architecture must be the one the other options give."),
    stop_after: Optional[int] = typer.Option(None, "--stop-after", help="Checkpoint and exit after N steps of this invocation (time-sliced jobs)."),
    strict: bool = typer.Option(False, "--strict", help="Fail on a corrupt store segment instead of skipping it."),
    activation_checkpointing: bool = typer.Option(False, "--activation-checkpointing", help="Recompute each drafter layer in backward: much less activation memory for about a third more compute (see BENCHMARKS.md, memory case)."),
    checkpoint_layers: str = typer.Option("auto", "--checkpoint-layers", help="Recompute the first N drafter layers in backward: a layer's activations saved, for its forward again. 'auto': on a GPU, the fewest that let the largest step of the store fit, measured before the first step (none where it fits; see README, memory)."),
    ddp_bucket_mb: float = typer.Option(100.0, "--ddp-bucket-mb", help="Size of DDP's gradient all-reduce buckets (several GPUs; see BENCHMARKS.md)."),
    compile_kernels: bool = typer.Option(True, "--compile/--no-compile", help="On CUDA, run the layers' norms, residual adds, RoPE and the loss's softmax as compiled fused kernels (1.28x faster steps; the first step compiles, ~30-60 s). --no-compile: eager PyTorch, same numbers."),
    seed: int = typer.Option(0, "--seed"),
    num_workers: int = typer.Option(2, "--num-workers", help="Data loader worker processes per GPU."),
    wandb: Optional[str] = typer.Option(None, "--wandb", help="Also log to this Weights & Biases project."),
    tensorboard: bool = typer.Option(False, "--tensorboard", help="Also write TensorBoard events."),
    device: str = typer.Option("auto", "--device", help="auto, cuda or cpu."),
    quiet: bool = typer.Option(False, "--quiet"),
):
    """Train a DFlash drafter from a feature store; exports RUN_DIR/final in the DFlash HF format."""
    _quiet_zarr_warnings()
    from dflash_pipeline.schemas.config import TrainConfig

    cfg = _config(TrainConfig, store=store, out=out, epochs=epochs, steps=steps, num_layers=num_layers,
                  block_size=block_size, max_anchors=max_anchors, gamma=gamma, kl_weight=kl_weight,
                  cap_weight=cap_weight, feature_noise=feature_noise, sliding_window=sliding_window,
                  swa_layers=_int_list(swa_layers, "--swa-layers") or [], tokens_per_batch=tokens_per_batch,
                  max_length=max_length, grad_accum=grad_accum, lr=lr, warmup_ratio=warmup_ratio,
                  grad_clip=grad_clip, adam_beta2=adam_beta2, mask_token_id=mask_token_id, ema=ema, gpus=gpus, eval_fraction=eval_fraction, eval_every=eval_every,
                  eval_tree_budget=_budgets(eval_tree_budget, "--eval-tree-budget"), eval_new_tokens=eval_new_tokens,
                  log_every=log_every, save_every=save_every, resume=resume, init_from=init_from,
                  stop_after=stop_after, strict=strict,
                  activation_checkpointing=activation_checkpointing,
                  checkpoint_layers=_auto_int(checkpoint_layers, "--checkpoint-layers"),
                  ddp_bucket_mb=ddp_bucket_mb, compile=compile_kernels, seed=seed, num_workers=num_workers, wandb=wandb, tensorboard=tensorboard, device=device,
                  quiet=quiet)
    from dflash_pipeline.train.trainer import run_train

    run_train(cfg)


@app.command("export")
@user_errors
def export(
    checkpoint: str = typer.Argument(..., help="A checkpoint folder (RUN_DIR/checkpoints/step-N) or a run directory (its latest)."),
    out: str = typer.Argument(..., help="Output folder for config.json + model.safetensors."),
    no_ema: bool = typer.Option(False, "--no-ema", help="Export the raw weights even if the checkpoint has an EMA."),
    dtype: str = typer.Option("bf16", "--dtype", help="Weights dtype: bf16 or fp32."),
):
    """Export a training checkpoint in the DFlash HF format (SGLang, vLLM, the `dflash` package)."""
    from dflash_pipeline.train.checkpoint import export_checkpoint

    path = export_checkpoint(checkpoint, out, use_ema=not no_ema, dtype=dtype)
    print(f"exported to {path}")


@app.command("eval")
@user_errors
def eval_cmd(
    drafter: str = typer.Option(..., "--drafter", help="Exported drafter folder (RUN_DIR/final)."),
    more_prompts: Optional[list[str]] = typer.Argument(None, metavar="PROMPT_FILES", show_default=False, help="More prompt files, as in --prompts chat.jsonl code.jsonl math.jsonl."),
    target: Optional[str] = typer.Option(None, "--target", help="Target model, as for extract (default: the embedded SmolLM2-135M-Instruct)."),
    prompts: Optional[list[str]] = typer.Option(None, "--prompts", help="Prompt files, JSONL/JSON/Parquet (prompt / messages / conversations); several give tau and speedup per file and pooled. Default: held-out embedded conversations."),
    num_prompts: int = typer.Option(32, "--num-prompts", help="Prompts per file."),
    max_new_tokens: int = typer.Option(2048, "--max-new-tokens", help="New tokens per prompt at most (the DFlash authors benchmark with 2048)."),
    all_turns: bool = typer.Option(False, "--all-turns", help="Every reply of a conversation becomes a prompt, its history before it (default: first turns only)."),
    temperature: float = typer.Option(0.0, "--temperature", help="0: greedy, checked against the target's greedy output (exact in fp32; bf16/fp16 ties counted, not failures); >0: rejection sampling."),
    block_size: Optional[int] = typer.Option(None, "--block-size", help="Verify blocks of this size (default: the drafter's)."),
    seed: int = typer.Option(0, "--seed"),
    dtype: str = typer.Option("auto", "--dtype", help="auto (bf16 on GPU, fp32 on CPU), bf16, fp16 or fp32."),
    device: str = typer.Option("auto", "--device", help="auto, cpu, cuda (every GPU --gpus allows) or cuda:N (that GPU alone)."),
    gpus: str = typer.Option("all", "--gpus", help="'all' or how many GPUs: prompts are divided over one process per GPU."),
    records: Optional[str] = typer.Option(None, "--records", help="Also write one JSON line per prompt (tokens of both runs, divergences) to this file."),
    compile_steps: bool = typer.Option(False, "--compile", help="torch.compile the graphed decode/verify/drafter steps (fused kernels; compiles for a minute or more first)."),
    compile_mode: Optional[str] = typer.Option(None, "--compile-mode", help="With --compile implied: torch.compile's mode, default or max-autotune-no-cudagraphs (Inductor's autotuned matrix products: 1.09x faster 8B decode steps on an H100, minutes of autotuning first)."),
    tree_budget: str = typer.Option("0", "--tree-budget", help="Verify a tree of N drafted tokens per step (DDTree, from the same drafter pass; 0: the chain). Several, e.g. 0,16,64,256, measure each on the same prompts: tau, tok/s and speedup per budget."),
    chat_template_kwargs: Optional[str] = typer.Option(None, "--chat-template-kwargs", help="JSON object of chat-template variables for the prompts, as given to extract (e.g. '{\"enable_thinking\": false}')."),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object on stdout (progress stays on stderr)."),
):
    """Real acceptance length: speculative decoding of the drafter against the target (exit 1 if greedy output differs at a clear margin)."""
    from rich.console import Console

    from dflash_pipeline.eval.report import render_report
    from dflash_pipeline.eval.run import EvalConfig, run_eval
    from dflash_pipeline.progress import LiveLine

    files = [*(prompts or []), *(more_prompts or [])]
    cfg = _config(EvalConfig, drafter=drafter, target=target, prompts=files or None, num_prompts=num_prompts,
                  max_new_tokens=max_new_tokens, all_turns=all_turns, temperature=temperature, block_size=block_size,
                  seed=seed, dtype=dtype, device=device, gpus=gpus, records=records, compile=compile_mode or compile_steps,
                  chat_template_kwargs=chat_template_kwargs, tree_budget=_int_list(tree_budget, "--tree-budget") or [],
                  json=json_out)
    # Progress goes to stderr either way: a long eval piped into a JSON file still says where it is.
    report = run_eval(cfg, LiveLine())
    if not report:  # a rank other than 0 under a launcher: rank 0 reports
        return
    if json_out:
        print(json.dumps(report, default=float))
    else:
        render_report(report, Console())
    if report["lossless"] is False:
        print(f"error: greedy output differs from the target's at a clear margin on {len(report['mismatches'])} "
              f"prompt(s)", file=sys.stderr)
        raise typer.Exit(1)
