"""`dflash store stats|verify` and their answers to bad input: one line, non-zero exit, nothing touched."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dflash_pipeline.cli import app
from helpers import write_random_store

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
runner = CliRunner()


def _snapshot(root: Path) -> dict[str, tuple[int, str]]:
    return {str(p.relative_to(root)): (p.stat().st_mtime_ns, hashlib.sha1(p.read_bytes()).hexdigest())
            for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture
def store(tmp_path):
    url = str(tmp_path / "store")
    write_random_store(url, codec="fp8", segments=3, samples_per_segment=4)
    return tmp_path / "store"


def _run(*args):
    res = runner.invoke(app, list(args))
    return res.exit_code, res.stdout, res.stderr


def test_stats_json_has_the_documented_keys(store, tmp_path):
    code, out, err = _run("store", "stats", str(store), "--json", "--plot", str(tmp_path / "p.png"))
    assert code == 0, err
    s = json.loads(out.strip().splitlines()[-1])
    for key in ("samples", "tokens", "supervised_tokens", "segments_committed", "segments_incomplete",
                "bytes_on_disk", "bytes_per_token", "compression_ratio", "codec", "layer_ids", "topk",
                "topk_mass_mean", "nonfinite_values"):
        assert key in s, key
    assert s["samples"] == 12 and s["segments_committed"] == 3 and s["codec"] == "fp8"
    assert s["layer_ids"] == [1, 3, 5] and s["topk"] == 4
    assert 1.5 < s["compression_ratio"] < 4          # fp8 + zstd of random normals
    assert 0.005 < s["codec_rel_rmse"] < 0.04
    assert 0 < s["topk_mass_mean"] < 1
    assert (tmp_path / "p.png").stat().st_size > 1000
    # the per-layer scale of the random features grows with the layer
    stds = [l["std"] for l in s["layers"]]
    assert stds == sorted(stds)


def test_stats_table_and_sampling(store):
    code, out, _ = _run("store", "stats", str(store), "--sample", "2")
    assert code == 0
    assert "random sample of 2 of 3 segments" in out
    assert "hidden states per layer" in out and "sample lengths" in out


def test_verify_clean_store(store):
    before = _snapshot(store)
    code, out, _ = _run("store", "verify", str(store))
    assert code == 0 and "OK" in out
    assert _snapshot(store) == before


def _one_line_error(code, out, err, *needles):
    assert code != 0
    lines = [l for l in err.strip().splitlines() if l]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    for n in needles:
        assert n in lines[0], (n, lines[0])
    assert "Traceback" not in out + err


def test_not_a_store(tmp_path):
    (tmp_path / "empty").mkdir()
    _one_line_error(*_run("store", "stats", str(tmp_path / "empty")), "not a dflash store", "empty")
    _one_line_error(*_run("store", "verify", str(tmp_path / "nowhere")), "no such store", "nowhere")


def test_newer_format(store):
    doc = json.loads((store / "zarr.json").read_text())
    doc["attributes"]["dflash"]["format_version"] = 2
    (store / "zarr.json").write_text(json.dumps(doc))
    before = _snapshot(store)
    _one_line_error(*_run("store", "stats", str(store)), "format 2 is newer", str(store))
    assert _snapshot(store) == before


def test_unknown_codec(store):
    doc = json.loads((store / "zarr.json").read_text())
    doc["attributes"]["dflash"]["codec"] = "zfp9"
    (store / "zarr.json").write_text(json.dumps(doc))
    _one_line_error(*_run("store", "verify", str(store)), "unknown hidden-state codec 'zfp9'")


def _verify_reports(store, segment, array, reason):
    before = _snapshot(store)
    code, out, err = _run("store", "verify", str(store))
    assert code == 1 and "FAILED" in out and "Traceback" not in out + err
    line = [l for l in out.splitlines() if "CORRUPT" in l]
    assert len(line) == 1, out
    assert f"segment {segment:08d}" in line[0] and f"array '{array}'" in line[0] and reason in line[0], line[0]
    assert _snapshot(store) == before


def test_missing_chunk_file(store):
    (store / "segments/00000001/hidden/c/0/2/0").unlink()
    _verify_reports(store, 1, "hidden", "missing chunk file c/0/2/0")


def test_truncated_chunk_file(store):
    p = store / "segments/00000002/topk_ids/c/0/0"
    p.write_bytes(p.read_bytes()[:-9])
    _verify_reports(store, 2, "topk_ids", "unreadable chunk")


def test_checksum_mismatch(store):
    # Two valid shards swapped: each decodes cleanly, but the data is not what was committed.
    a, b = store / "segments/00000000/hidden/c/0/0/0", store / "segments/00000000/hidden/c/0/1/0"
    da, db = a.read_bytes(), b.read_bytes()
    a.write_bytes(db)
    b.write_bytes(da)
    _verify_reports(store, 0, "hidden", "checksum mismatch in layer 1")


def test_corrupt_segment_read_names_store_segment_array(store):
    from dflash_pipeline.errors import CorruptSegmentError
    from dflash_pipeline.store.reader import StoreReader

    (store / "segments/00000001/loss_mask/c/0").unlink()
    with pytest.raises(CorruptSegmentError) as e:
        StoreReader(str(store)).read_segment(1)
    assert str(store) in str(e.value) and "00000001" in str(e.value) and "loss_mask" in str(e.value)


def test_repair_removes_incomplete_keeps_corrupt_unless_asked(store):
    (store / "segments/00000009/tokens").mkdir(parents=True)
    (store / "segments/00000009/tokens/zarr.json").write_text("{}")
    (store / "segments/00000001/hidden/c/0/2/0").unlink()
    code, out, _ = _run("store", "verify", str(store), "--repair")
    assert code == 1 and "removed 1 incomplete" in out and "corrupt segments are kept" in out
    assert not (store / "segments/00000009").exists()
    assert (store / "commits/00000001.json").exists()
    code, out, _ = _run("store", "verify", str(store), "--repair", "--drop-corrupt")
    assert code == 0 and "removed corrupt segment 00000001" in out
    assert not (store / "commits/00000001.json").exists()
    code, out, _ = _run("store", "verify", str(store), "--json")
    rep = json.loads(out)
    assert rep["ok"] and rep["checked"] == 2 and rep["manifest_problem"] is None


def test_nonfinite_values_are_counted(tmp_path):
    import torch

    from dflash_pipeline.store.writer import SegmentBuilder, StoreWriter
    from helpers import make_meta, random_sample

    url = str(tmp_path / "nan")
    w = StoreWriter(url, make_meta(codec="fp8"))
    b = SegmentBuilder(w, 0)
    s = list(random_sample(torch.Generator().manual_seed(0), 40, 3, 64, 100, 4))
    s[2][5, 1, 7] = float("nan")
    s[2][9, 1, 0] = float("inf")
    b.add(1, *s)
    b.commit()
    code, out, _ = _run("store", "stats", url, "--json")
    stats = json.loads(out)
    assert stats["nonfinite_values"] == 2
    assert [l["nonfinite"] for l in stats["layers"]] == [0, 2, 0]
    assert all(v == v for l in stats["layers"] for v in (l["mean"], l["std"]))  # stats stay finite


def test_verify_report_is_rendered_by_the_library(store):
    """`store verify` prints what `render_verify` renders and exits 1 exactly when the report `failed`."""
    from dflash_pipeline.store.verify import render_verify, verify_store

    (store / "segments/00000009/tokens").mkdir(parents=True)
    (store / "segments/00000001/hidden/c/0/2/0").unlink()
    rep = verify_store(str(store))
    text = render_verify(rep)
    assert rep.failed and text.splitlines()[-1] == "FAILED"
    assert "CORRUPT segment 00000001 array 'hidden'" in text and "incomplete (uncommitted" in text
    code, out, _ = _run("store", "verify", str(store))
    assert code == 1 and out == text + "\n"
    rep = verify_store(str(store), repair=True, drop_corrupt=True)
    assert not rep.failed and "removed corrupt segment 00000001" in render_verify(rep)


def test_stats_says_how_much_of_the_text_is_the_target_s_own_choice(tmp_path):
    """The share of supervised tokens that are the stored top-1 after the text before them, counted within samples:
    all of them where the store holds the target's own greedy text, about 1 in 4 where the top-1 is random among
    4 of a 4-token vocabulary, and a line that points at regeneration under 90%."""
    own, other = str(tmp_path / "own"), str(tmp_path / "other")
    write_random_store(own, segments=2, samples_per_segment=3, vocab=4, top1_is_text=1.0)
    write_random_store(other, segments=2, samples_per_segment=3, vocab=4, seed=1)
    shares = {}
    for url in (own, other):
        code, out, err = _run("store", "stats", url, "--json")
        assert code == 0, err
        a = json.loads(out.strip().splitlines()[-1])["target_agreement"]
        assert a["segments"] == 2 and a["tokens"] > 50
        shares[url] = a["share"]
    assert shares[own] == 1.0 and 0.1 < shares[other] < 0.45
    code, out, _ = _run("store", "stats", other)
    def flat(text):  # the table wraps long cells: compare without spaces and borders
        return "".join(c for c in text if not c.isspace() and c != "│")

    assert code == 0 and "target'sowntext" in flat(out) and "`dflashgenerate`" in flat(out)
    code, out, _ = _run("store", "stats", own)
    assert code == 0 and "100.0%ofsupervisedtokens" in flat(out) and "dflashgenerate" not in flat(out)


def test_stats_of_a_store_with_a_damaged_small_array_still_reports(store):
    """The target-agreement count reads small arrays: a segment whose topk_ids chunk is cut is left out of it
    (verify names it), and the report still comes; reading it directly names store, segment and array."""
    from dflash_pipeline.errors import CorruptSegmentError
    from dflash_pipeline.store.reader import StoreReader

    p = store / "segments/00000002/topk_ids/c/0/0"
    p.write_bytes(p.read_bytes()[:-9])
    code, out, err = _run("store", "stats", str(store), "--json")
    assert code == 0 and "Traceback" not in err, err
    assert json.loads(out.strip().splitlines()[-1])["target_agreement"]["segments"] == 2
    with pytest.raises(CorruptSegmentError) as e:
        StoreReader(str(store)).read_arrays(2, ("tokens", "topk_ids"))
    assert "00000002" in str(e.value) and "topk_ids" in str(e.value)
