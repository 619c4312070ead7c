"""The extraction plan: a deterministic list of segments, each ~N tokens of tokenized samples.

The coordinator tokenizes the input once and writes the plan into the store (`plan/`), so that
- every GPU process reads only the plan parts of its own segments (no re-tokenizing per rank),
- a restart (with any number of processes) redoes exactly the segments that have no commit marker,
- the plan's fingerprint (input files' bytes, tokenizer, options) lets a resumed run refuse other data.

Layout: plan/plan.json (fingerprint, segment table, data report) and plan/part-<k>.parquet, each
holding PART_SEGMENTS consecutive segments, one row group per segment.
"""

from __future__ import annotations

import hashlib
import io
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

import numpy as np

from dflash_pipeline.errors import StoreError
from dflash_pipeline.store.backends import KV

PLAN_KEY = "plan/plan.json"
PART_SEGMENTS = 64
PLAN_FORMAT = 1


def part_key(part: int) -> str:
    return f"plan/part-{part:06d}.parquet"


def fingerprint_inputs(paths: Iterable[Path], options: dict[str, Any]) -> str:
    """sha256 over the input files' bytes and every option that changes the samples or segments."""
    h = hashlib.sha256(json.dumps({"plan_format": PLAN_FORMAT, **options}, sort_keys=True).encode())
    for p in paths:
        h.update(str(Path(p).name).encode())
        with open(p, "rb") as f:
            while chunk := f.read(8 << 20):
                h.update(chunk)
    return h.hexdigest()


@dataclass
class SegmentPlan:
    segment: int
    sample_ids: list[int]
    input_ids: list[np.ndarray]     # int32 per sample
    loss_masks: list[np.ndarray]    # bool per sample

    @property
    def num_tokens(self) -> int:
        return sum(len(x) for x in self.input_ids)


@dataclass
class Plan:
    fingerprint: str
    segments: list[dict[str, int]]                  # {segment, samples, tokens, supervised}
    data_report: dict[str, Any] = field(default_factory=dict)
    options: dict[str, Any] = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return sum(s["tokens"] for s in self.segments)

    @property
    def num_samples(self) -> int:
        return sum(s["samples"] for s in self.segments)

    def to_json(self) -> bytes:
        return json.dumps({"format": PLAN_FORMAT, "fingerprint": self.fingerprint, "segments": self.segments,
                           "data_report": self.data_report, "options": self.options, "part_segments": PART_SEGMENTS}
                          ).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> "Plan":
        d = json.loads(raw)
        return cls(d["fingerprint"], d["segments"], d.get("data_report", {}), d.get("options", {}))


def split_segments(lengths: list[int], segment_tokens: int) -> list[tuple[int, int]]:
    """Greedy, in sample order: [start, end) sample ranges of about `segment_tokens` tokens each."""
    out, start, acc = [], 0, 0
    for i, n in enumerate(lengths):
        if acc and acc + n > segment_tokens:
            out.append((start, i))
            start, acc = i, 0
        acc += n
    if start < len(lengths):
        out.append((start, len(lengths)))
    return out


def write_plan(kv: KV, samples: list, segment_tokens: int, fingerprint: str, data_report: dict[str, Any],
               options: dict[str, Any]) -> Plan:
    """Split tokenized samples into segments and store the plan. `samples` have sample_id,
    input_ids, loss_mask."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    ranges = split_segments([len(s.input_ids) for s in samples], segment_tokens)
    table_rows = []
    for seg, (a, b) in enumerate(ranges):
        chunk = samples[a:b]
        table_rows.append({"segment": seg, "samples": b - a, "tokens": int(sum(len(s.input_ids) for s in chunk)),
                           "supervised": int(sum(int(np.sum(s.loss_mask)) for s in chunk))})
    schema = pa.schema([("segment", pa.int64()), ("sample_id", pa.int64()),
                        ("input_ids", pa.list_(pa.int32())), ("loss_mask", pa.list_(pa.bool_()))])
    for part_start in range(0, len(ranges), PART_SEGMENTS):
        buf = io.BytesIO()
        with pq.ParquetWriter(buf, schema, compression="zstd") as w:
            for seg in range(part_start, min(part_start + PART_SEGMENTS, len(ranges))):
                a, b = ranges[seg]
                chunk = samples[a:b]
                w.write_table(pa.table({
                    "segment": pa.array([seg] * len(chunk), pa.int64()),
                    "sample_id": pa.array([s.sample_id for s in chunk], pa.int64()),
                    "input_ids": pa.array([np.asarray(s.input_ids, np.int32) for s in chunk], pa.list_(pa.int32())),
                    "loss_mask": pa.array([np.asarray(s.loss_mask, bool) for s in chunk], pa.list_(pa.bool_())),
                }, schema=schema))
        kv.put(part_key(part_start // PART_SEGMENTS), buf.getvalue())
    plan = Plan(fingerprint, table_rows, data_report, options)
    kv.put(PLAN_KEY, plan.to_json())   # last: a plan.json means every part is there
    return plan


def read_plan(kv: KV) -> Plan | None:
    raw = kv.get(PLAN_KEY)
    return None if raw is None else Plan.from_json(raw)


class PlanReader:
    """Reads the segments' samples from the plan parts, one part object at a time (cached)."""

    def __init__(self, kv: KV):
        self.kv = kv
        self._part: tuple[int, Any] | None = None

    def segment(self, segment: int) -> SegmentPlan:
        import pyarrow.parquet as pq

        part = segment // PART_SEGMENTS
        if self._part is None or self._part[0] != part:
            raw = self.kv.get(part_key(part))
            if raw is None:
                raise StoreError(f"plan part {part} is missing; delete plan/ and run extraction again")
            self._part = (part, pq.ParquetFile(io.BytesIO(raw)))
        t = self._part[1].read_row_group(segment % PART_SEGMENTS)
        seg_col = t.column("segment").to_numpy()
        assert np.all(seg_col == segment), "plan part does not match its index"
        return SegmentPlan(segment, t.column("sample_id").to_pylist(), _lists(t.column("input_ids"), np.int32),
                           _lists(t.column("loss_mask"), bool))


def _lists(column, dtype) -> list[np.ndarray]:
    arr = column.combine_chunks()
    offsets = arr.offsets.to_numpy()
    values = arr.values.to_numpy(zero_copy_only=False).astype(dtype, copy=False)
    return [values[offsets[i]:offsets[i + 1]] for i in range(len(offsets) - 1)]
