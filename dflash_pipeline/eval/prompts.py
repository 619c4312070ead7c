"""The prompts `dflash eval` decodes: from one or several files, first turns or every turn.

Each file is read on its own, with its own `--num-prompts` limit, so that one run covers a chat, a
code and a math set in proportions the user chose, and the report can say tau and speedup per file.
A prompt keeps where it came from (file, row, turn): divergences and per-prompt records name it.

By default a prompt is a conversation up to its first reply (what the DFlash authors and the serving
benchmarks decode); `all_turns` replays every later point where the assistant replies, its history as
the prompt (extract.chat.iter_prompt_turns), which is where long-context acceptance shows.
"""

from __future__ import annotations

from dataclasses import dataclass

from dflash_pipeline.errors import DFlashError

EMBEDDED = "embedded-sharegpt-eval"  # the label of the default prompts (the embedded held-out split)


@dataclass
class Prompt:
    file: str          # the prompt file as given, or EMBEDDED
    sample_id: int     # the conversation's row in that file (0-based; the embedded dump's record index)
    turn: int          # 0: up to the first reply; k: up to the (k + 1)-th reply that follows a user turn
    ids: list[int]


def as_prompt(p) -> Prompt:
    """A Prompt, or a (sample_id, ids) pair as tests and callers with bare token ids give it."""
    if isinstance(p, Prompt):
        return p
    sample_id, ids = p
    return Prompt("", int(sample_id), 0, [int(t) for t in ids])


def load_prompts(paths: list[str] | None, tokenizer, limit: int, all_turns: bool = False,
                 template_kwargs: dict | None = None) -> list[Prompt]:
    """At most `limit` prompts of each file (the embedded held-out split without paths), in file order,
    rendered with the chat template's `template_kwargs` (e.g. enable_thinking), as extraction renders them."""
    from dflash_pipeline.extract.chat import iter_prompt_turns
    from dflash_pipeline.extract.readers import DataReport, check_inputs

    check_inputs(paths or [])  # every file is checked before any is tokenized
    prompts: list[Prompt] = []
    for path in paths or [None]:
        label = EMBEDDED if path is None else path
        report = DataReport()
        got = [Prompt(label, sid, turn, ids.tolist())
               for sid, turn, ids in iter_prompt_turns(None if path is None else [path], tokenizer, limit,
                                                       split="eval", report=report, all_turns=all_turns,
                                                       template_kwargs=template_kwargs)]
        if not got:
            where = path or "the embedded held-out split"
            why = (f" of {report.skipped_line()}" if report.num_skipped
                   else " (each record needs a user turn before its first reply)")
            raise DFlashError(f"{where}: no usable prompts{why}")
        prompts += got
    return prompts


def file_labels(prompts: list[Prompt]) -> list[str]:
    """The files of `prompts`, each once, in order of first appearance."""
    return list(dict.fromkeys(p.file for p in prompts))


__all__ = ["Prompt", "EMBEDDED", "as_prompt", "load_prompts", "file_labels"]
