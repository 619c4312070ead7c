"""The feature store's format, version 1, as plain dataclasses and Arrow schemas.

Everything a reader or trainer needs to refuse a mismatch is recorded here (in the root group's
`dflash` attribute), never in file names. The layout the classes describe:

    <store>/zarr.json                 root group; attributes["dflash"] = StoreMeta
    <store>/target/                   frozen target tensors (embed, lm_head, final_norm) + files/
    <store>/segments/<id:08d>/        one group per segment, written by exactly one writer
    <store>/commits/<id:08d>.json     the segment's commit marker, SegmentCommit (create-once, written last)
    <store>/manifest.parquet          one row per sample, rebuilt from the commit markers
    <store>/runs/                     JSON run records of the commands that wrote the store

Commit markers live in their own flat prefix rather than inside the segment so that finding the
committed segments is one listing of small keys, also on an object store, where listing every key of
every segment would cost thousands of requests.

Legend for array shapes: T tokens of a segment, N samples, L captured layers, H hidden size, K top-k.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

FORMAT_VERSION = 1
META_KEY = "dflash"

# Layer k means the output of decoder layer k (0-based), i.e. HF `output_hidden_states[k + 1]`,
# before the final norm. SGLang calls the same thing "capture index k + 1".
LAYER_CONVENTION = "decoder_output_0based"

SEGMENTS_PREFIX = "segments"
COMMITS_PREFIX = "commits"
MANIFEST_KEY = "manifest.parquet"
RUNS_PREFIX = "runs"
TARGET_GROUP = "target"
TARGET_FILES_PREFIX = "target/files"

# Arrays of a segment: name -> (dtype, shape description). `hidden` and `hidden_scale` come from the
# codec; their storage dtype depends on it.
SEGMENT_ARRAYS = ("tokens", "loss_mask", "sample_offsets", "sample_ids", "hidden", "hidden_scale",
                  "topk_ids", "topk_logprobs")


def segment_path(segment: int) -> str:
    return f"{SEGMENTS_PREFIX}/{segment:08d}"


def commit_key(segment: int) -> str:
    return f"{COMMITS_PREFIX}/{segment:08d}.json"


@dataclass(frozen=True)
class TargetInfo:
    """Identity of the target model whose features the store holds."""

    name_or_path: str
    config_hash: str
    num_layers: int
    hidden_size: int
    vocab_size: int
    dtype: str
    architecture: str = ""


@dataclass(frozen=True)
class TokenizerInfo:
    """Identity of the tokenizer: a hash over the vocabulary and the chat template."""

    hash: str
    vocab_size: int
    chat_template_hash: str = ""


@dataclass
class StoreMeta:
    """Root attributes of a store. `compatibility_diff` names what makes two stores incompatible."""

    target: TargetInfo
    tokenizer: TokenizerInfo
    layer_ids: list[int]
    topk: int
    codec: str
    codec_params: dict[str, Any] = field(default_factory=dict)
    extract_config: dict[str, Any] = field(default_factory=dict)
    data_fingerprint: str = ""
    # Inputs written by `dflash generate`: for each, the target that wrote the replies (and whether it is
    # this store's target) and the sampling settings. Empty: the replies are the data's own.
    data_provenance: list[dict[str, Any]] = field(default_factory=list)
    tool_version: str = ""
    layer_convention: str = LAYER_CONVENTION
    format_version: int = FORMAT_VERSION

    def __post_init__(self) -> None:
        if not self.layer_ids:
            raise ValueError("a store needs at least one captured layer")
        if sorted(set(self.layer_ids)) != list(self.layer_ids):
            raise ValueError(f"layer ids must be strictly increasing, got {self.layer_ids}")
        if any(k < 0 or k >= self.target.num_layers for k in self.layer_ids):
            raise ValueError(f"layer ids {self.layer_ids} out of range for {self.target.num_layers} layers")
        if self.topk < 0:
            raise ValueError("topk must be >= 0")

    def to_dict(self) -> dict[str, Any]:
        return json.loads(json.dumps(dataclasses.asdict(self)))

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "StoreMeta":
        d = dict(d)
        d["target"] = TargetInfo(**d["target"])
        d["tokenizer"] = TokenizerInfo(**d["tokenizer"])
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})

    def compatibility_diff(self, other: "StoreMeta") -> list[str]:
        """Human-readable differences that make data of `other` unfit to mix with this store's."""
        out = []
        pairs = [
            ("target", self.target.config_hash, other.target.config_hash),
            ("target path", self.target.name_or_path, other.target.name_or_path),
            ("target dtype", self.target.dtype, other.target.dtype),
            ("tokenizer", self.tokenizer.hash, other.tokenizer.hash),
            ("layer ids", self.layer_ids, other.layer_ids),
            ("layer convention", self.layer_convention, other.layer_convention),
            ("top-k", self.topk, other.topk),
            ("codec", self.codec, other.codec),
            ("codec parameters", self.codec_params, other.codec_params),
            ("input data", self.data_fingerprint, other.data_fingerprint),
        ]
        for name, a, b in pairs:
            if a != b:
                out.append(f"{name}: store has {_short(a)}, asked for {_short(b)}")
        return out


def _short(v: Any) -> str:
    s = json.dumps(v) if not isinstance(v, str) else v
    return s if len(s) <= 80 else s[:77] + "..."


@dataclass(frozen=True)
class ArrayCommit:
    """One array of a committed segment, as its commit marker records it."""

    shape: list[int]
    dtype: str                      # stored dtype (numpy's name; the codec's storage dtype for `hidden`)
    crc32c: list[int]               # of the logical bytes: one value, one per layer for `hidden`
    bytes: int                      # stored size of the array (metadata and chunk files)


@dataclass(frozen=True)
class SegmentCommit:
    """The commit marker `commits/<id>.json`, the store's central record. Its writer writes it last and
    create-once; a segment without one does not exist for any reader. It holds what readers check the
    segment's arrays against (shapes, CRC32C, sizes), the sample index the manifest is rebuilt from,
    and what `store stats` reports without decoding (per-layer feature sums, codec error, top-k mass).

    The JSON keys are the field names in field order, as every store written so far has them; a marker
    with a key missing or unknown is refused (`from_dict` raises ValueError naming the keys).
    """

    format_version: int
    segment: int
    writer: str                     # host:pid:nonce of the process that wrote the segment
    created: str                    # ISO 8601, UTC
    num_samples: int                # N
    num_tokens: int                 # T
    num_supervised: int             # tokens with loss_mask
    sample_ids: list[int]           # [N] rows in the input data
    sample_offsets: list[int]       # [N+1] first token of each sample, then T
    sample_supervised: list[int]    # [N] supervised tokens per sample
    arrays: dict[str, ArrayCommit]  # by array name
    codec: str                      # the hidden-state codec's name
    hidden_stats: dict[str, list[float]]  # per-layer sums of the raw features: count, sum, sumsq, absmax, nonfinite
    codec_error: dict[str, list[float]]   # per-layer sums: err_sq, ref_sq, max_abs (zeros for a lossless codec)
    topk_mass_sum: float            # sum over tokens of the teacher's top-k probability mass

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> bytes:
        """The marker's bytes on storage (compact JSON)."""
        return json.dumps(self.to_dict(), separators=(",", ":")).encode()

    @classmethod
    def from_dict(cls, d: Any) -> "SegmentCommit":
        _check_keys("commit marker", d, cls)
        arrays = d["arrays"]
        if not isinstance(arrays, dict):
            raise ValueError(f"commit marker: 'arrays' is a {type(arrays).__name__}, not an object")
        for name, a in arrays.items():
            _check_keys(f"commit marker, array '{name}'", a, ArrayCommit)
        return cls(**{**d, "arrays": {name: ArrayCommit(**a) for name, a in arrays.items()}})

    @classmethod
    def from_json(cls, raw: bytes) -> "SegmentCommit":
        try:
            d = json.loads(raw)
        except ValueError:  # JSONDecodeError and UnicodeDecodeError
            raise ValueError("unreadable JSON") from None
        return cls.from_dict(d)


def _check_keys(what: str, d: Any, cls) -> None:
    """Refuse a record whose keys are not exactly the fields of `cls`."""
    if not isinstance(d, dict):
        raise ValueError(f"{what} is a JSON {type(d).__name__}, not an object")
    names = [f.name for f in dataclasses.fields(cls)]
    missing, unknown = [k for k in names if k not in d], sorted(k for k in d if k not in names)
    if missing or unknown:
        parts = ([f"missing keys {missing}"] if missing else []) + ([f"unknown keys {unknown}"] if unknown else [])
        raise ValueError(f"{what}: " + ", ".join(parts))


def manifest_schema():
    """Arrow schema of manifest.parquet: one row per sample, in segment order."""
    import pyarrow as pa

    return pa.schema([
        ("segment", pa.int64()),
        ("index", pa.int32()),          # sample's position inside its segment
        ("offset", pa.int64()),         # first token inside the segment
        ("length", pa.int32()),         # tokens
        ("supervised", pa.int32()),     # tokens with loss_mask
        ("sample_id", pa.int64()),      # row in the input data
    ])
