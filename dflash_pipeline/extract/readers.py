"""Input data -> records -> chat messages: the reading half of `dflash extract` (and of `dflash eval`'s prompts).

Why it is built this way:
- Bad rows are data, not crashes: among 800K conversations some are always broken. A row that cannot
  be decoded is yielded as a `BadRow` in its place, so it keeps its row number and sample id; whoever
  consumes the rows records it in a `DataReport` with file, row and reason. A missing file or an
  unknown format is the user's mistake and stops the run before any work (`check_inputs`).
- `sample_id` is the row's global position in the input (bad rows included), so ids survive reruns,
  other `limit`s and other worker counts, and the store can always point back at its source row.
- Readers stream (JSON lines, Parquet batches, a `raw_decode` loop for JSON arrays), so no input is
  loaded whole; the embedded ShareGPT dump is a JSON array cut off mid-record, read by the same loop.
- Records come as ShareGPT `conversations`, OpenAI `messages`, plain `text` or a `prompt`; they are
  turned into one form, chat messages or plain text, here, without a tokenizer. Messages keep what a
  chat template renders beyond the text: an assistant's reasoning (`reasoning_content`) and tool calls
  (arguments parsed to a JSON object, which every template can render), tool results as `tool` turns,
  and the record's tool definitions (`record_tools`).

The reasons a row is skipped (the keys of `DataReport.skipped_by_reason`) are all defined here,
including those found later by tokenization: they are one vocabulary, the report's.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dflash_pipeline.embedded import embedded_sharegpt_path
from dflash_pipeline.errors import InputDataError

RECORD_KEYS = ("conversations", "messages", "text", "prompt")
ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
    "assistant": "assistant",
    "model": "assistant",
    "function_call": "assistant",  # ShareGPT tool calls (LLaMA-Factory's convention)
    "system": "system",
    "developer": "system",
    "tool": "tool",
    "function": "tool",
    "observation": "tool",  # ShareGPT tool results
}
# Where records put an assistant turn's reasoning (as OpenAI-compatible servers return it).
REASONING_KEYS = ("reasoning_content", "reasoning", "thinking")
TOOLS_KEY = "tools"  # a conversation record's tool definitions (JSON schemas)
HELDOUT_EVERY = 64  # embedded record i belongs to the eval split iff i % 64 == 63
MAX_PROBLEMS_KEPT = 1000  # counts stay exact; only the examples are capped

# Why a row was skipped: the keys of DataReport.skipped_by_reason.
NOT_JSON = "not JSON"
NOT_OBJECT = "not a JSON object"
UNKNOWN_FORM = "unknown record form"
UNKNOWN_ROLE = "unknown role"
EMPTY_CONVERSATION = "empty conversation"
EMPTY_CONTENT = "empty content"
NO_ASSISTANT = "no assistant turn"
NOT_IN_RENDERING = "assistant content not found in rendering"
TEMPLATE_ERROR = "chat template error"
NO_SUPERVISED = "no supervised token within max_length"
NO_PROMPT = "no prompt"

_JSON_READ_CHARS = 1 << 20
_SEPARATORS = re.compile(r"[\s,]*")  # between elements of a JSON array

# A record as chat messages ({role, content, ...}: see record_messages), or its plain text.
Messages = list[dict[str, Any]]


@dataclass
class Problem:
    file: str
    row: int  # 1-based row in its file; for JSON lines the line number
    reason: str  # one of the reason constants above
    detail: str


@dataclass
class DataReport:
    """What happened to every row read; printed by the CLI and written with the store."""

    num_rows_read: int = 0
    num_samples: int = 0
    num_skipped: int = 0
    skipped_by_reason: dict[str, int] = field(default_factory=Counter)
    problems: list[Problem] = field(default_factory=list)  # the first MAX_PROBLEMS_KEPT skipped rows
    num_truncated: int = 0  # kept samples cut to max_length
    num_dropped_no_anchor: int = 0  # no two consecutive supervised tokens: no DFlash anchor fits
    num_tokens: int = 0  # of kept samples
    num_supervised_tokens: int = 0  # of kept samples

    def skip(self, file: str, row: int, reason: str, detail: str) -> None:
        self.num_skipped += 1
        self.skipped_by_reason[reason] += 1
        if len(self.problems) < MAX_PROBLEMS_KEPT:
            self.problems.append(Problem(file, row, reason, detail))

    def summary_lines(self, num_examples: int = 5) -> list[str]:
        """Human-readable lines: totals, skipped rows by reason, the first few with file:row."""
        share = self.num_supervised_tokens / max(self.num_tokens, 1)
        lines = [
            f"rows read: {self.num_rows_read:,}; samples kept: {self.num_samples:,} "
            f"({self.num_truncated:,} truncated to max_length)",
            f"tokens: {self.num_tokens:,}; supervised: {self.num_supervised_tokens:,} ({share:.1%})",
        ]
        if self.num_dropped_no_anchor:
            lines.append(f"dropped, no two consecutive supervised tokens: {self.num_dropped_no_anchor:,}")
        if self.num_skipped:
            lines.append(f"skipped rows: {self.num_skipped:,}")
            for reason, count in self.reasons_by_count():
                lines.append(f"  {reason}: {count:,}")
            for p in self.problems[:num_examples]:
                lines.append(f"  e.g. {p.file}:{p.row}: {p.reason} ({p.detail})")
        return lines

    def reasons_by_count(self) -> list[tuple[str, int]]:
        """(reason, rows skipped for it), most common first."""
        return sorted(self.skipped_by_reason.items(), key=lambda kv: -kv[1])

    def skipped_line(self, detail_chars: int = 160) -> str:
        """The skipped rows in one line (for an error message): per reason, most common first, its count
        and its first row with the detail."""
        parts = []
        for reason, count in self.reasons_by_count():
            first = next((p for p in self.problems if p.reason == reason), None)
            at = f", first at row {first.row}: {first.detail[:detail_chars]}" if first else ""
            parts.append(f"{count} row(s) {reason}{at}")
        return f"{self.num_rows_read} row(s) read: " + "; ".join(parts)


@dataclass(frozen=True)
class BadRow:
    """Why a row is skipped. Readers yield it in place of a row they cannot decode, so the row keeps its
    place in the order; tokenizer workers return it (an exception with arguments would not unpickle)."""

    reason: str
    detail: str


class BadRowError(Exception):
    """Raised where a row turns out to be unusable; carries the `BadRow` to report."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.bad = BadRow(reason, detail)


@dataclass(frozen=True)
class SourceRow:
    """Where a record comes from."""

    file: str
    row: int  # 1-based, in its file
    sample_id: int  # global row index in the input, bad rows included


# ---------------------------------------------------------------- input files


def _first_char(path: Path) -> str:
    """The first non-whitespace character of a text file ('' when there is none)."""
    with open(path, encoding="utf-8-sig", errors="replace") as f:
        while chunk := f.read(4096):
            if stripped := chunk.lstrip():
                return stripped[0]
    return ""


def _file_kind(path: Path) -> str:
    """'jsonl', 'json_array' or 'parquet'; raises InputDataError for anything else."""
    if not path.is_file():
        raise InputDataError(f"{path}: no such file; check the path given as input data")
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        import pyarrow.parquet as pq  # here, not at the top: tokenizer workers import this module and never read files

        try:
            names = pq.ParquetFile(path).schema_arrow.names
        except Exception as e:  # pyarrow raises several types for a non-Parquet file
            raise InputDataError(f"{path}: not a readable Parquet file ({e})") from None
        if not any(k in names for k in RECORD_KEYS):
            expected, found = ", ".join(RECORD_KEYS), ", ".join(names)
            raise InputDataError(f"{path}: Parquet file has none of the columns {expected} (it has {found})")
        return "parquet"
    if suffix not in (".jsonl", ".json"):
        raise InputDataError(f"{path}: unknown input format '{suffix}'; use .jsonl, .json or .parquet")
    first = _first_char(path)
    if first == "{":
        return "jsonl"
    if first == "[" and suffix == ".json":
        return "json_array"
    expected = "'{' (JSON lines)" if suffix == ".jsonl" else "'[' (a JSON array) or '{' (JSON lines)"
    found = repr(first) if first else "an empty file"
    raise InputDataError(f"{path}: expected {expected}, found {found}; not a known data format")


def check_inputs(paths: Iterable[str]) -> None:
    """Raise InputDataError, naming the file, for any path that is missing or not a known format."""
    for p in paths:
        _file_kind(Path(p))


def _iter_jsonl(path: Path) -> Iterator[tuple[int, Any]]:
    with open(path, "rb") as f:
        for row, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield row, json.loads(line)
            except ValueError as e:  # JSONDecodeError and UnicodeDecodeError
                yield row, BadRow(NOT_JSON, str(e))


def _iter_json_array(path: Path, errors: str = "strict") -> Iterator[tuple[int, Any]]:
    """The elements of a JSON array, one at a time, without loading the file.

    A syntax error cannot be skipped over inside an array, so it ends the file with one BadRow.
    """
    decoder = json.JSONDecoder()
    row = 0
    with open(path, encoding="utf-8-sig", errors=errors) as f:
        try:
            buf = f.read(_JSON_READ_CHARS)
            pos = buf.index("[") + 1  # _file_kind saw '[' first
            eof = False
            while True:
                pos = _SEPARATORS.match(buf, pos).end()
                if pos < len(buf):
                    if buf[pos] == "]":
                        return
                    try:
                        value, end = decoder.raw_decode(buf, pos)
                    except json.JSONDecodeError as e:
                        if eof:
                            yield row + 1, BadRow(NOT_JSON, f"{e}; the rest of the file is not read")
                            return
                    else:
                        # A value that reaches the end of the buffer may continue in the next read.
                        if end < len(buf) or eof:
                            row += 1
                            yield row, value
                            pos = end
                            continue
                elif eof:
                    yield row + 1, BadRow(NOT_JSON, "file ends inside the JSON array")
                    return
                # Read at least as much as is pending, so one huge element is re-parsed O(log size) times.
                more = f.read(max(_JSON_READ_CHARS, len(buf) - pos))
                eof = not more
                buf, pos = buf[pos:] + more, 0
        except UnicodeDecodeError as e:
            yield row + 1, BadRow(NOT_JSON, f"not UTF-8 ({e}); the rest of the file is not read")


def _iter_parquet(path: Path) -> Iterator[tuple[int, Any]]:
    import pyarrow.parquet as pq

    pf = pq.ParquetFile(path)
    columns = [k for k in (*RECORD_KEYS, TOOLS_KEY) if k in pf.schema_arrow.names]
    row = 0
    for batch in pf.iter_batches(batch_size=1024, columns=columns):
        for record in batch.to_pylist():
            row += 1
            yield row, record


def iter_embedded_rows(split: str) -> Iterator[tuple[int, dict]]:
    """(record index, record) of the embedded ShareGPT dump: 'eval' is every index % 64 == 63, 'train' the rest.

    Holding the eval prompts out of the default training data keeps `dflash eval` honest.
    """
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', not {split!r}")
    want_eval = split == "eval"
    # The dump is cut off inside a record (and possibly inside a UTF-8 sequence): keep the complete ones.
    for row, record in _iter_json_array(embedded_sharegpt_path(), errors="replace"):
        index = row - 1
        if not isinstance(record, BadRow) and (index % HELDOUT_EVERY == HELDOUT_EVERY - 1) == want_eval:
            yield index, record


def iter_rows(paths: list[str] | None, split: str) -> Iterator[tuple[SourceRow, Any]]:
    """(where, record) for every row of the input, in order; a row that cannot be decoded comes as a
    `BadRow`. With no paths, the embedded ShareGPT `split` ('train' or 'eval').

    Not a generator itself, so bad paths raise here, before any work.
    """
    if not paths:
        return _embedded_rows(split)
    check_inputs(paths)
    return _file_rows(paths)


def _embedded_rows(split: str) -> Iterator[tuple[SourceRow, Any]]:
    name = str(embedded_sharegpt_path())
    for index, record in iter_embedded_rows(split):
        yield SourceRow(name, index + 1, index), record


def _file_rows(paths: list[str]) -> Iterator[tuple[SourceRow, Any]]:
    readers = {"jsonl": _iter_jsonl, "json_array": _iter_json_array, "parquet": _iter_parquet}
    offset = 0
    for p in paths:
        path = Path(p)
        last = 0
        for last, record in readers[_file_kind(path)](path):
            yield SourceRow(str(p), last, offset + last - 1), record
        offset += last  # the next file's ids start after this file's last row


# ---------------------------------------------------------------- records -> messages


def _content_text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise BadRowError(UNKNOWN_FORM, f"{where}: content part of type {kind!r}, only text is supported")
            texts.append(part["text"])
        return "\n".join(texts)  # as vLLM joins text parts, so training matches what a server renders
    if content is None:
        return ""
    raise BadRowError(UNKNOWN_FORM, f"{where}: content is a {type(content).__name__}")


def record_messages(record: Any) -> Messages | str:
    """The record as chat messages, or its plain text. Raises BadRowError.

    A message is {role, content} (role: system, user, assistant or tool), and, where the record has
    them, `reasoning_content` (assistant), `tool_calls` (assistant: [{type, function: {name,
    arguments}}], arguments a JSON object) and `tool_call_id` / `name` (tool).
    """
    if not isinstance(record, dict):
        raise BadRowError(NOT_OBJECT, f"a JSON {type(record).__name__}")
    # Parquet rows carry every known column, None where unused: None counts as absent.
    if record.get("conversations") is not None:
        key, turns, role_key, content_key = "conversations", record["conversations"], "from", "value"
    elif record.get("messages") is not None:
        key, turns, role_key, content_key = "messages", record["messages"], "role", "content"
    elif record.get("text") is not None or record.get("prompt") is not None:
        key = "text" if record.get("text") is not None else "prompt"
        text = _content_text(record[key], key)
        if not text.strip():
            raise BadRowError(EMPTY_CONTENT, f"'{key}' is empty")
        return text if key == "text" else [{"role": "user", "content": text}]
    else:
        raise BadRowError(UNKNOWN_FORM, f"keys {sorted(record)[:6]}; expected one of {', '.join(RECORD_KEYS)}")
    if not isinstance(turns, list):
        raise BadRowError(UNKNOWN_FORM, f"'{key}' is a {type(turns).__name__}, not a list")
    if not turns:
        raise BadRowError(EMPTY_CONVERSATION, f"'{key}' is empty")
    return [_message(turn, i, role_key, content_key) for i, turn in enumerate(turns, 1)]


def _message(turn: Any, i: int, role_key: str, content_key: str) -> dict[str, Any]:
    """Turn i (1-based) of a record as a chat message. Raises BadRowError."""
    if not isinstance(turn, dict):
        raise BadRowError(UNKNOWN_FORM, f"turn {i} is a {type(turn).__name__}, not an object")
    raw_role = turn.get(role_key)
    role = ROLES.get(raw_role) if isinstance(raw_role, str) else None
    if role is None:
        raise BadRowError(UNKNOWN_ROLE, f"turn {i}: '{role_key}' is {raw_role!r}")
    where = f"turn {i}"
    if raw_role == "function_call":  # ShareGPT (LLaMA-Factory): the turn's value is the call, as JSON
        calls, content = _json_value(turn.get(content_key), where), ""
    else:
        calls = turn.get("tool_calls") if turn.get("tool_calls") is not None else turn.get("function_call")
        content = _content_text(turn.get(content_key), where)
    message: dict[str, Any] = {"role": role, "content": content}
    if role == "assistant":
        reasoning = next((turn[k] for k in REASONING_KEYS if turn.get(k) is not None), None)
        if reasoning is not None:
            message["reasoning_content"] = _content_text(reasoning, f"{where} reasoning")
        if calls:
            message["tool_calls"] = _tool_calls(calls, where)
            if not content.strip():
                message["content"] = ""  # a call alone: templates test the content for emptiness
    elif role == "tool":
        message.update({k: turn[k] for k in ("tool_call_id", "name") if isinstance(turn.get(k), str)})
    supervised = message.get("reasoning_content", "").strip() or message.get("tool_calls")
    if not message["content"].strip() and not supervised and role != "tool":  # a tool may return nothing
        raise BadRowError(EMPTY_CONTENT, f"{where} ({role})")
    return message


def _json_value(value: Any, where: str) -> Any:
    """`value`, or the JSON it holds when it is a string. Raises BadRowError."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except ValueError:
        raise BadRowError(UNKNOWN_FORM, f"{where}: not JSON: {value[:60]!r}") from None


def _tool_calls(calls: Any, where: str) -> list[dict[str, Any]]:
    """OpenAI tool calls (or a bare {name, arguments}, or a list of them) as [{type, function: {name,
    arguments}}] with the arguments as a JSON object: templates iterate over them (Qwen3.5) or dump them.
    Raises BadRowError."""
    calls = calls if isinstance(calls, list) else [calls]
    out = []
    for j, call in enumerate(calls, 1):
        fn = call.get("function", call) if isinstance(call, dict) else None
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str) or not name:
            raise BadRowError(UNKNOWN_FORM, f"{where}: tool call {j} has no function name")
        arguments = _json_value(fn.get("arguments", {}), f"{where}: tool call {j} arguments")
        if not isinstance(arguments, dict):
            raise BadRowError(UNKNOWN_FORM, f"{where}: tool call {j} arguments are not a JSON object")
        out.append({"type": "function", "function": {"name": name, "arguments": arguments}})
        if isinstance(call.get("id"), str):
            out[-1]["id"] = call["id"]
    return out


def record_tools(record: Any) -> list[dict[str, Any]] | None:
    """The tool definitions a conversation record offers (`tools`: a list of JSON schemas, or that list
    as a JSON string), for the chat template's system prompt; None when it has none. Raises BadRowError."""
    tools = record.get(TOOLS_KEY) if isinstance(record, dict) else None
    if tools is None:
        return None
    tools = _json_value(tools, "'tools'")
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise BadRowError(UNKNOWN_FORM, "'tools' is not a list of JSON objects")
    return tools or None


GENERATED_KEY = "dflash"  # what `dflash generate` adds to each output row: sample id, source, its replies


def reply_cut_off(record: Any) -> bool:
    """Whether the record's last reply was cut at `dflash generate`'s token limit (finish "length"): the
    target did not write the end of turn that the chat template closes that reply with. A cut reply ends
    its conversation (generate replays no turn after it), so it is always the last assistant turn."""
    info = record.get(GENERATED_KEY) if isinstance(record, dict) else None
    replies = info.get("replies") if isinstance(info, dict) else None
    last = replies[-1] if isinstance(replies, list) and replies else None
    return isinstance(last, dict) and last.get("finish") == "length"


def prompt_messages(record: Any) -> Messages:
    """The conversation before its first reply (what a model is asked to continue). Raises BadRowError,
    also for a `BadRow` in place of the record."""
    return turn_prompts(record)[0]


def turn_prompts(record: Any) -> list[Messages]:
    """Every point of the conversation where the assistant is asked to reply: the messages before its
    first reply, then the history before each later reply that follows a user turn, and the whole
    conversation when it ends with a user turn after a reply. Raises BadRowError as `prompt_messages`."""
    if isinstance(record, BadRow):
        raise BadRowError(record.reason, record.detail)
    messages = record_messages(record)
    if isinstance(messages, str):
        raise BadRowError(NO_PROMPT, "a plain 'text' record has no prompt")
    replies = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    first_reply = replies[0] if replies else len(messages)
    if not any(m["role"] == "user" for m in messages[:first_reply]):
        raise BadRowError(NO_PROMPT, "no user turn before the first assistant turn")
    ends = [first_reply] + [i for i in [*replies[1:], len(messages)] if i > first_reply
                            and messages[i - 1]["role"] == "user"]
    return [messages[:i] for i in ends]
