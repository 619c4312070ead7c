"""The loss mask under the chat templates of every target family (tests/families.py, tests/templates/): thinking
on and off, reasoning kept and dropped, tool calls and tool results, and `--chat-template-kwargs`.

The reference is what a server does: it renders the conversation before an assistant turn with the
generation prompt and the same template variables, and the target writes the rest of the turn up to its
end-of-turn token. Where the template renders a turn that continues that served prompt (every turn after
the last user query), the supervised text must be exactly that continuation; where it renders a turn
differently (Qwen3's bare earlier turns), the part after what the two share. The reference renders
prefixes of the conversation; the code under test never does (it walks a marked rendering), so the two
agree only if both are right. Literal expectations next to it make the rules visible.

Templates run on SmolLM2's tokenizer with the family's turn tokens added (Qwen's `<think>`, `<tool_call>`,
... as added tokens, Gemma's `<start_of_turn>` / `<end_of_turn>` as special ones).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import pytest

from dflash_pipeline.extract import readers
from dflash_pipeline.extract.chat import ChatTokenizer, iter_prompts
from dflash_pipeline.extract.readers import record_messages, record_tools
from dflash_pipeline.extract.samples import load_samples
from dflash_pipeline.schemas.chat_template import unused_template_kwargs
from families import FAMILIES

TEMPLATES = Path(__file__).parent / "templates"
QWEN_TOKENS = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
FAMILY_TEMPLATES = [(f.model_type, t) for f in FAMILIES for t in f.chat_templates]
IDS = [f"{family}-{template or 'chatml'}" for family, template in FAMILY_TEMPLATES]
THINKING = [{}, {"enable_thinking": True}, {"enable_thinking": False}]

_TOKENIZERS: dict[str, object] = {}


def template_tokenizer(base, template: str):
    """SmolLM2's tokenizer with `template` (tests/templates/<template>.jinja) and its family's turn tokens."""
    if template not in _TOKENIZERS:
        tok = copy.deepcopy(base)
        if template:
            tok.chat_template = (TEMPLATES / f"{template}.jinja").read_text()
        if template.startswith("qwen"):
            tok.add_tokens(QWEN_TOKENS)  # added, not special, as in Qwen's own tokenizer
        if template == "gemma3":
            tok.add_special_tokens({"bos_token": "<bos>", "additional_special_tokens": ["<start_of_turn>",
                                                                                        "<end_of_turn>"]})
        _TOKENIZERS[template] = tok
    return _TOKENIZERS[template]


def eot(template: str) -> str:
    return "<end_of_turn>" if template == "gemma3" else "<|im_end|>"


# ---------------------------------------------------------------- conversations


def plain(final: str = "2+2 is 4.") -> dict:
    return {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"},
                         {"role": "assistant", "content": "Hello! How can I help?"},
                         {"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": final}]}


def reasoned(inline: bool) -> dict:
    """Two replies with reasoning: as OpenAI's `reasoning_content`, or inline in the content."""
    def reply(thought: str, answer: str) -> dict:
        if inline:
            return {"role": "assistant", "content": f"<think>\n{thought}\n</think>\n\n{answer}"}
        return {"role": "assistant", "reasoning_content": thought, "content": answer}

    return {"messages": [{"role": "user", "content": "What is 2+2?"}, reply("Two and two make four.", "4."),
                         {"role": "user", "content": "And 3+3?"}, reply("Three and three make six.", "6.")]}


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}


def call(city: str, i: int) -> dict:
    return {"id": f"call_{i}", "type": "function",
            "function": {"name": "get_weather", "arguments": json.dumps({"city": city})}}


def tool_chat(with_text: bool) -> dict:
    """A tool call (alone, or after some text and with a second call in parallel), its results, the answer."""
    calls = [call("Paris", 1), call("Rome", 2)] if with_text else [call("Paris", 1)]
    results = [{"role": "tool", "tool_call_id": c["id"], "content": r} for c, r in zip(calls, ["18 C, sunny",
                                                                                              "21 C, cloudy"])]
    return {"tools": [WEATHER], "messages": [
        {"role": "user", "content": "What is the weather in Paris" + (" and Rome?" if with_text else "?")},
        {"role": "assistant", "content": "Let me check." if with_text else None, "tool_calls": calls},
        *results,
        {"role": "assistant", "content": "It is 18 C and sunny in Paris."},
    ]}


# ---------------------------------------------------------------- the reference and the checks


def served_spans(tok, messages: list[dict], tools, kwargs: dict, end: str) -> list[tuple[int, int]]:
    """Per assistant turn, [start, end) of what the target writes, from renderings of the conversation
    before the turn, with and without the generation prompt (as a server renders it)."""
    rendered = tok.apply_chat_template(messages, tools=tools, tokenize=False, **kwargs)
    spans = []
    for k, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = tok.apply_chat_template(messages[:k], tools=tools, tokenize=False, **kwargs)
        served = tok.apply_chat_template(messages[:k], tools=tools, tokenize=False, add_generation_prompt=True,
                                         **kwargs)
        assert rendered.startswith(before) and served.startswith(before)
        turn = rendered[len(before):]
        shared = next((i for i, (a, b) in enumerate(zip(turn, served[len(before):])) if a != b),
                      min(len(turn), len(served) - len(before)))
        start = len(before) + shared
        spans.append((start, rendered.index(end, start) + len(end)))
    return spans


def tokens_over(tok, rendered: str, spans: list[tuple[int, int]]) -> np.ndarray:
    offsets = np.asarray(tok.backend_tokenizer.encode(rendered, add_special_tokens=False).offsets).reshape(-1, 2)
    mask = np.zeros(len(offsets), dtype=bool)
    for a, b in spans:
        mask |= (offsets[:, 0] < b) & (offsets[:, 1] > a)
    return mask


def check(tok, record: dict, kwargs: dict, template: str, literal: list[str] | None = None) -> np.ndarray:
    """The mask of `record` equals the served reference; with `literal`, the supervised texts are those."""
    messages, tools = record_messages(record), record_tools(record)
    ids, mask = ChatTokenizer(tok, kwargs).tokens(messages, tools)
    rendered = tok.apply_chat_template(messages, tools=tools, tokenize=False, **kwargs)
    assert ids.tolist() == tok(rendered, add_special_tokens=False)["input_ids"]  # one tokenization of the rendering
    spans = served_spans(tok, messages, tools, kwargs, eot(template))
    np.testing.assert_array_equal(mask, tokens_over(tok, rendered, spans))
    if literal is not None:
        assert [rendered[a:b] for a, b in spans] == literal
    return mask


# ---------------------------------------------------------------- per family


@pytest.mark.parametrize("kwargs", THINKING, ids=["default", "thinking", "no-thinking"])
@pytest.mark.parametrize("family, template", FAMILY_TEMPLATES, ids=IDS)
def test_thinking_on_and_off(smollm_tokenizer, family, template, kwargs):
    """Thinking on, the target writes the think block (Qwen3: all of it; Qwen3.5/3.6 and thinking-only
    checkpoints are handed `<think>\\n`); thinking off, the server writes an empty one and the target only the
    reply. Earlier replies are rendered bare by every Qwen template: only their text and `<|im_end|>`."""
    tok = template_tokenizer(smollm_tokenizer, template)
    thinking = kwargs.get("enable_thinking", True)
    block = {"qwen3": "<think>\n\n</think>\n\n", "qwen3_thinking": "\n</think>\n\n", "qwen3_5": "\n</think>\n\n",
             "qwen3_6": "\n</think>\n\n"}.get(template, "") if (thinking or template == "qwen3_thinking") else ""
    mask = check(tok, plain(), kwargs, template,
                 [f"Hello! How can I help?{eot(template)}", f"{block}2+2 is 4.{eot(template)}"])
    rendered = tok.apply_chat_template(record_messages(plain()), tokenize=False, **kwargs)
    ids = tok(rendered, add_special_tokens=False)["input_ids"]
    assert "Be brief" not in tok.decode([i for i, m in zip(ids, mask) if m])  # system and user turns: never


@pytest.mark.parametrize("inline", [False, True], ids=["reasoning_content", "inline-think"])
@pytest.mark.parametrize("family, template", FAMILY_TEMPLATES, ids=IDS)
def test_reasoning_kept_and_dropped(smollm_tokenizer, family, template, inline):
    """Reasoning is supervised where the template renders it: Qwen templates keep it in the last reply (after
    the last user query) and drop it from the earlier one, whether it comes as `reasoning_content` or inline;
    templates without reasoning ignore the field and render inline text as the reply it is."""
    tok = template_tokenizer(smollm_tokenizer, template)
    e = eot(template)
    if template.startswith("qwen"):
        last = ("<think>\n" if template == "qwen3" else "") + "Three and three make six.\n</think>\n\n6."
        literal = [f"4.{e}", f"{last}{e}"]
    elif inline:
        literal = [f"<think>\nTwo and two make four.\n</think>\n\n4.{e}",
                   f"<think>\nThree and three make six.\n</think>\n\n6.{e}"]
    else:
        literal = [f"4.{e}", f"6.{e}"]
    check(tok, reasoned(inline), {}, template, literal)
    if template.startswith("qwen"):  # both forms are one conversation to a Qwen template
        chat = ChatTokenizer(tok)
        a, b = (chat.tokens(record_messages(reasoned(x))) for x in (False, True))
        assert a[0].tolist() == b[0].tolist() and a[1].tolist() == b[1].tolist()


@pytest.mark.parametrize("with_text", [False, True], ids=["call", "text-and-two-calls"])
@pytest.mark.parametrize("kwargs", [{}, {"enable_thinking": False}], ids=["default", "no-thinking"])
@pytest.mark.parametrize("family, template", FAMILY_TEMPLATES, ids=IDS)
def test_tool_call_and_result(tmp_path, smollm_tokenizer, family, template, kwargs, with_text):
    """The assistant's tool calls are supervised as the template writes them, through the turn's end; the tool
    definitions (system prompt) and results are not. Templates without tool calls: SmolLM2's ChatML renders
    the text of a reply and drops its calls (a reply of calls alone is a bad row: nothing of it is
    rendered); Gemma 3 refuses a tool turn (roles must alternate), a bad row with its file and row."""
    tok = template_tokenizer(smollm_tokenizer, template)
    record = tool_chat(with_text)
    path = tmp_path / "tools.jsonl"
    path.write_text(json.dumps(record) + "\n")
    samples, report = load_samples([str(path)], tok, max_length=4096, template_kwargs=kwargs)
    if template == "gemma3" or (template == "" and not with_text):
        reason = readers.TEMPLATE_ERROR if template else readers.NOT_IN_RENDERING
        assert samples == [] and [(p.row, p.reason) for p in report.problems] == [(1, reason)]
        assert ("alternate" if template else "turn 2") in report.problems[0].detail
        return
    (sample,) = samples
    mask = check(tok, record, kwargs, template)
    assert sample.loss_mask.tolist() == mask.tolist()
    rendered = tok.apply_chat_template(record_messages(record), tools=[WEATHER], tokenize=False, **kwargs)
    offsets = tok.backend_tokenizer.encode(rendered, add_special_tokens=False).offsets
    supervised = "".join(rendered[a:b] for (a, b), m in zip(offsets, mask) if m)
    assert "18 C, sunny" not in supervised and "21 C" not in supervised and "The weather in a city" not in supervised
    if template:  # ChatML drops the calls
        assert supervised.count("Paris") == 2 and "get_weather" in supervised  # the call and the answer
    if template in ("qwen3_5", "qwen3_6"):  # Qwen3.5/3.6 write calls as XML, the arguments parsed from OpenAI's JSON
        assert "<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>" in supervised


def test_preserve_thinking_keeps_earlier_reasoning(smollm_tokenizer):
    """Qwen3.6's `preserve_thinking` renders the reasoning of earlier replies too: it is then supervised."""
    tok = template_tokenizer(smollm_tokenizer, "qwen3_6")
    check(tok, reasoned(False), {"preserve_thinking": True}, "qwen3_6",
          ["Two and two make four.\n</think>\n\n4.<|im_end|>",
           "Three and three make six.\n</think>\n\n6.<|im_end|>"])
    check(tok, plain(), {"preserve_thinking": True, "enable_thinking": False}, "qwen3_6")


def test_the_same_conversation_in_every_record_form(tmp_path, smollm_tokenizer):
    """A tool conversation as OpenAI messages (arguments as JSON text), as ShareGPT with LLaMA-Factory's
    function_call / observation turns (tools as JSON text), and in Parquet: one sample."""
    tok = template_tokenizer(smollm_tokenizer, "qwen3_5")
    openai = tool_chat(False)
    m = openai["messages"]
    sharegpt = {"tools": json.dumps([WEATHER]), "conversations": [
        {"from": "human", "value": m[0]["content"]},
        {"from": "function_call", "value": json.dumps({"name": "get_weather", "arguments": {"city": "Paris"}})},
        {"from": "observation", "value": m[2]["content"]},
        {"from": "gpt", "value": m[3]["content"]},
    ]}
    legacy = {"tools": [WEATHER], "messages": [m[0], {"role": "assistant", "content": None, "function_call": {
        "name": "get_weather", "arguments": '{"city": "Paris"}'}}, {"role": "function", "name": "get_weather",
                                                                  "content": m[2]["content"]}, m[3]]}
    jsonl = tmp_path / "a.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in (openai, sharegpt, legacy)))
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist([openai]), tmp_path / "b.parquet")
    samples, report = load_samples([str(jsonl), str(tmp_path / "b.parquet")], tok, max_length=4096)
    assert report.num_skipped == 0 and len(samples) == 4
    for s in samples[1:]:
        assert s.input_ids.tolist() == samples[0].input_ids.tolist()
        assert s.loss_mask.tolist() == samples[0].loss_mask.tolist()


def test_a_template_that_moves_text_falls_back_to_search(smollm_tokenizer):
    """A template whose scaffolding depends on the text (here: a reply that starts with a digit gets a
    prefix) cannot be walked; each reply is searched for and supervised with its end-of-turn token."""
    tok = copy.deepcopy(smollm_tokenizer)
    tok.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'][0] in '0123456789' %}"
                         "Number: {% endif %}{{ m['content'] }}<|im_end|>\n{% endfor %}")
    ids, mask = ChatTokenizer(tok).tokens([{"role": "user", "content": "Count."},
                                          {"role": "assistant", "content": "3 apples"}])
    assert tok.decode(ids[mask].tolist()) == "3 apples<|im_end|>"


@pytest.mark.parametrize("family, template", FAMILY_TEMPLATES, ids=IDS)
def test_a_reply_cut_at_the_length_limit_does_not_supervise_its_end_of_turn(smollm_tokenizer, family, template):
    """`dflash generate` marks a reply that stopped at --max-new-tokens (finish "length"): the target never
    wrote the end of turn the template closes it with, so that token is not a label (a drafter would learn
    to predict an end where the target goes on). Every other turn, and a reply that stopped, keep theirs."""
    tok = template_tokenizer(smollm_tokenizer, template)
    record = plain("2+2 is 4, and 4+4 is")
    record["dflash"] = {"sample_id": 0, "source": "x:1", "replies": [{"tokens": 7, "finish": "stop"},
                                                                     {"tokens": 9, "finish": "length"}]}
    assert readers.reply_cut_off(record)
    full = check(tok, {"messages": record["messages"]}, {}, template)  # as it stopped: the reference
    ids, mask = ChatTokenizer(tok).tokens(record_messages(record), None, cut_off=True)
    dropped = np.flatnonzero(full & ~mask)
    assert not (mask & ~full).any() and len(dropped) >= 1
    assert tok.decode(ids[dropped].tolist()).strip() == eot(template)  # the last turn's end of turn, only
    assert tok.decode(ids[mask].tolist()).endswith("4+4 is")
    from dflash_pipeline.extract.samples import _sample  # what extract stores for the record as generate wrote it
    np.testing.assert_array_equal(_sample(ChatTokenizer(tok), 4096, 0, record).sample.loss_mask, mask)
    stopped = {**record, "dflash": {**record["dflash"], "replies": [{"tokens": 9, "finish": "stop"}]}}
    assert not readers.reply_cut_off(stopped) and not readers.reply_cut_off({"messages": []})


def test_a_cut_reply_under_the_search_fallback(smollm_tokenizer):
    tok = copy.deepcopy(smollm_tokenizer)
    tok.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'][0] in '0123456789' %}"
                         "Number: {% endif %}{{ m['content'] }}<|im_end|>\n{% endfor %}")
    messages = [{"role": "user", "content": "Count."}, {"role": "assistant", "content": "3 apples"},
                {"role": "user", "content": "More."}, {"role": "assistant", "content": "4 apples and"}]
    ids, mask = ChatTokenizer(tok).tokens(messages, cut_off=True)
    assert tok.decode(ids[mask].tolist()) == "3 apples<|im_end|>4 apples and"


# ---------------------------------------------------------------- the option


def test_kwargs_reach_workers_and_prompts(tmp_path, smollm_tokenizer):
    """Spawned tokenizer workers render with the same variables, and eval's prompts end with the server's
    generation prompt for them."""
    tok = template_tokenizer(smollm_tokenizer, "qwen3")
    path = tmp_path / "a.jsonl"
    path.write_text("".join(json.dumps(plain(f"{i} is a number.")) + "\n" for i in range(8)))
    off = {"enable_thinking": False}
    one, _ = load_samples([str(path)], tok, max_length=256, template_kwargs=off)
    two, _ = load_samples([str(path)], tok, max_length=256, template_kwargs=off, workers=2)
    on, _ = load_samples([str(path)], tok, max_length=256)
    assert [s.loss_mask.tolist() for s in one] == [s.loss_mask.tolist() for s in two]
    assert all(a.loss_mask.sum() < b.loss_mask.sum() for a, b in zip(one, on))  # no think block to write
    (_, ids), = iter_prompts([str(path)], tok, limit=1, template_kwargs=off)
    assert tok.decode(ids.tolist()).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_kwargs_parser():
    from dflash_pipeline.schemas.chat_template import parse_chat_template_kwargs

    assert parse_chat_template_kwargs(None) == {} and parse_chat_template_kwargs("") == {}
    assert parse_chat_template_kwargs('{"enable_thinking": false}') == {"enable_thinking": False}
    assert parse_chat_template_kwargs({"preserve_thinking": True}) == {"preserve_thinking": True}
    for text, needle in [("enable_thinking=false", "must be a JSON object"), ("[1]", "got a JSON list"),
                         ('{"tools": []}', "tools cannot be set here"), ('{"a b": 1}', "not a template variable")]:
        with pytest.raises(ValueError, match=needle):
            parse_chat_template_kwargs(text)


def test_unread_kwargs_are_named(smollm_tokenizer):
    tok = template_tokenizer(smollm_tokenizer, "qwen3_6")
    assert unused_template_kwargs(tok, {"enable_thinking": False, "preserve_thinking": True}) == []
    assert unused_template_kwargs(tok, {"enable_thinkng": False}) == ["enable_thinkng"]
    assert unused_template_kwargs(smollm_tokenizer, {"enable_thinking": False}) == ["enable_thinking"]


def test_extract_records_the_kwargs_and_refuses_others_on_resume(tmp_path, smollm_tokenizer, smollm_dir):
    """`dflash extract` on a tiny random Qwen3.5 with Qwen3.5's template, thinking off: the store's masks are
    the tokenizer's, the store records the variables, and a resume with other variables is refused."""
    from dflash_pipeline.errors import ConfigMismatchError
    from dflash_pipeline.extract.pipeline import run_extract
    from dflash_pipeline.schemas.config import ExtractConfig
    from dflash_pipeline.store.reader import StoreReader
    from families import build

    family = next(f for f in FAMILIES if f.model_type == "qwen3_5")
    target = build(family, tmp_path / "target", smollm_dir)
    (target / "chat_template.jinja").write_text((TEMPLATES / "qwen3_5.jinja").read_text())
    data = tmp_path / "conv.jsonl"
    records = [plain(f"{i} times {i} is {i * i}.") for i in range(3)] + [tool_chat(True)]
    data.write_text("".join(json.dumps(r) + "\n" for r in records))

    def extract(kwargs):
        return run_extract(ExtractConfig(out=str(tmp_path / "store"), target=str(target), data=[str(data)],
                                         max_length=512, topk=2, tokens_per_batch=1024, segment_tokens=4096,
                                         tokenize_workers=1, quiet=True, device="cpu", dtype="fp32", num_features=2,
                                         chat_template_kwargs=kwargs))

    off = '{"enable_thinking": false}'  # as the command line gives it
    extract(off)
    r = StoreReader(str(tmp_path / "store"))
    assert r.meta.extract_config["chat_template_kwargs"] == {"enable_thinking": False}
    tok = r.load_tokenizer()
    chat = ChatTokenizer(tok, {"enable_thinking": False})
    assert r.num_samples == len(records)
    for row in range(r.num_samples):
        s = r.read_sample(row)
        ids, mask = chat.tokens(record_messages(records[s.sample_id]), record_tools(records[s.sample_id]))
        assert s.tokens_T.tolist() == ids.tolist() and s.loss_mask_T.tolist() == mask.tolist()
    assert extract({"enable_thinking": False})["segments_this_run"] == 0  # the same run resumes
    with pytest.raises(ConfigMismatchError, match=r"chat_template_kwargs: store has \{'enable_thinking': False\}, "
                                                  r"asked for \{\}"):
        extract(None)
    with pytest.raises(ValueError, match="must be a JSON object, got a JSON list"):  # the CLI: one line, exit 2
        extract("[1]")
