"""`dflash eval`: real block speculative decoding of a trained drafter against its target.

Every prompt is decoded twice in the same process: by the target alone (plain decoding with its KV
cache, the same stopping rules) and with the drafter. The two runs give the speedup, and at
temperature 0 the target's greedy output is the exact reference: speculative decoding must reproduce it
token for token, so any difference is reported as a failure with the prompt and position.

Everything a user can get wrong about the pairing (a drafter for another target) is checked from the
two config files before any weights load, and again against the loaded target's tables.

Both runs decode on a static KV cache with one CUDA graph launch per step (eval/graphed.py, the
`decoding` package); targets whose layers are not all attention layers (recurrent / linear-attention
hybrids) run the eager transformers path instead, and the progress output says so. The median time
of each step kind (target decode, target verify, drafter) is reported next to the speeds, with the
speedup they imply at the measured tau.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Sequence

import torch

from dflash_pipeline.errors import DFlashError
from dflash_pipeline.eval.graphed import GraphedDraft, GraphedTarget
from dflash_pipeline.eval.models import DFlashDraft, Target, stop_token_ids
from dflash_pipeline.eval.report import PromptResult, add_step_times, summarize
from dflash_pipeline.eval.speculative import Drafter, speculative_generate, target_generate
from dflash_pipeline.progress import LiveLine

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class EvalConfig:
    drafter: str                           # exported drafter folder (config.json + model.safetensors)
    target: str | None = None              # HF folder, .gguf, cached hub id; None: the embedded default
    prompts: list[str] | None = None       # JSONL/JSON/Parquet files; None: embedded ShareGPT held-out split
    num_prompts: int = 32
    max_new_tokens: int = 256
    temperature: float = 0.0
    block_size: int | None = None          # None: the drafter's
    seed: int = 0
    dtype: str = "auto"                    # auto (fp32 on CPU, bf16 on CUDA), fp32, bf16, fp16
    device: str = "auto"                   # auto (cuda if available), cpu, cuda, cuda:N
    compile: bool = False                  # torch.compile the graphed steps (fused elementwise kernels)
    chat_template_kwargs: dict[str, Any] | str | None = None  # prompts' chat-template variables, as for extract
    json: bool = False                     # print the report as JSON instead of tables

    def __post_init__(self):
        from dflash_pipeline.schemas.chat_template import parse_chat_template_kwargs

        self.chat_template_kwargs = parse_chat_template_kwargs(self.chat_template_kwargs)
        if not self.drafter:
            raise ValueError("eval: a drafter folder is required")
        if isinstance(self.prompts, str):
            self.prompts = [self.prompts]
        if self.num_prompts < 1:
            raise ValueError(f"eval: num_prompts must be >= 1, got {self.num_prompts}")
        if self.max_new_tokens < 1:
            raise ValueError(f"eval: max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not self.temperature >= 0:
            raise ValueError(f"eval: temperature must be >= 0, got {self.temperature}")
        if self.block_size is not None and self.block_size < 2:
            raise ValueError(f"eval: block_size must be >= 2 (1 is plain decoding), got {self.block_size}")
        if self.dtype not in ("auto", *DTYPES):
            raise ValueError(f"eval: dtype must be auto, {', '.join(DTYPES)}; got {self.dtype!r}")
        if self.device != "auto":
            try:
                torch.device(self.device)
            except RuntimeError:
                raise ValueError(f"eval: unknown device {self.device!r}; use auto, cpu, cuda or cuda:N") from None

    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def torch_dtype(self) -> torch.dtype:
        if self.dtype == "auto":
            return torch.bfloat16 if self.torch_device().type == "cuda" else torch.float32
        return DTYPES[self.dtype]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# ---------------------------------------------------------------- checks


def check_pairing(drafter_cfg, *, hidden_size: int, num_layers: int, vocab_rows: int, where: str) -> None:
    """Refuse a drafter that cannot read this target's features or share its embedding and LM head."""
    problems = []
    if drafter_cfg.hidden_size != hidden_size:
        problems.append(f"drafter hidden {drafter_cfg.hidden_size} != target hidden {hidden_size}")
    if drafter_cfg.vocab_size != vocab_rows:
        problems.append(f"drafter vocab {drafter_cfg.vocab_size} != target embedding rows {vocab_rows}")
    bad = [k for k in drafter_cfg.target_layer_ids if not 0 <= k < num_layers]
    if bad:
        problems.append(f"drafter target_layer_ids {bad} are not layers of the target (it has {num_layers})")
    elif drafter_cfg.num_target_layers != num_layers:
        problems.append(f"drafter trained for a target of {drafter_cfg.num_target_layers} layers, "
                        f"the target has {num_layers}")
    if problems:
        raise DFlashError(f"{where}: {'; '.join(problems)}; evaluate the drafter against the target it was trained for")


def read_drafter_config(directory: str):
    from dflash_pipeline.train.export import CONFIG_NAME, WEIGHTS_NAME, config_from_hf_dict

    d = Path(directory)
    if not d.is_dir():
        raise DFlashError(f"{directory}: no such drafter folder")
    missing = [n for n in (CONFIG_NAME, WEIGHTS_NAME) if not (d / n).is_file()]
    if missing:
        raise DFlashError(f"{directory}: not an exported drafter (missing {', '.join(missing)}); "
                          f"write one with `dflash export`")
    try:
        return config_from_hf_dict(json.loads((d / CONFIG_NAME).read_text()))
    except ValueError as e:  # JSONDecodeError included
        raise DFlashError(f"{directory}/{CONFIG_NAME}: {e}") from None


def load_drafter(directory: str, dtype: torch.dtype, device: torch.device):
    from dflash_pipeline.train.export import load_exported

    try:
        model, _ = load_exported(directory, dtype=dtype, device=device)
    except (ValueError, RuntimeError, OSError) as e:  # safetensors and state-dict errors included
        raise DFlashError(f"{directory}: cannot load the drafter weights ({str(e).splitlines()[0]})") from None
    return model


def _target_shape(config) -> tuple[int, int, int]:
    from dflash_pipeline.extract.target import text_config

    c = text_config(config)
    return c.hidden_size, c.num_hidden_layers, c.vocab_size


# ---------------------------------------------------------------- the run


def evaluate(target: Target, drafter: Drafter, prompts: Sequence[tuple[int, Sequence[int]]], *, max_new_tokens: int,
             temperature: float, stop_ids: frozenset[int], seed: int = 0, progress: LiveLine | None = None,
             warmup: bool = True) -> dict[str, Any]:
    """Decode every prompt with the target alone and with the drafter; the report dict of `summarize`,
    with the median step times."""
    from dflash_pipeline.decoding.graphs import StepTimer

    prompts = [(int(sid), [int(t) for t in ids]) for sid, ids in prompts]
    if not prompts:
        raise DFlashError("eval: no prompts to decode")
    kw = dict(max_new_tokens=max_new_tokens, temperature=temperature, stop_ids=stop_ids)
    if warmup:  # first calls pay for allocation, kernel selection and graph capture: keep that out of the timings
        target_generate(target, prompts[0][1], **{**kw, "max_new_tokens": min(4, max_new_tokens)})
        speculative_generate(target, drafter, prompts[0][1], **{**kw, "max_new_tokens": min(4, max_new_tokens)})
    timer = StepTimer(target.device)
    results: list[PromptResult] = []
    for i, (sid, ids) in enumerate(prompts):
        base = target_generate(target, ids, generator=_generator(seed, 2 * i, target.device), timer=timer, **kw)
        spec = speculative_generate(target, drafter, ids, generator=_generator(seed, 2 * i + 1, target.device),
                                    timer=timer, **kw)
        results.append(PromptResult(sid, spec, base))
        if progress is not None:
            progress.update(_progress_line(results, len(prompts), greedy=temperature == 0))
    report = summarize(results, block_size=drafter.block_size, temperature=temperature,
                       greedy_checked=temperature == 0)
    add_step_times(report, timer.summary(), "events" if target.device.type == "cuda" else "host clock")
    if progress is not None:
        progress.done()
    return report


def _generator(seed: int, stream: int, device: torch.device) -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed(seed * 1_000_003 + stream)
    return g


def _progress_line(results: list[PromptResult], total: int, greedy: bool) -> str:
    steps = sum(len(r.spec.steps) for r in results)
    committed = sum(s.committed for r in results for s in r.spec.steps)
    spec_s = sum(r.spec.seconds for r in results) or float("nan")
    base_s = sum(r.target.seconds for r in results) or float("nan")
    differ = sum(r.spec.tokens != r.target.tokens for r in results) if greedy else 0
    line = (f"eval prompt {len(results)}/{total}: tau {committed / max(steps, 1):.2f}, "
            f"{sum(r.spec.decoded_tokens for r in results) / spec_s:.1f} tok/s with drafter, "
            f"{sum(r.target.decoded_tokens for r in results) / base_s:.1f} tok/s target alone")
    return line + (f", {differ} differ from greedy" if differ else "")


def load_prompts(paths: list[str] | None, tokenizer, limit: int,
                 template_kwargs: dict[str, Any] | None = None) -> list[tuple[int, list[int]]]:
    from dflash_pipeline.extract.chat import iter_prompts

    prompts = [(sid, ids.tolist())
               for sid, ids in iter_prompts(paths, tokenizer, limit, split="eval", template_kwargs=template_kwargs)]
    if not prompts:
        where = ", ".join(paths) if paths else "the embedded held-out split"
        raise DFlashError(f"{where}: no usable prompts (each record needs a user turn before its first reply)")
    return prompts


def make_participants(model, drafter_model, prompts, cfg: EvalConfig, progress: LiveLine):
    """The graphed target and drafter (static caches sized for the longest prompt), or the eager ones for
    targets the static-cache runner does not support."""
    from dflash_pipeline.decoding.runner import unsupported_reason

    layer_ids = drafter_model.config.target_layer_ids
    block = int(cfg.block_size or drafter_model.config.block_size)
    reason = unsupported_reason(model)
    if reason:
        ignored = "; --compile has no effect there" if cfg.compile else ""
        progress.say(f"eager decoding (no static cache, no CUDA graphs): {reason}{ignored}")
        target = Target(model, layer_ids)
        return target, DFlashDraft(drafter_model, target, cfg.block_size)
    max_len = max(len(ids) for _, ids in prompts) + cfg.max_new_tokens + block
    if cfg.compile:
        progress.say("compiling the decode, verify and drafter steps at their first calls (a minute or more)")
    target = GraphedTarget(model, layer_ids, max_len=max_len, block_size=block, compile=cfg.compile)
    graphs = target.runner.prepare((1, block))  # none is built later, inside a timed prompt
    if target.runner.graphs:
        progress.say(f"captured {graphs} CUDA graphs of the decode and verify steps")
    return target, GraphedDraft(drafter_model, target, max_len=max_len, block_size=block, compile=cfg.compile)


def run_eval(cfg: EvalConfig, progress: LiveLine | None = None) -> dict[str, Any]:
    """Load drafter and target, check they belong together, decode the prompts; the report dict."""
    from transformers import AutoConfig, AutoTokenizer

    from dflash_pipeline.extract.target import load_target, resolve_target

    progress = progress or LiveLine(enabled=False)
    device, dtype = cfg.torch_device(), cfg.torch_dtype()
    dcfg = read_drafter_config(cfg.drafter)
    target_path = resolve_target(cfg.target)
    where = f"{cfg.drafter} vs target {cfg.target or 'embedded default'}"
    hidden, layers, vocab = _target_shape(AutoConfig.from_pretrained(target_path))
    check_pairing(dcfg, hidden_size=hidden, num_layers=layers, vocab_rows=vocab, where=where)

    progress.say(f"loading target {target_path} ({str(dtype).removeprefix('torch.')}, {device})")
    model = load_target(target_path, dtype, device)
    tokenizer = AutoTokenizer.from_pretrained(target_path)
    check_pairing(dcfg, hidden_size=hidden, num_layers=layers,
                  vocab_rows=model.get_input_embeddings().weight.shape[0], where=where)
    drafter_model = load_drafter(cfg.drafter, dtype, device)
    prompts = load_prompts(cfg.prompts, tokenizer, cfg.num_prompts, cfg.chat_template_kwargs)

    target, drafter = make_participants(model, drafter_model, prompts, cfg, progress)
    try:
        progress.say(f"decoding {len(prompts)} prompts, up to {cfg.max_new_tokens} new tokens each, "
                     f"block {drafter.block_size}, temperature {cfg.temperature:g}")
        report = evaluate(target, drafter, prompts, max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature,
                          stop_ids=stop_token_ids(tokenizer, model), seed=cfg.seed, progress=progress)
    finally:
        target.close()
    report["decoding"] = "graphed" if isinstance(target, GraphedTarget) else "eager"
    report["drafter"] = str(cfg.drafter)
    report["target"] = str(target_path)
    report["max_new_tokens"] = cfg.max_new_tokens
    report["config"] = cfg.to_dict()
    return report


__all__ = ["EvalConfig", "run_eval", "evaluate", "check_pairing", "load_prompts", "read_drafter_config"]
