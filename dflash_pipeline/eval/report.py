"""What `dflash eval` reports: acceptance, losslessness and speed, as one JSON-ready dict and a table.

tau is pooled over every verification step of every prompt (tokens committed per step, bonus
included), as serving engines and the paper report it; the per-prompt mean is kept beside it because a
few long easy prompts can dominate the pooled number. Speeds are decoding speeds (the prefill and its
first token excluded) of the two runs made on the same prompts in the same process.

Step times (median ms of the target's decode step, its verify step and the drafter's step) say where a
round's time goes; `speedup_from_step_times` = tau * t_decode / (t_verify + t_draft) is the speedup
those steps allow at the measured tau. The measured speedup falls short of it by whatever else a
round costs (the host's work between steps, the acceptance transfer).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dflash_pipeline.eval.speculative import Generation


@dataclass
class PromptResult:
    sample_id: int
    spec: Generation     # speculative decoding
    target: Generation   # the target alone


def first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first position where a and b differ (a shorter list differs at its end), else None."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def mismatch_detail(r: PromptResult) -> dict[str, Any] | None:
    """Where the speculative output left the target's greedy output, and how close the target's own
    top-2 logits were there (a margin near 0 points at numerics, a large one at a decoding bug)."""
    i = first_difference(r.spec.tokens, r.target.tokens)
    if i is None:
        return None
    spec, target = r.spec.tokens, r.target.tokens
    return {"prompt": r.sample_id, "position": i,
            "spec_token": spec[i] if i < len(spec) else None,
            "target_token": target[i] if i < len(target) else None,
            "target_top2_margin": r.target.margins[i] if i < len(r.target.margins) else None}


def summarize(results: list[PromptResult], *, block_size: int, temperature: float,
              greedy_checked: bool) -> dict[str, Any]:
    """The report dict. `greedy_checked`: the target's run was greedy, so outputs must match exactly."""
    B = block_size
    steps = [s for r in results for s in r.spec.steps]
    committed = sum(s.committed for s in steps)
    hist = [0] * (B + 1)  # index = tokens committed in a step (1..B); index 0 stays 0
    for s in steps:
        hist[s.committed] += 1
    # Slot j (1-based) is judged in a step only if it was drafted and every slot before it was accepted.
    reached = [sum(1 for s in steps if s.drafted >= j and s.accepted >= j - 1) for j in range(1, B)]
    accepted = [sum(1 for s in steps if s.drafted >= j and s.accepted >= j) for j in range(1, B)]
    per_prompt = [sum(s.committed for s in r.spec.steps) / len(r.spec.steps) for r in results if r.spec.steps]
    spec_tokens = sum(r.spec.decoded_tokens for r in results)
    target_tokens = sum(r.target.decoded_tokens for r in results)
    spec_s = sum(r.spec.seconds for r in results)
    target_s = sum(r.target.seconds for r in results)
    tok_s_spec = spec_tokens / spec_s if spec_s > 0 else None
    tok_s_target = target_tokens / target_s if target_s > 0 else None

    details = [d for r in results if (d := mismatch_detail(r))] if greedy_checked else []
    return {
        "tau": committed / len(steps) if steps else None,
        "tau_per_prompt_mean": sum(per_prompt) / len(per_prompt) if per_prompt else None,
        "lossless": (not details) if greedy_checked else None,
        "prompts": len(results),
        "generated_tokens": sum(len(r.spec.tokens) for r in results),
        "steps": len(steps),
        "speedup": tok_s_spec / tok_s_target if tok_s_spec and tok_s_target else None,
        "tok_s_spec": tok_s_spec,
        "tok_s_target": tok_s_target,
        "accept_hist": hist,
        "accept_rate_per_position": [a / r if r else None for a, r in zip(accepted, reached)],
        "mismatches": [d["prompt"] for d in details],
        "mismatch_details": details,
        "block_size": B,
        "temperature": temperature,
    }


def add_step_times(report: dict[str, Any], step_ms: dict[str, float], clock: str) -> None:
    """Put the median step times (ms) and the speedup they imply at the report's tau into `report`."""
    report["step_ms"] = {k: step_ms.get(k) for k in ("target_decode", "target_verify", "drafter")}
    report["step_ms_clock"] = clock
    d, v, a = (report["step_ms"][k] for k in ("target_decode", "target_verify", "drafter"))
    tau = report.get("tau")
    report["speedup_from_step_times"] = tau * d / (v + a) if None not in (tau, d, v, a) and v + a > 0 else None


def _fmt(x: float | None, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


def summary_line(report: dict[str, Any]) -> str:
    lossless = report["lossless"]
    check = {True: "lossless (equal to the target's greedy output)",
             False: f"NOT LOSSLESS: {len(report['mismatches'])} of {report['prompts']} prompts differ from the "
                    f"target's greedy output (prompt ids {report['mismatches'][:10]})",
             None: f"losslessness not checked at temperature {report['temperature']}"}[lossless]
    return (f"tau {_fmt(report['tau'])} (block {report['block_size']}), speedup {_fmt(report['speedup'])}x "
            f"({_fmt(report['tok_s_spec'], '.1f')} vs {_fmt(report['tok_s_target'], '.1f')} tok/s) over "
            f"{report['prompts']} prompts, {report['generated_tokens']} tokens; {check}")


def render_report(report: dict[str, Any], console) -> None:
    """Tables (acceptance per slot, histogram of committed tokens per step, speeds) and the summary line."""
    from rich.table import Table

    head = Table(title="dflash eval", show_header=False)
    head.add_column(style="bold")
    head.add_column(justify="right")
    head.add_row("tau (pooled over steps)", _fmt(report["tau"]))
    head.add_row("tau (mean over prompts)", _fmt(report["tau_per_prompt_mean"]))
    head.add_row("verification steps", str(report["steps"]))
    head.add_row("prompts / generated tokens", f"{report['prompts']} / {report['generated_tokens']}")
    head.add_row("tok/s with drafter", _fmt(report["tok_s_spec"], ".1f"))
    head.add_row("tok/s target alone", _fmt(report["tok_s_target"], ".1f"))
    head.add_row("speedup", f"{_fmt(report['speedup'])}x")
    if "step_ms" in report:
        ms = report["step_ms"]
        head.add_row("step ms: target decode / verify / drafter",
                     " / ".join(_fmt(ms[k], ".3f") for k in ("target_decode", "target_verify", "drafter")))
        head.add_row("speedup from step times", f"{_fmt(report['speedup_from_step_times'])}x")
    head.add_row("block size / temperature", f"{report['block_size']} / {report['temperature']:g}")
    console.print(head)

    total = max(sum(report["accept_hist"]), 1)
    peak = max(report["accept_hist"]) or 1
    acc = Table(title="acceptance per block slot k")
    acc.add_column("k", justify="right")
    acc.add_column("P(k accepted | < k accepted)", justify="right")
    acc.add_column("steps committing k", justify="right")
    acc.add_column("", no_wrap=True, overflow="crop")
    rates = report["accept_rate_per_position"]
    for k in range(1, report["block_size"] + 1):
        rate = _fmt(rates[k - 1], ".3f") if k - 1 < len(rates) else ""  # slot B does not exist: k = B is all + bonus
        n = report["accept_hist"][k]
        acc.add_row(str(k), rate, f"{n} ({n / total:.1%})", "█" * round(20 * n / peak))
    console.print(acc)

    for d in report["mismatch_details"][:10]:
        console.print(f"[red]prompt {d['prompt']}: differs at generated token {d['position']}: "
                      f"speculative {d['spec_token']}, target {d['target_token']} "
                      f"(target top-2 logit margin {_fmt(d['target_top2_margin'], '.3g')})[/red]")
    style = "red bold" if report["lossless"] is False else "bold"
    console.print(summary_line(report), style=style)


__all__ = ["PromptResult", "summarize", "add_step_times", "render_report", "summary_line", "first_difference", "mismatch_detail"]
