"""Training metrics: summed on the device over a logging interval, reduced over ranks, rendered, mirrored.

A step must never wait for the GPU, so nothing here reads a device value per step: `IntervalMetrics`
adds each micro-batch's sums into one device tensor and reads it back once per logging interval (one
all-reduce over ranks, one copy to the host). What the host already knows (token counts, attention
pairs) is summed on the host beside it. `render_train_line` / `render_eval_line` turn the records of
metrics.jsonl into the live line; `Trackers` mirrors them to wandb / TensorBoard when asked.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from dflash_pipeline.errors import DFlashError
from dflash_pipeline.progress import fmt_count, fmt_duration
from dflash_pipeline.train.step import TOPK_ACCURACY, flops_from_totals

PEAK_BF16_FLOPS = 790e12   # measured bf16 matmul peak of one H200 (see BENCHMARKS.md)


def slot_accuracies(correct_B: torch.Tensor, topk_correct_JB: torch.Tensor, count_B: torch.Tensor) -> dict[str, Any]:
    """Top-1 and top-k accuracy over the drafted slots 1..B-1, pooled and per slot (host tensors).

    Top-k (k in TOPK_ACCURACY) is how often a tree offering k tokens at a slot holds the label there."""
    n = count_B[1:].sum().clamp_min(1)
    out: dict[str, Any] = {
        "acc": float(correct_B[1:].sum() / n),
        "acc_per_pos": [round(float(c / max(m, 1)), 4) for c, m in zip(correct_B[1:], count_B[1:])],
    }
    for k, hits_B in zip(TOPK_ACCURACY, topk_correct_JB):
        out[f"acc_top{k}"] = float(hits_B[1:].sum() / n)
        out[f"acc_top{k}_per_pos"] = [round(float(c / max(m, 1)), 4) for c, m in zip(hits_B[1:], count_B[1:])]
    return out


class IntervalMetrics:
    """Sums over a logging interval, kept on the device (no host sync per step), reduced over ranks
    when logged. Slots of `v`: loss, ce, kl, cap, streak sum, blocks, labelled slots, then correct and
    labelled counts per block slot, then top-k hits per slot for each k of TOPK_ACCURACY; the counts known
    on the host (tokens, attention pairs) beside it."""

    def __init__(self, device, dcfg):
        self.device, self.dcfg, self.B = device, dcfg, dcfg.block_size
        self.clear()

    def clear(self):
        self.t0 = time.time()
        self.v = torch.zeros(7 + (2 + len(TOPK_ACCURACY)) * self.B, dtype=torch.float64, device=self.device)
        self.grad_norm = torch.zeros((), dtype=torch.float64, device=self.device)
        self.steps = self.micro = 0
        self.input_tokens = self.block_tokens = self.context_tokens = 0
        self.attn_pairs = 0.0

    def add(self, out, context_tokens: int, micro: int = 1):
        """One micro-batch's `StepOut` (micro=0: a chunk of rows of one, whose losses add up to the batch's)."""
        B = self.B
        self.v[:7] += torch.stack([out.loss.detach().double(), out.ce.double(), out.kl.double(), out.cap.double(),
                                   out.streak_sum.double(), out.blocks.double(), out.count_B.sum().double()])
        self.v[7:7 + B] += out.correct_B.double()
        self.v[7 + B:7 + 2 * B] += out.count_B.double()
        self.v[7 + 2 * B:] += out.topk_correct_JB.flatten().double()
        self.attn_pairs += out.attn_pairs
        self.input_tokens += out.input_tokens
        self.block_tokens += out.block_tokens
        self.context_tokens += context_tokens
        self.micro += micro

    def add_step(self, grad_norm: torch.Tensor):
        """One optimizer step, with its gradient norm (a device scalar)."""
        self.grad_norm = self.grad_norm + grad_norm.detach().double()
        self.steps += 1

    def reduce(self, world, dist) -> dict[str, Any]:
        ints = torch.tensor([self.input_tokens, self.block_tokens, self.context_tokens, self.attn_pairs],
                            dtype=torch.float64, device=self.device)
        v = torch.cat([self.v, ints, self.grad_norm.view(1)])
        if dist is not None:
            dist.all_reduce(v)
        v = v.cpu()
        dt = max(time.time() - self.t0, 1e-9)
        micro = max(self.micro, 1) * world
        B = self.B
        J = len(TOPK_ACCURACY)
        correct, count, topk = v[7:7 + B], v[7 + B:7 + 2 * B], v[7 + 2 * B:7 + (2 + J) * B].view(J, B)
        input_tokens, block_tokens, context_tokens, attn_pairs, grad_norm = (float(x) for x in v[7 + (2 + J) * B:])
        flops = flops_from_totals(self.dcfg, block_tokens=block_tokens, context_tokens=context_tokens,
                                  attn_pairs=attn_pairs, labelled=float(v[6]))
        return {"loss": float(v[0] / micro), "ce": float(v[1] / micro), "kl": float(v[2] / micro),
                "cap": float(v[3] / micro), **slot_accuracies(correct, topk, count),
                "streak": float(v[4] / v[5].clamp_min(1)), "grad_norm": grad_norm / max(self.steps * world, 1),
                "input_tok_s": input_tokens / dt, "block_tok_s": block_tokens / dt, "flops_per_s": flops / dt}


def render_train_line(rec: dict[str, Any], total: int) -> str:
    mfu = f" MFU {rec['mfu']:.0%}" if rec.get("mfu") is not None else ""
    mem = f" mem {rec['peak_mem_gb']:.1f}G" if rec.get("peak_mem_gb") is not None else ""
    parts = f"ce {rec['ce']:.3f}" + (f" kl {rec['kl']:.3f}" if rec["kl"] else "") + (f" cap {rec['cap']:.3f}" if rec["cap"] else "")
    return (f"step {rec['step']}/{total} ep {rec['epoch']:.2f} | loss {rec['loss']:.3f} ({parts}) acc {rec['acc']:.3f} "
            f"top{TOPK_ACCURACY[0]} {rec[f'acc_top{TOPK_ACCURACY[0]}']:.3f} "
            f"streak {rec['streak']:.2f} | lr {rec['lr']:.2e} gn {rec['grad_norm']:.2f} | "
            f"{fmt_count(rec['input_tok_s'])} tok/s {fmt_count(rec['block_tok_s'])} blk/s{mfu} | "
            f"data-wait {rec['data_wait_frac']:.1%}{mem} | ETA {fmt_duration(rec['eta_s'])}")


def data_hint(agreement: float) -> str:
    """After the first held-out estimate, one line where little of the held-out text is the target's own choice
    ('' otherwise)."""
    from dflash_pipeline.store.stats import own_text_hint

    hint = own_text_hint(agreement)
    return f"note: {agreement:.0%} of the held-out reply tokens are the target's own top-1 choice; {hint}" if hint else ""


def render_eval_line(res: dict[str, Any]) -> str:
    trees = [(k.removeprefix("tau_tree_"), v) for k, v in res.items() if k.startswith("tau_tree_")]
    tree = (" tree tau " + ", ".join(f"{v:.2f} @ {n}" for n, v in trees)) if trees else ""
    # judged against the target's top-1; where the text is not the target's own, the text-judged walk too
    text = res.get("tau_chain_text")
    judged = (f" (against the text {text:.2f}; {res['target_agreement']:.0%} of it the target's top-1)"
              if text is not None and "target_agreement" in res and round(text, 2) != round(res["tau_chain"], 2) else "")
    return (f"eval @ step {res['step']}: loss {res['loss']:.3f} acc {res['acc']:.3f} "
            f"streak {res['streak']:.2f} greedy-chain tau {res['tau_chain']:.2f}{judged}{tree} ({res['samples']} samples"
            + (f", first {res['new_tokens']} tokens of each reply)" if res.get("new_tokens") else ")"))


class Trackers:
    """Optional wandb / tensorboard mirrors of metrics.jsonl."""

    def __init__(self, run_dir: Path, *, wandb_project: str | None, tensorboard: bool, config: dict[str, Any]):
        self.wandb = self.tb = None
        if wandb_project:
            try:
                import wandb
            except ImportError:
                raise DFlashError("--wandb needs the wandb package: pip install wandb") from None
            self.wandb = wandb.init(project=wandb_project, dir=str(run_dir), config=config)
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                raise DFlashError("--tensorboard needs the tensorboard package: pip install tensorboard") from None
            self.tb = SummaryWriter(str(run_dir / "tensorboard"))

    def log(self, rec: dict[str, Any], step: int) -> None:
        scalars = {k: v for k, v in rec.items() if isinstance(v, (int, float)) and v is not None}
        if self.wandb is not None:
            self.wandb.log(scalars, step=step)
        if self.tb is not None:
            for k, v in scalars.items():
                self.tb.add_scalar(k, v, step)

    def close(self) -> None:
        if self.wandb is not None:
            self.wandb.finish()
        if self.tb is not None:
            self.tb.close()


__all__ = ["PEAK_BF16_FLOPS", "IntervalMetrics", "Trackers", "render_eval_line", "render_train_line", "slot_accuracies"]
