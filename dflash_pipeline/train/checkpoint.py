"""Checkpoints: model, optimizer, EMA, RNG and loader state, written atomically, pruned, resumable.

A checkpoint is a folder written under a temporary name and renamed into place, so a crash while
saving never leaves a checkpoint that `--resume` would trust. `latest` names the newest one.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from dflash_pipeline.errors import ConfigMismatchError, DFlashError


def checkpoint_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def save_checkpoint(run_dir: Path, step: int, *, model_state: dict[str, torch.Tensor], optim_state: dict,
                    ema_state: dict[str, torch.Tensor] | None, trainer_state: dict[str, Any], keep: int) -> Path:
    root = checkpoint_dir(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step-{step:08d}"
    tmp = Path(tempfile.mkdtemp(prefix=f".step-{step:08d}.", dir=root))
    try:
        torch.save(model_state, tmp / "model.pt")
        torch.save(optim_state, tmp / "optimizer.pt")
        if ema_state is not None:
            torch.save(ema_state, tmp / "ema.pt")
        (tmp / "trainer_state.json").write_text(json.dumps(trainer_state, indent=1, default=str))
        if final.exists():
            shutil.rmtree(final)
        os.rename(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    latest_tmp = root / ".latest.tmp"
    latest_tmp.write_text(final.name)
    os.replace(latest_tmp, root / "latest")
    for old in sorted(p for p in root.glob("step-*") if p.is_dir())[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def latest_checkpoint(run_dir: Path) -> Path | None:
    root = checkpoint_dir(run_dir)
    marker = root / "latest"
    if marker.exists():
        p = root / marker.read_text().strip()
        if (p / "trainer_state.json").exists():
            return p
    done = sorted(p for p in root.glob("step-*") if (p / "trainer_state.json").exists()) if root.exists() else []
    return done[-1] if done else None


def load_checkpoint(path: Path, map_location="cpu") -> dict[str, Any]:
    path = Path(path)
    if not (path / "trainer_state.json").exists():
        raise DFlashError(f"{path}: not a checkpoint (no trainer_state.json)")
    out = {"trainer_state": json.loads((path / "trainer_state.json").read_text()),
           "model": torch.load(path / "model.pt", map_location=map_location, weights_only=True),
           "optimizer": torch.load(path / "optimizer.pt", map_location=map_location, weights_only=False)
           if (path / "optimizer.pt").exists() else None,
           "ema": torch.load(path / "ema.pt", map_location=map_location, weights_only=True)
           if (path / "ema.pt").exists() else None}
    return out


def check_resume(saved_state: dict[str, Any], cfg, store_fp: str) -> None:
    """Refuse to resume with another store or a config that changes the computation."""
    diff = cfg.resume_diff(saved_state["config"])
    if saved_state.get("store_fingerprint") != store_fp:
        diff.insert(0, "store: its content differs from the one the run started with")
    if diff:
        raise ConfigMismatchError("cannot resume: " + "; ".join(diff) + " (give the checkpoint's values to resume it)")


def export_checkpoint(path: str, out: str, *, use_ema: bool = True, dtype: str = "bf16") -> Path:
    """`dflash export`: a checkpoint (or a run directory's latest) -> DFlash HF folder."""
    from dflash_pipeline.train.export import export_drafter
    from dflash_pipeline.train.model import DrafterConfig

    p = Path(path)
    if (p / "checkpoints").is_dir():
        found = latest_checkpoint(p)
        if found is None:
            raise DFlashError(f"{path}: the run directory has no complete checkpoint")
        p = found
    ck = load_checkpoint(p)
    ts = ck["trainer_state"]
    weights = ck["ema"] if (use_ema and ck["ema"] is not None) else ck["model"]
    dtypes = {"bf16": torch.bfloat16, "fp32": torch.float32}
    if dtype not in dtypes:
        raise DFlashError(f"--dtype must be bf16 or fp32, got '{dtype}'")
    return export_drafter(weights, DrafterConfig.from_dict(ts["drafter"]), out, dtype=dtypes[dtype],
                          extra={"dflash_pipeline": {"store_fingerprint": ts.get("store_fingerprint"),
                                                     "step": ts["step"], "ema": use_ema and ck["ema"] is not None}})
