"""Multi-turn replay: which prompt the target answers next, and the conversation it leaves behind.

A conversation is cut into reply slots: each maximal run of assistant turns is one slot, and turns
after the last assistant turn that end on a user (or tool) turn get one more (a prompt-only record is
one such slot). Slot j is answered given everything before it with the replies of slots < j replaced
by the target's own: the drafter is trained on conversations the target could have had, so each reply
must follow from the target's earlier replies, not from another model's. `--turns first` keeps only
slot 0 and drops what follows it.

A reply that hits a token limit is kept (marked in the row) and ends the replay: what follows was
written for a complete reply. An empty reply is dropped and ends the replay as well; a conversation
left without any reply is dropped whole. Both are counted by the caller.

The output row keeps the input's form (ShareGPT `conversations` with from/value, or OpenAI
`messages`; a `prompt` record becomes `messages`), its `id` and `tools` if it had them (every prompt
is rendered with the record's tools, as extraction renders the record), a tool turn's call id and
name, and a `dflash` entry with the source row and, per reply, the tokens generated and why it ended.
A reply is the target's text as it wrote it: a tool call it makes is in that text, in its template's
own syntax, and the original tool results that follow answer the original call.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from dflash_pipeline.extract.readers import (
    GENERATED_KEY, NO_PROMPT, TOOLS_KEY, BadRow, BadRowError, DataReport, iter_rows, record_messages, record_tools,
)
from dflash_pipeline.schemas.generate import STOP

SHAREGPT_ROLES = {"user": "human", "assistant": "gpt", "system": "system", "tool": "tool"}
TOOL_TURN_KEYS = ("tool_call_id", "name")


@dataclass(frozen=True)
class Conversation:
    """A usable input row as chat messages, with where it came from."""

    file: str
    row: int  # 1-based, in its file
    sample_id: int  # global row index in the input, bad rows included (as for extraction)
    form: str  # the record's key: 'conversations' (ShareGPT), 'messages' (OpenAI) or 'prompt'
    messages: list[dict[str, Any]]  # {role: system|user|assistant|tool, content} (+ a tool turn's call id, name)
    record_id: Any = None  # the record's own "id", if it has one
    tools: list[dict[str, Any]] | None = None  # the record's tool definitions: every prompt is rendered with them


def iter_conversations(paths: list[str] | None, split: str = "train",
                       report: DataReport | None = None) -> Iterator[Conversation]:
    """Every row of the input that is a conversation or a prompt, in input order, untokenized.

    Rows that are not (bad JSON, unknown form or role, empty content, plain `text`) are skipped and
    recorded in `report`, as extraction reports them. With no paths, the embedded ShareGPT `split`.
    """
    report = DataReport() if report is None else report
    for where, record in iter_rows(paths, split):
        report.num_rows_read += 1
        try:
            if isinstance(record, BadRow):
                raise BadRowError(record.reason, record.detail)
            messages = record_messages(record)
            if isinstance(messages, str):
                raise BadRowError(NO_PROMPT, "a plain 'text' record has no prompt")
            tools = record_tools(record)
        except BadRowError as e:
            report.skip(where.file, where.row, e.bad.reason, e.bad.detail)
            continue
        form = next((k for k in ("conversations", "messages") if record.get(k) is not None), "prompt")
        report.num_samples += 1
        yield Conversation(where.file, where.row, where.sample_id, form, messages, record.get("id"), tools)


class NoPrompt(ValueError):
    """The conversation has no user turn before its first reply slot."""


@dataclass
class Reply:
    text: str
    num_tokens: int  # tokens the target generated, the stop token included
    finish: str      # schemas.generate.FINISH_REASONS


def reply_slots(messages: list[dict[str, str]], turns: str) -> list[list[dict[str, str]]]:
    """The non-assistant turns before each reply slot (slot j's own new context)."""
    segments: list[list[dict[str, str]]] = []
    current: list[dict[str, str]] = []
    in_reply = False
    for m in messages:
        if m["role"] == "assistant":
            if not in_reply:
                segments.append(current)
                current = []
            in_reply = True
        else:
            current.append(m)
            in_reply = False
    if any(m["role"] in ("user", "tool") for m in current):
        segments.append(current)  # the conversation ends on a question: answer it too
    if not segments or not any(m["role"] == "user" for m in segments[0]):
        raise NoPrompt("no user turn before the first assistant turn")
    return segments[:1] if turns == "first" else segments


@dataclass
class Replay:
    """One conversation being regenerated."""

    conv: Conversation
    segments: list[list[dict[str, str]]]
    replies: list[Reply] = field(default_factory=list)
    ended: str | None = None   # why the replay stopped before the last slot: 'empty', 'length', 'context', ...

    @classmethod
    def start(cls, conv: Conversation, turns: str) -> "Replay":
        return cls(conv, reply_slots(conv.messages, turns))

    @property
    def done(self) -> bool:
        return self.ended is not None or len(self.replies) == len(self.segments)

    @property
    def turn(self) -> int:
        """Index of the reply slot answered next."""
        return len(self.replies)

    def history(self) -> list[dict[str, str]]:
        """The messages the next reply answers: earlier turns with the target's own replies."""
        out: list[dict[str, str]] = []
        for j, segment in enumerate(self.segments[: self.turn + 1]):
            out.extend(segment)
            if j < self.turn:
                out.append({"role": "assistant", "content": self.replies[j].text})
        return out

    def add(self, reply: Reply) -> None:
        assert not self.done
        if not reply.text.strip():
            self.ended = "empty"
            return
        self.replies.append(reply)
        if reply.finish != STOP and not self.done:
            self.ended = reply.finish

    def stop(self, why: str) -> None:
        """End the replay before the next slot (e.g. its prompt no longer fits the sequence)."""
        self.ended = why

    def messages(self) -> list[dict[str, str]]:
        """The regenerated conversation: every answered slot's turns and its reply."""
        out: list[dict[str, str]] = []
        for segment, reply in zip(self.segments, self.replies):
            out.extend(segment)
            out.append({"role": "assistant", "content": reply.text})
        return out

    def output_row(self) -> dict[str, Any] | None:
        """The output record, in the input's form; None when no reply survived."""
        if not self.replies:
            return None
        msgs = self.messages()
        # A tool turn keeps its call id and name (readers read them in either form).
        extra = [{k: m[k] for k in TOOL_TURN_KEYS if k in m} for m in msgs]
        if self.conv.form == "conversations":
            row: dict[str, Any] = {"conversations": [{"from": SHAREGPT_ROLES[m["role"]], "value": m["content"], **x}
                                                     for m, x in zip(msgs, extra)]}
        else:
            row = {"messages": [{"role": m["role"], "content": m["content"], **x} for m, x in zip(msgs, extra)]}
        if self.conv.record_id is not None:
            row["id"] = self.conv.record_id
        if self.conv.tools:
            row[TOOLS_KEY] = self.conv.tools
        row[GENERATED_KEY] = {
            "sample_id": self.conv.sample_id,
            "source": f"{self.conv.file}:{self.conv.row}",
            "replies": [{"tokens": r.num_tokens, "finish": r.finish} for r in self.replies],
        }
        return row


def conversation_to_json(conv: Conversation) -> dict[str, Any]:
    return {"file": conv.file, "row": conv.row, "sample_id": conv.sample_id, "form": conv.form,
            "messages": conv.messages, "id": conv.record_id, "tools": conv.tools}


def conversation_from_json(d: dict[str, Any]) -> Conversation:
    return Conversation(d["file"], d["row"], d["sample_id"], d["form"], d["messages"], d.get("id"), d.get("tools"))
