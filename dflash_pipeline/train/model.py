"""The DFlash drafter: Qwen3 decoder layers that read the target's fused hidden states as extra keys.

Built to the letter of docs/dflash-method.md so that the exported weights load into the reference
`dflash.model.DFlashDraftModel` (and SGLang / vLLM) and produce the same drafts:

- `fc` (n*H -> H, no bias) + `hidden_norm` fuse the n concatenated target features into a context;
- each layer projects that context with its own k_proj / v_proj / k_norm, applies RoPE at the context's
  own positions and puts it BEFORE the block's keys/values; queries come from block tokens only and the
  context never passes through an MLP;
- the final `norm` ends the drafter; the target's frozen embedding and LM head live outside it.

Two forwards share the layers: `forward` trains on packed rows with all anchor blocks at once (masks in
`masks.py`), and `draft_step` decodes with a `DrafterCache` of context keys/values, the way the
reference `dflash_generate` does. Parameter names equal the export names, so a state dict is a
checkpoint.

Shape legend: R rows, S context positions, F = n*H concatenated features, Q block tokens (A*B),
H hidden, h heads, D head dim, T cached positions, n new context positions, B block size.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields, replace

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

from dflash_pipeline.train.kernels import EAGER, Kernels, kernels, out_dtype_for
from dflash_pipeline.train.masks import BACKENDS, MaskLayout, attend, build_mask, choose_backend, dense_mask

LAYER_TYPES = ("full_attention", "sliding_attention")


@dataclass
class DrafterConfig:
    """Architecture of a drafter. `vocab_size` is the target's embedding rows (not saved weights)."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    block_size: int
    mask_token_id: int
    target_layer_ids: list[int]
    num_target_layers: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 32768
    layer_types: list[str] = field(default_factory=list)  # empty: all full_attention
    sliding_window: int | None = None
    # Sliding-window layers are causal inside the block by default (the method page); False makes
    # them bidirectional and is exported as `is_causal: false`, which the reference reads.
    sliding_causal: bool = True
    # How the target embeds and reads out, both shared with the drafter (Gemma: embeddings x sqrt(H),
    # soft-capped logits). Exported into `dflash_config`, where the reference `dflash` package reads them.
    embedding_scale: float = 1.0
    logit_scale: float | None = None
    final_logit_softcapping: float | None = None

    def __post_init__(self):
        for name in ("hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                     "head_dim", "vocab_size", "num_target_layers", "max_position_embeddings"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"drafter config: {name} must be >= 1, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"drafter config: num_heads ({self.num_heads}) must be a multiple of "
                             f"num_kv_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"drafter config: head_dim must be even for RoPE, got {self.head_dim}")
        if self.block_size < 2:
            raise ValueError(f"drafter config: block_size must be >= 2, got {self.block_size}")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(f"drafter config: mask_token_id {self.mask_token_id} is outside the "
                             f"embedding table (vocab_size {self.vocab_size})")
        self.target_layer_ids = [int(i) for i in self.target_layer_ids]
        if not self.target_layer_ids:
            raise ValueError("drafter config: target_layer_ids is empty")
        bad = [i for i in self.target_layer_ids if not 0 <= i < self.num_target_layers]
        if bad:
            raise ValueError(f"drafter config: target_layer_ids {bad} outside the target's "
                             f"{self.num_target_layers} layers")
        if not self.layer_types:
            self.layer_types = ["full_attention"] * self.num_layers
        self.layer_types = list(self.layer_types)
        if len(self.layer_types) != self.num_layers:
            raise ValueError(f"drafter config: {len(self.layer_types)} layer_types for {self.num_layers} layers")
        unknown = sorted(set(self.layer_types) - set(LAYER_TYPES))
        if unknown:
            raise ValueError(f"drafter config: unknown layer types {unknown}; use {', '.join(LAYER_TYPES)}")
        if "sliding_attention" in self.layer_types and (self.sliding_window is None or self.sliding_window < 1):
            raise ValueError("drafter config: sliding_attention layers need sliding_window >= 1")

    @property
    def num_features(self) -> int:
        return len(self.target_layer_ids)

    def layer_mask_kind(self, i: int) -> tuple[bool, int | None]:
        """(causal inside the block, window) of layer i."""
        if self.layer_types[i] == "sliding_attention":
            return self.sliding_causal, self.sliding_window
        return False, None

    def layer_mask_kinds(self) -> list[tuple[bool, int | None]]:
        """`layer_mask_kind` of every layer, in order."""
        return [self.layer_mask_kind(i) for i in range(self.num_layers)]

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "DrafterConfig":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"drafter config: unknown fields {unknown}")
        return cls(**d)


@dataclass(frozen=True)
class DrafterOptions:
    """How the drafter computes, never what: its outputs (up to float rounding), its config and its
    state dict are the same under every setting, so none of these is exported or saved."""

    # The first `checkpoint_layers` layers recompute their activations in backward: each one
    # checkpointed trades a layer's activations (7.7 GiB in the memory case) for its forward again.
    checkpoint_layers: int = 0
    # Elementwise chains (norms, residual adds, RoPE) as compiled fused kernels (kernels.py) in the
    # training forward, and the loss's chunk math (run_blocks): None = on CUDA, False = eager
    # everywhere (same numbers, ~150 ms more per step at the 8B shape), True = everywhere.
    compile_kernels: bool | None = None
    attn_backend: str | None = None  # None: flex on CUDA, dense elsewhere; or one of masks.BACKENDS

    def __post_init__(self):
        if self.checkpoint_layers < 0:
            raise ValueError(f"checkpoint_layers must be >= 0, got {self.checkpoint_layers}")
        if self.attn_backend is not None and self.attn_backend not in BACKENDS:
            raise ValueError(f"unknown attention backend '{self.attn_backend}': use one of {', '.join(BACKENDS)}")


class _Option:
    """A DrafterOptions field as an attribute of the model: read from `model.options`; setting it
    replaces the options (validated again)."""

    def __set_name__(self, owner, name: str):
        self.name = name

    def __get__(self, model, owner=None):
        return self if model is None else getattr(model.options, self.name)

    def __set__(self, model, value) -> None:
        model.options = replace(model.options, **{self.name: value})


def init_drafter_weights(model: "DFlashDrafter", std: float = 0.02, generator: torch.Generator | None = None):
    """Normal(0, std) linears and unit norms, as HF initialises Qwen3."""
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.Linear):
                module.weight.normal_(0.0, std, generator=generator)
            elif isinstance(module, RMSNorm):
                module.weight.fill_(1.0)


class RMSNorm(nn.Module):
    """Qwen3RMSNorm: statistics in fp32, weight applied in the input dtype."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor, out_dtype: torch.dtype | None = None, k: Kernels = EAGER) -> torch.Tensor:
        return k.rms_norm(x, self.weight, self.eps, out_dtype)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype):
    """cos, sin [..., D] for integer positions (fp32 math, then cast like HF's default RoPE)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float, device=positions.device) / head_dim))
    freqs = positions[..., None].float() * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


class DrafterAttention(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        H, D = cfg.hidden_size, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, D
        self.scale = D**-0.5
        self.q_proj = nn.Linear(H, cfg.num_heads * D, bias=False)
        self.k_proj = nn.Linear(H, cfg.num_kv_heads * D, bias=False)
        self.v_proj = nn.Linear(H, cfg.num_kv_heads * D, bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * D, H, bias=False)
        self.q_norm = RMSNorm(D, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(D, cfg.rms_norm_eps)

    def project_kv(self, x_RLH: torch.Tensor, rope, k: Kernels = EAGER) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys (k_norm, RoPE) and values [R, h_kv, L, D] of hidden states at their positions."""
        R, L, _ = x_RLH.shape
        key = k.norm_rope(self.k_proj(x_RLH).view(R, L, self.num_kv_heads, self.head_dim), self.k_norm.weight,
                          self.k_norm.eps, *rope, out_dtype_for(x_RLH.device))
        v = self.v_proj(x_RLH).view(R, L, self.num_kv_heads, self.head_dim).transpose(1, 2)
        return key, v

    def project_q(self, x_RQH: torch.Tensor, rope, k: Kernels = EAGER) -> torch.Tensor:
        R, Q, _ = x_RQH.shape
        return k.norm_rope(self.q_proj(x_RQH).view(R, Q, self.num_heads, self.head_dim), self.q_norm.weight,
                           self.q_norm.eps, *rope, out_dtype_for(x_RQH.device))

    def forward(self, x_RQH, ctx_kv, rope_q, mask, k: Kernels = EAGER) -> torch.Tensor:
        """Block queries over [context | block] keys; ctx_kv = (k, v) of the context, already roped."""
        R, Q, _ = x_RQH.shape
        q = self.project_q(x_RQH, rope_q, k)
        k_blk, v_blk = self.project_kv(x_RQH, rope_q, k)
        keys = torch.cat([ctx_kv[0], k_blk], dim=2)
        values = torch.cat([ctx_kv[1], v_blk], dim=2)
        out = attend(q, keys, values, mask, self.scale)
        return self.o_proj(out.transpose(1, 2).reshape(R, Q, self.num_heads * self.head_dim))


class DrafterMLP(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_proj(x), self.up_proj(x)
        if torch.is_grad_enabled() and gate.requires_grad:
            # silu(gate) * up recomputed in backward from gate and up (saved anyway): two fewer
            # [tokens, intermediate] tensors kept per layer (4.6 GB of 9 at 32K block tokens and
            # intermediate 17,408), for one elementwise kernel more. Same numbers.
            return self.down_proj(checkpoint(_swiglu, gate, up, use_reentrant=False))
        return self.down_proj(_swiglu(gate, up))


def _swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


class DrafterLayer(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DrafterAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = DrafterMLP(cfg)

    def forward(self, h_RQH, ctx_RSH, rope_q, rope_ctx, mask, compiled: bool = False) -> torch.Tensor:
        k = kernels(compiled)
        return self.block(h_RQH, self.self_attn.project_kv(ctx_RSH, rope_ctx, k), rope_q, mask, k)

    def block(self, h_RQH, ctx_kv, rope_q, mask, k: Kernels = EAGER) -> torch.Tensor:
        """The layer over block tokens, given the context's keys and values."""
        out_dtype = out_dtype_for(h_RQH.device)
        x_RQH = self.input_layernorm(h_RQH, out_dtype, k)
        h_RQH, x_RQH = k.add_rms_norm(h_RQH, self.self_attn(x_RQH, ctx_kv, rope_q, mask, k),
                                      self.post_attention_layernorm.weight, self.post_attention_layernorm.eps,
                                      out_dtype)
        return h_RQH + self.mlp(x_RQH)


class DrafterCache:
    """Context keys/values per layer (after k_norm and RoPE) of the committed tokens, and their positions.

    Only committed context is ever appended, so unlike the reference's DynamicCache nothing needs
    cropping after a draft: the block's own keys are never stored.
    """

    def __init__(self, num_layers: int):
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers
        self.positions: torch.Tensor | None = None

    def __len__(self) -> int:
        return 0 if self.positions is None else int(self.positions.shape[0])

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.keys[layer] is not None:
            k = torch.cat([self.keys[layer], k], dim=2)
            v = torch.cat([self.values[layer], v], dim=2)
        self.keys[layer], self.values[layer] = k, v
        return k, v

    def append_positions(self, positions: torch.Tensor) -> None:
        self.positions = positions if self.positions is None else torch.cat([self.positions, positions])


class DFlashDrafter(nn.Module):
    """The trainable drafter. Embedding and LM head stay with the (frozen) target, outside this module."""

    def __init__(self, cfg: DrafterConfig, options: DrafterOptions | None = None):
        super().__init__()
        self.config = cfg
        self.options = options or DrafterOptions()
        self.fc = nn.Linear(cfg.num_features * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DrafterLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def fuse(self, features_RSF: torch.Tensor, k: Kernels = EAGER) -> torch.Tensor:
        """Concatenated target features -> context hidden states [R, S, H]."""
        # Under autocast the matmul runs in bf16 whatever the input's dtype: casting the features to the
        # fp32 master weights' dtype first would only write and re-read an fp32 copy (1 GB per step at
        # 4 x 3,072 tokens x 5 x 4,096); bf16 -> fp32 -> bf16 is exact, so the result is the same.
        x = features_RSF
        if not torch.is_autocast_enabled(x.device.type):
            x = x.to(self.fc.weight.dtype)
        return self.hidden_norm(self.fc(x), out_dtype_for(x.device), k)

    # Each option also reads (and, for tests comparing paths on one set of weights, sets) by its name.
    checkpoint_layers = _Option()
    compile_kernels = _Option()
    attn_backend = _Option()

    @property
    def gradient_checkpointing(self) -> bool:
        return self.checkpoint_layers >= self.config.num_layers

    @gradient_checkpointing.setter
    def gradient_checkpointing(self, on: bool) -> None:
        self.checkpoint_layers = self.config.num_layers if on else 0

    def _rope(self, positions: torch.Tensor, dtype: torch.dtype):
        return rope_cos_sin(positions, self.config.head_dim, self.config.rope_theta, dtype)

    def forward(
        self,
        features_RSF: torch.Tensor,
        ctx_pos_RS: torch.Tensor,
        ctx_doc_RS: torch.Tensor,
        block_embeds_RQH: torch.Tensor,
        block_pos_RQ: torch.Tensor,
        block_doc_RQ: torch.Tensor,
        block_id_RQ: torch.Tensor,
    ) -> torch.Tensor:
        """Final-normed hidden states [R, Q, H] of all anchor blocks of packed rows at once.

        features_RSF: concatenated target layer outputs of every row position; ctx_pos_RS: position
        within its sample; ctx_doc_RS: sample index within the row (-1 = padding). block_embeds_RQH:
        frozen-embedding rows of [anchor token, MASK x (B-1)] per block, blocks contiguous; block_pos_RQ
        = anchor position + slot; block_doc_RQ: the anchor's sample; block_id_RQ: block index within the
        row, -1 for padded blocks (their outputs are finite and meaningless).
        """
        cfg = self.config
        dtype = self.fc.weight.dtype
        opts = self.options
        compiled = opts.compile_kernels if opts.compile_kernels is not None else features_RSF.device.type == "cuda"
        k = kernels(compiled)
        ctx_RSH = self.fuse(features_RSF, k)
        h_RQH = block_embeds_RQH.to(dtype)
        rope_ctx = self._rope(ctx_pos_RS, dtype)
        rope_q = self._rope(block_pos_RQ, dtype)
        layout = MaskLayout.for_training(ctx_pos_RS, ctx_doc_RS, block_pos_RQ, block_doc_RQ, block_id_RQ,
                                         cfg.block_size)
        backend = choose_backend(h_RQH.device, opts.attn_backend)
        masks = {}
        for i in range(cfg.num_layers):
            kind = cfg.layer_mask_kind(i)
            if kind not in masks:
                masks[kind] = build_mask(layout, *kind, backend)
        for i, layer in enumerate(self.layers):
            mask = masks[cfg.layer_mask_kind(i)]
            if i < opts.checkpoint_layers and self.training and torch.is_grad_enabled():
                # Eager inside the checkpoint: compiled autograd functions do not run under its hooks.
                h_RQH = checkpoint(layer, h_RQH, ctx_RSH, rope_q, rope_ctx, mask, False, use_reentrant=False)
            else:
                h_RQH = layer(h_RQH, ctx_RSH, rope_q, rope_ctx, mask, compiled)
        return self.norm(h_RQH, out_dtype_for(h_RQH.device), k)

    def new_cache(self) -> DrafterCache:
        return DrafterCache(self.config.num_layers)

    def draft_step(
        self,
        new_features: torch.Tensor,
        new_positions: torch.Tensor,
        block_embeds: torch.Tensor,
        block_positions: torch.Tensor,
        cache: DrafterCache,
    ) -> torch.Tensor:
        """One drafting step of speculative decoding; returns final-normed hidden [b, B, H].

        new_features [b, n, F] are the target features of the tokens committed since the last step (the
        whole prompt at first) at new_positions [n]; they join the cache for good. The block
        ([last committed token, MASK...] embedded, at block_positions [B] = start .. start+B-1) attends to
        all cached context below its start and to itself (bidirectional in full layers, causal + window
        in sliding ones), as the reference `dflash_generate` does.
        """
        cfg = self.config
        dtype = self.fc.weight.dtype
        ctx = self.fuse(new_features)
        h = block_embeds.to(dtype)
        b = h.shape[0]
        cache.append_positions(new_positions.to(block_positions.device))
        rope_ctx = tuple(t[None].expand(b, -1, -1) for t in self._rope(new_positions, dtype))
        rope_q = tuple(t[None].expand(b, -1, -1) for t in self._rope(block_positions, dtype))
        layout = MaskLayout.for_decoding(cache.positions, block_positions)
        masks = {}
        for i, layer in enumerate(self.layers):
            kind = cfg.layer_mask_kind(i)
            if kind not in masks:
                masks[kind] = dense_mask(layout, *kind)
            h = layer.block(h, cache.append(i, *layer.self_attn.project_kv(ctx, rope_ctx)), rope_q, masks[kind])
        return self.norm(h, out_dtype_for(h.device))

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())


def count_parameters_for(cfg: DrafterConfig) -> int:
    """Parameter count without allocating weights."""
    with torch.device("meta"):
        return DFlashDrafter(cfg).num_parameters()


__all__ = [
    "DrafterConfig", "DrafterOptions", "DFlashDrafter", "DrafterCache", "RMSNorm", "init_drafter_weights", "rope_cos_sin",
    "count_parameters_for",
]
