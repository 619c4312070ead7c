"""Store format v1: round trips, lazy reads, commit visibility, on every backend.

The same tests run against a local path, an in-memory object store and a real S3-compatible server
(moto, started on localhost), the way zarr tests its own store backends.
"""

from __future__ import annotations

import json
import uuid

import numpy as np
import pytest
import torch

from dflash_pipeline.errors import ConfigMismatchError, StoreError
from dflash_pipeline.schemas.store import commit_key
from dflash_pipeline.store.backends import KV, open_zarr_store
from dflash_pipeline.store.codecs import FP8_MAX, get_codec
from dflash_pipeline.store.manifest import committed_segments, rebuild_manifest
from dflash_pipeline.store.reader import StoreReader
from dflash_pipeline.store.writer import SegmentBuilder, StoreWriter
from helpers import make_meta, random_sample, write_random_store

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.fixture(params=["local", "memory", "s3"])
def store_url(request, tmp_path):
    if request.param == "local":
        return str(tmp_path / "store")
    if request.param == "memory":
        return f"memory://{uuid.uuid4().hex}"
    request.getfixturevalue("s3_server")
    return f"s3://dflash-test/{uuid.uuid4().hex}/store"


@pytest.mark.parametrize("codec", ["bf16", "fp8"])
def test_round_trip_every_backend(store_url, codec):
    ref = write_random_store(store_url, codec=codec, segments=3, samples_per_segment=3)
    r = StoreReader(store_url)
    assert r.num_samples == 9
    assert sorted(r.column("sample_id").tolist()) == sorted(ref)
    for row in range(r.num_samples):
        s = r.read_sample(row)
        tokens, mask, hidden, ids, lps = ref[s.sample_id]
        np.testing.assert_array_equal(s.tokens_T, tokens)
        np.testing.assert_array_equal(s.loss_mask_T, mask)
        np.testing.assert_array_equal(s.topk_ids_TK, ids)
        np.testing.assert_array_equal(s.topk_logprobs_TK, lps)
        if codec == "bf16":  # bit exact
            assert torch.equal(s.hidden_TLH.view(torch.int16), hidden.view(torch.int16))
        else:
            rel = (s.hidden_TLH.float() - hidden.float()).norm() / hidden.float().norm()
            assert rel < 0.04
    seg = r.read_segment(int(r.segment_ids()[1]))
    assert seg.num_samples == 3
    assert torch.equal(seg.sample(2).hidden_TLH, r.read_sample(5).hidden_TLH)
    assert r.target_config()["hidden_size"] == 64
    assert r.target_tensor("embed").dtype == torch.bfloat16
    assert r.target_files() == {"tokenizer_config.json": b"{}"}


def test_bf16_codec_bit_exact_including_specials():
    codec = get_codec("bf16")
    x = torch.randn(257, 3, 33).bfloat16()
    x[0, 0, :4] = torch.tensor([float("inf"), float("-inf"), float("nan"), -0.0])
    x[1, 1, :2] = torch.tensor([1e-40, 3e38])  # subnormal, near max
    enc = codec.encode(x)
    y = codec.decode(enc.data_TLH.numpy().view(np.uint16), None)
    assert torch.equal(y.view(torch.int16), x.view(torch.int16))


def test_fp8_codec_error_bound_and_measurement():
    """e4m3 keeps 3 mantissa bits: each value within 2^-4 relative (plus the subnormal floor of its
    row's scale); the measured error sums equal the error recomputed from the round trip."""
    codec = get_codec("fp8")
    g = torch.Generator().manual_seed(1)
    x = torch.randn(300, 4, 128, generator=g) * torch.logspace(-2, 2, 4)[None, :, None]
    x[5, 2, 7] = 500.0  # an outlier sets its row's scale
    enc = codec.encode(x.bfloat16())
    xb = x.bfloat16().float()
    y = codec.decode(enc.data_TLH.numpy(), enc.scale_TL.numpy(), torch.float32)
    scale = enc.scale_TL[..., None]
    err = (y - xb).abs()
    # decode rounds to bf16 (2^-9 relative) on top of e4m3's 2^-4
    assert torch.all(err <= xb.abs() * (2 ** -4 + 2 ** -8) + scale * 2 ** -9 + 1e-30)
    assert torch.allclose(enc.scale_TL, xb.abs().amax(-1) / FP8_MAX)
    rel = (y - xb).norm() / xb.norm()
    assert 0.005 < rel < 0.04
    exact = codec.decode(enc.data_TLH.numpy(), enc.scale_TL.numpy(), torch.float32)
    measured = (enc.err_sq_L.sum() / enc.ref_sq_L.sum()).sqrt()
    recomputed = ((exact.double() - xb.double()).square().sum() / xb.double().square().sum()).sqrt()
    assert abs(measured - recomputed) / recomputed < 0.02  # bf16 rounding of the decode only


def test_fp8_error_is_written_to_commit_marker(tmp_path):
    url = str(tmp_path / "s")
    write_random_store(url, codec="fp8", segments=1)
    c = StoreReader(url).commit(0)
    rel = np.sqrt(np.sum(c["codec_error"]["err_sq"]) / np.sum(c["codec_error"]["ref_sq"]))
    assert 0.005 < rel < 0.04
    assert len(c["codec_error"]["max_abs"]) == 3


def test_uncommitted_segment_is_invisible(store_url):
    write_random_store(store_url, segments=2)
    # A crashed writer: arrays of segment 7 written, no commit marker.
    writer = StoreWriter(store_url, make_meta())
    b = SegmentBuilder(writer, 7)
    g = torch.Generator().manual_seed(3)
    b.add(7000, *random_sample(g, 30, 3, 64, 100, 4))
    real_put = writer.kv.put_if_absent
    writer.kv.put_if_absent = lambda key, value: (_ for _ in ()).throw(RuntimeError("killed"))
    with pytest.raises(RuntimeError):
        b.commit()
    writer.kv.put_if_absent = real_put
    rebuild_manifest(writer.kv)
    r = StoreReader(store_url)
    assert 7 not in r.segment_ids()
    assert committed_segments(r.kv) == [0, 1]
    assert "00000007" in r.kv.list_dir("segments")


def test_commit_is_create_once(store_url):
    write_random_store(store_url, segments=1)
    writer = StoreWriter(store_url, make_meta())
    assert writer.is_committed(0)
    b = SegmentBuilder(writer, 0)
    b.add(1, *random_sample(torch.Generator().manual_seed(0), 10, 3, 64, 100, 4))
    with pytest.raises(StoreError, match="already committed"):
        b.commit()
    kv = KV(open_zarr_store(store_url, read_only=False))
    before = kv.get(commit_key(0))
    assert kv.put_if_absent(commit_key(0), b"other") is False
    assert kv.get(commit_key(0)) == before


def test_rewrite_after_crash_replaces_leftovers(tmp_path):
    url = str(tmp_path / "s")
    write_random_store(url, segments=1)
    leftover = tmp_path / "s" / "segments" / "00000004" / "hidden" / "c" / "0" / "9" / "0"
    leftover.parent.mkdir(parents=True)
    leftover.write_bytes(b"garbage from a crashed attempt")
    write_random_store(url, segment_ids=[4], with_target=False)
    assert not leftover.exists()
    from dflash_pipeline.store.verify import verify_store

    assert verify_store(url).ok


def test_reopen_with_other_settings_is_refused(tmp_path):
    url = str(tmp_path / "s")
    write_random_store(url, segments=1)
    with pytest.raises(ConfigMismatchError, match="codec: store has bf16, asked for fp8"):
        StoreWriter(url, make_meta(codec="fp8"))
    with pytest.raises(ConfigMismatchError, match="layer ids"):
        StoreWriter(url, make_meta(layer_ids=(1, 2)))


def test_layer_subset_and_unknown_layer(tmp_path):
    url = str(tmp_path / "s")
    ref = write_random_store(url, segments=1, samples_per_segment=2)
    r = StoreReader(url)
    s = r.read_sample(1, layers=[5, 1])
    full = ref[s.sample_id][2]
    assert torch.equal(s.hidden_TLH[:, 0], full[:, 2]) and torch.equal(s.hidden_TLH[:, 1], full[:, 0])
    seg = r.read_segment(0, layers=[3])
    assert seg.hidden_TLH.shape[1] == 1
    with pytest.raises(StoreError, match="layer 4 is not in the store"):
        r.read_sample(0, layers=[4])


def _counting(inner):
    """Wrap a zarr store so that it counts the bytes and requests that reads return."""
    from zarr.storage import WrapperStore

    class Counting(WrapperStore):
        bytes = 0
        gets = 0

        async def get(self, key, prototype=None, byte_range=None):
            buf = await self._store.get(key, prototype=prototype, byte_range=byte_range)
            type(self).gets += 1
            type(self).bytes += 0 if buf is None else len(buf.to_bytes())
            return buf

        async def exists(self, key):
            type(self).gets += 1
            return await self._store.exists(key)

    return Counting(inner)


def test_read_sample_does_not_read_whole_segment(tmp_path):
    url = str(tmp_path / "s")
    # H = 1024 bf16 -> inner chunks of 512 tokens; one segment of ~8K tokens over 3 layers.
    write_random_store(url, segments=1, samples_per_segment=40, hidden=1024, min_len=150, max_len=250)
    r = StoreReader(url)
    seg_bytes = sum(a["bytes"] for a in r.commit(0)["arrays"].values())
    counting = _counting(r.zstore)
    r.zstore = counting
    r.kv.zstore = counting
    r.read_sample(20)
    assert counting.bytes < seg_bytes / 5


def test_open_reads_constant_number_of_objects(tmp_path):
    """Opening and indexing touch the root metadata and the manifest only, however many segments."""
    counts = []
    for n in (2, 12):
        url = str(tmp_path / f"s{n}")
        write_random_store(url, segments=n, samples_per_segment=1, hidden=16, min_len=5, max_len=10)
        import dflash_pipeline.store.reader as reader_mod

        real_open = reader_mod.open_zarr_store
        holder = {}

        def counted_open(u, read_only):
            holder["store"] = _counting(real_open(u, read_only=read_only))
            return holder["store"]

        reader_mod.open_zarr_store = counted_open
        try:
            r = StoreReader(url)
            _ = r.num_samples, r.num_tokens, r.segment_ids()
        finally:
            reader_mod.open_zarr_store = real_open
        counts.append(type(holder["store"]).gets)
    assert counts[0] == counts[1] <= 2


def test_reader_pickles_as_url(tmp_path):
    import pickle

    url = str(tmp_path / "s")
    write_random_store(url, segments=1)
    r = StoreReader(url)
    r2 = pickle.loads(pickle.dumps(r))
    assert r2.url == url and r2.num_samples == r.num_samples


def test_reader_threads_share_one_reader(tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    url = str(tmp_path / "s")
    ref = write_random_store(url, segments=4, samples_per_segment=5)
    r = StoreReader(url, cache_segments=2)  # small cache: threads evict each other's segments

    def check(row):
        s = r.read_sample(row)
        return torch.equal(s.hidden_TLH.view(torch.int16), ref[s.sample_id][2].view(torch.int16))

    with ThreadPoolExecutor(8) as pool:
        assert all(pool.map(check, list(range(r.num_samples)) * 3))


def test_missing_manifest_falls_back_to_markers(tmp_path):
    url = str(tmp_path / "s")
    write_random_store(url, segments=2, manifest=False)
    r = StoreReader(url)
    assert r.num_samples == 8 and r.manifest_was_missing


def test_newer_format_is_refused(tmp_path):
    url = str(tmp_path / "s")
    write_random_store(url, segments=1)
    root = tmp_path / "s" / "zarr.json"
    doc = json.loads(root.read_text())
    doc["attributes"]["dflash"]["format_version"] = 99
    root.write_text(json.dumps(doc))
    with pytest.raises(StoreError, match="format 99 is newer"):
        StoreReader(url)


def test_crc32c_concat_matches_direct_checksum():
    import google_crc32c

    from dflash_pipeline.store.shards import crc32c_concat

    rng = np.random.default_rng(0)
    for sizes in ([1], [7, 7, 7, 3], [4096] * 5 + [100], [0, 5, 0, 9], [65536, 65536, 1]):
        parts = [rng.integers(0, 256, n, dtype=np.uint8).tobytes() for n in sizes]
        want = google_crc32c.value(b"".join(parts))
        assert crc32c_concat([google_crc32c.value(p) for p in parts], sizes) == want


def test_marker_layer_checksums_cover_raw_layers(tmp_path):
    """The per-layer CRCs, assembled from the compressing threads' chunk CRCs, equal the CRC of each
    layer's raw [T, H] bytes, for a segment of many chunks with a partial last chunk."""
    import google_crc32c

    from dflash_pipeline.store.codecs import chunk_tokens

    url = str(tmp_path / "s")
    w = StoreWriter(url, make_meta(hidden=64, layer_ids=[0, 1, 2], codec="bf16"))
    C = chunk_tokens(64, 2)
    b = SegmentBuilder(w, 0)
    n = 2 * C + 5
    hidden = torch.randn(n, 3, 64).bfloat16()
    b.add(0, np.arange(n, dtype=np.int32), np.ones(n, bool), hidden, torch.zeros(n, 4, dtype=torch.int32),
          torch.zeros(n, 4, dtype=torch.float16))
    marker = b.commit()
    raw = hidden.view(torch.int16).numpy()
    want = [google_crc32c.value(np.ascontiguousarray(raw[:, l]).tobytes()) for l in range(3)]
    assert marker["arrays"]["hidden"]["crc32c"] == want
    s = StoreReader(url).read_sample(0)
    assert torch.equal(s.hidden_TLH.view(torch.int16), hidden.view(torch.int16))
