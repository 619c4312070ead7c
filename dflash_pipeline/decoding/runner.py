"""DecodingRunner: rows of independent sequences over one causal LM, a static KV cache, graphed steps.

What it is for: `dflash eval` decodes one prompt at a time (R = 1) with a decode step (q = 1) and a
verify step (q = B); `dflash generate` keeps ~128 rows in flight and refills finished rows with new
prompts; tree decoding verifies a tree of q nodes per row. All three are the same few operations:

- `prefill(row, ids)`: reset a row and run its prompt eagerly (chunked, any length); logits of the last
  token and, on request, the captured layer features of every prompt token;
- `step(q)`: one forward of q new tokens for every row, from the static inputs `inputs(q)` (token ids,
  RoPE offsets, the q x q in-block mask); fp32 logits, their argmax and the captured features land in
  static outputs. On CUDA it is one graph launch after the first call of each shape. A step writes the
  rows' K/V at slots [len, len + q) but commits nothing. It attends to the first 256, 512, 1024, ...
  slots (a graph per q and bucket), the smallest bucket that holds the longest row, so short rows do
  not pay for reading the whole cache (with `split_decode`, one-token steps on CUDA read only each
  row's own slots within the bucket: decoding/split_attention.py);
- `set_length(row, n)` / `set_lengths([n, ...])` / `advance(n)`: commit or roll back, O(1): the row's
  committed slots are [0, n); whatever lies beyond is invisible to later steps and overwritten by them;
- `compact(row, src, dst)`: copy the accepted slots of a tree path to contiguous slots before commit.

A row's length lives on the device (the graphs read it) with a mirror on the host (capacity checks and
the caller's bookkeeping), so committing never synchronises.

Layer features (the drafter's input) are the outputs of decoder layers `layer_ids` (layer k = HF
hidden_states[k + 1], before the final norm), taken by forward hooks into a static buffer inside the
graph, concatenated in `layer_ids` order.

Inside a graph a step is still one kernel per operation (about 2,000 for a Qwen3-8B decode step);
`compile=True` runs the steps' decoder layers through torch.compile before capture, which fuses the
elementwise chains between the matrix products. The matrix products themselves are fused by default
(decoding/fused.py; `fuse=False` or DFLASH_FUSE_PROJECTIONS=0 turns it off): q|k|v as one product per
layer and gate|up as another, eager and compiled alike.

Targets whose layers are not all attention layers (recurrent / linear-attention hybrids, chunked
attention) are refused by `unsupported_reason`; callers fall back to the eager path for them.

Legend: R rows, q tokens per row in a step, V vocabulary, F = len(layer_ids) * H features, S slots.
"""

from __future__ import annotations

import inspect
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Sequence

import torch

from dflash_pipeline.decoding.attention import (STATIC_ATTENTION, StaticKV, StepState, active, active_state,
                                                kernels_label, register)
from dflash_pipeline.decoding.fused import fuse_from_env, fuse_projections
from dflash_pipeline.decoding.graphs import GraphedStep, new_pool
from dflash_pipeline.extract.target import decoder_layers, text_config

SLOT_ROUND = 64  # slot counts are rounded up to this: aligned mask rows, fewer distinct prefill shapes
MIN_ATTENDED = 256  # steps attend to the first 256, 512, 1024, ... slots: what the longest row needs
ATTENTION_LAYER_TYPES = {"full_attention", "sliding_attention"}


def unsupported_reason(model) -> str | None:
    """Why the static-cache runner cannot run `model` (None: it can)."""
    cfg = text_config(model.config)
    name = getattr(cfg, "model_type", type(model).__name__)
    other = sorted(set(getattr(cfg, "layer_types", None) or ()) - ATTENTION_LAYER_TYPES)
    if other:
        return f"{name} has {', '.join(other)} layers (only attention layers have a static cache here)"
    if not getattr(model, "_supports_attention_backend", False):
        return f"{name} does not route its attention through transformers' attention interface"
    if getattr(cfg, "use_bidirectional_attention", False):
        return f"{name} is configured with bidirectional attention"
    rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    per_layer_type = all(isinstance(v, dict) for v in rope.values())  # Gemma 3: one entry per layer type
    on_the_fly = {p.get("rope_type") for p in (rope.values() if per_layer_type else [rope])} & {"dynamic", "longrope"}
    if on_the_fly:  # transformers recomputes these frequencies from a sequence length it reads on the host
        return f"{name} uses {'/'.join(sorted(on_the_fly))} RoPE scaling"
    attn = getattr(decoder_layers(model)[0], "self_attn", None)
    if getattr(attn, "layer_idx", None) is None:
        return f"{name}: its attention modules carry no layer index"
    return None


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


@dataclass
class StepIO:
    """The static buffers of one step shape: write the inputs, call `step(q)`, read the outputs
    (valid until the next step of the same q)."""

    ids_Rq: torch.Tensor               # long: the new tokens
    offsets_Rq: torch.Tensor           # long: RoPE position = committed length + offset (default 0..q-1)
    block_mask_Rqq: torch.Tensor       # bool: query i sees block token j (default causal)
    logits_RqV: torch.Tensor           # fp32
    argmax_Rq: torch.Tensor            # long
    features_RqF: torch.Tensor | None  # model dtype; None without layer_ids


class DecodingRunner:
    """See the module docstring. `max_len`: slots per row, new block included."""

    def __init__(self, model, *, rows: int = 1, max_len: int, layer_ids: Sequence[int] = (),
                 graphs: bool | None = None, prefill_chunk: int = 512, compile: bool | str = False,
                 split_decode: bool = False, fuse: bool | None = None):
        reason = unsupported_reason(model)
        if reason:
            raise ValueError(f"static-cache runner: {reason}")
        fuse = fuse_from_env() if fuse is None else fuse  # before the model is touched: a bad value changes nothing
        register()
        cfg = text_config(model.config)
        emb = model.get_input_embeddings().weight
        self.model, self.device, self.dtype = model, emb.device, emb.dtype
        self.rows, self.slots, self.prefill_chunk = rows, round_up(max_len, SLOT_ROUND), prefill_chunk
        self.graphs = self.device.type == "cuda" if graphs is None else graphs
        heads = cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
        self.kv = StaticKV(cfg.num_hidden_layers, rows, kv_heads, self.slots, head_dim, self.dtype, self.device)
        self.groups = heads // kv_heads
        self.lengths_R = torch.zeros(rows, dtype=torch.long, device=self.device)
        self.host_lengths = [0] * rows
        self.slot_pos_RS = torch.zeros(rows, self.slots, dtype=torch.long, device=self.device)
        self.layer_ids = [int(k) for k in layer_ids]
        self.hidden_size = cfg.hidden_size
        layers = decoder_layers(model)
        self._hooks = [layers[k].register_forward_hook(self._hook(i)) for i, k in enumerate(self.layer_ids)]
        # The sliding windows the layers will ask for (per layer, or the config's for all layers).
        self.windows = {None, getattr(cfg, "sliding_window", None),
                        *(getattr(getattr(layer, "self_attn", None), "sliding_window", None) for layer in layers)}
        self._keep_kw = "logits_to_keep" in inspect.signature(model.forward).parameters
        # split_decode: one-token steps run the split decode kernel where it applies (decoding/attention.py;
        # it has no soft-capping). `dflash generate` asks for it. Speculative decoding does not: its lossless
        # check compares decode steps with verify steps, whose top-2 margins stay within 11 bf16 ulp of each
        # other (the rule allows 12) when both run the written-out kernel, and moved by up to 21 (chain
        # verify: 16) with the split kernel deciding
        # (real SmolLM2 on an H200, bench/tie_rule.py, BENCHMARKS.md)
        self._split = split_decode and not getattr(cfg, "attn_logit_softcapping", None)
        self._prev_attn = model.config._attn_implementation
        model.set_attn_implementation(STATIC_ATTENTION)
        # compile: in the steps (not the prefill, whose shapes vary), each decoder layer runs through
        # torch.compile before the step is captured, so that its elementwise chains (norms, RoPE,
        # residual adds) become fused kernels inside the graph. Layer by layer ("regional"): the layers
        # share one compiled code per step shape, so compiling costs one layer's time, not the model's.
        # The layer's forward, not its __call__: the feature hooks stay outside the compiled code (one
        # code for every layer, hooked or not). Automatic dynamic (no dynamic=False): the layer index
        # and the step shapes become symbolic after their first change instead of compiling again.
        # A string is torch.compile's mode, e.g. "max-autotune-no-cudagraphs": Inductor's Triton matrix-product
        # templates then compete with cuBLAS per shape (bench/eval.py --compile-mode measures it).
        mode = compile if isinstance(compile, str) else None
        self._compiled = [torch.compile(layer.forward, mode=mode) for layer in layers] if compile else None
        self._pool = new_pool(self.device)
        self._io: dict[int, StepIO] = {}
        self._steps: dict[tuple[int, int], GraphedStep] = {}  # (q, attended slots)
        # fuse: q|k|v and gate|up as one product each; the small k and v products ran far below the memory
        # bandwidth (36 Qwen3-8B layers + head, bf16, H200: 4.87 -> 4.19 ms at batch 1; bench/gemv.py).
        # None: DFLASH_FUSE_PROJECTIONS (default on)
        self._fused = fuse_projections(model) if fuse else None

    def _hook(self, i: int):
        def fn(module, args, output):
            state = active_state()
            if state is not None and state.capture is not None:
                state.capture(i, output[0] if isinstance(output, tuple) else output)

        return fn

    def close(self) -> None:
        """Remove the hooks and give the model its own attention and projection modules back."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self.model.set_attn_implementation(self._prev_attn)
        if self._fused is not None:
            self._fused.restore()

    def __enter__(self) -> "DecodingRunner":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def decode_attention(self) -> str:
        """The attention kernels this runner's steps run, as reports name them ('split/math', 'math', ...)."""
        return kernels_label(self.device, self.dtype, self._split)

    @property
    def fused_layers(self) -> int:
        """Decoder layers whose projections run fused (0 with fuse=False)."""
        return self._fused.layers if self._fused is not None else 0

    @property
    def num_features(self) -> int:
        return len(self.layer_ids) * self.hidden_size

    # ------------------------------------------------------------------ lengths: commit and roll back

    def set_length(self, row: int, n: int) -> None:
        """Row `row` keeps slots [0, n) (commit or roll back); no synchronisation."""
        if not 0 <= n <= self.slots:
            raise ValueError(f"row {row}: length {n} outside the cache's {self.slots} slots")
        self.host_lengths[row] = n
        self.lengths_R[row].fill_(n)

    def reset(self, row: int) -> None:
        self.set_length(row, 0)

    def advance(self, n: int = 1) -> None:
        """Every row commits n more slots (plain decoding of all rows)."""
        self.host_lengths = [x + n for x in self.host_lengths]
        self.lengths_R.add_(n)

    def set_lengths(self, lengths: Sequence[int]) -> None:
        """Every row's committed length at once (rows accepting different counts, idle rows at 0): one
        small copy that does not wait for the device."""
        if len(lengths) != self.rows or not all(0 <= n <= self.slots for n in lengths):
            raise ValueError(f"set_lengths: {self.rows} lengths in [0, {self.slots}] expected, got {list(lengths)}")
        self.host_lengths = [int(n) for n in lengths]
        self.lengths_R.copy_(torch.tensor(self.host_lengths, dtype=torch.long), non_blocking=True)

    def length(self, row: int) -> int:
        return self.host_lengths[row]

    def _check_room(self, row: int, q: int) -> None:
        if self.host_lengths[row] + q > self.slots:
            raise ValueError(f"row {row}: {self.host_lengths[row]} committed + {q} new tokens exceed the cache's "
                             f"{self.slots} slots (max_len)")

    def compact(self, row: int, src_slots: Sequence[int] | torch.Tensor, dst: int) -> None:
        """Copy K/V (and positions) of slots `src_slots` to slots dst, dst + 1, ...: an accepted tree path
        becomes contiguous; commit it afterwards with `set_length`. A device tensor of slots is used as it
        is (no host synchronisation)."""
        if isinstance(src_slots, torch.Tensor):
            src = src_slots.to(self.device, torch.long)
        else:
            src = torch.tensor(list(src_slots), dtype=torch.long).to(self.device)
        dst_n = torch.arange(dst, dst + len(src), device=self.device)
        self.kv.copy_slots(row, src, dst_n)
        pos = self.slot_pos_RS[row].index_select(0, src)
        self.slot_pos_RS[row].index_copy_(0, dst_n, pos)

    # ------------------------------------------------------------------ prefill (eager)

    @torch.inference_mode()
    def prefill(self, row: int, ids: Sequence[int] | torch.Tensor, *, features: bool = False,
                all_logits: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Reset `row` and commit `ids`: (fp32 logits [1, V] of the last token (all: [n, V]),
        features [n, F] or None)."""
        self.reset(row)
        return self.extend(row, ids, features=features, all_logits=all_logits)

    @torch.inference_mode()
    def extend(self, row: int, ids: Sequence[int] | torch.Tensor, *, features: bool = False,
               all_logits: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Append and commit `ids` to `row` at consecutive positions, eagerly, in chunks."""
        ids_n = torch.as_tensor(ids, dtype=torch.long).reshape(-1).to(self.device)
        self._check_room(row, ids_n.numel())
        logits, feats = [], []
        for a in range(0, ids_n.numel(), self.prefill_chunk):
            chunk = ids_n[a:a + self.prefill_chunk]
            lg, ft = self._forward_row(row, chunk, features, all_logits)
            logits.append(lg)
            feats.append(ft)
            self.set_length(row, self.host_lengths[row] + chunk.numel())
        if not all_logits:
            logits = logits[-1:]
        return torch.cat(logits), (torch.cat(feats) if features and self.layer_ids else None)

    def _forward_row(self, row: int, ids_c: torch.Tensor, features: bool, all_logits: bool):
        c, start = ids_c.numel(), self.host_lengths[row]
        parts: dict[int, torch.Tensor] = {}
        rows = slice(row, row + 1)
        state = StepState(
            self.kv, rows, self.lengths_R[rows], torch.arange(c, device=self.device)[None],
            torch.ones(c, c, dtype=torch.bool, device=self.device).tril()[None], self.slot_pos_RS[rows],
            min(self.slots, round_up(start + c, SLOT_ROUND)), groups=self.groups, windows=self.windows,
            capture=(lambda i, h: parts.__setitem__(i, h)) if features else None,
        )
        kw = {"logits_to_keep": 1} if self._keep_kw and not all_logits else {}
        with active(state):
            out = self.model(input_ids=ids_c[None], position_ids=state.pos_Rq, use_cache=False, **kw)
        logits = out.logits[0].float()
        feats = torch.cat([parts[i][0] for i in range(len(self.layer_ids))], dim=-1) if parts else None
        return (logits if all_logits else logits[-1:]), feats

    # ------------------------------------------------------------------ graphed steps

    def inputs(self, q: int) -> StepIO:
        """The static buffers of step shape q (made on first use, defaults: chain block, causal)."""
        if q not in self._io:
            R, V, dev = self.rows, self.model.get_output_embeddings().weight.shape[0], self.device
            self._io[q] = StepIO(
                ids_Rq=torch.zeros(R, q, dtype=torch.long, device=dev),
                offsets_Rq=torch.arange(q, device=dev)[None].repeat(R, 1),
                block_mask_Rqq=torch.ones(q, q, dtype=torch.bool, device=dev).tril()[None].repeat(R, 1, 1),
                logits_RqV=torch.zeros(R, q, V, dtype=torch.float32, device=dev),
                argmax_Rq=torch.zeros(R, q, dtype=torch.long, device=dev),
                features_RqF=(torch.zeros(R, q, self.num_features, dtype=self.dtype, device=dev)
                              if self.layer_ids else None),
            )
        return self._io[q]

    @torch.inference_mode()
    def step(self, q: int) -> StepIO:
        """One forward of the q tokens in `inputs(q)` for every row; commits nothing."""
        for r in range(self.rows):
            self._check_room(r, q)
        key = (q, self.attended_slots(q))
        if key not in self._steps:
            self._steps[key] = GraphedStep(self._step_fn(self.inputs(q), key[1]), self.device, self._pool, self.graphs)
        self._steps[key]()
        return self._io[q]

    @torch.inference_mode()
    def prepare(self, qs: Sequence[int]) -> int:
        """Capture (and compile) every step graph of these q for every slot bucket now, so that none is
        built in the middle of a timed or latency-bound run; the number of graphs. It runs real steps
        over all rows, so call it before rows hold anything worth keeping; lengths are restored."""
        before = list(self.host_lengths)
        for q in qs:
            bucket = MIN_ATTENDED
            while True:
                top = min(bucket, self.slots)
                self.set_lengths([max(top - q, 0)] * self.rows)
                if top >= q:
                    self.step(q)
                if top == self.slots:
                    break
                bucket *= 2
        self.set_lengths(before)
        return len(self._steps)

    def attended_slots(self, q: int) -> int:
        """Slots a step of q tokens attends to: the smallest power-of-two bucket holding every row's block."""
        need, bucket = max(self.host_lengths) + q, MIN_ATTENDED
        while bucket < need:
            bucket *= 2
        return min(bucket, self.slots)

    def _step_fn(self, io: StepIO, slots: int):
        H = self.hidden_size

        def capture(i: int, h: torch.Tensor) -> None:
            io.features_RqF[..., i * H:(i + 1) * H].copy_(h)

        def fn() -> None:
            state = StepState(self.kv, slice(None), self.lengths_R, io.offsets_Rq, io.block_mask_Rqq,
                              self.slot_pos_RS, slots, groups=self.groups, windows=self.windows,
                              capture=capture if self.layer_ids else None, split=self._split)
            with active(state), self._compiled_layers():
                io.logits_RqV.copy_(self._logits(io.ids_Rq, state.pos_Rq))
            torch.argmax(io.logits_RqV, dim=-1, out=io.argmax_Rq)

        return fn

    def _logits(self, ids_Rq: torch.Tensor, pos_Rq: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=ids_Rq, position_ids=pos_Rq, use_cache=False).logits

    @contextmanager
    def _compiled_layers(self):
        """The decoder layers run their compiled forwards inside."""
        if not self._compiled:
            yield
            return
        layers = decoder_layers(self.model)
        before = [layer.__dict__.get("forward") for layer in layers]  # e.g. accelerate's hook wrappers
        for layer, fn in zip(layers, self._compiled):
            layer.forward = fn  # an instance attribute: shadows the class's forward until restored
        try:
            # layer_idx a dynamic int: every layer shares one compiled code per kind of layer and shape
            with torch._dynamo.config.patch(allow_unspec_int_on_nn_module=True, recompile_limit=64):
                yield
        finally:
            for layer, fn in zip(layers, before):
                if fn is None:
                    del layer.forward
                else:
                    layer.forward = fn


__all__ = ["DecodingRunner", "StepIO", "unsupported_reason", "round_up"]
