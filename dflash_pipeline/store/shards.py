"""Writing and reading the hidden-state shards with our own thread pool.

zarr's codec pipeline encodes a shard's inner chunks with little parallelism, and copying each
one-layer chunk out of a [T, L, H] array is a strided copy; together they kept a segment write at a
fraction of what Blosc alone does. Here every (layer, chunk) is copied, compressed with Blosc (which
releases the GIL) and checksummed on a pool of threads, and each shard is assembled in the format of
zarr v3's `sharding_indexed` codec (inner codecs: bytes little-endian, blosc, crc32c; index at the
end: uint64 (offset, nbytes) per inner chunk in C order, then the CRC32C of the index). The array's
metadata is written by zarr itself, so every reader reads these shards with plain zarr; our reader
(`read_layer_shards`) decodes them the same way on the pool, checksumming as it goes.
"""

from __future__ import annotations

import os
import struct
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np

_POOL: ThreadPoolExecutor | None = None
_POOL_LOCK = threading.Lock()


_THREADS: int | None = None


def available_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 2


def set_pool_threads(threads: int) -> None:
    """Size of this process's encode/decode pool (default: every available core). Extraction sets it
    to its share of the node's cores: eight GPU processes of 128 threads each on 128 cores starve the
    threads that feed the GPUs."""
    global _POOL, _THREADS
    with _POOL_LOCK:
        _THREADS = max(1, int(threads))
        if _POOL is not None and _POOL._max_workers != _THREADS:  # noqa: SLF001
            _POOL.shutdown(wait=True)
            _POOL = None


def pool_threads() -> int:
    """Threads this process's encode/decode pool has (or will have)."""
    return _THREADS or max(2, available_cpus())


def encode_pool() -> ThreadPoolExecutor:
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = ThreadPoolExecutor(max_workers=pool_threads(),
                                       thread_name_prefix="dflash-encode")
        return _POOL


def _crc32c(buf) -> bytes:
    import google_crc32c

    return struct.pack("<I", google_crc32c.value(buf))


def numcodecs_blosc(zarr_blosc):
    """The numcodecs Blosc that produces what the given zarr BloscCodec would."""
    import numcodecs

    cfg = zarr_blosc.to_dict()["configuration"]
    shuffle = {"noshuffle": numcodecs.Blosc.NOSHUFFLE, "shuffle": numcodecs.Blosc.SHUFFLE,
               "bitshuffle": numcodecs.Blosc.BITSHUFFLE}[cfg["shuffle"]]
    return numcodecs.Blosc(cname=cfg["cname"], clevel=cfg["clevel"], shuffle=shuffle, blocksize=cfg["blocksize"])


# -- CRC32C of a concatenation from the CRCs of its parts ------------------------------------------
# crc(A || B) = shift(crc(A), len(B)) ^ crc(B), where shift is linear over GF(2): the effect of feeding
# len(B) zero bytes through the (reflected) CRC register. A layer's checksum is thereby assembled from
# its chunks' checksums, computed by the threads that compress them, instead of by a strided copy of
# the whole layer on one thread.

_CRC32C_POLY = 0x82F63B78


def _gf2_apply(mat: list[int], vec: int) -> int:
    out, i = 0, 0
    while vec:
        if vec & 1:
            out ^= mat[i]
        vec >>= 1
        i += 1
    return out


def _gf2_square(mat: list[int]) -> list[int]:
    return [_gf2_apply(mat, mat[i]) for i in range(32)]


def crc32c_shift_operator(nbytes: int) -> list[int]:
    """The 32x32 GF(2) matrix (as 32 column ints) that advances a CRC32C over `nbytes` zero bytes."""
    one_bit = [_CRC32C_POLY] + [1 << i for i in range(31)]  # one zero bit through the register
    op = [1 << i for i in range(32)]                        # identity
    power = _gf2_square(_gf2_square(_gf2_square(one_bit)))  # one zero byte
    n = nbytes
    while n:
        if n & 1:
            op = [_gf2_apply(power, c) for c in op]
        n >>= 1
        if n:
            power = _gf2_square(power)
    return op


def crc32c_concat(crcs: list[int], sizes: list[int]) -> int:
    """CRC32C of the concatenation of parts with these CRCs and byte sizes."""
    ops: dict[int, list[int]] = {}
    out = 0
    for crc, n in zip(crcs, sizes):
        if n == 0:
            continue
        op = ops.get(n)
        if op is None:
            op = ops[n] = crc32c_shift_operator(n)
        out = _gf2_apply(op, out) ^ crc
    return out


def _encode_chunk(data_TLH: np.ndarray, layer: int, a: int, C: int, blosc) -> tuple[bytes, bytes, int, int]:
    """Inner chunk [C, 1, H] of `layer` from token a: C-order bytes (zero-padded past T), blosc.
    Returns (compressed bytes, their crc32c, crc32c of the raw real rows, their byte count)."""
    import google_crc32c

    part = np.ascontiguousarray(data_TLH[a:a + C, layer])
    raw = part.reshape(-1).view(np.uint8)
    raw_crc = google_crc32c.value(raw)
    if part.shape[0] < C:
        full = np.zeros((C, data_TLH.shape[2]), dtype=data_TLH.dtype)
        full[: part.shape[0]] = part
        part = full
    comp = blosc.encode(part)
    return comp, _crc32c(comp), raw_crc, raw.nbytes


def _shard_parts(chunks: list[tuple[bytes, bytes, int, int]]) -> list:
    """The shard's bytes as a list of buffers, in file order: each inner chunk's compressed bytes and
    CRC, then the index and the index's CRC."""
    sizes = [len(c[0]) + len(c[1]) for c in chunks]
    index = np.empty((len(chunks), 2), dtype="<u8")
    index[:, 0] = np.concatenate([[0], np.cumsum(sizes)[:-1]]) if sizes else []
    index[:, 1] = sizes
    index_bytes = index.tobytes()
    parts: list = []
    for c in chunks:
        parts += [c[0], c[1]]
    return parts + [index_bytes, _crc32c(index_bytes)]


def write_layer_shards(kv, prefix: str, data_TLH: np.ndarray, C: int, zarr_blosc) -> "ShardWrite":
    """Start writing hidden [T, L, H] as one shard per layer (shard [ceil(T/C)*C, 1, H], chunks
    [C, 1, H]) on the pool; `.result()` waits and returns, per layer, the CRC32C of its raw [T, H]
    bytes (what the commit marker records).

    `prefix` is the array's path; the array metadata must already declare exactly these codecs.
    Shards go to storage as a sequence of buffers (`kv.put_parts`): no copy into one contiguous array,
    which for a few hundred MB per layer cost a serial second per segment in page faults and copies.
    """
    T, L, _ = data_TLH.shape
    blosc = numcodecs_blosc(zarr_blosc)
    starts = list(range(0, max(T, 1), C))
    pool = encode_pool()
    futures = {(l, a): pool.submit(_encode_chunk, data_TLH, l, a, C, blosc) for l in range(L) for a in starts}

    def finish_layer(l: int) -> int:
        chunks = [futures[(l, a)].result() for a in starts]
        kv.put_parts(f"{prefix}/c/0/{l}/0", _shard_parts(chunks))
        return crc32c_concat([c[2] for c in chunks], [c[3] for c in chunks])

    # Layer l's finisher waits only on its own chunks, which were all queued before any finisher.
    return ShardWrite([pool.submit(finish_layer, l) for l in range(L)])


class ShardWrite:
    def __init__(self, futures):
        self.futures = futures

    def result(self) -> list[int]:
        return [f.result() for f in self.futures]


def our_shard_layout(meta: dict) -> int | None:
    """Inner chunk length C if an array's zarr metadata is the layout `write_layer_shards` writes
    (one shard per layer, inner chunks [C, 1, H]: bytes, blosc, crc32c; index at the end with its
    crc32c), else None (then read through zarr)."""
    try:
        (codec,) = meta["codecs"]
        cfg = codec["configuration"]
        inner = [c["name"] for c in cfg["codecs"]]
        index = [c["name"] for c in cfg["index_codecs"]]
        C, one, H = cfg["chunk_shape"]
        T, _, H2 = meta["shape"]
        shard = meta["chunk_grid"]["configuration"]["chunk_shape"]
    except (KeyError, TypeError, ValueError):
        return None
    ok = (codec["name"] == "sharding_indexed" and inner == ["bytes", "blosc", "crc32c"]
          and cfg["codecs"][0].get("configuration", {}).get("endian", "little") == "little"
          and index == ["bytes", "crc32c"] and cfg["index_location"] == "end" and one == 1 and H == H2
          and list(shard) == [max(1, -(-T // C)) * C, 1, H])
    return C if ok else None


class ShardError(ValueError):
    """A shard file that is missing, truncated or fails a checksum (message names the part)."""


def read_layer_shards(kv, prefix: str, shape_TLH: tuple[int, int, int], dtype, C: int,
                      layers: list[int]) -> tuple[np.ndarray, list[int]]:
    """Read the hidden layers `layers` of an array in our shard layout: [T, len(layers), H] and, per
    layer, the CRC32C of its raw [T, H] bytes (what the commit marker records), computed on the way.

    Every inner chunk's CRC32C is checked before it is decompressed, straight from the shard bytes,
    on a pool of threads (Blosc and the checksums release the GIL); no strided copy for the layer
    checksums. Raises ShardError for a missing, truncated or altered shard.
    """
    import google_crc32c
    import numcodecs

    T, _, H = shape_TLH
    n = max(1, -(-T // C))
    out = np.empty((T, len(layers), H), dtype=dtype)
    blosc = numcodecs.Blosc()
    pool = encode_pool()

    def one_layer(j: int, layer: int) -> int:
        key = f"{prefix}/c/0/{layer}/0"
        raw = kv.get(key)
        if raw is None:
            raise ShardError(f"missing chunk file c/0/{layer}/0")
        buf = np.frombuffer(raw, dtype=np.uint8)
        tail = n * 16 + 4
        if len(buf) < tail:
            raise ShardError(f"truncated chunk file c/0/{layer}/0")
        index_bytes = buf[len(buf) - tail:len(buf) - 4]
        if _crc32c(index_bytes) != buf[len(buf) - 4:].tobytes():
            raise ShardError(f"chunk file c/0/{layer}/0: index checksum mismatch (truncated or altered)")
        index = index_bytes.view("<u8").reshape(n, 2)
        tmp = np.empty((C, H), dtype=dtype)
        crc = 0
        for i in range(n):
            off, nb = int(index[i, 0]), int(index[i, 1])
            if nb < 4 or off + nb > len(buf) - tail:
                raise ShardError(f"chunk file c/0/{layer}/0: inner chunk {i} out of bounds (truncated)")
            comp = buf[off:off + nb - 4]
            if _crc32c(comp) != buf[off + nb - 4:off + nb].tobytes():
                raise ShardError(f"chunk file c/0/{layer}/0: inner chunk {i} checksum mismatch")
            blosc.decode(comp, out=tmp)
            a, b = i * C, min(T, (i + 1) * C)
            part = tmp[: b - a]
            out[a:b, j] = part
            crc = google_crc32c.extend(crc, part.reshape(-1).view(np.uint8))
        return crc

    futures = [pool.submit(one_layer, j, layer) for j, layer in enumerate(layers)]
    crcs = [f.result() for f in futures]
    return out, crcs
