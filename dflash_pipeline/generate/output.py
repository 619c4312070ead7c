"""The output folder of `dflash generate`: plan, shards, commit records, run records (layout in
schemas/generate.py).

Every file is written under a temporary name in the same folder and renamed into place, and a shard's
data file is renamed last, after its counts: a killed run leaves each shard complete or absent, never a
truncated file that a later run (or `dflash extract`) would trust. The folder is a local (or mounted
shared) filesystem path, where a rename is atomic.
"""

from __future__ import annotations

import io
import json
import os
import tempfile
from pathlib import Path
from typing import Any, Iterable

from dflash_pipeline.extract.readers import GENERATED_KEY
from dflash_pipeline.generate.conversations import Conversation, conversation_from_json, conversation_to_json
from dflash_pipeline.schemas.generate import (
    RUN_FILE, RUNS_DIR, SHARD_FILE, commit_name, plan_name, read_run_file, shard_name,
)


def atomic_write(path: Path, data: bytes) -> None:
    """Write `data` to `path` so that `path` is either absent (or its old self) or complete."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _jsonl(rows: Iterable[dict[str, Any]]) -> bytes:
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows).encode()


def _parquet(rows: list[dict[str, Any]]) -> bytes:
    """Rows as Parquet, one explicit schema whatever the rows' forms (an absent form is null)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    turn = lambda a, b: pa.list_(pa.struct([(a, pa.string()), (b, pa.string())]))  # noqa: E731
    schema = pa.schema([
        ("conversations", turn("from", "value")),
        ("messages", turn("role", "content")),
        ("id", pa.string()),  # ids of any JSON type, as text: one column type for every row
        (GENERATED_KEY, pa.struct([("sample_id", pa.int64()), ("source", pa.string()),
                              ("replies", pa.list_(pa.struct([("tokens", pa.int64()), ("finish", pa.string())])))])),
    ])
    columns = {name: [r.get(name) for r in rows] for name in schema.names}
    columns["id"] = [None if v is None else (v if isinstance(v, str) else json.dumps(v)) for v in columns["id"]]
    buf = io.BytesIO()
    pq.write_table(pa.table(columns, schema=schema), buf, compression="zstd")
    return buf.getvalue()


class OutputFolder:
    """OUT of one `dflash generate` run; safe for one writer per shard at a time, any number of processes."""

    def __init__(self, path: str | Path):
        self.path = Path(path)

    # -- plan ------------------------------------------------------------------------------------

    def run_file(self) -> dict[str, Any] | None:
        return read_run_file(self.path)

    def write_plan(self, shards: list[list[Conversation]], run: dict[str, Any]) -> None:
        """Every shard's input conversations, then the run file (last: it says the plan is complete)."""
        for k, convs in enumerate(shards):
            atomic_write(self.path / plan_name(k), _jsonl(conversation_to_json(c) for c in convs))
        atomic_write(self.path / RUN_FILE, json.dumps(run, indent=1).encode())

    def remove_leftovers(self) -> None:
        """Temporary files of writes a killed run left unfinished (call before any worker starts)."""
        if self.path.is_dir():
            for p in self.path.rglob(".*.tmp"):
                p.unlink(missing_ok=True)

    def read_plan(self, shard: int) -> list[Conversation]:
        with open(self.path / plan_name(shard), encoding="utf-8") as f:
            return [conversation_from_json(json.loads(line)) for line in f if line.strip()]

    # -- shards ----------------------------------------------------------------------------------

    def committed(self, fmt: str) -> set[int]:
        """Shards whose data file has its final name."""
        if not self.path.is_dir():
            return set()
        out = set()
        for p in self.path.iterdir():
            m = SHARD_FILE.match(p.name)
            if m and m.group(2) == fmt:
                out.add(int(m.group(1)))
        return out

    def commit_shard(self, shard: int, rows: list[dict[str, Any]], counts: dict[str, Any], fmt: str) -> None:
        """The shard's counts, then its rows under their final name (the commit)."""
        atomic_write(self.path / commit_name(shard), json.dumps(counts).encode())
        atomic_write(self.path / shard_name(shard, fmt), _jsonl(rows) if fmt == "jsonl" else _parquet(rows))

    def shard_counts(self, shards: Iterable[int]) -> list[dict[str, Any]]:
        return [json.loads((self.path / commit_name(k)).read_text()) for k in shards]

    def write_run_record(self, run_id: str, record: dict[str, Any]) -> Path:
        path = self.path / RUNS_DIR / f"generate-{run_id}.json"
        atomic_write(path, json.dumps(record, indent=1, default=float).encode())
        return path
