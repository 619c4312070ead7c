"""Chat messages -> token ids through the target's chat template: the loss mask of training samples, and
the prompts that `dflash eval` decodes from.

What is supervised: what the target generates when it is served with this template and these template
variables (`--chat-template-kwargs`, e.g. Qwen3's `enable_thinking`). The server renders the
conversation up to the generation prompt G (`<|im_start|>assistant\\n`, Qwen3 with thinking off
`<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n`, Qwen3.5 with thinking on `...<think>\\n`); the
target writes the rest of the turn: reasoning, reply, tool calls and the token that closes the turn.
So each assistant turn is supervised from where its rendering departs from G to its end-of-turn token:
- an empty think block the template writes into a turn is supervised when G does not hold it
  (thinking on: the target writes it) and not when G does (thinking off: the server wrote it);
- reasoning is supervised wherever the template renders it (Qwen3/3.5 render it only in turns after
  the last user query; Qwen3.6 everywhere with `preserve_thinking`); what the template drops is gone;
- tool calls are the assistant's text; tool results, like user and system turns, are never supervised.

How the spans are found:
- Most templates have no `{% generation %}` markers, and rendering prefixes of a conversation costs a
  rendering per turn and fails for templates that render a turn differently depending on what follows
  it (a Qwen3 reply that ends a prefix gets a think block it does not have in the whole conversation).
  So each conversation is rendered twice: as is, and with every text field
  (content, reasoning, tool-call name) replaced by a unique mark. The text between marks is the
  template's scaffolding (role headers, inserted blocks, tool-call syntax); walking the real rendering
  along it gives each field's exact character span, however short or repeated the text, and puts
  every piece of scaffolding at a known place in the real rendering.
- In the marked rendering, a turn starts at the last role header (G's first line) before its first
  field and ends at the first end-of-turn token after its last field; both are found once per
  tokenizer from a marked two-turn conversation.
- Qwen-style templates read an inline `<think>...</think>` in the content as the turn's reasoning;
  where the template does (checked once, by rendering both forms), the split is done before rendering,
  as the template does it, so that the marked rendering has the same shape as the real one.
- Where the walk fails (scaffolding that depends on the text), each content is searched forward in
  message order instead, and supervised with the special token that follows it.
- Spans are mapped to tokens through the fast tokenizer's offsets: every token overlapping a span.

Legend: T = tokens of one sample.
"""

from __future__ import annotations

import bisect
import re
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import jinja2
import numpy as np

from dflash_pipeline.extract.readers import (
    NO_ASSISTANT, NOT_IN_RENDERING, TEMPLATE_ERROR, BadRowError, DataReport, Messages, iter_rows, prompt_messages,
    record_tools, turn_prompts,
)

Tools = list[dict[str, Any]] | None


def _mark(key: str) -> str:
    """Stands in for one text field in the marked rendering: private-use characters, which no template
    strips, splits or tests for."""
    return f"\ue000{key}\ue001"


@dataclass(frozen=True)
class _Field:
    """One text field of a message, as the marked rendering holds it."""

    message: int  # index in the conversation
    mark: str
    text: str


def _marked(messages: Messages) -> tuple[Messages, list[_Field]]:
    """The conversation with every non-empty text field replaced by its mark, and the fields.

    Empty fields stay empty (templates test them: Qwen3.5 writes `\\n\\n` before a tool call only after
    a content), so the marked conversation renders with the same scaffolding as the real one.
    """
    out, fields = [], []

    def mark(i: int, key: str, text: str) -> str:
        fields.append(_Field(i, _mark(f"{i}{key}"), text))
        return fields[-1].mark

    for i, m in enumerate(messages):
        pm = dict(m)
        if m["content"].strip():
            pm["content"] = mark(i, "c", m["content"])
        if (m.get("reasoning_content") or "").strip():
            pm["reasoning_content"] = mark(i, "r", m["reasoning_content"])
        if m.get("tool_calls"):
            pm["tool_calls"] = [{**c, "function": {**c["function"], "name": mark(i, f"t{j}", c["function"]["name"])}}
                                for j, c in enumerate(m["tool_calls"])]
        out.append(pm)
    return out, fields


@dataclass
class _Walk:
    """The real rendering aligned with the marked one."""

    fields: list[tuple[_Field, int]]  # the rendered fields in rendering order, with their mark's position
    spans: list[tuple[int, int]]  # [start, end) of each of those fields' text in the real rendering
    scaffold: list[tuple[int, int, int]]  # each piece of scaffolding: marked start, marked end, real start

    def to_rendered(self, at: int) -> int:
        """A position in the marked rendering that lies in (or at either end of) scaffolding -> the real one."""
        k = bisect.bisect_right([p0 for p0, _, _ in self.scaffold], at) - 1
        p0, p1, r0 = self.scaffold[k]
        assert p0 <= at <= p1, "a position inside a mark has no place in the real rendering"
        return r0 + at - p0


def _walk(rendered: str, probe: str, fields: list[_Field]) -> _Walk | None:
    """Align `rendered` with `probe` (the marked rendering) along the scaffolding between the marks.

    Each field's text is the region between two pieces of scaffolding, which holds however the template
    trims it. None when the scaffolding depends on the text (a template that splits or rewrites it), when
    a mark is rendered twice, or when the real rendering does not follow the marked one.
    """
    found = sorted(((probe.find(f.mark), f) for f in fields if f.mark in probe), key=lambda kf: kf[0])
    if any(probe.count(f.mark) > 1 for _, f in found):
        return None
    walk = _Walk([(f, k) for k, f in found], [], [])
    cursor = probe_at = 0
    for j, (k, f) in enumerate(found):
        scaffold = probe[probe_at:k]
        if not rendered.startswith(scaffold, cursor):
            return None
        walk.scaffold.append((probe_at, k, cursor))
        start = cursor + len(scaffold)
        probe_at = k + len(f.mark)
        needle = f.text.strip()
        if j + 1 < len(found):
            following = probe[probe_at:found[j + 1][0]]
            end = rendered.find(following, start + len(needle)) if following else start + len(needle)
        else:  # the rest of the rendering is the scaffolding after the last mark
            tail = len(probe) - probe_at
            end = len(rendered) - tail if rendered.endswith(probe[probe_at:]) else -1
        if end < start or rendered[start:end].strip() != needle:
            return None
        walk.spans.append((start, end))
        cursor = end
    if rendered[cursor:] != probe[probe_at:]:
        return None
    walk.scaffold.append((probe_at, len(probe), cursor))
    return walk


@dataclass(frozen=True)
class _TemplateFacts:
    """What the template does around any assistant turn, found once per tokenizer and template variables."""

    generation_prompt: str  # G: what add_generation_prompt appends ('' if nothing)
    end_of_turn: str  # the special token right after an assistant turn's text ('' if none)
    splits_think: bool  # the template reads an inline <think>...</think> in the content as the turn's reasoning

    @property
    def header(self) -> str:
        """The role header that opens an assistant turn: G's first line."""
        g = self.generation_prompt
        return g[: g.index("\n") + 1] if "\n" in g else g


def _common_prefix(a: str, b: str) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _assistant_turns(walk: _Walk, probe: str, messages: Messages, facts: _TemplateFacts
                     ) -> list[tuple[int, int, bool, int]] | None:
    """(start, end, open, text_end) of each assistant turn's supervised text in the real rendering, found in
    the marked one: from where the turn departs from the generation prompt to its end-of-turn token (`open`:
    no such token found, the span ends with the turn's last text, which ends at `text_end`). None when a
    turn's texts are not together (a template that moves text between turns); BadRowError when the
    template drops a turn."""
    where: dict[int, list[int]] = {}
    for j, (f, _) in enumerate(walk.fields):
        where.setdefault(f.message, []).append(j)
    marks_end = [k + len(f.mark) for f, k in walk.fields]
    turns = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        js = where.get(i)
        if not js:  # the walk held: the template renders no text of this turn
            raise BadRowError(NOT_IN_RENDERING, f"turn {i + 1}: the chat template renders nothing of this reply "
                                                "(tool calls or reasoning it does not support?)")
        if js[-1] - js[0] + 1 != len(js):
            return None
        a, b = js[0], js[-1]
        first = walk.fields[a][1]
        start = walk.spans[a][0]
        previous_end = marks_end[a - 1] if a else 0
        if facts.header and (h := probe.rfind(facts.header, previous_end, first)) >= 0:
            start = walk.to_rendered(h + _common_prefix(probe[h:first], facts.generation_prompt))
        next_start = walk.fields[b + 1][1] if b + 1 < len(walk.fields) else len(probe)
        e = probe.find(facts.end_of_turn, marks_end[b], next_start) if facts.end_of_turn else -1
        if e >= 0:
            turns.append((start, walk.to_rendered(e + len(facts.end_of_turn)), False, walk.spans[b][1]))
        else:
            turns.append((start, walk.spans[b][1], True, walk.spans[b][1]))
    return turns


def _spans_by_search(rendered: str, messages: Messages, special: re.Pattern, cut_off: bool = False
                     ) -> list[tuple[int, int]]:
    """Assistant spans [start, end) found by searching each content forward from the previous one
    (`cut_off`: the last reply was cut at a length limit, so the end of turn after it is not supervised).

    The fallback for templates whose scaffolding depends on the text. Templates may strip content, so
    the stripped text is searched. A very short content can be matched inside template text that
    precedes it; the walk above does not have that weakness.
    """
    spans = []
    cursor = 0
    for i, m in enumerate(messages, 1):
        content = m["content"]
        needle = content.strip()
        start = rendered.find(needle, cursor) if needle else -1
        if start < 0:
            if m["role"] == "assistant":
                what = "changed the reply's text" if needle else "rewrote this reply's calls or reasoning"
                raise BadRowError(NOT_IN_RENDERING, f"turn {i}: the chat template {what}")
            continue  # templates may rewrite system/user text; only assistant spans must be exact
        end = start + len(needle)
        if m["role"] == "assistant":
            # Trailing whitespace the template kept is generated by the target before the end of turn.
            trail = content[len(content.rstrip()):]
            if trail and rendered.startswith(trail, end):
                end += len(trail)
            last = not any(x["role"] == "assistant" for x in messages[i:])
            if not (cut_off and last) and (eot := special.match(rendered, end)):
                end = eot.end()
            spans.append((start, end))
        cursor = end
    return spans


def _split_think(message: dict[str, Any]) -> dict[str, Any]:
    """An assistant message whose content holds `</think>` as reasoning + content, split as Qwen's
    templates split it (they drop the reasoning of earlier turns, so it must be a field of its own)."""
    content = message["content"]
    if message["role"] != "assistant" or "reasoning_content" in message or "</think>" not in content:
        return message
    reasoning = content.split("</think>")[0].rstrip("\n").split("<think>")[-1].lstrip("\n")
    return {**message, "reasoning_content": reasoning, "content": content.split("</think>")[-1].lstrip("\n")}


class ChatTokenizer:
    """Messages -> token ids with the target's chat template, and the loss mask over what it generates."""

    def __init__(self, tokenizer: Any, template_kwargs: dict[str, Any] | None = None):
        """`template_kwargs`: extra variables of every rendering (schemas/chat_template.py, e.g. Qwen3's
        enable_thinking), so that a conversation is rendered and masked as the target is served."""
        if not getattr(tokenizer, "is_fast", False):
            name = type(tokenizer).__name__
            raise ValueError(f"{name} is not a fast tokenizer: the loss mask needs its character offsets")
        self.tokenizer = tokenizer
        self.template_kwargs = dict(template_kwargs or {})
        # Any added or special token string may close a turn; longest first so a prefix never wins.
        strings = {t.content for t in tokenizer.added_tokens_decoder.values() if t.content}
        strings = sorted(strings, key=len, reverse=True)
        self.special = re.compile("|".join(map(re.escape, strings)) or r"(?!)")

    def _chat(self, messages: Messages, tools: Tools = None, **kwargs: Any) -> str:
        try:
            return self.tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                                      **self.template_kwargs, **kwargs)
        except (jinja2.TemplateError, TypeError, ValueError) as e:
            # e.g. templates that refuse a system role or non-alternating turns, or have no template at all
            raise BadRowError(TEMPLATE_ERROR, " ".join(str(e).split())) from None

    @cached_property
    def facts(self) -> _TemplateFacts:
        """The generation prompt, the end-of-turn token and the think split, from marked renderings."""
        user, reply, thought = [{"role": "user", "content": _mark("q")}], _mark("a"), _mark("r")

        def render(messages: Messages, **kwargs: Any) -> str | None:
            try:
                return self._chat(messages, **kwargs)
            except BadRowError:
                return None

        bare, prompted = render(user), render(user, add_generation_prompt=True)
        g = prompted[len(bare):] if bare is not None and prompted is not None and prompted.startswith(bare) else ""
        two = render(user + [{"role": "assistant", "content": reply}]) or ""
        eot = self.special.match(two, two.find(reply) + len(reply)) if reply in two else None
        inline = render(user + [{"role": "assistant", "content": f"<think>\n{thought}\n</think>\n\n{reply}"}])
        split = render(user + [{"role": "assistant", "reasoning_content": thought, "content": reply}])
        return _TemplateFacts(g, eot.group() if eot else "", inline is not None and inline == split)

    def _spans(self, rendered: str, messages: Messages, tools: Tools, cut_off: bool = False) -> list[tuple[int, int]]:
        """[start, end) in `rendered` of the text the target generates in each assistant turn; `cut_off`:
        the last turn's reply was cut at a length limit, so it ends with its text (the target did not write
        the end of turn the template closes it with)."""
        marked, fields = _marked(messages)
        probe = self._chat(marked, tools)
        walk = _walk(rendered, probe, fields)
        turns = _assistant_turns(walk, probe, messages, self.facts) if walk else None
        if turns is None:
            return _spans_by_search(rendered, messages, self.special, cut_off)
        spans = []
        for k, (start, end, open_, text_end) in enumerate(turns):
            if cut_off and k == len(turns) - 1:
                end = text_end
            elif open_ and (eot := self.special.match(rendered, end)):  # <|im_end|>, <|eot_id|>, ...
                end = eot.end()
            spans.append((start, end))
        return spans

    def tokens(self, messages: Messages | str, tools: Tools = None, cut_off: bool = False
               ) -> tuple[np.ndarray, np.ndarray]:
        """input_ids int32 [T] and loss_mask bool [T] of one record's messages (or plain text) and tool
        definitions, untruncated; `cut_off`: the last reply stopped at a length limit (`dflash generate`'s
        finish "length"), so the end of turn after it is not supervised. Raises BadRowError."""
        # The Rust tokenizer directly: the same ids and offsets as the HF wrapper, without its overhead.
        backend = self.tokenizer.backend_tokenizer
        if isinstance(messages, str):  # plain text: no template, BOS as the tokenizer adds it, all supervised
            ids = np.asarray(backend.encode(messages, add_special_tokens=True).ids, dtype=np.int32)
            return ids, np.ones(len(ids), dtype=bool)
        if not any(m["role"] == "assistant" for m in messages):
            raise BadRowError(NO_ASSISTANT, f"roles {[m['role'] for m in messages][:6]}")
        if self.facts.splits_think:
            messages = [_split_think(m) for m in messages]
        rendered = self._chat(messages, tools)
        spans = self._spans(rendered, messages, tools, cut_off)
        # The template writes BOS itself where the model wants one: tokenizing must not add another.
        enc = backend.encode(rendered, add_special_tokens=False)
        ids = np.asarray(enc.ids, dtype=np.int32)
        offsets = np.asarray(enc.offsets, dtype=np.int64).reshape(-1, 2)  # [T, 2] character start, end
        mask = np.zeros(len(ids), dtype=bool)
        for start, end in spans:
            mask |= (offsets[:, 0] < end) & (offsets[:, 1] > start)  # every token overlapping the span
        return ids, mask

    def prompt(self, head: Messages, tools: Tools = None) -> np.ndarray:
        """Token ids int32 [T] of a conversation's head (readers.prompt_messages), with the generation prompt."""
        rendered = self._chat(head, tools, add_generation_prompt=True)
        ids = self.tokenizer.backend_tokenizer.encode(rendered, add_special_tokens=False).ids
        return np.asarray(ids, dtype=np.int32)


def iter_prompts(
    paths: list[str] | None,
    tokenizer: Any,
    limit: int | None = None,
    split: str = "eval",
    report: DataReport | None = None,
    template_kwargs: dict[str, Any] | None = None,
) -> Iterator[tuple[int, np.ndarray]]:
    """(sample_id, prompt ids int32 [T]) for evaluation: each conversation up to its first reply.

    The prompt is rendered with the generation prompt and `template_kwargs`; `{"prompt": "..."}`
    records are one user message. Rows without a prompt are skipped and, when `report` is given,
    recorded there.
    """
    for sample_id, _, ids in iter_prompt_turns(paths, tokenizer, limit, split, report,
                                               template_kwargs=template_kwargs):
        yield sample_id, ids


def iter_prompt_turns(
    paths: list[str] | None,
    tokenizer: Any,
    limit: int | None = None,
    split: str = "eval",
    report: DataReport | None = None,
    all_turns: bool = False,
    template_kwargs: dict[str, Any] | None = None,
) -> Iterator[tuple[int, int, np.ndarray]]:
    """(sample_id, turn, prompt ids int32 [T]): `iter_prompts`, and with `all_turns` every later point
    of a conversation where the assistant replies (readers.turn_prompts), its history as the prompt;
    turn 0 is the first. `limit` counts prompts."""
    if report is None:
        report = DataReport()
    if limit is not None and limit <= 0:
        return
    rows = iter_rows(paths, split)
    chat = ChatTokenizer(tokenizer, template_kwargs)
    for where, record in rows:
        report.num_rows_read += 1
        try:
            heads, tools = turn_prompts(record), record_tools(record)
            prompts = [chat.prompt(head, tools) for head in (heads if all_turns else heads[:1])]
        except BadRowError as e:
            report.skip(where.file, where.row, e.bad.reason, e.bad.detail)
            continue
        for turn, ids in enumerate(prompts):
            report.num_samples += 1
            report.num_tokens += len(ids)
            yield where.sample_id, turn, ids
            if limit is not None and report.num_samples >= limit:
                return
