"""Run configurations, validated on construction and dumped to JSON with every run."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

from dflash_pipeline.method import (DEFAULT_CAP_WEIGHT, DEFAULT_FEATURE_NOISE, DEFAULT_KL_WEIGHT, GAMMA_BY_BLOCK_SIZE,
                                    gamma_table_text)
from dflash_pipeline.schemas.chat_template import parse_chat_template_kwargs

CODEC_NAMES = ("bf16", "fp8")


def _to_dict(obj) -> dict[str, Any]:
    return json.loads(json.dumps(dataclasses.asdict(obj), default=str))


def check_gpus(gpus: str) -> None:
    """--gpus: 'all' or a positive number of GPUs (one process each)."""
    if gpus != "all" and not (gpus.isdigit() and int(gpus) >= 1):
        raise ValueError(f"--gpus must be 'all' or a positive number, got '{gpus}'")


@dataclass
class ExtractConfig:
    """`dflash extract`: target + data -> feature store."""

    out: str
    target: str | None = None            # None: the embedded SmolLM2-135M-Instruct
    data: list[str] = field(default_factory=list)   # empty: the embedded ShareGPT conversations
    max_length: int = 2048
    limit: int | None = None
    # Variables of the target's chat template (e.g. {"enable_thinking": false}); a JSON string is parsed.
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    layers: list[int] | None = None      # None: the DFlash default for num_features
    num_features: int = 5
    topk: int = 32
    codec: str = "bf16"
    tokens_per_batch: int = 16384
    segment_tokens: int = 32768
    gpus: str = "all"                    # "all" or a number of GPUs to use
    gpus_per_replica: int = 1
    dtype: str = "auto"                  # auto: bf16 on GPUs, fp32 on CPUs (CPU bf16 matmuls are slow)
    tokenize_workers: int = 0            # 0: one per CPU core, capped
    logit_chunk_tokens: int = 2048
    device: str = "auto"                 # auto | cuda | cpu
    num_procs: int | None = None         # CPU only: worker processes (tests of the multi-process path)
    # Segments between the GPU loop and the store: one being filled, the rest being written. With two,
    # a bf16 Qwen3-8B segment (1.3 GB) had to be written in the time the GPU took to fill the next
    # one, and the H200 waited on writes 11% of the time; four absorb it (host memory: 4 segments).
    inflight_segments: int = 4
    writer_processes: int | None = None  # segment writers in processes; None: inflight_segments on GPUs, 0 on CPUs
    quiet: bool = False

    def __post_init__(self) -> None:
        self.chat_template_kwargs = parse_chat_template_kwargs(self.chat_template_kwargs)
        if self.codec not in CODEC_NAMES:
            raise ValueError(f"--codec must be one of {', '.join(CODEC_NAMES)}, got '{self.codec}'")
        if self.dtype not in ("auto", "bf16", "fp32", "fp16"):
            raise ValueError(f"--dtype must be auto, bf16, fp16 or fp32, got '{self.dtype}'")
        for name in ("max_length", "tokens_per_batch", "segment_tokens", "gpus_per_replica", "num_features",
                     "logit_chunk_tokens", "inflight_segments"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
        if self.topk < 0:
            raise ValueError("--topk must be >= 0")
        if self.limit is not None and self.limit < 1:
            raise ValueError("--limit must be >= 1")
        check_gpus(self.gpus)
        if self.layers is not None and (not self.layers or sorted(set(self.layers)) != list(self.layers)):
            raise ValueError(f"--layers must be strictly increasing layer ids, got {self.layers}")
        if self.device not in ("auto", "cuda", "cpu"):
            raise ValueError(f"device must be auto, cuda or cpu, got '{self.device}'")

    def to_dict(self) -> dict[str, Any]:
        return _to_dict(self)


# -- training: one section per component, each owning (and validating) its options ---------------------


@dataclass
class ModelConfig:
    """The drafter's architecture, beyond what the store's target fixes (width, heads, vocabulary)."""

    num_layers: int = 5
    block_size: int = 16
    layers: list[int] | None = None      # target layers to use (default: every layer in the store)
    mask_token_id: int | None = None     # default: the method's rule (see method.py)
    sliding_window: int | None = None
    swa_layers: list[int] = field(default_factory=list)
    init_from: str | None = None         # an exported drafter whose weights start the run (fresh optimizer)

    def __post_init__(self) -> None:
        if self.num_layers < 1:
            raise ValueError("--num-layers must be >= 1")
        if self.block_size < 2:
            raise ValueError("--block-size must be >= 2")
        if self.swa_layers and self.sliding_window is None:
            raise ValueError("--swa-layers needs --sliding-window")
        if self.sliding_window is not None and not self.swa_layers:
            raise ValueError("--sliding-window needs --swa-layers (which drafter layers use it)")
        if any(i < 0 or i >= self.num_layers for i in self.swa_layers):
            raise ValueError(f"--swa-layers {self.swa_layers} outside the drafter's {self.num_layers} layers")


@dataclass
class LossConfig:
    """Anchors and the loss. Each term is a weighted sum over labelled block slots divided by the sum
    of the weights (decay-weighted count)."""

    max_anchors: int | None = None       # per sample per step; None: chosen from the store (train/from_store.py
                                         # resolve_batch: 512, or fewer over more tokens on short samples)
    gamma: float | None = None           # None: the published value for the block size (method.py)
    kl_weight: float | None = None       # None: DEFAULT_KL_WEIGHT where the store keeps a top-k, else 0
    cap_weight: float = DEFAULT_CAP_WEIGHT
    feature_noise: float = DEFAULT_FEATURE_NOISE

    def __post_init__(self) -> None:
        if self.max_anchors is not None and self.max_anchors < 1:
            raise ValueError("--max-anchors must be >= 1")
        if self.kl_weight is not None and not 0 <= self.kl_weight <= 1:
            raise ValueError("--kl-weight must be in [0, 1] (the KL share of the CE/KL blend)")
        if self.cap_weight < 0 or self.feature_noise < 0:
            raise ValueError("--cap-weight and --feature-noise must be >= 0")

    def kl_for(self, store_topk: int) -> float:
        """The KL weight a run on a store keeping `store_topk` teacher log-probabilities per token uses."""
        if self.kl_weight is not None:
            return self.kl_weight
        return DEFAULT_KL_WEIGHT if store_topk > 0 else 0.0


# AdamW's moment decays. beta2 is torch's 0.999 (SpecForge's DFlash trainer keeps it too): at 1,500 steps of
# the default recipe on the real SmolLM2 it trained a drafter 1.022x the real tau of 0.95's (paired 95%
# 1.011-1.033, BENCHMARKS.md, 2026-12-07), 0.95 having been the default before. A run whose config does not
# name beta2 was written by a version with that earlier default, and resumes as LEGACY_ADAM_BETA2.
ADAM_BETA1, DEFAULT_ADAM_BETA2, LEGACY_ADAM_BETA2 = 0.9, 0.999, 0.95


@dataclass
class OptimConfig:
    """The optimizer, its schedule and the run's length."""

    epochs: float | None = None          # default 1 when neither epochs nor steps is given
    steps: int | None = None
    lr: float = 6e-4
    warmup_ratio: float = 0.04
    min_lr_ratio: float = 0.0
    weight_decay: float = 0.0
    adam_beta2: float | None = None      # AdamW's second-moment decay; None: DEFAULT_ADAM_BETA2 (recorded as such)
    grad_clip: float = 1.0
    grad_accum: int = 1
    ema: float | None = None

    def __post_init__(self) -> None:
        if self.epochs is not None and self.steps is not None:
            raise ValueError("give --epochs or --steps, not both")
        if self.epochs is None and self.steps is None:
            self.epochs = 1.0
        if self.epochs is not None and self.epochs <= 0:
            raise ValueError("--epochs must be > 0")
        if self.steps is not None and self.steps < 1:
            raise ValueError("--steps must be >= 1")
        if self.grad_accum < 1:
            raise ValueError("--grad-accum must be >= 1")
        if self.ema is not None and not 0 < self.ema < 1:
            raise ValueError("--ema must be in (0, 1), e.g. 0.999")
        if not 0 <= self.warmup_ratio < 1:
            raise ValueError("--warmup-ratio must be in [0, 1)")
        if self.adam_beta2 is not None and not 0 < self.adam_beta2 < 1:
            raise ValueError("--adam-beta2 must be in (0, 1), e.g. 0.95 or 0.999")
        if self.adam_beta2 is None:  # resolved, so that config.json and checkpoints name the value used
            self.adam_beta2 = DEFAULT_ADAM_BETA2

    @property
    def betas(self) -> tuple[float, float]:
        """AdamW's (beta1, beta2)."""
        return ADAM_BETA1, self.adam_beta2


@dataclass
class DataConfig:
    """What the trainer reads: the store, cut into rows, less the held-out share."""

    store: str
    tokens_per_batch: int | None = None  # rows x row length per micro-batch; None: chosen with the anchors
                                         # (train/from_store.py resolve_batch: 4 rows of 3,072 tokens, or more
                                         # rows on a store of short samples)
    max_length: int = 3072               # row length; longer samples are truncated
    eval_fraction: float = 0.02

    def __post_init__(self) -> None:
        for name in ("tokens_per_batch", "max_length"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
        if self.tokens_per_batch is not None and self.tokens_per_batch % self.max_length:
            raise ValueError(f"--tokens-per-batch ({self.tokens_per_batch}) must be a multiple of "
                             f"--max-length ({self.max_length}): a batch is rows of max-length tokens")
        if not 0 <= self.eval_fraction < 1:
            raise ValueError("--eval-fraction must be in [0, 1)")

    @property
    def rows_per_batch(self) -> int:
        if self.tokens_per_batch is None:
            raise ValueError("tokens_per_batch is chosen from the store: resolve the config first (resolve_batch)")
        return self.tokens_per_batch // self.max_length


@dataclass
class RuntimeConfig:
    """Where and how this invocation computes: devices, processes, memory and kernel choices. None of
    these changes the numbers a step computes, so they may differ on --resume."""

    gpus: str = "all"
    device: str = "auto"
    num_procs: int | None = None         # CPU only: DDP processes (tests of the multi-process path)
    num_workers: int = 2
    strict: bool = False
    activation_checkpointing: bool = False  # recompute each drafter layer in backward (memory for compute)
    checkpoint_layers: int | None = None    # recompute the first N layers; None (auto): measured on the GPU (train/memory.py)
    ddp_bucket_mb: float = 100.0            # DDP all-reduce bucket size (PyTorch's default is 25 MB)
    compile: bool = True                    # fused compiled kernels on CUDA (False: eager, same numbers)
    loss_chunk: int = 4096

    def __post_init__(self) -> None:
        check_gpus(self.gpus)
        if self.loss_chunk < 1:
            raise ValueError("--loss-chunk must be >= 1")
        if self.checkpoint_layers is not None and self.checkpoint_layers < 0:
            raise ValueError("--checkpoint-layers must be >= 0")
        if self.ddp_bucket_mb <= 0:
            raise ValueError("--ddp-bucket-mb must be > 0")
        if self.device not in ("auto", "cuda", "cpu"):
            raise ValueError(f"device must be auto, cuda or cpu, got '{self.device}'")


@dataclass
class OutputConfig:
    """What the run writes and when: the run directory, logs, evaluations, checkpoints, trackers."""

    out: str
    log_every: int = 10
    eval_every: int = 0                  # 0: at epoch ends, within trainer.EPOCH_EVAL_SHARE of the run
    eval_max_samples: int = 256
    eval_tree_budget: list[int] = field(default_factory=lambda: [16, 64])  # tau_tree_N of the held-out estimate
    eval_new_tokens: int = 0             # the estimate walks this many tokens of each reply (0: all of it)
    save_every: int = 500
    keep_checkpoints: int = 2
    resume: bool = False
    stop_after: int | None = None        # checkpoint and exit after this many steps of this invocation
    wandb: str | None = None
    tensorboard: bool = False
    quiet: bool = False

    def __post_init__(self) -> None:
        for name in ("log_every", "keep_checkpoints", "eval_max_samples"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
        if self.eval_new_tokens < 0:
            raise ValueError(f"--eval-new-tokens must be >= 0 (0: whole replies), got {self.eval_new_tokens}")
        self.eval_tree_budget = [int(b) for b in self.eval_tree_budget]
        if min(self.eval_tree_budget, default=0) < 0 or len(set(self.eval_tree_budget)) != len(self.eval_tree_budget):
            raise ValueError(f"--eval-tree-budget takes distinct budgets >= 0 (0: the chain; 'none' for no tree "
                             f"estimate), got {self.eval_tree_budget}")


_SECTIONS = {"model": ModelConfig, "loss": LossConfig, "optim": OptimConfig, "data": DataConfig,
             "runtime": RuntimeConfig, "output": OutputConfig}
_OWNER = {f.name: name for name, cls in _SECTIONS.items() for f in dataclasses.fields(cls)}


def _with_legacy_defaults(saved: dict[str, Any]) -> dict[str, Any]:
    """A saved flat config with the options whose default has changed since filled in as they were then:
    adam_beta2, left unnamed (None or absent) before 0.999 became the default, was 0.95."""
    if saved.get("adam_beta2") is None:
        saved = {**saved, "adam_beta2": LEGACY_ADAM_BETA2}
    return saved


@dataclass(init=False)
class TrainConfig:
    """`dflash train`: store -> drafter, as sections owned by the components they configure.

    Built from the command line's flat options (`TrainConfig(store=..., lr=..., ...)`: each name
    belongs to exactly one section) or from sections. `to_dict()` is flat, under the option names, and
    is what config.json and checkpoints hold; `TrainConfig.from_dict` reads it back.

    `seed` and the sections model, loss, optim and data decide the computation: a resumed run must
    match them (`resume_diff`). runtime and output may change between invocations.
    """

    model: ModelConfig
    loss: LossConfig
    optim: OptimConfig
    data: DataConfig
    runtime: RuntimeConfig
    output: OutputConfig
    seed: int = 0                        # weights, shuffling, held-out split, anchors and noise

    COMPUTATION = ("seed", "model", "loss", "optim", "data")

    def __init__(self, *, seed: int = 0, **options: Any) -> None:
        given: dict[str, dict[str, Any]] = {name: {} for name in _SECTIONS}
        for key, value in options.items():
            if key in _SECTIONS:
                continue
            if key not in _OWNER:
                raise TypeError(f"TrainConfig got an unexpected option '{key}'")
            given[_OWNER[key]][key] = value
        for name, cls in _SECTIONS.items():
            section = options.get(name)
            if section is not None and given[name]:
                raise TypeError(f"TrainConfig: give the {name} section or its options, not both")
            setattr(self, name, section if section is not None else cls(**given[name]))
        self.seed = seed
        self.__post_init__()

    def __post_init__(self) -> None:
        if self.loss.gamma is None and self.model.block_size not in GAMMA_BY_BLOCK_SIZE:
            raise ValueError(f"--gamma: no published loss decay for block size {self.model.block_size} "
                             f"({gamma_table_text()}); pass --gamma")

    def to_dict(self) -> dict[str, Any]:
        flat: dict[str, Any] = {}
        for name in _SECTIONS:
            flat.update(_to_dict(getattr(self, name)))
        flat["seed"] = self.seed
        return flat

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "TrainConfig":
        return cls(**_with_legacy_defaults(d))

    def resume_diff(self, saved: dict[str, Any]) -> list[str]:
        """The options, among those that decide the computation, whose value differs from `saved` (a
        checkpoint's flat config), each as one readable clause."""
        now, saved = self.to_dict(), _with_legacy_defaults(saved)
        keys = [k for k in now if k == "seed" or _OWNER[k] in self.COMPUTATION]
        def shown(v):  # None is an option left to its default (e.g. --kl-weight, decided by the store)
            return "the default" if v is None else repr(v)

        return [f"{k}: checkpoint has {shown(saved.get(k))}, this run has {shown(now.get(k))}"
                for k in keys if saved.get(k) != now.get(k)]
