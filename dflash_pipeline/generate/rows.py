"""How many sequences `dflash generate` keeps in flight, and the decoding runner that holds them.

The number of rows is computed from the target's shapes and the device's free memory, not guessed:
a row holds `--max-length` tokens (rounded up to the runner's slot multiple) of KV cache (layers x 2
x KV heads x head dim x dtype bytes per slot, and the slot's int64 position), and beside the cache a
step needs its logits and the sampling's temporaries (fp32 and int64 per vocabulary entry per row),
and a prefill (several rows, generate/prefill.py) its activations, attention biases, gathered K/V and
last-token logits.
Every term is counted at its largest; what remains of free memory, less a margin for the allocator's
fragmentation and the graphs' pool, is divided among rows, at most `MAX_ROWS` and never more than the
worker's conversations. tests/test_generate_cuda.py checks the plan against the real peak, and
bench/generate.py's `memory` part runs the plan for a Qwen3-8B shape on the whole GPU.

`--batch-tokens N` asks for N // max_length rows instead; a request that does not fit is refused
with what it needs and what is free. On the CPU, where memory is not the limit but matmul width is,
the default is `CPU_ROWS`.

Targets the runner cannot run are refused (`check_target`, before anything is planned): there is no
eager fallback (README, "Generation").

Legend: R rows, C capacity (tokens per row), V vocabulary, H hidden, I intermediate, Q prefill chunk.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch

from dflash_pipeline.errors import DFlashError

GIB = 1 << 30
MAX_ROWS = 256          # past this a decode step is compute-bound on any current GPU: more rows add latency only
CPU_ROWS = 16
PREFILL_CHUNK = 512     # prompt tokens per row per prefill forward (longer prompts run in chunks)
PREFILL_TOKENS = 8192   # padded tokens per prefill forward (several rows at once)
FRAGMENTATION = 0.06    # share of free memory left to the allocator's rounding and fragmentation
FIXED_MARGIN = 1 * GIB  # CUDA graphs' private pools, cuBLAS workspaces, kernels built at first use


def _shape(config) -> dict[str, int]:
    from dflash_pipeline.extract.target import text_config

    c = text_config(config)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    return {"layers": c.num_hidden_layers, "kv_heads": getattr(c, "num_key_value_heads", None) or c.num_attention_heads,
            "heads": c.num_attention_heads, "head_dim": head_dim, "hidden": c.hidden_size,
            "intermediate": getattr(c, "intermediate_size", 4 * c.hidden_size), "vocab": c.vocab_size,
            # the runner builds one attention bias per window the config names (full attention included)
            "windows": 1 + bool(getattr(c, "sliding_window", None))}


def kv_bytes_per_token(config, dtype: torch.dtype) -> int:
    """Bytes of one cache slot: K and V of every layer, and the slot's position (int64, for sliding windows)."""
    s = _shape(config)
    return s["layers"] * 2 * s["kv_heads"] * s["head_dim"] * torch.empty(0, dtype=dtype).element_size() + 8


def runner_slots(capacity: int) -> int:
    """Slots the decoding runner allocates per row for `capacity` tokens (it rounds up)."""
    from dflash_pipeline.decoding.runner import SLOT_ROUND, round_up

    return round_up(capacity, SLOT_ROUND)


def step_workspace(config, dtype: torch.dtype, rows: int, slots: int) -> int:
    """Bytes a decode step needs beside the cache at `rows` rows over `slots` slots: the model's logits
    and the runner's fp32 copy, the sampling's temporaries per vocabulary entry at their worst (top-p over
    the whole vocabulary: a sort's values and ids, softmax, cumulative mass, the masked logits, three hash
    words, the uniform, its Gumbel noise and the noisy logits), activations, and the attention's scores
    where the written-out kernel runs (decoding/attention.py)."""
    from dflash_pipeline.decoding.attention import written_out_workspace

    s = _shape(config)
    elt = torch.empty(0, dtype=dtype).element_size()
    per_entry = elt + 4 + (4 + 4 + 8 + 4 + 4 + 4 + 3 * 8 + 4 + 4 + 4)
    act = (4 * s["hidden"] + 3 * s["intermediate"]) * elt
    return rows * (s["vocab"] * per_entry + act) + written_out_workspace(rows * s["heads"] * slots)


def prefill_workspace(config, dtype: torch.dtype, capacity: int, rows: int) -> int:
    """Bytes one prefill forward needs (generate/prefill.py): at most T = PREFILL_TOKENS padded tokens
    of activations and folded attention bias over C slots, the rows' gathered K and V (at most T/Q rows
    reach C slots; shorter ones attend to fewer), and the last tokens' logits of every row. The bias is
    one per attention window, each made from a folded visibility copy (bool) that lives while it is built;
    the attention's scores where the written-out kernel runs (small targets)."""
    from dflash_pipeline.decoding.attention import written_out_workspace

    s = _shape(config)
    elt = torch.empty(0, dtype=dtype).element_size()
    T, C, Q = PREFILL_TOKENS, capacity, PREFILL_CHUNK
    act = T * (6 * s["hidden"] + 3 * s["intermediate"]) * elt
    folded = T * (s["heads"] // s["kv_heads"]) * C
    bias = s["windows"] * folded * elt + folded + T * C                   # biases, folded copy, visibility
    kv = max(T, (T // Q) * C) * s["kv_heads"] * s["head_dim"] * elt * 2
    logits = min(rows, T) * s["vocab"] * (elt + 4 + 4)                    # head output, fp32, sampling
    return act + bias + kv + logits + written_out_workspace(T * s["heads"] * C)


@dataclass
class RowBudget:
    rows: int
    capacity: int
    kv_bytes_per_token: int
    kv_bytes: int
    step_bytes: int
    prefill_bytes: int
    free_bytes: int
    margin_bytes: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def text(self) -> str:
        free = f", of {self.free_bytes / GIB:.1f} GiB free" if self.free_bytes else ""   # 0: not planned (CPU)
        return (f"{self.rows} sequences in flight x {self.capacity} tokens: KV cache {self.kv_bytes / GIB:.1f} GiB, "
                f"step and prefill workspace {(self.step_bytes + self.prefill_bytes) / GIB:.1f} GiB{free}")


def budget_for(config, dtype: torch.dtype, capacity: int, rows: int, *, prefill_rows: int | None = None,
               free_bytes: int = 0, margin: int = 0) -> RowBudget:
    """What `rows` rows of `capacity` tokens need (the prefill's logits sized for `prefill_rows`)."""
    per_token, slots = kv_bytes_per_token(config, dtype), runner_slots(capacity)
    return RowBudget(rows, capacity, per_token, rows * slots * per_token, step_workspace(config, dtype, rows, slots),
                     prefill_workspace(config, dtype, slots, prefill_rows or rows), free_bytes, margin)


def plan_rows(config, dtype: torch.dtype, capacity: int, free_bytes: int, *, max_rows: int = MAX_ROWS,
              batch_tokens: int | None = None) -> RowBudget:
    """The rows that fit `free_bytes` (or the rows `batch_tokens` asks for, refused if they do not fit)."""
    margin = int(free_bytes * FRAGMENTATION) + FIXED_MARGIN

    def budget(rows: int) -> RowBudget:
        return budget_for(config, dtype, capacity, rows, prefill_rows=max_rows, free_bytes=free_bytes, margin=margin)

    one = budget(1)
    prefill = one.prefill_bytes
    fits = max(0, (free_bytes - margin - prefill) // (one.kv_bytes + one.step_bytes))

    if batch_tokens is not None:
        rows = batch_tokens // capacity
        if rows < 1:
            raise DFlashError(f"--batch-tokens {batch_tokens} is less than one sequence of --max-length {capacity}")
        if rows > fits:
            need = budget(rows)
            total = need.kv_bytes + need.step_bytes + prefill + margin
            raise DFlashError(f"--batch-tokens {batch_tokens} ({rows} sequences of {capacity} tokens) needs "
                              f"{total / GIB:.1f} GiB, {free_bytes / GIB:.1f} GiB are free: at most "
                              f"{fits * capacity} fit (or lower --max-length)")
        return budget(rows)
    rows = min(fits, max_rows)
    if rows < 1:
        raise DFlashError(f"not even one sequence of --max-length {capacity} fits in the {free_bytes / GIB:.1f} GiB "
                          f"free beside the target; lower --max-length")
    return budget(rows)


def open_rows(model, cfg, device: torch.device, line, conversations: int):
    """The runner of `dflash generate`'s worker: rows planned for this device's free memory, never more
    than the worker's conversations (a row without one would only idle)."""
    capacity = int(cfg.max_length)
    dtype = model.get_input_embeddings().weight.dtype
    asked = min(cfg.batch_tokens, conversations * capacity) if cfg.batch_tokens else None
    if device.type == "cuda":
        torch.cuda.empty_cache()
        free, _ = torch.cuda.mem_get_info(device)
        budget = plan_rows(model.config, dtype, capacity, free, max_rows=min(MAX_ROWS, conversations),
                           batch_tokens=asked)
    else:
        rows = asked // capacity if asked else min(CPU_ROWS, conversations)
        if rows < 1:
            raise DFlashError(f"--batch-tokens {cfg.batch_tokens} is less than one sequence of --max-length {capacity}")
        budget = budget_for(model.config, dtype, capacity, rows)
    line.say(budget.text())
    # compile by default on CUDA: the fused elementwise kernels made the 128-row 8B step 1.48x faster on an
    # H200 (BENCHMARKS.md); on CPUs (tests, demo) compiling costs more than it saves
    compile = cfg.compile if cfg.compile is not None else device.type == "cuda"
    return build_rows(model, budget.rows, capacity, device, compile=compile, asked=cfg.compile is not None, line=line)


def build_rows(model, num_rows: int, capacity: int, device: torch.device, *, compile: bool, asked: bool, line):
    """make_rows, compiled if `compile`. A compiler failure (some architecture's layer that torch.compile
    cannot trace) is not the user's mistake: when compiling was only the default, generation goes on with
    eager steps and says so; when the user asked for it (`asked`), one clear line names the failure."""
    if not compile:
        return make_rows(model, num_rows, capacity, device)
    line.say("compiling the decode step's layers before its graphs are captured (~12 s for an 8B shape)")
    try:
        return make_rows(model, num_rows, capacity, device, compile=True)
    except (DFlashError, torch.OutOfMemoryError, KeyboardInterrupt):
        raise
    except Exception as e:
        text = str(e).strip()
        why = f"{type(e).__name__}: {text.splitlines()[0] if text else ''}"[:300]
        if asked:
            raise DFlashError(f"dflash generate --compile: compiling the decode step failed ({why}); "
                              "run with --no-compile") from e
        line.say(f"compiling the decode step failed ({why}); generating with eager steps (--no-compile)")
        torch._dynamo.reset()
        return make_rows(model, num_rows, capacity, device)


class RunnerRows:
    """The decoding runner's rows behind the engine's `DecodeRows` protocol: one-token steps of every
    row, committed at once (`advance`); a row's reset is O(1) (its length), so refilling costs only the
    new prompt's prefill. `capacity` is the asked length, not the runner's rounded slot count, so that
    which replies fit never depends on the runner's internals."""

    def __init__(self, model, num_rows: int, capacity: int, compile: bool = False):
        from dflash_pipeline.decoding.runner import DecodingRunner
        from dflash_pipeline.eval.models import Target

        # split_decode: a row reads only its own K/V, not the bucket its longest neighbour sets (generation has
        # no verify step whose kernel the decode step must match; decoding/runner.py)
        self.runner = DecodingRunner(model, rows=num_rows, max_len=capacity, prefill_chunk=PREFILL_CHUNK,
                                     split_decode=True, compile=compile)
        self.num_rows, self.capacity, self.device = num_rows, capacity, self.runner.device
        self.compiled = compile
        try:
            self.io = self.runner.inputs(1)
            if self.runner.graphs:
                # Every step graph (one per slot bucket) captured now, while no row holds a sequence: none is
                # captured mid-run, and capture's temporaries are taken before the rows' memory is in use.
                self.runner.prepare((1,))
        except BaseException:
            self.runner.close()   # the model gets its own attention back before the caller retries or stops
            raise
        self.head = Target(model).logits   # the LM head with the target's logit scale and soft-capping

    def reset_row(self, row: int) -> None:
        self.runner.reset(row)

    def prefill_rows(self, rows: list[int], prompts: list[torch.Tensor]) -> torch.Tensor:
        from dflash_pipeline.generate.prefill import prefill_rows

        return prefill_rows(self.runner, rows, prompts, head=self.head, chunk=PREFILL_CHUNK, max_tokens=PREFILL_TOKENS)

    def step(self, tokens_R: torch.Tensor) -> torch.Tensor:
        self.io.ids_Rq[:, 0].copy_(tokens_R)
        io = self.runner.step(1)
        self.runner.advance(1)
        return io.logits_RqV[:, 0]   # a static buffer: valid until the next step, which comes after sampling

    def close(self) -> None:
        self.runner.close()


def _refuse(reason: str | None) -> None:
    if reason:
        raise DFlashError(f"dflash generate: the static-cache decoding runner cannot run this target: {reason} "
                          "(generate has no eager fallback; regenerate with a serving engine and give its "
                          "conversations to `dflash extract --data`)")


def check_target(target_path) -> None:
    """Refuse, before anything is planned or loaded, a target the decoding runner cannot run (hybrid
    linear-attention layers, ...): the runner's own test, on the model built on the meta device."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from dflash_pipeline.decoding.runner import unsupported_reason

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(target_path))
    _refuse(unsupported_reason(model))


def make_rows(model, num_rows: int, capacity: int, device: torch.device, compile: bool = False) -> RunnerRows:
    """`num_rows` sequences of up to `capacity` tokens on the decoding runner (graphed on CUDA; `compile`:
    the step's decoder layers through torch.compile first)."""
    from dflash_pipeline.decoding.runner import unsupported_reason

    _refuse(unsupported_reason(model))
    return RunnerRows(model, num_rows, capacity, compile=compile)
