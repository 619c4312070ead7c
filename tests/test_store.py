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

from dflash_pipeline.errors import ConfigMismatchError, CorruptSegmentError, StoreError
from dflash_pipeline.schemas.store import SegmentCommit, commit_key
from dflash_pipeline.store.backends import KV, open_zarr_store
from dflash_pipeline.store.codecs import FP8_MAX, get_codec
from dflash_pipeline.store.manifest import committed_segments, read_commits, rebuild_manifest
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


@pytest.mark.parametrize("name", ["bf16", "fp8"])
def test_codec_pickles_to_the_same_codec(name):
    """Extraction builds its codec once and pickles it to the writer processes: the copy must encode,
    compress and describe itself exactly as the original."""
    import pickle

    codec = get_codec(name)
    copy = pickle.loads(pickle.dumps(codec))
    assert type(copy) is type(codec) and copy.name == codec.name and copy.params() == codec.params()
    assert copy.storage_dtype == codec.storage_dtype and copy.has_scale == codec.has_scale
    assert [c.to_dict() for c in copy.compressors()] == [c.to_dict() for c in codec.compressors()]
    x = torch.randn(7, 2, 16, generator=torch.Generator().manual_seed(0)).bfloat16()
    a, b = codec.encode(x), copy.encode(x)
    assert torch.equal(a.data_TLH, b.data_TLH) and torch.equal(a.err_sq_L, b.err_sq_L)


def test_fp8_error_is_written_to_commit_marker(tmp_path):
    url = str(tmp_path / "s")
    write_random_store(url, codec="fp8", segments=1)
    c = StoreReader(url).commit(0)
    rel = np.sqrt(np.sum(c.codec_error["err_sq"]) / np.sum(c.codec_error["ref_sq"]))
    assert 0.005 < rel < 0.04
    assert len(c.codec_error["max_abs"]) == 3


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
    seg_bytes = sum(a.bytes for a in r.commit(0).arrays.values())
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
    assert marker.arrays["hidden"].crc32c == want
    s = StoreReader(url).read_sample(0)
    assert torch.equal(s.hidden_TLH.view(torch.int16), hidden.view(torch.int16))


# A commit marker as the writer wrote it before the marker had a type (a dict literal in
# store/writer.py): an fp8 segment of two samples, two layers, top-2. Stores written then must read.
LEGACY_MARKER = (
    b'{"format_version":1,"segment":0,"writer":"host:1180:ff772113","created":"2026-12-01T08:25:08+00:00",'
    b'"num_samples":2,"num_tokens":8,"num_supervised":6,"sample_ids":[0,1],"sample_offsets":[0,4,8],'
    b'"sample_supervised":[3,3],"arrays":{"tokens":{"shape":[8],"dtype":"int32","crc32c":[2181141036],'
    b'"bytes":744},"loss_mask":{"shape":[8],"dtype":"bool","crc32c":[526989068],"bytes":664},'
    b'"sample_offsets":{"shape":[3],"dtype":"int64","crc32c":[12862687],"bytes":736},"sample_ids":'
    b'{"shape":[2],"dtype":"int64","crc32c":[189589453],"bytes":728},"hidden_scale":{"shape":[8,2],'
    b'"dtype":"float32","crc32c":[2095198626],"bytes":1397},"topk_ids":{"shape":[8,2],"dtype":"int32",'
    b'"crc32c":[68019711],"bytes":1393},"topk_logprobs":{"shape":[8,2],"dtype":"float16","crc32c":'
    b'[2570416326],"bytes":1365},"hidden":{"shape":[8,2,8],"dtype":"uint8","crc32c":[2560324566,3134606180],'
    b'"bytes":1451}},"codec":"fp8","hidden_stats":{"count":[64.0,64.0],"sum":[-7.8837890625,121.441162109375],'
    b'"sumsq":[19.21353530883789,3736.510009765625],"absmax":[1.5546875,17.0],"nonfinite":[0.0,0.0]},'
    b'"codec_error":{"err_sq":[0.008377796970307827,1.1765968799591064],"ref_sq":[19.21353530883789,'
    b'3736.510009765625],"max_abs":[0.036272287368774414,0.3303565979003906]},"topk_mass_sum":1.0192847788995167}'
)


def test_legacy_commit_marker_parses_and_writes_back_byte_for_byte():
    c = SegmentCommit.from_json(LEGACY_MARKER)
    assert (c.segment, c.num_samples, c.num_tokens, c.num_supervised, c.codec) == (0, 2, 8, 6, "fp8")
    assert c.sample_offsets == [0, 4, 8] and c.sample_supervised == [3, 3] and c.sample_ids == [0, 1]
    assert list(c.arrays) == ["tokens", "loss_mask", "sample_offsets", "sample_ids", "hidden_scale", "topk_ids",
                              "topk_logprobs", "hidden"]
    assert c.arrays["hidden"].shape == [8, 2, 8] and c.arrays["hidden"].crc32c == [2560324566, 3134606180]
    assert c.arrays["hidden"].bytes == 1451 and c.arrays["tokens"].dtype == "int32"
    assert c.codec_error["max_abs"] == [0.036272287368774414, 0.3303565979003906]
    assert c.topk_mass_sum == 1.0192847788995167
    assert c.to_json() == LEGACY_MARKER


def test_written_marker_is_the_typed_record_with_the_legacy_layout(tmp_path):
    """What the writer stores is exactly the marker it returns, with the keys (and their order) of the
    markers written before the type existed."""
    url = str(tmp_path / "s")
    write_random_store(url, codec="fp8", segments=1, samples_per_segment=2, hidden=8, layer_ids=(1, 3), topk=2)
    r = StoreReader(url)
    raw = r.kv.get(commit_key(0))
    assert raw == r.commit(0).to_json()
    legacy, now = json.loads(LEGACY_MARKER), json.loads(raw)
    assert list(now) == list(legacy)
    assert list(now["arrays"]) == list(legacy["arrays"])
    assert all(list(now["arrays"][k]) == list(legacy["arrays"][k]) for k in legacy["arrays"])
    assert list(now["hidden_stats"]) == list(legacy["hidden_stats"])
    assert list(now["codec_error"]) == list(legacy["codec_error"])


def test_commit_marker_with_missing_or_unknown_keys_is_refused(tmp_path):
    d = json.loads(LEGACY_MARKER)
    missing = {k: v for k, v in d.items() if k != "topk_mass_sum"}
    with pytest.raises(ValueError, match=r"commit marker: missing keys \['topk_mass_sum'\]"):
        SegmentCommit.from_dict(missing)
    with pytest.raises(ValueError, match=r"commit marker: unknown keys \['surprise'\]"):
        SegmentCommit.from_dict({**d, "surprise": 1})
    arrays = {**d["arrays"], "tokens": {k: v for k, v in d["arrays"]["tokens"].items() if k != "bytes"}}
    with pytest.raises(ValueError, match=r"array 'tokens': missing keys \['bytes'\]"):
        SegmentCommit.from_dict({**d, "arrays": arrays})
    with pytest.raises(ValueError, match="unreadable JSON"):
        SegmentCommit.from_json(b"{not json")

    # In a store: the reader names the segment, the manifest rebuild skips the marker.
    url = str(tmp_path / "s")
    write_random_store(url, segments=2)
    kv = KV(open_zarr_store(url, read_only=False))
    kv.put(commit_key(1), json.dumps({**json.loads(kv.get(commit_key(1))), "surprise": 1}).encode())
    with pytest.raises(CorruptSegmentError, match=r"segment 00000001, array 'commit marker': .*unknown keys"):
        StoreReader(url).read_segment(1)
    assert read_commits(kv, [0, 1])[1] is None
