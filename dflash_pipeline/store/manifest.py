"""manifest.parquet: one row per sample, rebuilt from the commit markers.

Readers open the manifest (one object) instead of listing or opening segments, so a store of
100,000 segments opens in constant time. The manifest is derived data: `rebuild_manifest` recreates
it from `commits/` at the end of every extraction and on `store verify --repair`.
"""

from __future__ import annotations

import io
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from dflash_pipeline.schemas.store import COMMITS_PREFIX, MANIFEST_KEY, SegmentCommit, commit_key, manifest_schema
from dflash_pipeline.store.backends import KV


def committed_segments(kv: KV) -> list[int]:
    """Segment ids that have a commit marker (one listing of `commits/`)."""
    out = []
    for name in kv.list_dir(COMMITS_PREFIX):
        stem = name.removesuffix(".json")
        if name.endswith(".json") and stem.isdigit():
            out.append(int(stem))
    return sorted(out)


def read_commits(kv: KV, segments: list[int], threads: int = 16) -> dict[int, SegmentCommit | None]:
    """Commit markers by segment id; None where a marker is unreadable or malformed (a damaged store)."""

    def load(seg: int):
        raw = kv.get(commit_key(seg))
        try:
            return seg, SegmentCommit.from_json(raw) if raw is not None else None
        except ValueError:
            return seg, None

    with ThreadPoolExecutor(max(1, min(threads, len(segments)))) as pool:
        return dict(pool.map(load, segments))


def manifest_from_commits(commits: dict[int, SegmentCommit]):
    import pyarrow as pa

    cols: dict[str, list[np.ndarray]] = {k: [] for k in manifest_schema().names}
    for seg in sorted(commits):
        c = commits[seg]
        offsets = np.asarray(c.sample_offsets, dtype=np.int64)
        n = len(offsets) - 1
        cols["segment"].append(np.full(n, seg, dtype=np.int64))
        cols["index"].append(np.arange(n, dtype=np.int32))
        cols["offset"].append(offsets[:-1])
        cols["length"].append(np.diff(offsets).astype(np.int32))
        cols["supervised"].append(np.asarray(c.sample_supervised, dtype=np.int32))
        cols["sample_id"].append(np.asarray(c.sample_ids, dtype=np.int64))
    schema = manifest_schema()
    arrays = [pa.array(np.concatenate(cols[f.name]) if cols[f.name] else np.array([], dtype=f.type.to_pandas_dtype()),
                       type=f.type) for f in schema]
    return pa.Table.from_arrays(arrays, schema=schema)


def write_manifest(kv: KV, table) -> None:
    import pyarrow.parquet as pq

    buf = io.BytesIO()
    pq.write_table(table, buf, compression="zstd")
    kv.put(MANIFEST_KEY, buf.getvalue())


def rebuild_manifest(kv: KV, commits: dict[int, SegmentCommit | None] | None = None):
    """Recreate manifest.parquet from every readable commit marker; returns the table."""
    if commits is None:
        commits = read_commits(kv, committed_segments(kv))
    table = manifest_from_commits({s: c for s, c in commits.items() if c is not None})
    write_manifest(kv, table)
    return table


def rebuild_manifest_at(url: str):
    """Rebuild the manifest of the store at `url` (opened for writing)."""
    from dflash_pipeline.store.backends import open_zarr_store

    return rebuild_manifest(KV(open_zarr_store(url, read_only=False)))


def read_manifest(kv: KV):
    """The manifest table, or None if the store has none yet."""
    import pyarrow.parquet as pq

    raw = kv.get(MANIFEST_KEY)
    if raw is None:
        return None
    return pq.read_table(io.BytesIO(raw))
