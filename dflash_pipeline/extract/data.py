"""Conversations -> token ids + loss masks: the first stage of `dflash extract`.

Why it is built this way:
- The loss mask comes from the target's own chat template. Most templates have no `{% generation %}`
  markers, and rendering prefixes of a conversation fails for templates that render a turn
  differently depending on what follows it (Qwen3 adds an empty `<think>` block to the turns after the
  last user query). So each conversation is rendered twice: as is, and with every content replaced by
  a unique mark. The text between marks is the template's scaffolding (role headers, inserted
  blocks); walking the real rendering along it gives each content's exact character span, however
  short or repeated the content. Where the scaffolding depends on the content (Qwen3 splitting a reply
  that holds `</think>`), each content is searched forward in message order instead. Assistant spans
  are mapped to tokens through the fast tokenizer's offsets and extended over the special token that
  closes the turn: the drafter learns what the target generates, the reply and its end-of-turn token,
  never role headers, generation prompts or text the template inserts.
- Bad rows are data, not crashes: among 800K conversations some are always broken. Each is skipped and
  recorded with file, row and reason. A missing file or an unknown format is the user's mistake and
  stops the run before any work (`check_inputs`).
- `sample_id` is the row's global position in the input (bad rows included), so ids survive reruns,
  other `limit`s and other worker counts, and the store can always point back at its source row.
- Readers stream (JSON lines, Parquet batches, a `raw_decode` loop for JSON arrays), so no input is
  loaded whole; the embedded ShareGPT dump is a JSON array cut off mid-record, read by the same loop.
- Tokenizing dominates (~0.4M tokens/s per core), so `workers > 1` sends chunks of rows to spawned
  processes, a bounded number in flight, and consumes the results in input order: the output and the
  report are identical for any worker count.

Legend: T = tokens of one sample.
"""

from __future__ import annotations

import json
import os
import pickle
import re
from collections import Counter, deque
from collections.abc import Iterable, Iterator
from contextlib import closing
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass, field
from itertools import islice
from multiprocessing import get_context
from pathlib import Path
from typing import Any

import jinja2
import numpy as np

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
    "system": "system",
    "tool": "tool",
}
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

_CHUNK_ROWS = 64  # rows per task sent to a worker: large enough to amortise pickling, small for limit
_JSON_READ_CHARS = 1 << 20
_SEPARATORS = re.compile(r"[\s,]*")  # between elements of a JSON array


@dataclass
class TokenizedSample:
    sample_id: int  # global row index in the input, bad rows included
    input_ids: np.ndarray  # int32 [T]
    loss_mask: np.ndarray  # bool [T]: True where the target generated the token (assistant turns)


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
            for reason, count in sorted(self.skipped_by_reason.items(), key=lambda kv: -kv[1]):
                lines.append(f"  {reason}: {count:,}")
            for p in self.problems[:num_examples]:
                lines.append(f"  e.g. {p.file}:{p.row}: {p.reason} ({p.detail})")
        return lines


@dataclass(frozen=True)
class _Bad:
    """Why a row is skipped. Readers yield it in place of a row they cannot decode, so the row keeps its
    place in the order; workers return it (an exception with arguments would not unpickle)."""

    reason: str
    detail: str


class _BadRow(Exception):
    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.bad = _Bad(reason, detail)


@dataclass
class _Outcome:
    sample: TokenizedSample | None = None
    truncated: bool = False
    dropped_no_anchor: bool = False
    bad: _Bad | None = None


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
        import pyarrow.parquet as pq  # here, not at the top: workers import this module and never read files

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
                yield row, _Bad(NOT_JSON, str(e))


def _iter_json_array(path: Path, errors: str = "strict") -> Iterator[tuple[int, Any]]:
    """The elements of a JSON array, one at a time, without loading the file.

    A syntax error cannot be skipped over inside an array, so it ends the file with one _Bad row.
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
                            yield row + 1, _Bad(NOT_JSON, f"{e}; the rest of the file is not read")
                            return
                    else:
                        # A value that reaches the end of the buffer may continue in the next read.
                        if end < len(buf) or eof:
                            row += 1
                            yield row, value
                            pos = end
                            continue
                elif eof:
                    yield row + 1, _Bad(NOT_JSON, "file ends inside the JSON array")
                    return
                # Read at least as much as is pending, so one huge element is re-parsed O(log size) times.
                more = f.read(max(_JSON_READ_CHARS, len(buf) - pos))
                eof = not more
                buf, pos = buf[pos:] + more, 0
        except UnicodeDecodeError as e:
            yield row + 1, _Bad(NOT_JSON, f"not UTF-8 ({e}); the rest of the file is not read")


def _iter_parquet(path: Path) -> Iterator[tuple[int, Any]]:
    import pyarrow.parquet as pq

    pf = pq.ParquetFile(path)
    columns = [k for k in RECORD_KEYS if k in pf.schema_arrow.names]
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
        if not isinstance(record, _Bad) and (index % HELDOUT_EVERY == HELDOUT_EVERY - 1) == want_eval:
            yield index, record


@dataclass(frozen=True)
class _Row:
    file: str
    row: int  # 1-based, in its file
    sample_id: int


def _iter_rows(paths: list[str] | None, split: str) -> Iterator[tuple[_Row, Any]]:
    """Every row of the input, in order, with its global sample id; the embedded split when no paths.

    Not a generator itself, so bad paths raise here, before any work.
    """
    if not paths:
        return _embedded_rows(split)
    check_inputs(paths)
    return _file_rows(paths)


def _embedded_rows(split: str) -> Iterator[tuple[_Row, Any]]:
    name = str(embedded_sharegpt_path())
    for index, record in iter_embedded_rows(split):
        yield _Row(name, index + 1, index), record


def _file_rows(paths: list[str]) -> Iterator[tuple[_Row, Any]]:
    readers = {"jsonl": _iter_jsonl, "json_array": _iter_json_array, "parquet": _iter_parquet}
    offset = 0
    for p in paths:
        path = Path(p)
        last = 0
        for last, record in readers[_file_kind(path)](path):
            yield _Row(str(p), last, offset + last - 1), record
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
                raise _BadRow(UNKNOWN_FORM, f"{where}: content part of type {kind!r}, only text is supported")
            texts.append(part["text"])
        return "\n".join(texts)  # as vLLM joins text parts, so training matches what a server renders
    if content is None:
        return ""
    raise _BadRow(UNKNOWN_FORM, f"{where}: content is a {type(content).__name__}")


def _messages(record: Any) -> list[dict[str, str]] | str:
    """The record as chat messages ({role, content}), or its plain text. Raises _BadRow."""
    if not isinstance(record, dict):
        raise _BadRow(NOT_OBJECT, f"a JSON {type(record).__name__}")
    # Parquet rows carry every known column, None where unused: None counts as absent.
    if record.get("conversations") is not None:
        key, turns, role_key, content_key = "conversations", record["conversations"], "from", "value"
    elif record.get("messages") is not None:
        key, turns, role_key, content_key = "messages", record["messages"], "role", "content"
    elif record.get("text") is not None or record.get("prompt") is not None:
        key = "text" if record.get("text") is not None else "prompt"
        text = _content_text(record[key], key)
        if not text.strip():
            raise _BadRow(EMPTY_CONTENT, f"'{key}' is empty")
        return text if key == "text" else [{"role": "user", "content": text}]
    else:
        raise _BadRow(UNKNOWN_FORM, f"keys {sorted(record)[:6]}; expected one of {', '.join(RECORD_KEYS)}")
    if not isinstance(turns, list):
        raise _BadRow(UNKNOWN_FORM, f"'{key}' is a {type(turns).__name__}, not a list")
    if not turns:
        raise _BadRow(EMPTY_CONVERSATION, f"'{key}' is empty")
    messages = []
    for i, turn in enumerate(turns, 1):
        if not isinstance(turn, dict):
            raise _BadRow(UNKNOWN_FORM, f"turn {i} is a {type(turn).__name__}, not an object")
        raw_role = turn.get(role_key)
        role = ROLES.get(raw_role) if isinstance(raw_role, str) else None
        if role is None:
            raise _BadRow(UNKNOWN_ROLE, f"turn {i}: '{role_key}' is {raw_role!r}")
        content = _content_text(turn.get(content_key), f"turn {i}")
        if not content.strip():
            raise _BadRow(EMPTY_CONTENT, f"turn {i} ({role})")
        messages.append({"role": role, "content": content})
    return messages


# ---------------------------------------------------------------- messages -> tokens + mask


def _mark(i: int) -> str:
    """Stands in for message i's content in the probe rendering: private-use characters, which no
    template strips, splits or tests for."""
    return f"\ue000{i}\ue001"


def _spans_along_probe(
    rendered: str, probe: str, messages: list[dict[str, str]], end_of_turn: re.Pattern
) -> list[tuple[int, int]] | None:
    """Assistant spans [start, end) in `rendered`, found by walking it along the template's own scaffolding.

    `probe` is the same conversation rendered with every content replaced by its mark, so the text
    between marks is exactly what the template writes around the contents (role headers, Qwen3's
    empty think block, ...). Each content is then the region between two pieces of scaffolding, which
    holds however the template trims it, and however short or repeated it is. Returns None when the
    scaffolding depends on the content (e.g. Qwen3 splitting a reply that contains `</think>`).
    """
    found = [(i, probe.find(_mark(i))) for i in range(len(messages))]
    present = [(i, k) for i, k in found if k >= 0]  # a template may drop e.g. a system message
    if any(messages[i]["role"] == "assistant" and k < 0 for i, k in found):
        return None
    spans = []
    cursor = probe_at = 0
    for j, (i, k) in enumerate(present):
        scaffold = probe[probe_at:k]
        if k < probe_at or not rendered.startswith(scaffold, cursor):
            return None
        start = cursor + len(scaffold)
        probe_at = k + len(_mark(i))
        following = probe[probe_at : present[j + 1][1] if j + 1 < len(present) else len(probe)]
        needle = messages[i]["content"].strip()
        if following:
            end = rendered.find(following, start + len(needle))
        else:  # only the last content may end the rendering
            end = len(rendered) if j + 1 == len(present) else -1
        if end < 0 or rendered[start:end].strip() != needle:
            return None
        if messages[i]["role"] == "assistant":
            eot = end_of_turn.match(rendered, end)  # <|im_end|>, <|eot_id|>, <end_of_turn>, ...
            spans.append((start, eot.end() if eot else end))
        cursor = end
    return spans


def _spans_by_search(rendered: str, messages: list[dict[str, str]], end_of_turn: re.Pattern) -> list[tuple[int, int]]:
    """Assistant spans [start, end) found by searching each content forward from the previous one.

    The fallback for templates whose scaffolding depends on the content. Templates may strip content,
    so the stripped text is searched. A very short content can be matched inside template text that
    precedes it; the probe walk above does not have that weakness.
    """
    spans = []
    cursor = 0
    for i, m in enumerate(messages, 1):
        content = m["content"]
        needle = content.strip()
        start = rendered.find(needle, cursor)
        if start < 0:
            if m["role"] == "assistant":
                raise _BadRow(NOT_IN_RENDERING, f"turn {i}: the chat template changed the reply's text")
            continue  # templates may rewrite system/user text; only assistant spans must be exact
        end = start + len(needle)
        if m["role"] == "assistant":
            # Trailing whitespace the template kept is generated by the target before the end of turn.
            trail = content[len(content.rstrip()) :]
            if trail and rendered.startswith(trail, end):
                end += len(trail)
            if eot := end_of_turn.match(rendered, end):
                end = eot.end()
            spans.append((start, end))
        cursor = end
    return spans


class _Tokenizing:
    """Records -> samples: the chat template, the mask, truncation. One per worker process."""

    def __init__(self, tokenizer: Any, max_length: int):
        if not getattr(tokenizer, "is_fast", False):
            name = type(tokenizer).__name__
            raise ValueError(f"{name} is not a fast tokenizer: the loss mask needs its character offsets")
        self.tokenizer = tokenizer
        self.max_length = max_length
        # Any added or special token string may close a turn; longest first so a prefix never wins.
        strings = {t.content for t in tokenizer.added_tokens_decoder.values() if t.content}
        strings = sorted(strings, key=len, reverse=True)
        self.end_of_turn = re.compile("|".join(map(re.escape, strings)) or r"(?!)")

    def _chat(self, messages: list[dict[str, str]], **template_kwargs: Any) -> str:
        try:
            return self.tokenizer.apply_chat_template(messages, tokenize=False, **template_kwargs)
        except jinja2.TemplateError as e:  # e.g. templates that refuse a system role or non-alternating turns
            raise _BadRow(TEMPLATE_ERROR, str(e)) from None

    def tokens(self, record: Any) -> tuple[np.ndarray, np.ndarray]:
        """input_ids int32 [T] and loss_mask bool [T] of one record, untruncated. Raises _BadRow."""
        messages = _messages(record)
        # The Rust tokenizer directly: the same ids and offsets as the HF wrapper, without its overhead.
        backend = self.tokenizer.backend_tokenizer
        if isinstance(messages, str):  # plain text: no template, BOS as the tokenizer adds it, all supervised
            ids = np.asarray(backend.encode(messages, add_special_tokens=True).ids, dtype=np.int32)
            return ids, np.ones(len(ids), dtype=bool)
        if not any(m["role"] == "assistant" for m in messages):
            raise _BadRow(NO_ASSISTANT, f"roles {[m['role'] for m in messages][:6]}")
        rendered = self._chat(messages)
        probe = self._chat([{"role": m["role"], "content": _mark(i)} for i, m in enumerate(messages)])
        spans = _spans_along_probe(rendered, probe, messages, self.end_of_turn)
        if spans is None:
            spans = _spans_by_search(rendered, messages, self.end_of_turn)
        # The template writes BOS itself where the model wants one: tokenizing must not add another.
        enc = backend.encode(rendered, add_special_tokens=False)
        ids = np.asarray(enc.ids, dtype=np.int32)
        offsets = np.asarray(enc.offsets, dtype=np.int64).reshape(-1, 2)  # [T, 2] character start, end
        mask = np.zeros(len(ids), dtype=bool)
        for start, end in spans:
            mask |= (offsets[:, 0] < end) & (offsets[:, 1] > start)  # every token overlapping the span
        return ids, mask

    def sample(self, sample_id: int, record: Any) -> _Outcome:
        if isinstance(record, _Bad):
            return _Outcome(bad=record)
        try:
            ids, mask = self.tokens(record)
        except _BadRow as e:
            return _Outcome(bad=e.bad)
        truncated = len(ids) > self.max_length
        if truncated:  # copies, so the full-length buffers are freed
            ids, mask = ids[: self.max_length].copy(), mask[: self.max_length].copy()
        if not mask.any():
            return _Outcome(bad=_Bad(NO_SUPERVISED, f"the first assistant token is past max_length {self.max_length}"))
        # A DFlash anchor at p needs p and p + 1 supervised.
        if not (mask[:-1] & mask[1:]).any():
            return _Outcome(truncated=truncated, dropped_no_anchor=True)
        return _Outcome(sample=TokenizedSample(sample_id, ids, mask), truncated=truncated)

    def prompt(self, record: Any) -> np.ndarray:
        """Token ids int32 [T] of the conversation before its first reply, with the generation prompt."""
        if isinstance(record, _Bad):
            raise _BadRow(record.reason, record.detail)
        messages = _messages(record)
        if isinstance(messages, str):
            raise _BadRow(NO_PROMPT, "a plain 'text' record has no prompt")
        first_reply = next((i for i, m in enumerate(messages) if m["role"] == "assistant"), len(messages))
        head = messages[:first_reply]
        if not any(m["role"] == "user" for m in head):
            raise _BadRow(NO_PROMPT, "no user turn before the first assistant turn")
        rendered = self._chat(head, add_generation_prompt=True)
        ids = self.tokenizer.backend_tokenizer.encode(rendered, add_special_tokens=False).ids
        return np.asarray(ids, dtype=np.int32)


# ---------------------------------------------------------------- ordered (parallel) map

_WORKER: _Tokenizing | None = None


def _init_worker(pickled_tokenizer: bytes, max_length: int) -> None:
    global _WORKER
    # The Rust tokenizer's own threads make a single encode slower (measured 3.4 s vs 1.9 s for 512
    # ShareGPT rows) and would oversubscribe the cores the other workers use.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _WORKER = _Tokenizing(pickle.loads(pickled_tokenizer), max_length)


def _sample_chunk(chunk: list[tuple[int, Any]]) -> list[_Outcome]:
    return [_WORKER.sample(sample_id, record) for sample_id, record in chunk]


def _sample_rows(
    tokenizing: _Tokenizing, rows: Iterator[tuple[_Row, Any]], workers: int
) -> Iterator[tuple[_Row, _Outcome]]:
    """(row, tokenizing.sample(...)) for every row, in input order, on `workers` processes."""
    if workers <= 1:
        for meta, record in rows:
            yield meta, tokenizing.sample(meta.sample_id, record)
        return
    chunks = iter(lambda: list(islice(rows, _CHUNK_ROWS)), [])
    # The tokenizer goes as bytes, unpickled in the initializer: the pool starts workers one at a time
    # and would otherwise wait for each to import transformers. Pickling keeps any chat template
    # set on the object, which reloading from `name_or_path` would lose. spawn, because forking a
    # process whose Rust tokenizer has started threads can deadlock.
    pool = ProcessPoolExecutor(
        workers,
        mp_context=get_context("spawn"),
        initializer=_init_worker,
        initargs=(pickle.dumps(tokenizing.tokenizer), tokenizing.max_length),
    )
    try:
        pending: deque[tuple[list[_Row], Future]] = deque()
        for chunk in chunks:
            pending.append(([m for m, _ in chunk], pool.submit(_sample_chunk, [(m.sample_id, r) for m, r in chunk])))
            # A bounded number of chunks in flight keeps memory flat however large the input.
            if len(pending) >= 2 * workers:
                metas, future = pending.popleft()
                yield from zip(metas, future.result())
        while pending:
            metas, future = pending.popleft()
            yield from zip(metas, future.result())
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


# ---------------------------------------------------------------- entry points


def load_samples(
    paths: list[str] | None,
    tokenizer: Any,
    max_length: int,
    limit: int | None = None,
    workers: int = 1,
    split: str = "train",
) -> tuple[list[TokenizedSample], DataReport]:
    """Tokenize every usable row of `paths`, stopping after `limit` kept samples.

    With no paths, the embedded ShareGPT `split` is read (`split` applies to nothing else).
    `tokenizer` is the target's fast HF tokenizer, chat template included; `workers` processes
    tokenize in parallel, with the same result as one.
    """
    if max_length < 2:
        raise ValueError(f"max_length must be at least 2 (an anchor needs two supervised tokens), got {max_length}")
    rows = _iter_rows(paths, split)
    report = DataReport()
    samples: list[TokenizedSample] = []
    if limit is not None and limit <= 0:
        return samples, report
    with closing(_sample_rows(_Tokenizing(tokenizer, max_length), rows, workers)) as outcomes:
        for meta, outcome in outcomes:
            report.num_rows_read += 1
            if outcome.bad is not None:
                report.skip(meta.file, meta.row, outcome.bad.reason, outcome.bad.detail)
            elif outcome.dropped_no_anchor:
                report.num_dropped_no_anchor += 1
            else:
                sample = outcome.sample
                samples.append(sample)
                report.num_samples += 1
                report.num_truncated += outcome.truncated
                report.num_tokens += len(sample.input_ids)
                report.num_supervised_tokens += int(sample.loss_mask.sum())
                if limit is not None and report.num_samples >= limit:
                    break
    return samples, report


def iter_prompts(
    paths: list[str] | None,
    tokenizer: Any,
    limit: int | None = None,
    split: str = "eval",
    report: DataReport | None = None,
) -> Iterator[tuple[int, np.ndarray]]:
    """(sample_id, prompt ids int32 [T]) for evaluation: each conversation up to its first reply.

    The prompt is rendered with the generation prompt; `{"prompt": "..."}` records are one user
    message. Rows without a prompt are skipped and, when `report` is given, recorded there.
    """
    if report is None:
        report = DataReport()
    if limit is not None and limit <= 0:
        return
    rows = _iter_rows(paths, split)
    tokenizing = _Tokenizing(tokenizer, max_length=0)
    for meta, record in rows:
        report.num_rows_read += 1
        try:
            ids = tokenizing.prompt(record)
        except _BadRow as e:
            report.skip(meta.file, meta.row, e.bad.reason, e.bad.detail)
            continue
        report.num_samples += 1
        report.num_tokens += len(ids)
        yield meta.sample_id, ids
        if limit is not None and report.num_samples >= limit:
            return


@dataclass(frozen=True)
class Conversation:
    """A usable input row as chat messages, with where it came from (for `dflash generate`)."""

    file: str
    row: int  # 1-based, in its file
    sample_id: int  # global row index in the input, bad rows included (as for extraction)
    form: str  # the record's key: 'conversations' (ShareGPT), 'messages' (OpenAI) or 'prompt'
    messages: list[dict[str, str]]  # {role: system|user|assistant|tool, content}
    record_id: Any = None  # the record's own "id", if it has one


def iter_conversations(
    paths: list[str] | None, split: str = "train", report: DataReport | None = None
) -> Iterator[Conversation]:
    """Every row of the input that is a conversation or a prompt, in input order, untokenized.

    Rows that are not (bad JSON, unknown form or role, empty content, plain `text`) are skipped and
    recorded in `report`, as extraction reports them. With no paths, the embedded ShareGPT `split`.
    """
    if report is None:
        report = DataReport()
    for meta, record in _iter_rows(paths, split):
        report.num_rows_read += 1
        try:
            if isinstance(record, _Bad):
                raise _BadRow(record.reason, record.detail)
            messages = _messages(record)
            if isinstance(messages, str):
                raise _BadRow(NO_PROMPT, "a plain 'text' record has no prompt")
        except _BadRow as e:
            report.skip(meta.file, meta.row, e.bad.reason, e.bad.detail)
            continue
        form = next((k for k in ("conversations", "messages") if record.get(k) is not None), "prompt")
        report.num_samples += 1
        yield Conversation(meta.file, meta.row, meta.sample_id, form, messages, record.get("id"))
