"""Reading a store: lazy open, one sample without its whole segment, whole segments with verification.

Opening reads two objects (the root metadata and manifest.parquet), whatever the number of segments.
Segment arrays are opened on first use and cached. The reader is safe to share between threads
(zarr's synchronous API runs on one event-loop thread; the caches take a lock) and to pass to worker
processes: it pickles as its URL and reopens there.

Legend: T tokens, L captured layers (or the chosen subset), H hidden size, K top-k.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator

import numpy as np
import torch

from dflash_pipeline.errors import CorruptSegmentError, StoreError
from dflash_pipeline.schemas.store import (
    FORMAT_VERSION, META_KEY, TARGET_FILES_PREFIX, TARGET_GROUP, SegmentCommit, StoreMeta, commit_key,
    segment_path,
)
from dflash_pipeline.store.backends import KV, open_zarr_store
from dflash_pipeline.store.codecs import get_codec
from dflash_pipeline.store.shards import ShardError, our_shard_layout, read_layer_shards
from dflash_pipeline.store.writer import crc32c
from dflash_pipeline.store.manifest import (
    committed_segments, manifest_from_commits, read_commits, read_manifest,
)


@dataclass
class SampleData:
    sample_id: int
    segment: int
    tokens_T: np.ndarray          # int32
    loss_mask_T: np.ndarray       # bool
    hidden_TLH: torch.Tensor      # decoded, bf16 unless asked otherwise
    topk_ids_TK: np.ndarray       # int32
    topk_logprobs_TK: np.ndarray  # float16


@dataclass
class SegmentData:
    segment: int
    tokens_T: np.ndarray
    loss_mask_T: np.ndarray
    sample_offsets: np.ndarray    # int64 [N+1]
    sample_ids: np.ndarray        # int64 [N]
    hidden_TLH: torch.Tensor
    topk_ids_TK: np.ndarray
    topk_logprobs_TK: np.ndarray

    def sample(self, i: int) -> SampleData:
        a, b = int(self.sample_offsets[i]), int(self.sample_offsets[i + 1])
        return SampleData(int(self.sample_ids[i]), self.segment, self.tokens_T[a:b], self.loss_mask_T[a:b],
                          self.hidden_TLH[a:b], self.topk_ids_TK[a:b], self.topk_logprobs_TK[a:b])

    @property
    def num_samples(self) -> int:
        return len(self.sample_ids)


def expected_chunk_keys(prefix: str, meta: dict[str, Any]) -> list[str]:
    """Keys of the stored chunks (or shards) of a zarr v3 array, from its metadata document."""
    shape = meta["shape"]
    if any(s == 0 for s in shape):
        return []
    grid = meta["chunk_grid"]["configuration"]["chunk_shape"]
    counts = [-(-s // g) for s, g in zip(shape, grid)]
    keys = [""]
    for n in counts:
        keys = [f"{k}/{i}" for k in keys for i in range(n)]
    return [f"{prefix}/c{k}" for k in keys]


class StoreReader:
    def __init__(self, url: str, *, cache_segments: int = 32):
        self.url = url
        self._cache_size = cache_segments
        self.zstore = open_zarr_store(url, read_only=True)
        self.kv = KV(self.zstore)
        raw = self.kv.get("zarr.json")
        if raw is None:
            raise StoreError(f"{url}: not a dflash store (no zarr.json at its root)")
        try:
            attrs = json.loads(raw).get("attributes", {})
        except ValueError:
            raise StoreError(f"{url}: not a dflash store (unreadable zarr.json)") from None
        if META_KEY not in attrs:
            raise StoreError(f"{url}: a zarr hierarchy but not a dflash store (no '{META_KEY}' attribute)")
        version = attrs[META_KEY].get("format_version")
        if not isinstance(version, int) or version > FORMAT_VERSION:
            raise StoreError(f"{url}: store format {version} is newer than this tool reads ({FORMAT_VERSION}); "
                             "upgrade dflash-pipeline")
        self.meta = StoreMeta.from_dict(attrs[META_KEY])
        self.codec = get_codec(self.meta.codec)
        self._lock = threading.Lock()
        self._manifest = None
        self._commits: dict[int, SegmentCommit] = {}
        self._arrays: OrderedDict[int, dict[str, Any]] = OrderedDict()
        self.manifest_was_missing = False

    # Pickle as the URL: worker processes reopen the store themselves.
    def __getstate__(self):
        return {"url": self.url, "cache_segments": self._cache_size}

    def __setstate__(self, state):
        self.__init__(state["url"], cache_segments=state["cache_segments"])

    # -- index --------------------------------------------------------------------------------------

    @property
    def manifest(self):
        """The sample table (pyarrow). Built from the commit markers if the file is missing."""
        with self._lock:
            if self._manifest is None:
                table = read_manifest(self.kv)
                if table is None:
                    self.manifest_was_missing = True
                    commits = read_commits(self.kv, committed_segments(self.kv))
                    table = manifest_from_commits({s: c for s, c in commits.items() if c is not None})
                self._manifest = table
            return self._manifest

    @property
    def num_samples(self) -> int:
        return self.manifest.num_rows

    @property
    def num_tokens(self) -> int:
        return int(np.asarray(self.manifest.column("length")).sum()) if self.num_samples else 0

    def segment_ids(self) -> np.ndarray:
        return np.unique(np.asarray(self.manifest.column("segment")))

    def column(self, name: str) -> np.ndarray:
        return np.asarray(self.manifest.column(name))

    def commit(self, segment: int) -> SegmentCommit:
        """The segment's commit marker (CorruptSegmentError if it is unreadable or malformed)."""
        with self._lock:
            if segment in self._commits:
                return self._commits[segment]
        raw = self.kv.get(commit_key(segment))
        if raw is None:
            raise StoreError(f"{self.url}: segment {segment:08d} is not committed")
        try:
            c = SegmentCommit.from_json(raw)
        except ValueError as e:
            raise CorruptSegmentError(self.url, segment, "commit marker", str(e)) from None
        with self._lock:
            self._commits[segment] = c
        return c

    # -- arrays -------------------------------------------------------------------------------------

    def _layer_index(self, layers: Iterable[int] | None) -> list[int] | None:
        if layers is None:
            return None
        idx = []
        for k in layers:
            if k not in self.meta.layer_ids:
                raise StoreError(f"{self.url}: layer {k} is not in the store (it has {self.meta.layer_ids})")
            idx.append(self.meta.layer_ids.index(k))
        return idx

    def _segment_arrays(self, segment: int) -> dict[str, Any]:
        import zarr

        with self._lock:
            if segment in self._arrays:
                self._arrays.move_to_end(segment)
                return self._arrays[segment]
        c = self.commit(segment)
        out = {}
        for name in c.arrays:
            try:
                out[name] = zarr.open_array(self.zstore, path=f"{segment_path(segment)}/{name}", mode="r")
            except Exception as e:  # missing or unreadable array metadata
                raise CorruptSegmentError(self.url, segment, name, f"cannot open array ({e})") from None
            if list(out[name].shape) != c.arrays[name].shape:
                raise CorruptSegmentError(self.url, segment, name,
                                          f"shape {list(out[name].shape)} != committed {c.arrays[name].shape}")
        with self._lock:
            self._arrays[segment] = out
            while len(self._arrays) > self._cache_size:
                self._arrays.popitem(last=False)
        return out

    def _read(self, segment: int, name: str, arr, selection=None) -> np.ndarray:
        try:
            return arr[...] if selection is None else arr.get_orthogonal_selection(selection)
        except Exception as e:  # a truncated or altered chunk fails its CRC32C or its decompression
            raise CorruptSegmentError(self.url, segment, name, f"unreadable chunk ({type(e).__name__}: {e})") from None

    def _check_chunks_exist(self, segment: int, name: str, arr, layer_idx: list[int] | None = None) -> None:
        """zarr reads a missing chunk as fill values; a committed segment must have all of them."""
        meta = arr.metadata.to_dict()
        keys = expected_chunk_keys(f"{segment_path(segment)}/{name}", meta)
        if name == "hidden" and layer_idx is not None:
            keys = [k for k in keys if int(k.split("/")[-2]) in layer_idx]
        for k in keys:
            if not self.kv.exists(k):
                raise CorruptSegmentError(self.url, segment, name, f"missing chunk file {k.split(name + '/', 1)[1]}")

    def read_sample(self, row: int, layers: Iterable[int] | None = None,
                    dtype: torch.dtype = torch.bfloat16) -> SampleData:
        """One sample by manifest row, reading only the chunks that hold it."""
        m = self.manifest
        if not 0 <= row < m.num_rows:
            raise IndexError(f"sample row {row} out of range (store has {m.num_rows})")
        seg = int(m.column("segment")[row].as_py())
        a = int(m.column("offset")[row].as_py())
        b = a + int(m.column("length")[row].as_py())
        sid = int(m.column("sample_id")[row].as_py())
        arrs = self._segment_arrays(seg)
        idx = self._layer_index(layers)
        lay = slice(None) if idx is None else idx
        for name in arrs:
            self._check_chunks_exist(seg, name, arrs[name], idx)
        data = self._read(seg, "hidden", arrs["hidden"], (slice(a, b), lay, slice(None)))
        scale = None
        if "hidden_scale" in arrs:
            scale = self._read(seg, "hidden_scale", arrs["hidden_scale"], (slice(a, b), lay))
        return SampleData(
            sample_id=sid, segment=seg,
            tokens_T=self._read(seg, "tokens", arrs["tokens"], (slice(a, b),)),
            loss_mask_T=self._read(seg, "loss_mask", arrs["loss_mask"], (slice(a, b),)),
            hidden_TLH=self.codec.decode(data, scale, dtype),
            topk_ids_TK=self._read(seg, "topk_ids", arrs["topk_ids"], (slice(a, b), slice(None))),
            topk_logprobs_TK=self._read(seg, "topk_logprobs", arrs["topk_logprobs"], (slice(a, b), slice(None))),
        )

    def find_sample(self, sample_id: int) -> int:
        """Manifest row of an input-data row id."""
        rows = np.nonzero(self.column("sample_id") == sample_id)[0]
        if len(rows) == 0:
            raise KeyError(f"sample id {sample_id} is not in {self.url}")
        return int(rows[0])

    def read_arrays(self, segment: int, names: Iterable[str]) -> dict[str, np.ndarray]:
        """Some of a segment's small arrays whole (not `hidden`), each checked against its commit marker's CRC32C."""
        c = self.commit(segment)
        arrs = self._segment_arrays(segment)
        out = {}
        for name in names:
            if name in ("hidden", "hidden_scale") or name not in arrs:
                raise ValueError(f"read_arrays reads the small per-segment arrays, not {name!r}")
            self._check_chunks_exist(segment, name, arrs[name])
            out[name] = self._read(segment, name, arrs[name])
        self._verify_raw(segment, c, out, None)
        return out

    def read_segment(self, segment: int, layers: Iterable[int] | None = None, *, verify: bool = True,
                     dtype: torch.dtype = torch.bfloat16) -> SegmentData:
        """A whole segment, checked against its commit marker's CRC32C (for the layers read)."""
        c = self.commit(segment)
        arrs = self._segment_arrays(segment)
        idx = self._layer_index(layers)
        raw: dict[str, np.ndarray] = {}
        layer_crcs = None
        for name, arr in arrs.items():
            if name == "hidden" and (C := our_shard_layout(arr.metadata.to_dict())) is not None:
                layer_idx = idx if idx is not None else list(range(arr.shape[1]))
                try:
                    raw[name], layer_crcs = read_layer_shards(self.kv, f"{segment_path(segment)}/hidden",
                                                              tuple(arr.shape), arr.dtype, C, layer_idx)
                except ShardError as e:
                    raise CorruptSegmentError(self.url, segment, name, str(e)) from None
            elif name == "hidden" and idx is not None and idx != list(range(len(self.meta.layer_ids))):
                raw[name] = self._read(segment, name, arr, (slice(None), idx, slice(None)))
            elif name == "hidden_scale" and idx is not None:
                raw[name] = self._read(segment, name, arr, (slice(None), idx))
            else:
                raw[name] = self._read(segment, name, arr)
        if verify:
            self._verify_raw(segment, c, raw, idx, layer_crcs)
        return SegmentData(
            segment=segment,
            tokens_T=raw["tokens"], loss_mask_T=raw["loss_mask"],
            sample_offsets=raw["sample_offsets"], sample_ids=raw["sample_ids"],
            hidden_TLH=self.codec.decode(raw["hidden"], raw.get("hidden_scale"), dtype),
            topk_ids_TK=raw["topk_ids"], topk_logprobs_TK=raw["topk_logprobs"],
        )

    def _verify_raw(self, segment: int, c: SegmentCommit, raw: dict[str, np.ndarray],
                    idx: list[int] | None, layer_crcs: list[int] | None = None) -> None:
        for name, arr in raw.items():
            want = c.arrays[name].crc32c
            if name == "hidden":
                layer_idx = idx if idx is not None else list(range(arr.shape[1]))
                for j, l in enumerate(layer_idx):
                    got = layer_crcs[j] if layer_crcs is not None else crc32c(arr[:, j])
                    if got != want[l]:
                        raise CorruptSegmentError(self.url, segment, name,
                                                  f"checksum mismatch in layer {self.meta.layer_ids[l]} "
                                                  "(missing or altered chunk)")
            elif name == "hidden_scale" and idx is not None and idx != list(range(len(self.meta.layer_ids))):
                continue  # its CRC covers all layers; inner-chunk CRC32C still checked what was read
            elif crc32c(arr) != want[0]:
                raise CorruptSegmentError(self.url, segment, name, "checksum mismatch (missing or altered chunk)")

    def iter_segments(self, order: Iterable[int] | None = None, layers: Iterable[int] | None = None,
                      verify: bool = True) -> Iterator[SegmentData]:
        for seg in (self.segment_ids() if order is None else order):
            yield self.read_segment(int(seg), layers, verify=verify)

    # -- target ---------------------------------------------------------------------------------------

    def target_config(self) -> dict[str, Any]:
        raw = self.kv.get(f"{TARGET_GROUP}/zarr.json")
        if raw is None:
            raise StoreError(f"{self.url}: the store has no target/ group (was extraction started?)")
        return json.loads(raw)["attributes"]["config"]

    def target_tensor(self, name: str) -> torch.Tensor:
        import zarr

        try:
            arr = zarr.open_array(self.zstore, path=f"{TARGET_GROUP}/{name}", mode="r")
        except Exception:
            raise StoreError(f"{self.url}: target tensor '{name}' is missing") from None
        data = arr[...]
        if crc32c(data) != arr.attrs.get("crc32c"):
            raise StoreError(f"{self.url}: target tensor '{name}' fails its checksum")
        t = torch.from_numpy(np.ascontiguousarray(data))
        if arr.attrs.get("logical_dtype") == "bfloat16":
            t = t.view(torch.int16).view(torch.bfloat16) if t.dtype != torch.int16 else t.view(torch.bfloat16)
        return t

    def has_target_tensor(self, name: str) -> bool:
        return self.kv.exists(f"{TARGET_GROUP}/{name}/zarr.json")

    def target_files(self) -> dict[str, bytes]:
        out = {}
        for name in self.kv.list_dir(TARGET_FILES_PREFIX):
            blob = self.kv.get(f"{TARGET_FILES_PREFIX}/{name}")
            if blob is not None:
                out[name] = blob
        return out

    def tokenizer_dir(self) -> Path:
        """The target's tokenizer files materialised in the cache (keyed by the tokenizer hash)."""
        from dflash_pipeline.embedded import cache_dir

        out = cache_dir() / "tokenizers" / (self.meta.tokenizer.hash[:16] or "unknown")
        if not (out / ".complete").exists():
            out.mkdir(parents=True, exist_ok=True)
            for name, blob in self.target_files().items():
                tmp = out / (name + ".tmp")
                tmp.write_bytes(blob)
                tmp.replace(out / name)
            (out / ".complete").write_text("ok")
        return out

    def load_tokenizer(self):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(self.tokenizer_dir())
