"""The tables of `bench/quality.py`, built from the JSON its parts wrote (nothing is measured here).

Every cell names where it comes from: `dflash eval` JSON (real tau, speedup, losslessness), the training
run's summary.json (the held-out greedy-chain estimate `tau_chain`, accuracy per slot) and metrics.jsonl
(tokens/s), the stores' `store stats` and extraction run records, the SpecForge and online runs' JSON.
A missing input leaves its cell as "-", so the summary works on any subset of finished parts.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

GOAL_TAU, GOAL_REGEN_RATIO, GOAL_FP8_REL, GOAL_EST_REL, GOAL_TREE_RATIO = 3.0, 1.5, 0.02, 0.10, 1.3


def _f(x: Any, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


def _table(head: list[str], rows: list[list[Any]]) -> str:
    out = ["| " + " | ".join(head) + " |", "|" + "|".join("---" if i == 0 else "---:" for i in range(len(head))) + "|"]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


def metrics(run_dir: Path, kind: str) -> list[dict[str, Any]]:
    """A run's records of one type ("train", "eval") from its metrics.jsonl; [] where it has none."""
    try:
        recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    except OSError:
        return []
    return [r for r in recs if r.get("type") == kind]


def train_speed(run_dir: Path) -> float | None:
    """Median input tokens/s of a run's logged intervals after the first (start-up, compilation)."""
    tok = sorted(r["input_tok_s"] for r in metrics(run_dir, "train")[1:])
    return tok[len(tok) // 2] if tok else None


def train_peak_gb(run_dir: Path) -> float | None:
    """The largest GPU memory peak a run's logged intervals report (both trainers log `peak_mem_gb` on CUDA)."""
    peaks = [r["peak_mem_gb"] for r in metrics(run_dir, "train") if r.get("peak_mem_gb") is not None]
    return max(peaks) if peaks else None


def run_row(b, name: str) -> dict[str, Any]:
    """Everything the tables show about one trained drafter."""
    from quality import read_eval, run_summary

    s = run_summary(b.run_dir(name))
    ev = s.get("eval") or {}
    row: dict[str, Any] = {"run": name, "steps": s.get("step"), "train_s": s.get("seconds"),
                           "tau_est": ev.get("tau_chain"), "acc1": (ev.get("acc_per_pos") or [None])[0],
                           # judged against the text, and how much of it is the target's own top-1 (summary.json)
                           "tau_est_text": ev.get("tau_chain_text"), "target_agreement": ev.get("target_agreement"),
                           "acc": ev.get("acc"), "train_tok_s": train_speed(b.run_dir(name))}
    try:
        cfg = json.loads((b.run_dir(name) / "config.json").read_text())
        row["block"] = cfg["train"]["block_size"]
        row["store"] = Path(cfg["store"]["url"]).name
        row["tokens_trained"] = (s.get("step") or 0) * cfg["train"]["tokens_per_batch"]
        row["epochs"] = (s.get("step") or 0) / max(cfg.get("steps_per_epoch") or 1, 1)
    except (OSError, ValueError, KeyError):
        pass
    for prompt_set, temps in (("chat", b.plan.temperatures), ("code", (0.0,)), ("math", (0.0,))):
        for t in temps:
            e = read_eval(b.eval_file(name, prompt_set, t))
            if e is not None:
                row[f"tau_{prompt_set}_T{t:g}"] = e.get("tau")
                row[f"lossless_{prompt_set}_T{t:g}"] = e.get("lossless")
    alone = read_eval(b.eval_file(name, "chat", 0.0, alone=True))
    if alone is not None:
        row["speedup_alone"] = alone.get("speedup")
        row["tok_s_alone"] = (alone.get("tok_s_spec"), alone.get("tok_s_target"))
    # Trees (plan eval_trees): per budget, the real tau of the shared chat T=0 eval, the speedup of the alone
    # one and the training's held-out estimate of the same budget. The chain is budget 0.
    trees: dict[str, dict[str, Any]] = {}
    for key, e in (("tau", read_eval(b.eval_file(name, "chat", 0.0))), ("speedup", alone)):
        for budget, r in ((e or {}).get("per_budget") or {}).items():
            trees.setdefault(budget, {})[key] = r.get(key)
    for budget, t in trees.items():
        t["est"] = ev.get("tau_chain") if budget == "0" else ev.get(f"tau_tree_{budget}")
    if trees:
        row["trees"] = dict(sorted(trees.items(), key=lambda kv: int(kv[0])))
    real = row.get("tau_chat_T0")
    if real and row.get("tau_est"):
        row["est_over_real"] = row["tau_est"] / real
    return row


def _recipe_rows(b, names: list[str]) -> list[list[Any]]:
    from quality import RECIPE_BASE, RECIPES

    out = []
    for n in names:
        r = run_row(b, n)
        if n in RECIPES:
            given = {k: v for k, v in b.recipe_args(n).items() if v != RECIPE_BASE.get(k)}  # the terms it adds
            settings = ", ".join(f"{k}={v}" for k, v in given.items()) or "CE, gamma 7"
        else:
            settings = f"store {r.get('store', '-')}"
        out.append([n, settings, _f(r.get("acc1"), ".3f"), _f(r.get("tau_est")),
                    _f(r.get("tau_chat_T0")), _f(r.get("est_over_real")), _f(r.get("tau_chat_T1")),
                    _f(r.get("tau_code_T0")), _f(r.get("tau_math_T0")), _f(r.get("speedup_alone")), _lossless(r),
                    _f(r.get("train_tok_s"), ",.0f")])
    return out


def _lossless(r: dict[str, Any]) -> str:
    vals = [v for k, v in r.items() if k.startswith("lossless_") and v is not None]
    return "-" if not vals else ("yes" if all(vals) else "NO")


def store_rows(b) -> tuple[list[list[Any]], dict[str, Any]]:
    from quality import DEFAULT_STORES, STORES

    data = b.read("data")
    rows, recs = [], {}
    for name in STORES:
        f = b.root / "stores" / f"{name}.json"
        if not f.exists() and name not in DEFAULT_STORES:
            continue  # an optional store this run did not extract
        if not f.exists():
            rows.append([name] + ["-"] * 7)
            continue
        rec = json.loads(f.read_text())
        recs[name] = rec
        st, rr = rec.get("stats", {}), rec.get("run_record", {})
        rows.append([name, _f(st.get("samples"), ","), _f(st.get("tokens"), ","), _f(st.get("bytes_per_token"), ",.0f"),
                     _f((st.get("bytes_on_disk") or 0) / 2 ** 30, ".1f"), _f(rr.get("seconds"), ".0f"),
                     _f(rr.get("tokens_per_second"), ",.0f"), _f(rec.get("teacher_top1_agreement"), ".3f")])
    return rows, {"stores": recs, "data": data}


def build_summary(b) -> tuple[str, dict[str, Any]]:
    from quality import RECIPES, VARIANT_TAGS, best_run

    out: list[str] = [f"# Drafter quality: {'SMOKE (CPU, tiny)' if b.smoke else 'SmolLM2-135M-Instruct'}", ""]
    rec: dict[str, Any] = {"smoke": b.smoke}
    data = b.read("data")
    orig = b.read("inputs").get("orig", {})
    gen = _generate_record(b)
    dplan, steps = ran_with(b, "data"), ran_with(b, "recipes")["steps"]
    total = gen.get("total", {})
    turns = orig.get("turns", dplan["turns"])
    every = turns == "all"
    if every:
        what = (f"{orig.get('conversations', '-')} conversations of the embedded ShareGPT train split, every exchange "
                f"(mean {_f(orig.get('mean_exchanges'), '.2f')} per conversation; a conversation ends at its first "
                f"reply cut at the token limit)")
    elif turns == "each":
        what = (f"{orig.get('conversations', '-')} user turns of the embedded ShareGPT train split, each asked afresh "
                f"as a one-turn question (each distinct question once)")
    else:
        what = f"{orig.get('conversations', '-')} first exchanges of the embedded ShareGPT train split"
    replies = (f"original replies {_f(orig.get('mean_reply_tokens'), '.0f')} tokens per conversation" if every
               else f"original reply {_f(orig.get('mean_reply_tokens'), '.0f')} tokens")
    out += [f"Data: {what} (prompts <= {dplan['max_prompt_tokens']} tokens; mean prompt "
            f"{_f(orig.get('mean_prompt_tokens'), '.0f')}, {replies}); regenerated by {data.get('regen_backend', '-')} "
            f"(greedy, up to {dplan['max_new_tokens']} new tokens) in "
            f"{_f((data.get('jobs', {}).get('generate') or data.get('hf_generate') or {}).get('seconds'), '.0f')} s"
            + (f" ({_f(gen.get('tokens_per_second'), ',.0f')} new tok/s; {_f(total.get('replies'), ',')} replies, "
               f"{total.get('truncated', '-')} truncated)" if gen else "") + ".", ""]
    rows, rec["stores"] = store_rows(b)
    out += ["## Stores", _table(["store", "samples", "tokens", "bytes/token", "GiB", "extract s", "extract tok/s",
                                 "target top-1 = next token"], rows), ""]

    best = best_run(b)
    rec["best"] = best
    recipe_names = [n for n in RECIPES if (b.run_dir(n) / "summary.json").exists()]
    head = ["run", "settings", "held-out acc slot 1", "held-out tau (est.)", "real tau chat T=0", "est/real",
            "real tau chat T=1", "real tau code T=0", "real tau math T=0", "speedup (alone)", "lossless", "train tok/s"]
    metas = [json.loads(m.read_text()) for m in (b.run_dir(n) / "quality-run.json" for n in recipe_names) if m.exists()]
    # the part's record lists its runs once the part has ended; each run's own record from its start (a summary
    # packed while the part still runs read "bf16" for an fp8 run, 2026-12-07)
    trained_on = sorted(({r.get("store") for r in b.read("recipes").get("runs", [])}
                         | {m.get("store") for m in metas}) - {None}) or ["regen-bf16"]
    where = "the regenerated bf16 store" if trained_on == ["regen-bf16"] else f"store {', '.join(trained_on)}"
    inits = sorted({m.get("init_from") for m in metas} - {None})
    if inits:  # runs that trained on from a drafter an earlier session returned
        where += f", each continued from {', '.join(Path(i).name for i in inits)} (`--init-from`)"
    out += [f"## Recipes on {where}, {steps} steps each (best: {best})",
            _table(head, _recipe_rows(b, recipe_names)), ""]
    rec["recipes"] = {n: run_row(b, n) for n in recipe_names}

    if best:
        var = [n for n in (best, *(f"{best}@{t}" for t in VARIANT_TAGS.values()))
               if (b.run_dir(n) / "summary.json").exists()]
        out += [f"## The best recipe ({best}) on other data", _table(head, _recipe_rows(b, var)), ""]
        rec["variants"] = {n: run_row(b, n) for n in var}
        curve = sorted([n for n in _runs_like(b, f"{best}@steps")] + [best],
                       key=lambda n: run_row(b, n).get("steps") or 0)
        out += ["## Learning curve", _table(["run", "steps", "tokens trained", "epochs", "held-out acc slot 1",
                                              "held-out tau (est.)", "real tau chat T=0", "real tau chat T=1"],
                                             [[n, _f(r.get("steps"), ","), _f(r.get("tokens_trained"), ","),
                                               _f(r.get("epochs")), _f(r.get("acc1"), ".3f"), _f(r.get("tau_est")),
                                               _f(r.get("tau_chat_T0")), _f(r.get("tau_chat_T1"))]
                                              for n in curve for r in [run_row(b, n)]]), ""]
        rec["curve"] = {n: run_row(b, n) for n in curve}
        out += _in_run_curve(b, best, rec)
    out += _trees_section(b, rec)
    out += _specforge_section(b, rec)
    out += _online_section(b, rec)
    out += _goals(b, rec)
    return "\n".join(out) + "\n", rec


def _trees_section(b, rec: dict[str, Any]) -> list[str]:
    """Each drafter measured as a chain and with trees (chat T=0): real tau, speedup alone, and the held-out
    estimate of the same budget; where tau and speedup peak is the budget to use."""
    rows, runs = [], {**rec.get("recipes", {}), **rec.get("variants", {})}
    for name, r in runs.items():
        chain = (r.get("trees") or {}).get("0", {}).get("tau")
        for budget, t in (r.get("trees") or {}).items():
            est, real = t.get("est"), t.get("tau")
            rows.append([name, "chain" if budget == "0" else budget, _f(est), _f(real),
                         _f(est / real if est and real else None),
                         _f(real / chain if real and chain else None), _f(t.get("speedup"))])
    if not rows:
        return []
    rec["trees"] = {n: r["trees"] for n, r in runs.items() if r.get("trees")}
    return ["## Chain and trees (chat T=0)", _table(["run", "tree budget", "held-out tau (est.)", "real tau",
                                                     "est/real", "x the chain's tau", "speedup (alone)"], rows), ""]


def in_run_evals(run_dir: Path) -> list[dict[str, Any]]:
    """The held-out estimates a run logged while it trained (`--eval-every`, or each epoch's end)."""
    by_step = {r["step"]: r for r in metrics(run_dir, "eval") if "step" in r}
    return [by_step[k] for k in sorted(by_step)]


def _in_run_curve(b, best: str, rec: dict[str, Any]) -> list[str]:
    """One run's held-out estimate over its steps: the learning curve at no extra training (the lr schedule
    is that run's, so a point is not a shorter run's end)."""
    evals = in_run_evals(b.run_dir(best))
    if len(evals) < 2:
        return []
    trees = sorted({k for e in evals for k in e if k.startswith("tau_tree_")}, key=lambda k: int(k.rsplit("_", 1)[1]))
    rec["in_run_curve"] = {best: [{k: e.get(k) for k in ("step", "loss", "acc", "tau_chain", *trees)}
                                  | {"acc1": (e.get("acc_per_pos") or [None])[0]} for e in evals]}
    head = ["step", "held-out loss", "acc slot 1", "acc", "tau (est., chain)", *[f"tau (est., {k[4:]})" for k in trees]]
    rows = [[_f(e.get("step"), ","), _f(e.get("loss")), _f((e.get("acc_per_pos") or [None])[0], ".3f"),
             _f(e.get("acc"), ".3f"), _f(e.get("tau_chain")), *[_f(e.get(k)) for k in trees]] for e in evals]
    return [f"### {best}: held-out estimate while it trained", _table(head, rows), ""]


def ran_with(b, part: str) -> dict[str, Any]:
    """The plan a part ran with, as its record says (a summary may be written later, by a command without
    the run's overrides); this invocation's plan where the record has none."""
    return {**dataclasses.asdict(b.plan), **b.read(part).get("plan", {})}


def _generate_record(b) -> dict[str, Any]:
    try:
        return json.loads(b.data("regen.done").read_text())
    except (OSError, ValueError):
        return {}


def _runs_like(b, prefix: str) -> list[str]:
    return [p.name for p in (b.root / "runs").glob(f"{prefix}*") if (p / "summary.json").exists()]


def _span(lo, hi) -> str:
    return f"{lo}" if lo == hi else f"{lo}-{hi}"


def _specforge_section(b, rec: dict[str, Any]) -> list[str]:
    from quality import specforge_runs

    part = b.read("specforge")
    recipe = part.get("compared_with", "ce")
    sf_name, speed_name = specforge_runs(recipe)
    sf_dir = b.run_dir(sf_name)
    if not (sf_dir / "summary.json").exists():
        return []
    sf = json.loads((sf_dir / "summary.json").read_text())
    ours, theirs = run_row(b, recipe), run_row(b, sf_name)
    ours_speed = train_speed(b.run_dir(speed_name))
    sf_speed = (sf.get("steady") or {}).get("input_tok_s")
    shape, store = part.get("shape") or {}, part.get("store", "regen-bf16")
    ours_peak, sf_peak = train_peak_gb(b.run_dir(speed_name)), sf.get("peak_mem_gb") or train_peak_gb(sf_dir)
    rows = [[f"ours (`dflash train`, recipe {recipe})", _f(ours.get("steps"), ","), _f(ours.get("tau_est")),
             _f(ours.get("tau_chat_T0")), _f(ours.get("tau_chat_T1")), _f(ours.get("tau_code_T0")),
             _f(ours_speed, ",.0f"), _f(ours_peak, ".1f")],
            ["SpecForge 0.2 (OnlineDFlashModel)", _f(theirs.get("steps"), ","), _f(theirs.get("tau_est")),
             _f(theirs.get("tau_chat_T0")), _f(theirs.get("tau_chat_T1")), _f(theirs.get("tau_code_T0")),
             _f(sf_speed, ",.0f"), _f(sf_peak, ".1f")]]
    chunks = sf.get("objective_chunk_blocks") or {}
    ratio = ours_speed / sf_speed if ours_speed and sf_speed else None
    paired = paired_tau(b.eval_file(sf_name, "chat", 0.0), b.eval_file(recipe, "chat", 0.0))
    rec["specforge"] = {"compared_with": recipe, "store": store, "shape": shape,
                        "ours": ours, "specforge": theirs, "ours_tok_s_alone": ours_speed, "specforge_tok_s_alone": sf_speed,
                        "speed_ratio": ratio, "differences": sf.get("differences"),
                        "peak_mem_gb": {"ours": ours_peak, "specforge": sf_peak}, "specforge_loss_chunks": chunks,
                        "paired_chat_T0": paired}
    loss = "CE + decay on both sides" if recipe == "ce" else f"SpecForge's CE + decay against recipe {recipe}"
    anchors = f", {shape['max_anchors']} anchors a sample over {shape['tokens_per_batch']:,} tokens" if shape else ""
    return [f"## Side by side with SpecForge (store {store}, same batches, steps, lr schedule, "
            f"block 16{anchors}; {loss})",
            _table(["trainer", "steps", "held-out tau (est.)", "real tau chat T=0", "real tau chat T=1",
                    "real tau code T=0", "input tok/s, alone", "peak GB"], rows),
            f"Our steps are {_f(ratio)}x SpecForge's speed (steady state, each alone on the GPU). SpecForge "
            f"keeps its own optimizer details: {sf.get('differences')}."
            + (f" Its loss ran in chunks of {_span(chunks['min'], chunks['max'])} anchors (a {chunks['logits_budget_gib']} "
               "GiB logits budget; its default, one chunk of 128, ran an 80 GB GPU out of memory at the default "
               "recipe's batch)." if chunks.get("max") else "")
            + (f" Paired by prompt (chat T=0, {paired['prompts']} prompts): ours / SpecForge's tau {paired['ratio']:.3f}, "
               f"95% bootstrap {paired['ratio_ci95'][0]:.3f}-{paired['ratio_ci95'][1]:.3f} "
               f"({'separated' if paired['separated'] else 'within the noise of these prompts'}); ours better on "
               f"{paired['per_prompt']['b_wins']} prompts, SpecForge's on {paired['per_prompt']['a_wins']}."
               if paired and "ratio" in paired else "")
            + (f" Not paired by prompt: {paired['error']}." if paired and "error" in paired else ""), ""]


def paired_tau(a_eval: Path, b_eval: Path) -> dict[str, Any] | None:
    """bench/tau_compare.py's paired comparison (B against A) of two evals' per-prompt records, where both exist."""
    from quality import records_file
    from tau_compare import compare, paired_counts, read_records

    a, b = records_file(a_eval), records_file(b_eval)
    if not (a.exists() and b.exists()):
        return None
    try:
        return compare(paired_counts(read_records(a), read_records(b), 0)[1])
    except ValueError as e:  # other prompts or another target's output: no pairing, said in the record
        return {"error": str(e)}


def _online_section(b, rec: dict[str, Any]) -> list[str]:
    f = b.run_dir("online") / "online.json"
    if not f.exists():
        return []
    on = json.loads(f.read_text())
    modes = on.get("modes", {})
    rows = [[m, _f(v["step_s"] * 1e3, ".1f"), _f(v.get("target_s_per_step", 0) * 1e3, ".1f"), _f(v["input_tok_s"], ",.0f")]
            for m, v in modes.items()]
    out = ["## Online (target forward in every step) against offline (the store), same batches, one process",
           _table(["mode", "ms/step", "target forward ms/step", "input tok/s"], rows)]
    best = b.read("online").get("recipe")
    steps = (run_row(b, best).get("steps") if best else None) or b.plan.steps
    store = (rec.get("stores", {}).get("stores", {}) or {}).get("regen-bf16", {})
    extract_s = (store.get("run_record") or {}).get("seconds")
    data = b.read("data")
    gen_s = (data.get("jobs", {}).get("generate") or data.get("hf_generate") or {}).get("seconds")
    if "offline" in modes and "online" in modes:
        off = (extract_s or 0) + steps * modes["offline"]["step_s"]
        onl = steps * modes["online"]["step_s"]
        rec["online"] = {"modes": modes, "steps": steps, "extract_s": extract_s, "generate_s": gen_s,
                         "offline_total_s": off, "online_total_s": onl}
        out.append(f"For the {steps} steps of recipe {best}: offline = extract {_f(extract_s, '.0f')} s + train "
                   f"{_f(steps * modes['offline']['step_s'], '.0f')} s = **{_f(off, '.0f')} s**; online = "
                   f"**{_f(onl, '.0f')} s** (both after generating the data, {_f(gen_s, '.0f')} s). Each further "
                   f"epoch costs online the target's forward again; offline reads the store.")
    return out + [""]


def _goals(b, rec: dict[str, Any]) -> list[str]:
    goals = []
    best = rec.get("best")
    r16 = [r for r in rec.get("recipes", {}).values() if r.get("block") == 16 and r.get("tau_chat_T0")]
    top16 = max(r16, key=lambda r: r["tau_chat_T0"]) if r16 else {}
    goals.append(("real tau (T=0, block 16, chat) >= 3.0", top16.get("tau_chat_T0"),
                  (top16.get("tau_chat_T0") or 0) >= GOAL_TAU, top16.get("run", "")))
    alone = [r for r in rec.get("recipes", {}).values() if r.get("speedup_alone")]
    goals.append(("real speedup > 1 (best, alone)", alone[0]["speedup_alone"] if alone else None,
                  bool(alone) and alone[0]["speedup_alone"] > 1, alone[0]["run"] if alone else ""))
    sf = rec.get("specforge", {})
    if sf:
        o, t = sf["ours"].get("tau_chat_T0"), sf["specforge"].get("tau_chat_T0")
        both = o is not None and t is not None
        paired = sf.get("paired_chat_T0") or {}
        if both and "ratio_ci95" in paired:  # within the prompts' noise (the paired interval reaches 1) or better
            lo, hi = paired["ratio_ci95"]
            met, note = hi >= 1, f"ours / SpecForge's {paired['ratio']:.3f}, paired 95% {lo:.3f}-{hi:.3f}"
        else:
            met, note = both and o >= t * 0.98, ("within 2% counts as equal" if o is not None
                                                 else "our side's run is not in this root")
        goals.append((f"ours ({sf.get('compared_with', 'ce')}) tau >= SpecForge's (T=0 chat)",
                      f"{_f(o)} vs {_f(t)}" if both else None, met, note))
        goals.append(("our steps faster than SpecForge's", sf.get("speed_ratio"), (sf.get("speed_ratio") or 0) > 1, ""))
    var = rec.get("variants", {})
    if best and best in var:
        base, fp8 = var[best].get("tau_chat_T0"), var.get(f"{best}@fp8", {}).get("tau_chat_T0")
        from quality import STORES, VARIANT_TAGS

        # the original replies' run in the base run's codec where both exist (like for like), else either
        codec = STORES.get(var[best].get("store"), ((), None))[1]
        origs = sorted((s for s in VARIANT_TAGS if STORES[s][0] == ("orig",)), key=lambda s: STORES[s][1] != codec)
        orig_run = next((f"{best}@{VARIANT_TAGS[s]}" for s in origs
                         if var.get(f"{best}@{VARIANT_TAGS[s]}", {}).get("tau_chat_T0")), None)
        orig = var[orig_run]["tau_chat_T0"] if orig_run else None
        ratio = base / orig if base and orig else None
        goals.append(("regenerated / original tau >= 1.5", ratio, (ratio or 0) >= GOAL_REGEN_RATIO,
                      f"against {orig_run}" if orig_run else ""))
        rel = abs(fp8 - base) / base if base and fp8 else None
        goals.append(("fp8 within 2% of bf16 tau", rel, rel is not None and rel <= GOAL_FP8_REL, "relative difference"))
    ests = [r for r in rec.get("recipes", {}).values() if r.get("est_over_real")]
    worst = max(ests, key=lambda r: abs(r["est_over_real"] - 1)) if ests else {}
    goals.append(("held-out estimate within 10% of real tau (recipes, worst)", worst.get("est_over_real"),
                  bool(ests) and abs(worst["est_over_real"] - 1) <= GOAL_EST_REL, worst.get("run", "")))
    tree_runs = {n: t for n, t in rec.get("trees", {}).items() if "0" in t and "64" in t}
    if tree_runs:  # issue 18's goals, on the drafter with the best real tree-64 tau
        name = max(tree_runs, key=lambda n: tree_runs[n]["64"].get("tau") or 0)
        chain, t64 = tree_runs[name]["0"], tree_runs[name]["64"]
        ratio = t64["tau"] / chain["tau"] if t64.get("tau") and chain.get("tau") else None
        goals.append(("tree (budget 64) tau >= 1.3x the chain's", ratio, (ratio or 0) >= GOAL_TREE_RATIO, name))
        fast = t64.get("speedup") is not None and chain.get("speedup") is not None
        goals.append(("tree (budget 64) speedup >= the chain's (alone)",
                      f"{_f(t64.get('speedup'))} vs {_f(chain.get('speedup'))}",
                      fast and t64["speedup"] >= chain["speedup"], name))
        est = t64["est"] / t64["tau"] if t64.get("est") and t64.get("tau") else None
        goals.append(("held-out tau_tree_64 within 10% of real", est, est is not None and abs(est - 1) <= GOAL_EST_REL,
                      name))
    rec["goals"] = [{"goal": g, "value": v, "met": m, "note": n} for g, v, m, n in goals]
    # a goal whose value this root has not measured (e.g. fp8 trained, its bf16 twin in another root) is
    # said to be unmeasured, not missed
    rows = [[g, v if isinstance(v, str) else _f(v, ".3f"), "met" if m else "not measured" if v is None else "**missed**",
             n or ""] for g, v, m, n in goals]
    return ["## Goals", _table(["goal", "value", "", "note"], rows), ""]
