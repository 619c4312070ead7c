"""extract/readers.py, chat.py, samples.py: input formats and record forms, bad rows, the loss mask against real templates,
truncation, stable sample ids, the embedded ShareGPT splits, and workers."""

from __future__ import annotations

import copy
import json
import re
from itertools import islice
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dflash_pipeline.errors import InputDataError
from dflash_pipeline.extract import readers as data
from dflash_pipeline.extract.chat import iter_prompts
from dflash_pipeline.extract.readers import DataReport, check_inputs, iter_embedded_rows
from dflash_pipeline.extract.samples import load_samples

MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hi there"},
    {"role": "assistant", "content": "Hello! How can I help?"},
    {"role": "user", "content": "Name a prime."},
    {"role": "assistant", "content": "7 is prime.\n"},  # trailing newline: kept by ChatML, must stay supervised
]
SHAREGPT_ROLE = {"system": "system", "user": "human", "assistant": "gpt"}


def sharegpt(messages: list[dict]) -> dict:
    return {"conversations": [{"from": SHAREGPT_ROLE[m["role"]], "value": m["content"]} for m in messages]}


def chat(user: str, reply: str) -> dict:
    return {"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": reply}]}


def write_jsonl(path: Path, rows: list) -> str:
    """rows: objects, or strings written as raw lines."""
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def runs(mask: np.ndarray) -> list[tuple[int, int]]:
    """[start, end) of each run of True."""
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask.astype(np.int8), [0]])))
    return list(zip(edges[::2].tolist(), edges[1::2].tolist()))


def masked_texts(tok, sample) -> list[str]:
    return [tok.decode(sample.input_ids[a:b].tolist()) for a, b in runs(sample.loss_mask)]


def problems(report: DataReport) -> list[tuple[str, int, str]]:
    return [(Path(p.file).name, p.row, p.reason) for p in report.problems]


def same(a: list, b: list) -> bool:
    return [s.sample_id for s in a] == [s.sample_id for s in b] and all(
        np.array_equal(x.input_ids, y.input_ids) and np.array_equal(x.loss_mask, y.loss_mask) for x, y in zip(a, b)
    )


# ---------------------------------------------------------------- the mask against real templates


def test_mask_is_exactly_assistant_contents_and_im_end(tmp_path, smollm_tokenizer):
    tok = smollm_tokenizer
    path = write_jsonl(tmp_path / "a.jsonl", [sharegpt(MESSAGES), {"messages": MESSAGES}])
    samples, report = load_samples([path], tok, max_length=1024)
    assert report.num_samples == 2 and report.num_skipped == 0
    rendered = tok.apply_chat_template(MESSAGES, tokenize=False)
    expected_ids = tok(rendered, add_special_tokens=False)["input_ids"]
    for s in samples:
        assert s.input_ids.dtype == np.int32 and s.loss_mask.dtype == np.bool_
        assert s.input_ids.tolist() == expected_ids  # one tokenization of the template's rendering
        assert masked_texts(tok, s) == ["Hello! How can I help?<|im_end|>", "7 is prime.\n<|im_end|>"]
        replies = [m["content"] + "<|im_end|>" for m in MESSAGES if m["role"] == "assistant"]
        assert [s.input_ids[a:b].tolist() for a, b in runs(s.loss_mask)] == [
            tok(r, add_special_tokens=False)["input_ids"] for r in replies
        ]
    assert report.num_supervised_tokens == 2 * int(samples[0].loss_mask.sum())


@pytest.mark.parametrize("question, reply", [("ok", "ok"), ("a", "by")])
def test_short_replies_are_found_at_their_own_place(tmp_path, smollm_tokenizer, question, reply):
    # SmolLM's default system prompt ("You are a helpful AI assistant ... trained by Hugging Face")
    # holds both "a" and "by": a plain text search would mask them there.
    path = write_jsonl(tmp_path / "a.jsonl", [chat(question, reply)])
    (s,), _ = load_samples([path], smollm_tokenizer, max_length=1024)
    ((start, end),) = runs(s.loss_mask)
    assert smollm_tokenizer.decode(s.input_ids[start:end].tolist()) == reply + "<|im_end|>"
    assert end == len(s.input_ids) - 1  # the last turn; only the final "\n" follows


def test_reply_the_template_rewrites_and_template_errors_are_bad_rows(tmp_path, smollm_tokenizer):
    tok = copy.deepcopy(smollm_tokenizer)
    tok.chat_template = (
        "{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('no system role') }}{% endif %}"
        "<|im_start|>{{ m['role'] }}\n{{ m['content'] | upper if m['role'] == 'assistant' else m['content'] }}"
        "<|im_end|>\n{% endfor %}"
    )
    rows = [{"messages": MESSAGES}, chat("hi", "hello"), chat("hi", "HELLO")]
    samples, report = load_samples([write_jsonl(tmp_path / "t.jsonl", rows)], tok, max_length=64)
    assert [s.sample_id for s in samples] == [2]
    assert problems(report) == [("t.jsonl", 1, data.TEMPLATE_ERROR), ("t.jsonl", 2, data.NOT_IN_RENDERING)]
    assert "no system role" in report.problems[0].detail


# ---------------------------------------------------------------- formats and record forms


def test_every_format_gives_the_same_samples(tmp_path, smollm_tokenizer):
    records = [sharegpt(MESSAGES), chat("What is 2+2?", "4, of course.")]
    jsonl = write_jsonl(tmp_path / "a.jsonl", records)
    array = tmp_path / "b.json"
    array.write_text(json.dumps(records, indent=2))
    lines_json = write_jsonl(tmp_path / "c.json", records)
    parquet = tmp_path / "d.parquet"
    # Parquet needs one schema: the ShareGPT row as OpenAI messages, the same conversation.
    pq.write_table(pa.Table.from_pylist([{"messages": MESSAGES}, records[1]]), parquet)
    reference, _ = load_samples([jsonl], smollm_tokenizer, max_length=1024)
    assert len(reference) == 2
    for path in (str(array), lines_json, str(parquet)):
        samples, report = load_samples([path], smollm_tokenizer, max_length=1024)
        assert same(samples, reference), path
        assert report.num_rows_read == 2 and report.num_skipped == 0


def test_json_array_is_streamed_across_read_boundaries(tmp_path, smollm_tokenizer, monkeypatch):
    records = [chat(f"question {i}", f"answer {i} é✓") for i in range(7)]
    path = tmp_path / "a.json"
    path.write_text(json.dumps(records, indent=1))
    monkeypatch.setattr(data, "_JSON_READ_CHARS", 5)  # every element spans several reads
    assert [r for _, r in data._iter_json_array(path)] == records


def test_record_forms(tmp_path, smollm_tokenizer):
    tok = smollm_tokenizer
    parts = {
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "Look:"}, {"type": "text", "text": "two parts"}]},
            {"role": "model", "content": [{"type": "text", "text": "Seen."}]},
        ]
    }
    rows = [
        parts,
        {"text": "Plain pretraining text."},
        {"conversations": [{"from": "human", "value": "a"}, {"from": "chatgpt", "value": "b"}]},
        {"prompt": "Only a prompt"},  # nothing to supervise
    ]
    samples, report = load_samples([write_jsonl(tmp_path / "f.jsonl", rows)], tok, max_length=1024)
    assert [s.sample_id for s in samples] == [0, 1, 2]
    expected = tok.apply_chat_template(
        [{"role": "user", "content": "Look:\ntwo parts"}, {"role": "assistant", "content": "Seen."}], tokenize=False
    )
    assert samples[0].input_ids.tolist() == tok(expected, add_special_tokens=False)["input_ids"]
    assert masked_texts(tok, samples[0]) == ["Seen.<|im_end|>"]
    assert samples[1].input_ids.tolist() == tok("Plain pretraining text.")["input_ids"]
    assert samples[1].loss_mask.all()
    assert masked_texts(tok, samples[2]) == ["b<|im_end|>"]
    assert problems(report) == [("f.jsonl", 4, data.NO_ASSISTANT)]


def test_tool_calls_reasoning_and_tools_are_read_into_one_form():
    record = {"tools": '[{"type": "function", "function": {"name": "f"}}]', "messages": [
        {"role": "developer", "content": "Be exact."},
        {"role": "user", "content": "Run f."},
        {"role": "assistant", "content": None, "reasoning": "I call f.",
         "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": ""},  # a tool may return nothing
        {"role": "assistant", "content": "Done.", "function_call": None},
    ]}
    call = {"type": "function", "function": {"name": "f", "arguments": {"x": 1}}, "id": "c1"}
    assert data.record_messages(record) == [
        {"role": "system", "content": "Be exact."},
        {"role": "user", "content": "Run f."},
        {"role": "assistant", "content": "", "reasoning_content": "I call f.", "tool_calls": [call]},
        {"role": "tool", "content": "", "tool_call_id": "c1"},
        {"role": "assistant", "content": "Done."},
    ]
    assert data.record_tools(record) == [{"type": "function", "function": {"name": "f"}}]
    assert data.record_tools({"messages": []}) is None


def test_bad_tool_calls_are_bad_rows(tmp_path, smollm_tokenizer):
    def calls(*tool_calls, **extra) -> dict:
        return {"messages": [{"role": "user", "content": "q"},
                             {"role": "assistant", "content": "", "tool_calls": list(tool_calls)}], **extra}

    rows = [
        calls({"function": {"arguments": "{}"}}),  # 1: no name
        calls({"function": {"name": "f", "arguments": "{x"}}),  # 2: arguments not JSON
        calls({"function": {"name": "f", "arguments": "[1]"}}),  # 3: arguments not an object
        calls(),  # 4: an assistant turn with nothing in it
        chat("q", "a") | {"tools": {"name": "f"}},  # 5: tools not a list
        chat("q", "a") | {"tools": [{"type": "function", "function": {"name": "f"}}]},  # 6: fine
    ]
    samples, report = load_samples([write_jsonl(tmp_path / "t.jsonl", rows)], smollm_tokenizer, max_length=64)
    assert [s.sample_id for s in samples] == [5]
    assert problems(report) == [("t.jsonl", 1, data.UNKNOWN_FORM), ("t.jsonl", 2, data.UNKNOWN_FORM),
                                ("t.jsonl", 3, data.UNKNOWN_FORM), ("t.jsonl", 4, data.EMPTY_CONTENT),
                                ("t.jsonl", 5, data.UNKNOWN_FORM)]
    assert [p.detail for p in report.problems][:3] == [
        "turn 2: tool call 1 has no function name", "turn 2: tool call 1 arguments: not JSON: '{x'",
        "turn 2: tool call 1 arguments are not a JSON object"]


# ---------------------------------------------------------------- bad rows and bad files


def test_each_bad_row_is_skipped_with_file_row_and_reason(tmp_path, smollm_tokenizer):
    long_question = " ".join(["word"] * 200)
    rows = [
        chat("hi", "hello"),  # 1
        "this is not json",  # 2
        "[1, 2]",  # 3
        {"foo": 1},  # 4
        {"conversations": [{"from": "human", "value": "hi"}, {"from": "robot", "value": "beep"}]},  # 5
        {"conversations": []},  # 6
        chat("hi", "   "),  # 7
        {"messages": [{"role": "user", "content": "hi"}]},  # 8
        "",  # 9: blank lines are not rows
        chat(long_question, "ok"),  # 10: the reply starts past max_length
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]},  # 11
        chat("bye", "goodbye"),  # 12
    ]
    a = write_jsonl(tmp_path / "a.jsonl", rows)
    b = tmp_path / "b.json"
    b.write_text('[{"text": "a fine plain text"}, 5, {"text": "cut off')  # row 3 is cut off mid-record
    samples, report = load_samples([a, str(b)], smollm_tokenizer, max_length=64)
    assert problems(report) == [
        ("a.jsonl", 2, data.NOT_JSON),
        ("a.jsonl", 3, data.NOT_OBJECT),
        ("a.jsonl", 4, data.UNKNOWN_FORM),
        ("a.jsonl", 5, data.UNKNOWN_ROLE),
        ("a.jsonl", 6, data.EMPTY_CONVERSATION),
        ("a.jsonl", 7, data.EMPTY_CONTENT),
        ("a.jsonl", 8, data.NO_ASSISTANT),
        ("a.jsonl", 10, data.NO_SUPERVISED),
        ("a.jsonl", 11, data.UNKNOWN_FORM),
        ("b.json", 2, data.NOT_OBJECT),
        ("b.json", 3, data.NOT_JSON),
    ]
    assert "'robot'" in report.problems[3].detail
    # ids: row - 1 in a.jsonl; b.json starts after a.jsonl's last row (12).
    assert [s.sample_id for s in samples] == [0, 11, 12]
    assert report.num_rows_read == 14 and report.num_samples == 3 and report.num_skipped == 11
    assert report.skipped_by_reason[data.UNKNOWN_FORM] == 2
    lines = report.summary_lines()
    assert any(line.strip() == f"{data.UNKNOWN_FORM}: 2" for line in lines)
    assert any(f"{a}:2: {data.NOT_JSON}" in line for line in lines)


def test_problem_examples_are_capped_but_counts_exact(tmp_path, smollm_tokenizer, monkeypatch):
    monkeypatch.setattr(data, "MAX_PROBLEMS_KEPT", 2)
    path = write_jsonl(tmp_path / "a.jsonl", [chat("q", "a"), "x", "y", "z"])
    samples, report = load_samples([path], smollm_tokenizer, max_length=64)
    assert len(samples) == 1 and report.num_skipped == 3 and len(report.problems) == 2


@pytest.mark.parametrize(
    "name, content",
    [
        ("missing.jsonl", None),
        ("data.csv", "a,b\n"),
        ("data.json", "hello"),
        ("data.jsonl", ""),
        ("data.jsonl", "[1, 2]\n"),
        ("data.parquet", "not parquet"),
    ],
)
def test_bad_files_raise_input_data_error_naming_the_file(tmp_path, smollm_tokenizer, name, content):
    good = write_jsonl(tmp_path / "good.jsonl", [chat("q", "a")])
    bad = tmp_path / name
    if content is not None:
        bad.write_text(content)
    with pytest.raises(InputDataError, match=re.escape(str(bad))):
        check_inputs([good, str(bad)])
    with pytest.raises(InputDataError, match=re.escape(str(bad))) as err:
        load_samples([good, str(bad)], smollm_tokenizer, max_length=64)
    assert "\n" not in str(err.value)


def test_parquet_without_a_known_column_is_refused(tmp_path):
    path = tmp_path / "x.parquet"
    pq.write_table(pa.table({"question": ["q"], "answer": ["a"]}), path)
    with pytest.raises(InputDataError, match="none of the columns"):
        check_inputs([str(path)])


# ---------------------------------------------------------------- truncation, ids, limit


def test_truncation_and_the_two_consecutive_supervised_tokens_rule(tmp_path, smollm_tokenizer):
    path = write_jsonl(tmp_path / "a.jsonl", [chat("Count.", "one two three four five six seven")])
    (full,), report = load_samples([path], smollm_tokenizer, max_length=1024)
    assert report.num_truncated == 0
    first = int(np.argmax(full.loss_mask))  # first supervised position

    (cut,), report = load_samples([path], smollm_tokenizer, max_length=first + 2)
    assert report.num_truncated == 1 and len(cut.input_ids) == first + 2
    assert cut.input_ids.tolist() == full.input_ids[: first + 2].tolist() and cut.loss_mask[-2:].all()

    samples, report = load_samples([path], smollm_tokenizer, max_length=first + 1)  # one supervised token left
    assert samples == [] and report.num_dropped_no_anchor == 1 and report.num_skipped == 0

    samples, report = load_samples([path], smollm_tokenizer, max_length=first)  # none left
    assert samples == [] and problems(report) == [("a.jsonl", 1, data.NO_SUPERVISED)]


def test_sample_ids_are_global_row_indices_stable_under_limit(tmp_path, smollm_tokenizer):
    a = write_jsonl(tmp_path / "a.jsonl", [chat("q1", "a1"), "broken", chat("q2", "a2")])
    b = tmp_path / "b.parquet"
    pq.write_table(pa.Table.from_pylist([chat("q3", "a3"), chat("q4", "a4")]), b)
    samples, report = load_samples([a, str(b)], smollm_tokenizer, max_length=64)
    assert [s.sample_id for s in samples] == [0, 2, 3, 4]
    limited, report = load_samples([a, str(b)], smollm_tokenizer, max_length=64, limit=3)
    assert same(limited, samples[:3]) and report.num_rows_read == 4 and report.num_samples == 3


def test_workers_give_identical_output(tmp_path, smollm_tokenizer):
    rows = [chat(f"question {i}?", f"answer number {i}.") if i % 7 != 3 else "bad" for i in range(150)]
    path = write_jsonl(tmp_path / "a.jsonl", rows)
    one, report_one = load_samples([path], smollm_tokenizer, max_length=64, limit=120)
    two, report_two = load_samples([path], smollm_tokenizer, max_length=64, limit=120, workers=2)
    assert len(one) == 120 and same(one, two) and report_one == report_two


# ---------------------------------------------------------------- embedded data and prompts


def test_embedded_dump_recovers_records_and_splits_are_disjoint(smollm_tokenizer):
    train = list(islice(iter_embedded_rows("train"), 300))
    eval_ = list(islice(iter_embedded_rows("eval"), 4))
    assert [i for i, _ in eval_] == [63, 127, 191, 255]
    train_ids = [i for i, _ in train]
    assert train_ids == sorted(train_ids) and len(train_ids) == 300
    assert all(i % 64 != 63 for i in train_ids) and set(train_ids).isdisjoint(i for i, _ in eval_)
    assert all(isinstance(r["conversations"], list) for _, r in train + eval_)

    samples, report = load_samples(None, smollm_tokenizer, max_length=512, limit=5)  # default: embedded train
    assert len(samples) == 5 and all(s.sample_id % 64 != 63 for s in samples)
    assert all(Path(p.file).name.endswith(".json") and p.row >= 1 for p in report.problems)
    prompts = list(iter_prompts(None, smollm_tokenizer, limit=2))  # default: embedded eval
    assert len(prompts) == 2 and all(i % 64 == 63 for i, _ in prompts)


def test_cut_off_array_keeps_complete_records(tmp_path):
    path = tmp_path / "cut.json"
    path.write_text('[\n  {"id": 1},\n  {"id": 2},\n  {"id": "thr')
    rows = list(data._iter_json_array(path))
    assert rows[:2] == [(1, {"id": 1}), (2, {"id": 2})]
    assert rows[2][0] == 3 and rows[2][1].reason == data.NOT_JSON and len(rows) == 3


def test_iter_prompts_stops_before_the_first_reply(tmp_path, smollm_tokenizer):
    tok = smollm_tokenizer
    rows = [
        {"messages": MESSAGES},
        {"prompt": "Write a haiku."},
        {"text": "plain"},
        {"conversations": [{"from": "gpt", "value": "I speak first"}, {"from": "human", "value": "ok"}]},
    ]
    report = DataReport()
    prompts = list(iter_prompts([write_jsonl(tmp_path / "p.jsonl", rows)], tok, report=report))
    assert [i for i, _ in prompts] == [0, 1]
    heads = [MESSAGES[:2], [{"role": "user", "content": "Write a haiku."}]]
    for (_, ids), head in zip(prompts, heads):
        text = tok.apply_chat_template(head, tokenize=False, add_generation_prompt=True)
        assert ids.dtype == np.int32 and ids.tolist() == tok(text, add_special_tokens=False)["input_ids"]
        assert tok.decode(ids.tolist()).endswith("<|im_start|>assistant\n")
    assert problems(report) == [("p.jsonl", 3, data.NO_PROMPT), ("p.jsonl", 4, data.NO_PROMPT)]
