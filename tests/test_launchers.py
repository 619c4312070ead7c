"""The launcher path: `torchrun` gives the ranks; extract and train use them (gloo on CPU) and produce
what the built-in multi-process launch produces."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from dflash_pipeline.extract.pipeline import run_extract
from dflash_pipeline.schemas.config import ExtractConfig
from dflash_pipeline.store.reader import StoreReader
from helpers import make_tiny_target, write_conversations

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
TORCHRUN = Path(sys.executable).parent / "torchrun"


def _port() -> str:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


@pytest.mark.skipif(not TORCHRUN.exists(), reason="torchrun not installed next to python")
def test_torchrun_extract_and_train(tmp_path, smollm_dir):
    target = make_tiny_target(tmp_path / "target", smollm_dir)
    data = write_conversations(tmp_path / "conv.jsonl", n=30)
    common = ["--target", str(target), "--data", str(data), "--max-length", "128", "--num-features", "3",
              "--topk", "4", "--tokens-per-batch", "1024", "--segment-tokens", "300", "--device", "cpu", "--quiet"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    launched = tmp_path / "launched"
    res = subprocess.run([str(TORCHRUN), "--nproc-per-node", "2", "--master-port", _port(), "-m", "dflash_pipeline",
                          "extract", "--out", str(launched), *common], capture_output=True, text=True, env=env,
                         timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    reference = tmp_path / "reference"
    run_extract(ExtractConfig(out=str(reference), target=str(target), data=[str(data)], max_length=128, num_features=3,
                              topk=4, tokens_per_batch=1024, segment_tokens=300, device="cpu", quiet=True,
                              tokenize_workers=1))
    a, b = StoreReader(str(launched)), StoreReader(str(reference))
    assert a.num_samples == b.num_samples > 0
    for row in range(a.num_samples):
        sa = a.read_sample(row)
        sb = b.read_sample(b.find_sample(sa.sample_id))
        np.testing.assert_array_equal(sa.tokens_T, sb.tokens_T)
        assert torch.equal(sa.hidden_TLH.view(torch.int16), sb.hidden_TLH.view(torch.int16))
    record = json.loads(a.kv.get(next(f"runs/{n}" for n in a.kv.list_dir("runs") if n.startswith("extract-"))))
    assert record["processes"] == 2

    run = tmp_path / "run"
    res = subprocess.run([str(TORCHRUN), "--nproc-per-node", "2", "--master-port", _port(), "-m", "dflash_pipeline",
                          "train", "--store", str(launched), "--out", str(run), "--steps", "3", "--num-layers", "1",
                          "--block-size", "4", "--gamma", "3", "--max-anchors", "8", "--tokens-per-batch", "128",
                          "--max-length", "128", "--num-workers", "0", "--device", "cpu", "--log-every", "1",
                          "--eval-fraction", "0.1", "--quiet"],
                         capture_output=True, text=True, env=env, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    cfg = json.loads((run / "config.json").read_text())
    assert cfg["world_size"] == 2
    assert (run / "final" / "model.safetensors").exists()
