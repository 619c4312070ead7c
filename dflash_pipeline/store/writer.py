"""Writing a store: create it, write the frozen target tensors, write segments and commit them.

Crash safety rests on three rules:
1. A segment is written by exactly one writer, each array in ONE call (a sharded zarr array written
   piecewise is rewritten whole at every write), after deleting whatever a crashed attempt left.
2. The commit marker (`commits/<id>.json`) is written last, create-once, and holds the counts, the
   per-array (per-layer for `hidden`) CRC32C of the logical bytes, and the stored sizes.
3. A segment without a commit marker does not exist for any reader; `store verify --repair` deletes it.

So SIGKILL at any moment leaves either a committed, complete segment or an invisible one.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import socket
import uuid
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from dflash_pipeline.errors import ConfigMismatchError, StoreError
from dflash_pipeline.schemas.store import (
    FORMAT_VERSION, META_KEY, RUNS_PREFIX, TARGET_FILES_PREFIX, TARGET_GROUP, ArrayCommit, SegmentCommit,
    StoreMeta, commit_key, segment_path,
)
from dflash_pipeline.store.backends import KV, open_zarr_store
from dflash_pipeline.store.shards import write_layer_shards
from dflash_pipeline.store.codecs import (
    HiddenCodec, chunk_tokens, get_codec, hidden_layer_stats, small_array_compressors,
)


def crc32c(arr: np.ndarray) -> int:
    import google_crc32c

    # google_crc32c takes a read-only buffer; a uint8 ndarray view passes without a copy (~12 GB/s).
    return int(google_crc32c.value(np.ascontiguousarray(arr).reshape(-1).view(np.uint8)))


def now_iso() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


@dataclass
class SegmentArrays:
    """A whole segment on the host, ready to write. hidden_TLH is already encoded by the codec."""

    tokens_T: np.ndarray            # int32
    loss_mask_T: np.ndarray         # bool
    sample_offsets: np.ndarray      # int64 [N+1]
    sample_ids: np.ndarray          # int64 [N]
    hidden_TLH: np.ndarray          # codec storage dtype
    hidden_scale_TL: np.ndarray | None
    topk_ids_TK: np.ndarray         # int32
    topk_logprobs_TK: np.ndarray    # float16
    hidden_stats: dict[str, list[float]] = field(default_factory=dict)   # per-layer sums
    codec_error: dict[str, list[float]] = field(default_factory=dict)    # per-layer sums

    def check(self) -> None:
        T = len(self.tokens_T)
        N = len(self.sample_ids)
        assert self.loss_mask_T.shape == (T,) and self.hidden_TLH.shape[0] == T
        assert self.sample_offsets.shape == (N + 1,) and self.sample_offsets[0] == 0
        assert self.sample_offsets[-1] == T and np.all(np.diff(self.sample_offsets) > 0)
        assert self.topk_ids_TK.shape == self.topk_logprobs_TK.shape and self.topk_ids_TK.shape[0] == T


class StoreWriter:
    """Opens (or creates) a store for writing segments. Safe for one writer per segment id at a time,
    any number of processes and hosts at once.

    `codec`: the hidden-state codec named by `meta`, where the caller already has it (extraction builds
    it once from its config and hands it to every process that writes); else it is looked up here."""

    def __init__(self, url: str, meta: StoreMeta, *, codec: HiddenCodec | None = None, create: bool = True):
        import zarr

        assert codec is None or codec.name == meta.codec, (codec.name, meta.codec)
        self.url = url
        self.meta = meta
        self.codec = codec if codec is not None else get_codec(meta.codec)
        self.zstore = open_zarr_store(url, read_only=False)
        self.kv = KV(self.zstore)
        self.writer_id = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        root_meta = self.kv.get("zarr.json")
        if root_meta is None:
            if not create:
                raise StoreError(f"{url}: no store here")
            zarr.open_group(self.zstore, mode="w-", attributes={META_KEY: meta.to_dict()})
            return
        attrs = json.loads(root_meta).get("attributes", {})
        if META_KEY not in attrs:
            raise StoreError(f"{url}: a zarr hierarchy but not a dflash store (no '{META_KEY}' attribute)")
        existing = StoreMeta.from_dict(attrs[META_KEY])
        if existing.format_version > FORMAT_VERSION:
            raise StoreError(f"{url}: store format {existing.format_version} is newer than this tool's "
                             f"({FORMAT_VERSION}); upgrade dflash-pipeline")
        diff = existing.compatibility_diff(meta)
        if diff:
            raise ConfigMismatchError(f"{url}: existing store was made differently: " + "; ".join(diff))
        self.meta = existing

    # -- segments ---------------------------------------------------------------------------------

    def is_committed(self, segment: int) -> bool:
        return self.kv.exists(commit_key(segment))

    def write_segment(self, segment: int, arrays: SegmentArrays) -> SegmentCommit:
        """Write one segment (each array in one call) and commit it. Returns the commit marker."""
        arrays.check()
        if self.is_committed(segment):
            raise StoreError(f"{self.url}: segment {segment:08d} is already committed")
        base = segment_path(segment)
        self.kv.delete_prefix(base)  # leftovers of a crashed attempt
        written = self._write_arrays(base, arrays)
        records = {name: ArrayCommit(shape, dtype, crcs, self.kv.size_prefix(f"{base}/{name}"))
                   for name, (shape, dtype, crcs) in written.items()}
        marker = self._marker(segment, arrays, records)
        if not self.kv.put_if_absent(commit_key(segment), marker.to_json()):
            raise StoreError(f"{self.url}: segment {segment:08d} was committed by another writer meanwhile")
        return marker

    def _write_arrays(self, base: str, arrays: SegmentArrays) -> dict[str, tuple[list[int], str, list[int]]]:
        """Every array of the segment: name -> (shape, dtype, CRC32C list), in the marker's order."""
        import zarr
        from zarr.codecs import Crc32cCodec

        # hidden first, so that its shards compress on the pool while the small arrays are written
        # here: one shard per layer (a few objects per segment), inner chunks of C tokens so that one
        # sample can be read without its whole segment; CRC32C on every inner chunk catches damage.
        T, L, H = arrays.hidden_TLH.shape
        C = chunk_tokens(H, arrays.hidden_TLH.dtype.itemsize)
        C = min(C, max(T, 1))
        shard_T = -(-T // C) * C
        # The big array: metadata through zarr, shards encoded on our thread pool (see shards.py).
        compressors = [*self.codec.compressors(), Crc32cCodec()]
        zarr.create_array(self.zstore, name=f"{base}/hidden", shape=arrays.hidden_TLH.shape,
                          dtype=arrays.hidden_TLH.dtype, chunks=(C, 1, H), shards=(shard_T, 1, H),
                          compressors=compressors, fill_value=0)
        hidden = write_layer_shards(self.kv, f"{base}/hidden", arrays.hidden_TLH, C, compressors[0]) if T else None
        try:
            written = self._write_small_arrays(base, arrays, C, shard_T)
        except BaseException:
            if hidden is not None:  # the pool still reads the caller's array: let it finish first
                try:
                    hidden.result()
                except BaseException:
                    pass
            raise
        written["hidden"] = (list(arrays.hidden_TLH.shape), str(arrays.hidden_TLH.dtype),
                             hidden.result() if hidden is not None else [0] * L)
        return written

    def _write_small_arrays(self, base: str, arrays: SegmentArrays, C: int,
                            shard_T: int) -> dict[str, tuple[list[int], str, list[int]]]:
        """Everything but `hidden`, each through zarr in one call; per-token arrays sharded like `hidden`."""
        import zarr
        from zarr.codecs import Crc32cCodec

        T, L, _ = arrays.hidden_TLH.shape
        K = arrays.topk_ids_TK.shape[1]
        written: dict[str, tuple[list[int], str, list[int]]] = {}

        def put(name: str, data: np.ndarray, chunks: tuple, shards: tuple | None, compressors: list,
                crcs: list[int]) -> None:
            # Zero-length dimensions are legal (K = 0 without teacher); chunk sizes must be >= 1.
            chunks = tuple(max(1, c) for c in chunks)
            shards = None if shards is None else tuple(max(1, s) for s in shards)
            # write_empty_chunks: a chunk equal to the fill value (say sample_ids == [0]) must still be
            # written, or the segment reads as damaged (a committed segment has every chunk file).
            zarr.create_array(self.zstore, name=f"{base}/{name}", data=data, chunks=chunks, shards=shards,
                              compressors=compressors, fill_value=0, write_data=True,
                              config={"write_empty_chunks": True})
            written[name] = (list(data.shape), str(data.dtype), crcs)

        put("tokens", arrays.tokens_T.astype(np.int32, copy=False), (T,), None, small_array_compressors(4),
            [crc32c(arrays.tokens_T)])
        put("loss_mask", arrays.loss_mask_T.astype(bool, copy=False), (T,), None, small_array_compressors(1),
            [crc32c(arrays.loss_mask_T)])
        put("sample_offsets", arrays.sample_offsets.astype(np.int64, copy=False), (len(arrays.sample_offsets),),
            None, small_array_compressors(8), [crc32c(arrays.sample_offsets)])
        put("sample_ids", arrays.sample_ids.astype(np.int64, copy=False), (len(arrays.sample_ids),), None,
            small_array_compressors(8), [crc32c(arrays.sample_ids)])
        if self.codec.has_scale:
            assert arrays.hidden_scale_TL is not None
            put("hidden_scale", arrays.hidden_scale_TL.astype(np.float32, copy=False), (C, L), (shard_T, L),
                [*small_array_compressors(4), Crc32cCodec()], [crc32c(arrays.hidden_scale_TL)])
        put("topk_ids", arrays.topk_ids_TK.astype(np.int32, copy=False), (C, K), (shard_T, K),
            [*small_array_compressors(4), Crc32cCodec()], [crc32c(arrays.topk_ids_TK)])
        put("topk_logprobs", arrays.topk_logprobs_TK.astype(np.float16, copy=False), (C, K), (shard_T, K),
            [*small_array_compressors(2), Crc32cCodec()], [crc32c(arrays.topk_logprobs_TK)])
        return written

    def _marker(self, segment: int, arrays: SegmentArrays, records: dict[str, ArrayCommit]) -> SegmentCommit:
        offsets = arrays.sample_offsets
        supervised = np.add.reduceat(arrays.loss_mask_T.astype(np.int64), offsets[:-1]) if len(offsets) > 1 else []
        K = arrays.topk_ids_TK.shape[1]
        topk_mass = float(np.exp(arrays.topk_logprobs_TK.astype(np.float64)).sum()) if K else 0.0
        return SegmentCommit(
            format_version=FORMAT_VERSION,
            segment=segment,
            writer=self.writer_id,
            created=now_iso(),
            num_samples=int(len(arrays.sample_ids)),
            num_tokens=int(len(arrays.tokens_T)),
            num_supervised=int(arrays.loss_mask_T.sum()),
            sample_ids=arrays.sample_ids.tolist(),
            sample_offsets=offsets.tolist(),
            sample_supervised=[int(x) for x in supervised],
            arrays=records,
            codec=self.codec.name,
            hidden_stats=arrays.hidden_stats,
            codec_error=arrays.codec_error,
            topk_mass_sum=topk_mass,
        )

    # -- target tensors and files -----------------------------------------------------------------

    def write_target(self, tensors: dict[str, torch.Tensor], config: dict[str, Any],
                     files: dict[str, bytes]) -> None:
        """Frozen target tensors (embed, lm_head, final_norm, ...), its config and tokenizer files.

        Written once by the coordinator before any segment; bf16 tensors are kept as uint16 bit
        patterns with the logical dtype in the array's attributes (zarr has no bfloat16).
        """
        import zarr

        group = zarr.open_group(self.zstore, path=TARGET_GROUP, mode="a")
        group.attrs.update({"config": config, "tensors": sorted(tensors)})
        for name, t in tensors.items():
            t = t.detach().cpu().contiguous()
            logical = str(t.dtype).removeprefix("torch.")
            data = t.view(torch.int16).numpy().view(np.uint16) if t.dtype == torch.bfloat16 else t.numpy()
            chunks = (max(1, min(data.shape[0], (8 << 20) // max(1, data[0].nbytes))),) + data.shape[1:] \
                if data.ndim > 1 else data.shape
            zarr.create_array(self.zstore, name=f"{TARGET_GROUP}/{name}", data=data, chunks=chunks,
                              compressors=small_array_compressors(data.dtype.itemsize), fill_value=0,
                              attributes={"logical_dtype": logical, "crc32c": crc32c(data)}, overwrite=True)
        for fname, blob in files.items():
            self.kv.put(f"{TARGET_FILES_PREFIX}/{fname}", blob)

    def write_run_record(self, name: str, record: dict[str, Any]) -> str:
        key = f"{RUNS_PREFIX}/{name}"
        self.kv.put(key, json.dumps(record, indent=2, default=str).encode())
        return key


class SegmentBuilder:
    """Collects samples on the host (raw features as torch tensors) and writes them as one segment.

    The simple path used by tests, the demo store and small jobs; extraction encodes on the GPU and
    calls `StoreWriter.write_segment` itself.
    """

    def __init__(self, writer: StoreWriter, segment: int):
        self.writer, self.segment = writer, segment
        self.parts: list[tuple] = []

    def add(self, sample_id: int, tokens: np.ndarray, loss_mask: np.ndarray, hidden_TLH: torch.Tensor,
            topk_ids: np.ndarray | torch.Tensor, topk_logprobs: np.ndarray | torch.Tensor) -> None:
        assert len(tokens) == len(loss_mask) == hidden_TLH.shape[0] == len(topk_ids) > 0
        self.parts.append((sample_id, np.asarray(tokens), np.asarray(loss_mask), hidden_TLH,
                           np.asarray(topk_ids), np.asarray(topk_logprobs)))

    def commit(self) -> SegmentCommit:
        codec = self.writer.codec
        hidden = torch.cat([p[3] for p in self.parts])
        enc = codec.encode(hidden)
        arrays = SegmentArrays(
            tokens_T=np.concatenate([p[1] for p in self.parts]).astype(np.int32),
            loss_mask_T=np.concatenate([p[2] for p in self.parts]).astype(bool),
            sample_offsets=np.concatenate([[0], np.cumsum([len(p[1]) for p in self.parts])]).astype(np.int64),
            sample_ids=np.array([p[0] for p in self.parts], dtype=np.int64),
            hidden_TLH=enc.data_TLH.cpu().numpy().view(codec.storage_dtype),
            hidden_scale_TL=None if enc.scale_TL is None else enc.scale_TL.cpu().numpy(),
            topk_ids_TK=np.concatenate([p[4] for p in self.parts]).astype(np.int32),
            topk_logprobs_TK=np.concatenate([p[5] for p in self.parts]).astype(np.float16),
            hidden_stats={k: v.tolist() for k, v in hidden_layer_stats(hidden).items()},
            codec_error=encoded_error(enc),
        )
        return self.writer.write_segment(self.segment, arrays)


def encoded_error(enc) -> dict[str, list[float]]:
    return {"err_sq": enc.err_sq_L.tolist(), "ref_sq": enc.ref_sq_L.tolist(), "max_abs": enc.max_abs_err_L.tolist()}
