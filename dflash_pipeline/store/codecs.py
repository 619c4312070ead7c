"""Hidden-state codecs: how `hidden` [T, L, H] is turned into stored bytes and back.

A codec has two halves:
- `encode` runs in torch on whatever device holds the features (the GPU during extraction), so the
  lossy part (fp8 scaling) costs nothing on the host and only the small encoded tensor crosses PCIe;
- `compressors` are the zarr bytes-to-bytes codecs applied per chunk by the store (Blosc/zstd, which
  releases the GIL and scales over encoder threads; numcodecs' Shuffle holds the GIL and does not).

Every chunk holds one layer: mixing layers in a chunk compresses worse. The low mantissa byte of bf16
activations is noise, so no lossless codec gets much past ~1.4x; fp8 with one scale per (token, layer)
row roughly halves that again, at a relative error measured and written into every commit marker.

Registry: `get_codec(name)`. A new codec needs a round-trip test with an error bound and a line in
BENCHMARKS.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from dflash_pipeline.errors import StoreError

FP8_MAX = 448.0  # largest finite float8_e4m3fn


@dataclass
class EncodedHidden:
    """Output of a codec's encode: storage tensors (same device as the input) and error measurements.

    data_TLH: storage dtype (uint16 bit patterns for bf16, uint8 for fp8).
    scale_TL: float32 per-row scale for lossy codecs, else None.
    err_sq_L / ref_sq_L / max_abs_err_L: per-layer sums for the codec's measured error (zeros when lossless).
    """

    data_TLH: torch.Tensor
    scale_TL: torch.Tensor | None
    err_sq_L: torch.Tensor
    ref_sq_L: torch.Tensor
    max_abs_err_L: torch.Tensor


class HiddenCodec:
    name: str = ""
    lossless: bool = True
    storage_dtype: np.dtype
    has_scale: bool = False

    def params(self) -> dict[str, Any]:
        return {}

    def encode(self, hidden_TLH: torch.Tensor) -> EncodedHidden:
        raise NotImplementedError

    def decode(self, data_TLH: np.ndarray | torch.Tensor, scale_TL: np.ndarray | torch.Tensor | None,
               dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        raise NotImplementedError

    def compressors(self) -> list:
        raise NotImplementedError


def _blosc(typesize: int, shuffle: bool):
    from zarr.codecs import BloscCodec

    return BloscCodec(cname="zstd", clevel=1, shuffle="shuffle" if shuffle else "noshuffle",
                      typesize=typesize, blocksize=1 << 20)


def _as_tensor(x: np.ndarray | torch.Tensor) -> torch.Tensor:
    return x if isinstance(x, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(x))


class Bf16Codec(HiddenCodec):
    """Lossless: bf16 bit patterns as uint16, byte shuffle + zstd level 1 with 1 MiB blocks."""

    name = "bf16"
    lossless = True
    storage_dtype = np.dtype(np.uint16)

    def params(self) -> dict[str, Any]:
        return {"storage": "uint16 bf16 bit patterns", "compressor": "blosc zstd clevel 1 byte-shuffle"}

    def encode(self, hidden_TLH: torch.Tensor) -> EncodedHidden:
        data = hidden_TLH.to(torch.bfloat16).contiguous().view(torch.int16)
        zeros = torch.zeros(hidden_TLH.shape[1], dtype=torch.float64, device=hidden_TLH.device)
        return EncodedHidden(data, None, zeros, zeros, zeros)

    def decode(self, data_TLH, scale_TL, dtype=torch.bfloat16):
        t = _as_tensor(data_TLH)
        if t.dtype != torch.int16:
            t = t.view(torch.int16)
        return t.view(torch.bfloat16).to(dtype)

    def compressors(self) -> list:
        return [_blosc(2, True)]


class Fp8Codec(HiddenCodec):
    """Lossy: float8 e4m3 with one float32 scale per (token, layer) row (absmax / 448), + zstd."""

    name = "fp8"
    lossless = False
    storage_dtype = np.dtype(np.uint8)
    has_scale = True

    def params(self) -> dict[str, Any]:
        return {"storage": "uint8 float8_e4m3fn bit patterns", "scale": "float32 absmax/448 per (token, layer)",
                "compressor": "blosc zstd clevel 1"}

    def encode(self, hidden_TLH: torch.Tensor) -> EncodedHidden:
        T, L, H = hidden_TLH.shape
        dev = hidden_TLH.device
        data = torch.empty((T, L, H), dtype=torch.uint8, device=dev)
        scale = torch.empty((T, L), dtype=torch.float32, device=dev)
        err_sq, ref_sq, max_err = (torch.zeros(L, dtype=torch.float64, device=dev) for _ in range(3))
        # One layer at a time keeps the float32 temporaries to 1/L of the batch.
        for l in range(L):
            # A non-finite value would poison its row's scale; the store's statistics count it, and
            # it is stored as 0 here.
            x = torch.nan_to_num(hidden_TLH[:, l].float(), nan=0.0, posinf=0.0, neginf=0.0)
            s = (x.abs().amax(dim=-1) / FP8_MAX).clamp_min(torch.finfo(torch.float32).tiny)
            q = (x / s[:, None]).to(torch.float8_e4m3fn)
            err = q.float() * s[:, None] - x
            data[:, l] = q.view(torch.uint8)
            scale[:, l] = s
            if T:
                err_sq[l] = err.square().sum().double()
                ref_sq[l] = x.square().sum().double()
                max_err[l] = err.abs().max().double()
        return EncodedHidden(data, scale, err_sq, ref_sq, max_err)

    def decode(self, data_TLH, scale_TL, dtype=torch.bfloat16):
        q = _as_tensor(data_TLH)
        if q.dtype != torch.uint8:
            q = q.view(torch.uint8)
        s = _as_tensor(scale_TL).float()
        return (q.view(torch.float8_e4m3fn).float() * s[..., None]).to(dtype)

    def compressors(self) -> list:
        return [_blosc(1, False)]


CODECS: dict[str, HiddenCodec] = {c.name: c for c in (Bf16Codec(), Fp8Codec())}


def get_codec(name: str) -> HiddenCodec:
    try:
        return CODECS[name]
    except KeyError:
        raise StoreError(f"unknown hidden-state codec '{name}' (known: {', '.join(sorted(CODECS))})") from None


def small_array_compressors(itemsize: int) -> list:
    """Tokens, masks, offsets and top-k arrays: shuffle by element size + zstd."""
    return [_blosc(itemsize, itemsize > 1)]


def chunk_tokens(hidden_size: int, itemsize: int, target_bytes: int = 1 << 20) -> int:
    """Tokens per inner chunk so that one chunk (one layer) holds about `target_bytes`.

    Large enough for zstd to find structure, small enough that reading one sample does not read its
    whole segment.
    """
    n = max(1, target_bytes // max(1, hidden_size * itemsize))
    return int(min(4096, max(64, 1 << (n.bit_length() - 1))))


def hidden_layer_stats(hidden_TLH: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per-layer statistics of raw features, computed where they live, returned as float64 [L].

    The sums let `store stats` report mean, std, absmax and non-finite counts without decoding.
    """
    T, L, _ = hidden_TLH.shape
    out = {k: torch.zeros(L, dtype=torch.float64, device=hidden_TLH.device)
           for k in ("count", "sum", "sumsq", "absmax", "nonfinite")}
    for l in range(L):
        x = hidden_TLH[:, l].float()
        finite = torch.isfinite(x)
        x = torch.where(finite, x, torch.zeros((), device=x.device))
        n_finite = finite.sum()
        out["count"][l] = n_finite.double()
        out["nonfinite"][l] = (x.numel() - n_finite).double()
        out["sum"][l] = x.sum().double()
        out["sumsq"][l] = x.square().sum().double()
        if T:
            out["absmax"][l] = x.abs().max().double()
    return out
