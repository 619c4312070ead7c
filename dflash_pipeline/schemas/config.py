"""Run configurations, validated on construction and dumped to JSON with every run."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

CODEC_NAMES = ("bf16", "fp8")


def _to_dict(obj) -> dict[str, Any]:
    return json.loads(json.dumps(dataclasses.asdict(obj), default=str))


@dataclass
class ExtractConfig:
    """`dflash extract`: target + data -> feature store."""

    out: str
    target: str | None = None            # None: the embedded SmolLM2-135M-Instruct
    data: list[str] = field(default_factory=list)   # empty: the embedded ShareGPT conversations
    max_length: int = 2048
    limit: int | None = None
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
    inflight_segments: int = 2
    quiet: bool = False

    def __post_init__(self) -> None:
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
        if self.gpus != "all" and not (self.gpus.isdigit() and int(self.gpus) >= 1):
            raise ValueError(f"--gpus must be 'all' or a positive number, got '{self.gpus}'")
        if self.layers is not None and (not self.layers or sorted(set(self.layers)) != list(self.layers)):
            raise ValueError(f"--layers must be strictly increasing layer ids, got {self.layers}")
        if self.device not in ("auto", "cuda", "cpu"):
            raise ValueError(f"device must be auto, cuda or cpu, got '{self.device}'")

    def to_dict(self) -> dict[str, Any]:
        return _to_dict(self)
