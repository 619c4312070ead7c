"""`dflash eval`: real block speculative decoding of a trained drafter against its target.

Every prompt is decoded twice in the same process: by the target alone (plain decoding with its KV
cache, the same stopping rules) and with the drafter. The two runs give the speedup, and at
temperature 0 the target's greedy output is the reference the speculative output is judged against
by the rule of eval/lossless.py: token for token in fp32; in bf16/fp16 a divergence where the
target's top two logits are within rounding of each other is a counted tie, one at a clear margin a
failure. `decode_prompt` is all of that for one prompt.

Tree verification (`tree_budget`, eval/tree_decoding.py): each budget in the list decodes every prompt
with the drafter once more, against the same plain decoding, and is checked by the same rule; budget 0
is the chain. The report describes the first budget at its top level and every budget in `per_budget`
(tau, speeds, speedup, step times), so one run sweeps the budgets a user chooses between.

Prompts come from one or several files (eval/prompts.py) and are divided over one process per
visible GPU (launch.py, as extract and train do; `gpus`), round robin by their index in the run, so
any number of processes decodes the same prompts with the same random streams; the processes'
results are merged into one report, per file and pooled.

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
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Sequence

import torch

from dflash_pipeline.decoding.tree import check_tree_target
from dflash_pipeline.train.export import load_drafter, read_drafter_config
from dflash_pipeline.errors import DFlashError
from dflash_pipeline.eval.graphed import GraphedDraft, GraphedTarget
from dflash_pipeline.eval.lossless import TIE_ULPS, check_greedy, teacher_forcing
from dflash_pipeline.eval.models import DFlashDraft, Target, stop_token_ids
from dflash_pipeline.eval.prompts import Prompt, as_prompt, load_prompts
from dflash_pipeline.eval.report import PromptResult, add_step_times, prompt_record, summarize, sweep_report
from dflash_pipeline.eval.speculative import (
    Drafter, Generation, TargetLike, speculative_generate, target_generate,
)
from dflash_pipeline.eval.tree_decoding import tree_generate
from dflash_pipeline.launch import Proc, bind_device, launch, launched, plan_processes, process_group, resolve_device
from dflash_pipeline.progress import LiveLine
from dflash_pipeline.schemas.config import check_gpus

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


# torch.compile modes `--compile-mode` takes. max-autotune-no-cudagraphs: Inductor's Triton matrix-product
# templates compete with cuBLAS per shape (1.09x faster 8B decode steps on an H100; minutes of autotuning at the
# start), within the compiled tie rule (at most 12 ulp over 2,048 positions of the real SmolLM2, BENCHMARKS.md).
# The reduce-overhead and max-autotune modes capture CUDA graphs of their own: the steps are captured already.
COMPILE_MODES = ("default", "max-autotune-no-cudagraphs")


@dataclass
class EvalConfig:
    drafter: str                           # exported drafter folder (config.json + model.safetensors)
    target: str | None = None              # HF folder, .gguf, cached hub id; None: the embedded default
    prompts: list[str] | None = None       # JSONL/JSON/Parquet files; None: embedded ShareGPT held-out split
    num_prompts: int = 32                  # per prompt file
    max_new_tokens: int = 2048             # as the DFlash authors benchmark
    all_turns: bool = False                # every reply of a conversation, its history as the prompt
    temperature: float = 0.0
    block_size: int | None = None          # None: the drafter's
    seed: int = 0
    dtype: str = "auto"                    # auto (fp32 on CPU, bf16 on CUDA), fp32, bf16, fp16
    device: str = "auto"                   # auto (cuda if available), cpu, cuda, cuda:N (that GPU alone)
    gpus: str = "all"                      # "all" or how many GPUs (one process each)
    num_procs: int | None = None           # CPU only: processes (tests of the multi-process path)
    records: str | None = None             # a JSONL file: one line per prompt, tokens included
    compile: bool | str = False            # torch.compile the graphed steps (fused elementwise kernels); a str
                                           # is its mode: COMPILE_MODES
    chat_template_kwargs: dict[str, Any] | str | None = None  # prompts' chat-template variables, as for extract
    tree_budget: list[int] | int = 0       # nodes per verified tree, one or several (0: the chain)
    json: bool = False                     # print the report as JSON instead of tables

    def __post_init__(self):
        from dflash_pipeline.schemas.chat_template import parse_chat_template_kwargs

        self.chat_template_kwargs = parse_chat_template_kwargs(self.chat_template_kwargs)
        if not self.drafter:
            raise ValueError("eval: a drafter folder is required")
        if isinstance(self.prompts, str):
            self.prompts = [self.prompts]
        if self.prompts is not None and len(set(self.prompts)) != len(self.prompts):
            twice = sorted({p for p in self.prompts if self.prompts.count(p) > 1})
            raise ValueError(f"eval: prompt file given twice: {', '.join(twice)}")
        for name in ("num_prompts", "max_new_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"eval: {name} must be >= 1, got {getattr(self, name)}")
        if not self.temperature >= 0:
            raise ValueError(f"eval: temperature must be >= 0, got {self.temperature}")
        if self.block_size is not None and self.block_size < 2:
            raise ValueError(f"eval: block_size must be >= 2 (1 is plain decoding), got {self.block_size}")
        if self.dtype not in ("auto", *DTYPES):
            raise ValueError(f"eval: dtype must be auto, {', '.join(DTYPES)}; got {self.dtype!r}")
        check_gpus(self.gpus)
        if isinstance(self.compile, str):
            if self.compile not in COMPILE_MODES:
                raise ValueError(f"eval: --compile-mode must be one of {', '.join(COMPILE_MODES)} (modes with CUDA "
                                 f"graphs of their own would capture inside the steps' graphs), got {self.compile!r}")
            self.compile = True if self.compile == "default" else self.compile
        self.tree_budget = [int(self.tree_budget)] if isinstance(self.tree_budget, int) else list(self.tree_budget)
        if not self.tree_budget or min(self.tree_budget) < 0 or len(set(self.tree_budget)) != len(self.tree_budget):
            raise ValueError(f"eval: --tree-budget takes distinct budgets >= 0 (0: the chain), got {self.tree_budget}")
        if self.device != "auto":
            try:
                torch.device(self.device)
            except RuntimeError:
                raise ValueError(f"eval: unknown device {self.device!r}; use auto, cpu, cuda or cuda:N") from None

    def torch_device(self) -> torch.device:
        return resolve_device(self.device)

    def torch_dtype(self, device: torch.device | None = None) -> torch.dtype:
        if self.dtype == "auto":
            return torch.bfloat16 if (device or self.torch_device()).type == "cuda" else torch.float32
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


def _target_shape(config) -> tuple[int, int, int]:
    from dflash_pipeline.extract.target import text_config

    c = text_config(config)
    return c.hidden_size, c.num_hidden_layers, c.vocab_size


# ---------------------------------------------------------------- one prompt, a process's prompts

SPEC_STEP_KINDS = ("drafter", "tree_build", "target_verify", "target_decode")


def budget_timer(timer, budget: int):
    """`timer` with the speculative run's step names kept apart per budget ("b16/target_verify")."""
    if timer is None:
        return None

    @contextmanager
    def named(name: str):
        with timer(f"b{budget}/{name}"):
            yield

    return named


def speculate(target: TargetLike, drafter: Drafter, prompt: Sequence[int], *, budget: int, **kw) -> Generation:
    """Speculative decoding of one prompt: the chain at budget 0, a budget-N tree per round otherwise."""
    if budget == 0:
        return speculative_generate(target, drafter, prompt, **kw)
    return tree_generate(target, drafter, prompt, budget=budget, **kw)


def decode_prompt(target: TargetLike, drafter: Drafter, prompt: Prompt, index: int, *, max_new_tokens: int,
                  temperature: float, stop_ids: frozenset[int], seed: int = 0, timer=None,
                  budgets: Sequence[int] = (0,)) -> list[PromptResult]:
    """One prompt decoded by the target alone, then with the drafter at each tree budget (0: the chain),
    and at T = 0 the lossless check of each speculative output; one result per budget. `index`, the
    prompt's place in the run, picks its random streams (every budget's speculative run the same one), so
    the tokens do not depend on which process decodes it."""
    kw = dict(max_new_tokens=max_new_tokens, temperature=temperature, stop_ids=stop_ids)
    base = target_generate(target, prompt.ids, generator=_generator(seed, 2 * index, target.device), timer=timer, **kw)
    out = []
    for budget in budgets:
        spec = speculate(target, drafter, prompt.ids, budget=budget, timer=budget_timer(timer, budget),
                         generator=_generator(seed, 2 * index + 1, target.device), **kw)
        check = None
        if temperature == 0:
            check = check_greedy(prompt.sample_id, spec.tokens, base.tokens, base.top1, base.top2, target.dtype,
                                 lambda: teacher_forcing(target, prompt.ids, spec.tokens),
                                 tie_ulps=getattr(target, "tie_ulps", TIE_ULPS))
        out.append(PromptResult(prompt, spec, base, check, budget))
    return out


def decode_prompts(target: TargetLike, drafter: Drafter, prompts: Sequence[tuple[int, Prompt]], *, max_new_tokens: int,
                   temperature: float, stop_ids: frozenset[int], seed: int = 0, progress: LiveLine | None = None,
                   warmup: bool = True, budgets: Sequence[int] = (0,)
                   ) -> tuple[list[list[PromptResult]], dict[str, list[float]]]:
    """`decode_prompt` for each (index, prompt); the results (per prompt, per budget) and every step time
    (ms) by step name ("target_decode" of plain decoding, "b<budget>/<kind>" of the speculative runs)."""
    from dflash_pipeline.decoding.graphs import StepTimer

    kw = dict(max_new_tokens=max_new_tokens, temperature=temperature, stop_ids=stop_ids)
    if warmup and prompts:  # first calls pay for allocation, kernel selection and graph capture: keep that out
        few = {**kw, "max_new_tokens": min(4, max_new_tokens)}
        target_generate(target, prompts[0][1].ids, **few)
        for budget in budgets:
            speculate(target, drafter, prompts[0][1].ids, budget=budget, **few)
    timer = StepTimer(target.device)
    results: list[list[PromptResult]] = []
    for index, prompt in prompts:
        results.append(decode_prompt(target, drafter, prompt, index, seed=seed, timer=timer, budgets=budgets, **kw))
        if progress is not None:
            progress.update(_progress_line(results, len(prompts)))
    if progress is not None:
        progress.done()
    names = ["target_decode", *(f"b{b}/{k}" for b in budgets for k in SPEC_STEP_KINDS)]
    return results, {name: timer.times(name) for name in names}


def build_report(results: list[list[PromptResult]], step_times: dict[str, list[float]], *, block_size: int,
                 temperature: float, dtype: torch.dtype, cuda: bool) -> dict[str, Any]:
    """The report of each budget (`summarize` with its median step times), combined by `sweep_report`."""
    medians = {k: sorted(v)[len(v) // 2] for k, v in step_times.items() if v}
    reports = {}
    for j, first in enumerate(results[0] if results else []):
        b = first.budget
        report = summarize([r[j] for r in results], block_size=block_size, temperature=temperature, dtype=dtype)
        ms = {"target_decode": medians.get("target_decode"),
              **{k: medians.get(f"b{b}/{k}") for k in ("target_verify", "drafter", "tree_build")}}
        add_step_times(report, ms, "events" if cuda else "host clock")
        reports[b] = report
    return sweep_report(reports, [r for rs in results for r in rs], temperature=temperature, dtype=dtype)


def evaluate(target: TargetLike, drafter: Drafter, prompts: Sequence, *, max_new_tokens: int, temperature: float,
             stop_ids: frozenset[int], seed: int = 0, progress: LiveLine | None = None,
             warmup: bool = True, budgets: Sequence[int] = (0,)) -> dict[str, Any]:
    """Decode every prompt (a `Prompt` or a (sample_id, ids) pair) here, with the target alone and with the
    drafter at each tree budget; the report dict."""
    prompts = [as_prompt(p) for p in prompts]
    if not prompts:
        raise DFlashError("eval: no prompts to decode")
    results, times = decode_prompts(target, drafter, list(enumerate(prompts)), max_new_tokens=max_new_tokens,
                                    temperature=temperature, stop_ids=stop_ids, seed=seed, progress=progress,
                                    warmup=warmup, budgets=budgets)
    return build_report(results, times, block_size=drafter.block_size, temperature=temperature, dtype=target.dtype,
                        cuda=target.device.type == "cuda")


def _generator(seed: int, stream: int, device: torch.device) -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed(seed * 1_000_003 + stream)
    return g


def _progress_line(results: list[list[PromptResult]], total: int) -> str:
    def rate(gens) -> float:
        return sum(g.decoded_tokens for g in gens) / (sum(g.seconds for g in gens) or float("nan"))

    parts = []
    for j, first in enumerate(results[0]):
        specs = [r[j].spec for r in results]
        tau = sum(s.committed for g in specs for s in g.steps) / max(sum(len(g.steps) for g in specs), 1)
        label = f"budget {first.budget}: " if len(results[0]) > 1 else ""
        parts.append(f"{label}tau {tau:.2f}, {rate(specs):.1f} tok/s with drafter")
    flat = [r for rs in results for r in rs]
    failed = sum(r.check is not None and r.check.failure is not None for r in flat)
    ties = sum(len(r.check.ties) for r in flat if r.check is not None)
    line = (f"eval prompt {len(results)}/{total}: {'; '.join(parts)}; "
            f"{rate([r[0].target for r in results]):.1f} tok/s target alone")
    return line + (f", {failed} NOT lossless" if failed else "") + (f", {ties} tie divergences" if ties else "")


def make_participants(model, drafter_model, prompts: Sequence, cfg: EvalConfig, progress: LiveLine):
    """The graphed target and drafter (static caches sized for the longest prompt), or the eager ones for
    targets the static-cache runner does not support."""
    from dflash_pipeline.decoding.runner import unsupported_reason

    layer_ids = drafter_model.config.target_layer_ids
    block = int(cfg.block_size or drafter_model.config.block_size)
    trees = [b for b in cfg.tree_budget if b > 0]
    reason = unsupported_reason(model)
    if trees:
        check_tree_target(model.config)
        if reason:
            raise DFlashError(f"--tree-budget {max(trees)}: tree verification runs on the static-cache decoding "
                              f"path, which this target cannot use ({reason}); use --tree-budget 0 (the chain)")
    if reason:
        ignored = "; --compile has no effect there" if cfg.compile else ""
        progress.say(f"eager decoding (no static cache, no CUDA graphs): {reason}{ignored}")
        target = Target(model, layer_ids)
        return target, DFlashDraft(drafter_model, target, cfg.block_size)
    # A round writes at most max(B, N + 1) slots past the committed tokens.
    max_len = max(len(as_prompt(p).ids) for p in prompts) + cfg.max_new_tokens + max([block, *(b + 1 for b in trees)])
    if cfg.compile:
        tuned = f" in mode {cfg.compile}, its matrix products autotuned (minutes)" if isinstance(cfg.compile, str) else ""
        progress.say(f"compiling the decode, verify and drafter steps{tuned} before the first prompt (a minute or more)")
    target = GraphedTarget(model, layer_ids, max_len=max_len, block_size=block, compile=cfg.compile)
    graphs = target.runner.prepare((1, block, *(b + 1 for b in trees)))  # none is built later, in a timed prompt
    if target.runner.graphs:
        what = "decode, verify and tree verify" if trees else "decode and verify"
        progress.say(f"captured {graphs} CUDA graphs of the {what} steps")
    # the drafter's steps: its elementwise chains fused (a mode is the target's: the drafter is a few layers)
    return target, GraphedDraft(drafter_model, target, max_len=max_len, block_size=block, compile=bool(cfg.compile))


# ---------------------------------------------------------------- processes


def eval_rank(proc: Proc, cfg: EvalConfig, prompts: list[Prompt], progress: LiveLine) -> dict[str, Any]:
    """One process: the prompts whose index % world == rank, on its own device. A user's error comes
    back as {"error": line}: a spawned process cannot print it as one line for the user."""
    try:
        return _decode_share(proc, cfg, prompts, progress if proc.is_main else LiveLine(enabled=False))
    except DFlashError as e:
        return {"error": str(e)}


def _decode_share(proc: Proc, cfg: EvalConfig, prompts: list[Prompt], progress: LiveLine) -> dict[str, Any]:
    from transformers import AutoTokenizer

    from dflash_pipeline.extract.target import load_target, resolve_target

    device = cfg.torch_device() if proc.world == 1 else bind_device(proc)
    dtype = cfg.torch_dtype(device)
    mine = [(i, p) for i, p in enumerate(prompts) if i % proc.world == proc.rank]
    share = {"indices": [i for i, _ in mine], "results": [], "step_times": {}, "device": str(device), "dtype": dtype}
    if not mine:
        return share
    target_path = resolve_target(cfg.target)
    where = f"{cfg.drafter} vs target {cfg.target or 'embedded default'}"
    of = f", process {proc.rank + 1} of {proc.world}" if proc.world > 1 else ""
    progress.say(f"loading target {target_path} ({str(dtype).removeprefix('torch.')}, {device}{of})")
    model = load_target(target_path, dtype, device)
    hidden, layers, _ = _target_shape(model.config)
    check_pairing(read_drafter_config(cfg.drafter), hidden_size=hidden, num_layers=layers,
                  vocab_rows=model.get_input_embeddings().weight.shape[0], where=where)
    drafter_model = load_drafter(cfg.drafter, dtype, device)
    stop_ids = stop_token_ids(AutoTokenizer.from_pretrained(target_path), model)
    # Caches sized for the run's longest prompt, not this share's: every process then runs the same step
    # shapes, so a prompt's tokens do not depend on which process decodes it.
    target, drafter = make_participants(model, drafter_model, prompts, cfg, progress)
    try:
        budgets = "" if cfg.tree_budget == [0] else f", tree budgets {', '.join(map(str, cfg.tree_budget))}"
        progress.say(f"decoding {len(mine)} prompts{of}, up to {cfg.max_new_tokens} new tokens each, "
                     f"block {drafter.block_size}{budgets}, temperature {cfg.temperature:g}")
        share["results"], share["step_times"] = decode_prompts(
            target, drafter, mine, max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature,
            stop_ids=stop_ids, seed=cfg.seed, progress=progress, budgets=cfg.tree_budget)
    finally:
        target.close()
    graphed = isinstance(target, GraphedTarget)
    # the target's attention in its steps: the static runner's kernel (decoding/attention.py), or
    # transformers' own on the eager path; named so that a report says which kernel its numbers came from
    share.update(decoding="graphed" if graphed else "eager", block_size=drafter.block_size,
                 decode_attention=target.runner.decode_attention if graphed else "transformers")
    return share


def merge_shares(cfg: EvalConfig, shares: list[dict[str, Any]], target_path: str) -> dict[str, Any]:
    """One report from every process's share: results in prompt order, step times pooled."""
    errors = [s["error"] for s in shares if "error" in s]
    if errors:
        raise DFlashError(errors[0])
    done = [s for s in shares if s["results"]]
    ordered = sorted(((i, r) for s in done for i, r in zip(s["indices"], s["results"])), key=lambda x: x[0])
    results = [r for _, r in ordered]
    times = {k: [t for s in done for t in s["step_times"].get(k, [])] for k in done[0]["step_times"]}
    first = done[0]
    report = build_report(results, times, block_size=first["block_size"], temperature=cfg.temperature,
                          dtype=first["dtype"], cuda=first["device"].startswith("cuda"))
    report.update(decoding=first["decoding"], decode_attention=first.get("decode_attention"), processes=len(shares),
                  devices=[s["device"] for s in shares],
                  drafter=str(cfg.drafter), target=str(target_path), max_new_tokens=cfg.max_new_tokens,
                  all_turns=cfg.all_turns, config=cfg.to_dict())
    if cfg.records:
        write_records(cfg.records, [r for rs in results for r in rs])
    return report


def write_records(path: str, results: list[PromptResult]) -> None:
    """One JSON line per prompt and budget (eval.report.prompt_record), written whole under a temporary
    name first."""
    import os

    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        for r in results:
            f.write(json.dumps(prompt_record(r)) + "\n")
    os.replace(tmp, path)


def run_eval(cfg: EvalConfig, progress: LiveLine | None = None) -> dict[str, Any]:
    """Check that drafter and target belong together, load the prompts, decode them on every process;
    the report dict (under a launcher: on rank 0; the other ranks return {})."""
    from transformers import AutoConfig, AutoTokenizer

    from dflash_pipeline.extract.target import resolve_target

    progress = progress or LiveLine(enabled=False)
    proc = launched(cfg.device)
    if proc is None:  # user errors before any process starts
        one_gpu = cfg.device.startswith("cuda:")
        kind, nprocs = ("cuda", 1) if one_gpu else plan_processes(cfg.device, cfg.gpus, cfg.num_procs)
    if cfg.records and not Path(cfg.records).resolve().parent.is_dir():
        raise DFlashError(f"--records {cfg.records}: its folder does not exist")
    dcfg = read_drafter_config(cfg.drafter)
    target_path = resolve_target(cfg.target)
    target_cfg = AutoConfig.from_pretrained(target_path)
    if max(cfg.tree_budget) > 0:
        check_tree_target(target_cfg)  # hybrid targets: one line, before any weights load
    hidden, layers, vocab = _target_shape(target_cfg)
    check_pairing(dcfg, hidden_size=hidden, num_layers=layers, vocab_rows=vocab,
                  where=f"{cfg.drafter} vs target {cfg.target or 'embedded default'}")
    prompts = load_prompts(cfg.prompts, AutoTokenizer.from_pretrained(target_path), cfg.num_prompts, cfg.all_turns,
                           cfg.chat_template_kwargs)
    if proc is not None:
        shares = _gather(proc, eval_rank(proc, cfg, prompts, progress))
        if not proc.is_main:
            return {}
    else:
        nprocs = min(nprocs, len(prompts))
        if nprocs > 1:
            progress.say(f"{len(prompts)} prompts over {nprocs} processes ({kind}), divided round robin")
        shares = launch(eval_rank, (cfg, prompts, progress), nprocs=nprocs, kind=kind)
    return merge_shares(cfg, shares, target_path)


def _gather(proc: Proc, share: dict[str, Any]) -> list[dict[str, Any]]:
    """Every rank's share, on every rank (under a launcher)."""
    import torch.distributed as dist

    with process_group("gloo"):  # objects only: the processes decode independently
        shares: list[Any] = [None] * proc.world
        dist.all_gather_object(shares, share)
    return shares


__all__ = ["EvalConfig", "run_eval", "evaluate", "speculate", "decode_prompt", "decode_prompts", "eval_rank", "merge_shares",
           "check_pairing", "load_prompts", "read_drafter_config", "make_participants"]
