"""Shared fixtures. The real embedded model is converted once per cache directory and reused."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
if "CUDA_VISIBLE_DEVICES" not in os.environ and not os.path.exists("/dev/nvidiactl"):
    # Triton kernels (decoding/split_attention.py) run in Triton's interpreter on a machine without a GPU;
    # it must be set before triton is first imported (its library's own kernels are decorated then)
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def smollm_dir():
    """A plain HF folder of the real embedded target (SmolLM2-135M-Instruct)."""
    from dflash_pipeline.embedded import embedded_target_dir

    return embedded_target_dir()


@pytest.fixture(scope="session")
def smollm_tokenizer(smollm_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm_dir)


@pytest.fixture(scope="session")
def smollm_model(smollm_dir):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(smollm_dir, dtype=torch.float32)
    model.eval()
    return model


@pytest.fixture(scope="session")
def s3_server():
    moto_server = pytest.importorskip("moto.server")
    boto3 = pytest.importorskip("boto3")
    srv = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    srv.start()
    host, port = srv.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    env = {"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test", "AWS_REGION": "us-east-1",
           "AWS_ENDPOINT_URL": endpoint}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(Bucket="dflash-test")
    yield endpoint
    srv.stop()
    for k, v in old.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture
def one_thread():
    """Tiny models on a shared 2-core machine: batch-1 decoding is per-op overhead and memory bound, and
    a second thread mostly adds contention (measured: up to 5x slower)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def interpreter(monkeypatch):
    """Triton's interpreter on the CPU. Triton 3.6's interpreter turns its scalars (1-element arrays) into
    loop bounds with int(), which numpy >= 2.4 refuses: patched here to take the element."""
    import numpy as np
    from triton.runtime import interpreter as interp

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    original = getattr(interp, "_patch_lang_tensor", None)
    if original is None:   # a Triton whose interpreter is organised otherwise: nothing to patch
        return

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))

    monkeypatch.setattr(interp, "_patch_lang_tensor", patched)
