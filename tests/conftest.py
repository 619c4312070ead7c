"""Shared fixtures. The real embedded model is converted once per cache directory and reused."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


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
