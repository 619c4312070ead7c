"""What `dflash eval` reports: acceptance, losslessness and speed, as one JSON-ready dict and tables.

tau is pooled over every verification step of every prompt (tokens committed per step, bonus
included), as serving engines and the paper report it; the per-prompt mean is kept beside it because a
few long easy prompts can dominate the pooled number. Speeds are decoding speeds (the prefill and its
first token excluded) of the two runs made on the same prompts in the same process; with several
processes, tokens and seconds are summed over them, so the speeds are per process (per GPU).

Losslessness at T = 0 follows eval/lossless.py, whose rule the report states (`lossless_rule`):
`lossless` is False only for a divergence at a clear margin (any divergence in fp32), listed in
`mismatch_details`; tie divergences of bf16/fp16 are listed in `tie_divergences` and do not fail.

With several prompt files, `per_file` holds the same acceptance and speed numbers for each file's
prompts; the top level is pooled over all of them.

Step times (median ms of the target's decode step, its verify step, the drafter's step and, for trees,
building the tree) say where a round's time goes; `speedup_from_step_times` = tau * t_decode /
(t_verify + t_draft + t_tree) is the speedup those steps allow at the measured tau. The measured speedup
falls short of it by whatever else a round costs (the host's work between steps, the acceptance
transfer).

Tree budgets (`--tree-budget 0,16,64`): every budget decodes the same prompts against the same plain
decoding. The top level describes the first budget (per_file included); `per_budget` gives each
budget's tau, speeds, speedup and step times (the verify step of a budget-N tree is q = N + 1 tokens);
losslessness at the top level covers every budget, and each divergence names its budget.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from dflash_pipeline.eval.lossless import TIE_ULPS, Divergence, LosslessCheck, is_exact_dtype, rule_text
from dflash_pipeline.eval.prompts import Prompt, file_labels
from dflash_pipeline.eval.speculative import Generation


@dataclass
class PromptResult:
    prompt: Prompt
    spec: Generation                    # speculative decoding
    target: Generation                  # the target alone
    check: LosslessCheck | None = None  # T = 0: where spec left the target's greedy output, if it did
    budget: int = 0                     # the tree budget of the speculative run (0: the chain)


def acceptance(results: list[PromptResult], block_size: int) -> dict[str, Any]:
    """tau, acceptance per slot, speeds and counts of `results` (one file's, or all)."""
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
    spec_s = sum(r.spec.seconds for r in results)
    target_s = sum(r.target.seconds for r in results)
    tok_s_spec = sum(r.spec.decoded_tokens for r in results) / spec_s if spec_s > 0 else None
    tok_s_target = sum(r.target.decoded_tokens for r in results) / target_s if target_s > 0 else None
    return {
        "tau": committed / len(steps) if steps else None,
        "tau_per_prompt_mean": sum(per_prompt) / len(per_prompt) if per_prompt else None,
        "prompts": len(results),
        "generated_tokens": sum(len(r.spec.tokens) for r in results),
        "steps": len(steps),
        "speedup": tok_s_spec / tok_s_target if tok_s_spec and tok_s_target else None,
        "tok_s_spec": tok_s_spec,
        "tok_s_target": tok_s_target,
        "accept_hist": hist,
        "accept_rate_per_position": [a / r if r else None for a, r in zip(accepted, reached)],
    }


def divergence_dict(r: PromptResult, d: Divergence) -> dict[str, Any]:
    """A divergence as the report lists it: which prompt (file, row, turn), where, and the margin."""
    return {"file": r.prompt.file, "turn": r.prompt.turn, "tree_budget": r.budget, **d.to_dict()}


def losslessness(results: list[PromptResult], *, temperature: float, dtype: torch.dtype) -> dict[str, Any]:
    """The lossless verdict of `results`, judged when every result carries its check (T = 0)."""
    checked = temperature == 0 and bool(results) and all(r.check is not None for r in results)
    failed = [r for r in results if checked and r.check.failure is not None]
    ties = [divergence_dict(r, d) for r in results if checked for d in r.check.ties]
    ulps = max((r.check.tie_ulps for r in results), default=TIE_ULPS) if checked else None
    return {
        "lossless": (not failed) if checked else None,
        "lossless_rule": rule_text(dtype, ulps) if checked else None,
        "tie_ulps": None if not checked or is_exact_dtype(dtype) else ulps,
        "mismatches": [r.prompt.sample_id for r in failed],
        "mismatch_details": [divergence_dict(r, r.check.failure) for r in failed],
        "num_tie_divergences": len(ties),
        "tie_divergences": ties,
    }


def summarize(results: list[PromptResult], *, block_size: int, temperature: float,
              dtype: torch.dtype) -> dict[str, Any]:
    """The report dict of one speculative run (one budget) over `results`."""
    checked = temperature == 0 and bool(results) and all(r.check is not None for r in results)
    report = {
        **acceptance(results, block_size),
        **losslessness(results, temperature=temperature, dtype=dtype),
        "dtype": str(dtype).removeprefix("torch."),
        "block_size": block_size,
        "temperature": temperature,
    }
    report["per_file"] = {}
    for f in file_labels([r.prompt for r in results]):
        sub = [r for r in results if r.prompt.file == f]
        bad = sum(r.check.failure is not None for r in sub) if checked else 0
        report["per_file"][f] = {
            **acceptance(sub, block_size),
            "lossless": not bad if checked else None,
            "num_mismatches": bad,
            "num_tie_divergences": sum(len(r.check.ties) for r in sub) if checked else 0,
        }
    return report


# What `per_budget` keeps of each budget's report.
BUDGET_KEYS = ("tau", "tau_per_prompt_mean", "steps", "generated_tokens", "tok_s_spec", "tok_s_target", "speedup",
               "step_ms", "speedup_from_step_times", "accept_hist", "accept_rate_per_position", "lossless")


def sweep_report(reports: dict[int, dict[str, Any]], results: list[PromptResult], *, temperature: float,
                 dtype: torch.dtype) -> dict[str, Any]:
    """One report from each budget's (`reports`, in the order given; `results`: every budget's): the first
    budget's at the top level, each budget's numbers in `per_budget`, losslessness over all of them."""
    budgets = list(reports)
    report = dict(reports[budgets[0]])
    report["tree_budget"] = budgets[0]
    report["per_budget"] = {str(b): {**{k: r.get(k) for k in BUDGET_KEYS},
                                     "num_mismatches": len(r["mismatches"]),
                                     "num_tie_divergences": r["num_tie_divergences"]} for b, r in reports.items()}
    if len(budgets) > 1:
        report.update(losslessness(results, temperature=temperature, dtype=dtype))
    return report


def prompt_record(r: PromptResult) -> dict[str, Any]:
    """One prompt's outcome at one tree budget, tokens included: a line of `--records`."""
    steps = r.spec.steps
    return {
        "file": r.prompt.file, "sample_id": r.prompt.sample_id, "turn": r.prompt.turn, "tree_budget": r.budget,
        "prompt_tokens": len(r.prompt.ids),
        "tau": sum(s.committed for s in steps) / len(steps) if steps else None,
        "committed_per_step": [s.committed for s in steps],
        "seconds_spec": r.spec.seconds, "seconds_target": r.target.seconds,
        "tokens": r.spec.tokens, "target_tokens": r.target.tokens,
        "failure": divergence_dict(r, r.check.failure) if r.check and r.check.failure else None,
        "tie_divergences": [divergence_dict(r, d) for d in r.check.ties] if r.check else [],
    }


def add_step_times(report: dict[str, Any], step_ms: dict[str, float], clock: str) -> None:
    """Put the median step times (ms) and the speedup they imply at the report's tau into `report`."""
    report["step_ms"] = {k: step_ms.get(k) for k in ("target_decode", "target_verify", "drafter", "tree_build")}
    report["step_ms_clock"] = clock
    d, v, a, t = (report["step_ms"][k] for k in ("target_decode", "target_verify", "drafter", "tree_build"))
    tau = report.get("tau")
    round_ms = None if None in (v, a) else v + a + (t or 0.0)
    report["speedup_from_step_times"] = tau * d / round_ms if None not in (tau, d, round_ms) and round_ms > 0 else None


def _fmt(x: float | None, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


def summary_line(report: dict[str, Any]) -> str:
    lossless, ties = report["lossless"], report.get("num_tie_divergences", 0)
    tie_note = (f"; {ties} tie divergence(s) (top-2 margin within {report.get('tie_ulps') or TIE_ULPS} ulp of {report['dtype']}), "
                f"not failures" if ties else "")
    check = {True: "lossless (equal to the target's greedy output)" + tie_note,
             False: f"NOT LOSSLESS: {len(report['mismatches'])} of {report['prompts']} prompts differ from the "
                    f"target's greedy output at a clear margin (prompt ids {report['mismatches'][:10]})" + tie_note,
             None: f"losslessness not checked at temperature {report['temperature']}"}[lossless]
    tree = f", tree budget {report['tree_budget']}" if report.get("tree_budget") else ""
    sweep = (f" (budget {report.get('tree_budget', 0)}; {len(report['per_budget'])} budgets checked)"
             if len(report.get("per_budget", {})) > 1 else "")
    return (f"tau {_fmt(report['tau'])} (block {report['block_size']}{tree}), speedup {_fmt(report['speedup'])}x{sweep} "
            f"({_fmt(report['tok_s_spec'], '.1f')} vs {_fmt(report['tok_s_target'], '.1f')} tok/s) over "
            f"{report['prompts']} prompts, {report['generated_tokens']} tokens; {check}")


def _where(d: dict[str, Any]) -> str:
    """prompt ROW [of FILE] [turn K]: the prompt's row in its file, as `Prompt.sample_id` counts it."""
    return f"prompt {d['prompt']}" + (f" of {d['file']}" if d["file"] else "") + (f" turn {d['turn']}" if d["turn"] else "")


def divergence_line(d: dict[str, Any]) -> str:
    against = "plain decoding" if d["against"] == "plain" else "the target along the speculative path"
    return (f"{_where(d)}: generated token {d['position']}: speculative {d['spec_token']}, {against} "
            f"{d['target_token']} (target top-2 logit margin {_fmt(d['margin'], '.3g')})")


def render_report(report: dict[str, Any], console) -> None:
    """Tables (the run, each prompt file, acceptance per slot), divergences and the summary line."""
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
    if report.get("tree_budget"):
        head.add_row("tree budget (nodes verified per step)", str(report["tree_budget"]))
    if "step_ms" in report:
        ms = report["step_ms"]
        kinds = ("target_decode", "target_verify", "drafter") + (("tree_build",) if ms.get("tree_build") else ())
        head.add_row("step ms: target decode / verify / drafter" + (" / tree" if len(kinds) > 3 else ""),
                     " / ".join(_fmt(ms[k], ".3f") for k in kinds))
        head.add_row("speedup from step times", f"{_fmt(report['speedup_from_step_times'])}x")
    head.add_row("block size / temperature / dtype",
                 f"{report['block_size']} / {report['temperature']:g} / {report['dtype']}")
    if report.get("processes", 1) > 1:
        head.add_row("processes (speeds are per process)", str(report["processes"]))
    console.print(head)
    if len(report.get("per_file", {})) > 1:
        console.print(_per_file_table(report))
    if len(report.get("per_budget", {})) > 1:
        console.print(_per_budget_table(report))
    console.print(_acceptance_table(report))

    for d in report["mismatch_details"][:10]:
        console.print(divergence_line(d), style="red", markup=False)
    for d in report["tie_divergences"][:5]:
        console.print("tie: " + divergence_line(d), style="yellow", markup=False)
    if report["lossless_rule"]:
        console.print(f"lossless rule ({report['dtype']}): {report['lossless_rule']}", markup=False)
    style = "red bold" if report["lossless"] is False else "bold"
    console.print(summary_line(report), style=style, markup=False)


def _per_file_table(report: dict[str, Any]):
    from rich.table import Table

    t = Table(title="per prompt file")
    for name in ("file", "prompts", "tokens", "tau", "tok/s with drafter", "tok/s target", "speedup", "lossless"):
        t.add_column(name, justify="left" if name == "file" else "right")
    rows = [*report["per_file"].items(), ("pooled", report)]
    for name, r in rows:
        check = {True: "yes", False: f"NO ({r.get('num_mismatches', len(r.get('mismatches', [])))})",
                 None: "-"}[r["lossless"]]
        if r["num_tie_divergences"]:
            check += f", {r['num_tie_divergences']} ties"
        t.add_row(name, str(r["prompts"]), str(r["generated_tokens"]), _fmt(r["tau"]), _fmt(r["tok_s_spec"], ".1f"),
                  _fmt(r["tok_s_target"], ".1f"), f"{_fmt(r['speedup'])}x", check)
    return t


def _per_budget_table(report: dict[str, Any]):
    from rich.table import Table

    t = Table(title="per tree budget (0: the chain; verify step of budget N: N + 1 tokens)")
    for name in ("budget", "tau", "tok/s with drafter", "speedup", "verify ms", "tree ms", "from step times",
                 "lossless"):
        t.add_column(name, justify="right")
    for b, r in report["per_budget"].items():
        check = {True: "yes", False: f"NO ({r['num_mismatches']})", None: "-"}[r["lossless"]]
        if r["num_tie_divergences"]:
            check += f", {r['num_tie_divergences']} ties"
        ms = r["step_ms"] or {}
        t.add_row(b, _fmt(r["tau"]), _fmt(r["tok_s_spec"], ".1f"), f"{_fmt(r['speedup'])}x",
                  _fmt(ms.get("target_verify"), ".3f"), _fmt(ms.get("tree_build"), ".3f"),
                  f"{_fmt(r['speedup_from_step_times'])}x", check)
    return t


def _acceptance_table(report: dict[str, Any]):
    from rich.table import Table

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
    return acc


__all__ = ["PromptResult", "acceptance", "losslessness", "summarize", "sweep_report", "prompt_record", "divergence_dict",
           "add_step_times", "render_report", "summary_line", "divergence_line"]
