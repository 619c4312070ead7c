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

    @property
    def failed(self) -> bool:
        """What `store verify` exits 1 for: a damaged target, or corrupt segments left in the store."""
        return self.target_problem is not None or bool(self.corrupt and not self.dropped_corrupt)

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
    report.corrupt = _check_segments(reader, committed, threads, progress)
    report.checked = len(committed)
    report.manifest_problem = _manifest_problem(reader, committed)
    report.target_problem = _target_problem(reader)
    if repair:
        _repair(url, report, drop_corrupt)
    return report


def _check_segments(reader: StoreReader, committed: list[int], threads: int,
                    progress: Callable[[int, int], None] | None) -> list[tuple[int, str, str]]:
    """(segment, array, reason) of every corrupt committed segment, sorted."""
    corrupt = []
    done = 0

    def one(seg: int):
        return seg, check_segment(reader, seg)

    with ThreadPoolExecutor(max(1, threads)) as pool:
        for seg, problem in pool.map(one, committed):
            done += 1
            if problem is not None:
                corrupt.append((seg, *problem))
            if progress:
                progress(done, len(committed))
    return sorted(corrupt)


def _manifest_problem(reader: StoreReader, committed: list[int]) -> str | None:
    table = read_manifest(reader.kv)
    if table is None:
        return "manifest.parquet is missing"
    in_manifest = set(np.unique(np.asarray(table.column("segment"))).tolist())
    missing, extra = set(committed) - in_manifest, in_manifest - set(committed)
    if missing or extra:
        return (f"manifest is stale: {len(missing)} committed segments not in it, "
                f"{len(extra)} listed segments not committed")
    return None


def _target_problem(reader: StoreReader) -> str | None:
    if not reader.kv.exists("target/zarr.json"):
        return "the store has no target/ group (frozen embedding and LM head)"
    problem = None
    for name in reader.kv.list_dir("target"):
        if reader.has_target_tensor(name):
            try:
                reader.target_tensor(name)
            except StoreError as e:
                problem = str(e)
    return problem


def _repair(url: str, report: VerifyReport, drop_corrupt: bool) -> None:
    """Remove incomplete segments (and, if asked, corrupt ones); rebuild the manifest if anything changed."""
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


def render_verify(rep: VerifyReport) -> str:
    """The readable report: what was checked, each problem, what was repaired, then OK or FAILED."""
    lines = [f"{rep.store}: checked {rep.checked} committed segments"]
    for seg, array, reason in rep.corrupt:
        lines.append(f"  CORRUPT segment {seg:08d} array '{array}': {reason}")
    if rep.incomplete:
        lines.append(f"  incomplete (uncommitted, invisible to readers): {len(rep.incomplete)} segments: "
                     + ", ".join(f"{s:08d}" for s in rep.incomplete[:20]) + (" ..." if len(rep.incomplete) > 20 else ""))
    if rep.manifest_problem:
        lines.append(f"  {rep.manifest_problem}")
    if rep.target_problem:
        lines.append(f"  target: {rep.target_problem}")
    if rep.removed_incomplete:
        lines.append(f"  removed {len(rep.removed_incomplete)} incomplete segments")
    for seg in rep.dropped_corrupt:
        lines.append(f"  removed corrupt segment {seg:08d} (re-run `dflash extract` to redo it)")
    if rep.manifest_rebuilt:
        lines.append("  manifest rebuilt")
    if rep.corrupt and not rep.dropped_corrupt:
        lines.append("  corrupt segments are kept; `--repair --drop-corrupt` removes them so that extraction redoes them")
    lines.append("OK" if rep.ok else "FAILED")
    return "\n".join(lines)
