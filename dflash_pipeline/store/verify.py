"""`dflash store verify`: check every committed segment against its commit marker.

A segment is corrupt when its marker is unreadable, an array is missing or has another shape, a chunk
file is missing or truncated, or the CRC32C of what decodes differs from the committed one. Incomplete
segments (no marker: a crashed writer) are listed; they are invisible to readers and harmless.
`repair` removes incomplete segments and rebuilds the manifest. It never removes a committed segment
unless asked with `drop_corrupt`, and then it names each one (a later `dflash extract` redoes them).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from dflash_pipeline.errors import CorruptSegmentError, StoreError
from dflash_pipeline.schemas.store import commit_key, segment_path
from dflash_pipeline.store.backends import KV, open_zarr_store
from dflash_pipeline.store.manifest import committed_segments, read_manifest, rebuild_manifest
from dflash_pipeline.store.reader import StoreReader
from dflash_pipeline.store.stats import incomplete_segments


@dataclass
class VerifyReport:
    store: str
    checked: int = 0
    corrupt: list[tuple[int, str, str]] = field(default_factory=list)   # (segment, array, reason)
    incomplete: list[int] = field(default_factory=list)
    manifest_problem: str | None = None
    target_problem: str | None = None
    removed_incomplete: list[int] = field(default_factory=list)
    dropped_corrupt: list[int] = field(default_factory=list)
    manifest_rebuilt: bool = False

    @property
    def ok(self) -> bool:
        return not self.corrupt and self.target_problem is None

    def to_dict(self) -> dict:
        return {
            "store": self.store, "ok": self.ok, "checked": self.checked,
            "corrupt": [{"segment": s, "array": a, "reason": r} for s, a, r in self.corrupt],
            "incomplete": self.incomplete, "manifest_problem": self.manifest_problem,
            "target_problem": self.target_problem, "removed_incomplete": self.removed_incomplete,
            "dropped_corrupt": self.dropped_corrupt, "manifest_rebuilt": self.manifest_rebuilt,
        }


def check_segment(reader: StoreReader, segment: int) -> tuple[str, str] | None:
    """None if the segment is intact, else (array, reason)."""
    try:
        arrs = reader._segment_arrays(segment)
        c = reader.commit(segment)
        for name, spec in c.arrays.items():
            if str(arrs[name].dtype) != spec.dtype:
                return name, f"dtype {arrs[name].dtype} != committed {spec.dtype}"
            reader._check_chunks_exist(segment, name, arrs[name])
        reader.read_segment(segment, verify=True)
    except CorruptSegmentError as e:
        return e.array, e.reason
    return None


def verify_store(url: str, *, repair: bool = False, drop_corrupt: bool = False, threads: int = 8,
                 progress: Callable[[int, int], None] | None = None) -> VerifyReport:
    reader = StoreReader(url)
    report = VerifyReport(store=url)
    committed = committed_segments(reader.kv)
    report.incomplete = incomplete_segments(reader, set(committed))

    done = 0

    def one(seg: int):
        return seg, check_segment(reader, seg)

    with ThreadPoolExecutor(max(1, threads)) as pool:
        for seg, problem in pool.map(one, committed):
            done += 1
            if problem is not None:
                report.corrupt.append((seg, *problem))
            if progress:
                progress(done, len(committed))
    report.checked = len(committed)
    report.corrupt.sort()

    table = read_manifest(reader.kv)
    if table is None:
        report.manifest_problem = "manifest.parquet is missing"
    else:
        in_manifest = set(np.unique(np.asarray(table.column("segment"))).tolist())
        missing, extra = set(committed) - in_manifest, in_manifest - set(committed)
        if missing or extra:
            report.manifest_problem = (f"manifest is stale: {len(missing)} committed segments not in it, "
                                       f"{len(extra)} listed segments not committed")

    if not reader.kv.exists("target/zarr.json"):
        report.target_problem = "the store has no target/ group (frozen embedding and LM head)"
    else:
        for name in reader.kv.list_dir("target"):
            if reader.has_target_tensor(name):
                try:
                    reader.target_tensor(name)
                except StoreError as e:
                    report.target_problem = str(e)

    if repair:
        kv = KV(open_zarr_store(url, read_only=False))
        for seg in report.incomplete:
            kv.delete_prefix(segment_path(seg))
            report.removed_incomplete.append(seg)
        if drop_corrupt:
            for seg in sorted({s for s, _, _ in report.corrupt}):
                kv.delete(commit_key(seg))  # uncommit first: a crash here leaves it incomplete
                kv.delete_prefix(segment_path(seg))
                report.dropped_corrupt.append(seg)
        if report.manifest_problem or report.removed_incomplete or report.dropped_corrupt:
            rebuild_manifest(kv)
            report.manifest_rebuilt = True
    return report
