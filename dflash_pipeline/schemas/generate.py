"""`dflash generate`: its configuration and the layout of what it writes.

An output folder holds the regenerated conversations as shards that `dflash extract --data OUT`
reads like any other input, plus what resume and provenance need:

    OUT/generate.json                 identity of the run: target, sampling, input fingerprint, shard table
    OUT/plan/shard-<k>.jsonl          the input conversations of shard k, normalised (what the workers read)
    OUT/shard-<k>.jsonl | .parquet    committed output shards (written elsewhere, renamed into place)
    OUT/commits/shard-<k>.json        per-shard counts (responses, tokens, stop reasons), written before the shard
    OUT/runs/generate-<run id>.json   one record per invocation (counts, stop reasons, throughput)

A shard exists only once its data file has its final name, so a killed run leaves every shard either
complete or absent; a re-run with the same settings completes the absent ones. `generate.json` is
written last when a run plans its shards: where it exists, every plan part is there.

Which settings change what is generated (`OUTPUT_KEYS`) is decided here once: a re-run that changes
any of them is refused with the difference named; the others (GPUs, memory budget, progress) may
change between runs.
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dflash_pipeline.schemas.chat_template import parse_chat_template_kwargs

GENERATE_FORMAT = 1
RUN_FILE = "generate.json"
PLAN_DIR = "plan"
COMMITS_DIR = "commits"
RUNS_DIR = "runs"
SHARD_FORMATS = ("jsonl", "parquet")

# Why a reply ended (the run record counts each):
STOP = "stop"          # the target wrote a stop token (end of turn / EOS)
LENGTH = "length"      # --max-new-tokens reached: kept, marked truncated
CONTEXT = "context"    # the sequence reached --max-length: kept, marked truncated
FINISH_REASONS = (STOP, LENGTH, CONTEXT)

# Settings that change the output; a re-run must match them (plus the target and the input data).
OUTPUT_KEYS = ("limit", "max_new_tokens", "max_length", "temperature", "top_p", "top_k", "seed", "turns",
               "chat_template_kwargs", "shard_size", "format", "dtype")


SHARD_FILE = re.compile(r"shard-(\d{5})\.(jsonl|parquet)$")


def shard_name(shard: int, fmt: str) -> str:
    return f"shard-{shard:05d}.{fmt}"


def plan_name(shard: int) -> str:
    return f"{PLAN_DIR}/shard-{shard:05d}.jsonl"


def commit_name(shard: int) -> str:
    return f"{COMMITS_DIR}/shard-{shard:05d}.json"


@dataclass
class GenerateConfig:
    """`dflash generate`: input conversations -> the same conversations with the target's own replies."""

    out: str
    target: str | None = None            # None: the embedded SmolLM2-135M-Instruct
    data: list[str] = field(default_factory=list)   # empty: the embedded ShareGPT conversations (train split)
    limit: int | None = None             # conversations (usable rows) to regenerate
    max_new_tokens: int = 2048           # per reply
    max_length: int | None = None        # prompt + reply tokens per sequence; None: 4096 (or the target's limit)
    temperature: float = 0.0             # 0: greedy
    top_p: float = 1.0
    top_k: int = 0                       # 0: the whole vocabulary
    seed: int = 0
    turns: str = "all"                   # all: replay every assistant turn; first: the first reply only
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    shard_size: int = 256                # conversations per output shard (the unit of work and of resume)
    format: str = "jsonl"                # shard files: jsonl or parquet
    gpus: str = "all"
    batch_tokens: int | None = None      # KV-cache tokens per GPU (sequences x max_length); None: what fits
    dtype: str = "auto"                  # auto: bf16 on GPUs, fp32 on CPUs
    device: str = "auto"
    num_procs: int | None = None         # CPU only: worker processes (tests of the multi-process path)
    compile: bool | None = None          # torch.compile the decode step's layers before capture (fused
                                         # elementwise kernels); None: on CUDA only. Not an output setting:
                                         # a re-run may change it
    quiet: bool = False

    def __post_init__(self) -> None:
        self.chat_template_kwargs = parse_chat_template_kwargs(self.chat_template_kwargs)
        for name in ("max_new_tokens", "shard_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
        if self.limit is not None and self.limit < 1:
            raise ValueError("--limit must be >= 1")
        if self.max_length is not None and self.max_length < 2:
            raise ValueError("--max-length must be >= 2")
        if self.batch_tokens is not None and self.batch_tokens < 1:
            raise ValueError("--batch-tokens must be >= 1")
        if not self.temperature >= 0:
            raise ValueError(f"--temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"--top-p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"--top-k must be >= 0 (0: no limit), got {self.top_k}")
        if self.turns not in ("all", "first"):
            raise ValueError(f"--turns must be 'all' or 'first', got '{self.turns}'")
        if self.format not in SHARD_FORMATS:
            raise ValueError(f"--format must be one of {', '.join(SHARD_FORMATS)}, got '{self.format}'")
        if self.gpus != "all" and not (self.gpus.isdigit() and int(self.gpus) >= 1):
            raise ValueError(f"--gpus must be 'all' or a positive number, got '{self.gpus}'")
        if self.dtype not in ("auto", "bf16", "fp32", "fp16"):
            raise ValueError(f"--dtype must be auto, bf16, fp16 or fp32, got '{self.dtype}'")
        if self.device not in ("auto", "cuda", "cpu"):
            raise ValueError(f"device must be auto, cuda or cpu, got '{self.device}'")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def gpus_per_replica(self) -> int:
        return 1  # the decoding runner keeps a whole target on one GPU

    def to_dict(self) -> dict[str, Any]:
        return json.loads(json.dumps(dataclasses.asdict(self), default=str))

    def output_settings(self) -> dict[str, Any]:
        d = self.to_dict()
        return {k: d[k] for k in OUTPUT_KEYS}


def output_diff(saved: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """'key: OUT has a, this run has b' for every output-changing setting that differs."""
    keys = sorted(set(saved) | set(now))
    return [f"{k}: the output has {saved.get(k)!r}, this run asks for {now.get(k)!r}"
            for k in keys if saved.get(k) != now.get(k)]


# ---------------------------------------------------------------- reading an output folder back


@dataclass
class GeneratedData:
    """A finished `dflash generate` output, as `dflash extract --data` sees it."""

    folder: str
    files: list[str]                     # the shard files, in shard order
    target: dict[str, Any]               # name_or_path, config_hash, tokenizer hash, chat_template_hash
    settings: dict[str, Any]             # OUTPUT_KEYS values
    num_shards: int

    def provenance(self) -> dict[str, Any]:
        """What a store records about data that a target generated."""
        return {"generated_by": dict(self.target), "generation": dict(self.settings), "folder": self.folder}


def read_run_file(folder: Path) -> dict[str, Any] | None:
    path = Path(folder) / RUN_FILE
    if not path.is_file():
        return None
    return json.loads(path.read_text())


def _shard_rows(folder: Path, shard: int) -> int | None:
    """Rows a committed shard holds, from its commit record (None where the record does not say)."""
    path = folder / commit_name(shard)
    return json.loads(path.read_text()).get("rows") if path.is_file() else None


def generated_data(folder: str | Path) -> GeneratedData | None:
    """The finished output of `dflash generate` in `folder`, or None if it is not such a folder.

    ValueError names what is missing when the folder is a generate output whose run has not finished.
    """
    folder = Path(folder)
    run = read_run_file(folder) if folder.is_dir() else None
    if run is None:
        return None
    fmt = run["settings"]["format"]
    shards = [s["shard"] for s in run["shards"]]
    missing = [k for k in shards if not (folder / shard_name(k, fmt)).is_file()]
    if missing:
        raise ValueError(f"{folder}: generation is not finished ({len(missing)} of {len(shards)} shards missing, "
                         f"e.g. {shard_name(missing[0], fmt)}); re-run the same `dflash generate` command to complete it")
    # A shard whose every conversation was dropped (empty replies) holds no row (its commit record says so).
    kept = [str(folder / shard_name(k, fmt)) for k in shards if _shard_rows(folder, k) != 0]
    if shards and not kept:
        raise ValueError(f"{folder}: `dflash generate` kept no conversation in it (every reply was dropped, "
                         f"see its summary in {RUN_FILE} and runs/); nothing to extract")
    return GeneratedData(str(folder), kept, run["target"], run["settings"], len(shards))


def expand_generated_inputs(paths: list[str]) -> tuple[list[str], list[dict[str, Any]]]:
    """Input paths with each `dflash generate` output folder replaced by its shard files, and the
    provenance of every generate output among them (a folder, or shard files given one by one).

    ValueError (one line) for a generate output whose run has not finished.
    """
    files: list[str] = []
    provenance: dict[str, dict[str, Any]] = {}
    for p in paths:
        gen = generated_data(p)
        if gen is not None:
            files.extend(gen.files)
            provenance.setdefault(gen.folder, gen.provenance())
            continue
        files.append(p)
        parent = Path(p).parent
        run = read_run_file(parent) if SHARD_FILE.match(Path(p).name) else None
        if run is not None and str(parent) not in provenance:
            provenance[str(parent)] = GeneratedData(str(parent), [], run["target"], run["settings"],
                                                    len(run["shards"])).provenance()
    return files, list(provenance.values())
