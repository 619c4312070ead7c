"""`--chat-template-kwargs`: extra variables a target's chat template reads (Qwen3's `enable_thinking`, ...).

One parser for every command that renders conversations with the target's template (`dflash
generate`, and `dflash extract` next), so that the option is written the same way everywhere and two
commands given the same JSON render the same text: the responses a target generated under one setting
are then masked for training under the same setting.

The value is a JSON object whose entries go to `tokenizer.apply_chat_template(..., **kwargs)`. Keys
that `apply_chat_template` itself takes to decide what to return (tokenize, add_generation_prompt,
...) are refused: the pipeline sets those, and a user's value would silently change what is
rendered. A key the template never reads is almost always a typo; `unused_template_kwargs` names such
keys so that the command can warn instead of ignoring them in silence.
"""

from __future__ import annotations

import json
from typing import Any

OPTION = "--chat-template-kwargs"

# apply_chat_template's own parameters that the pipeline sets: a user value would change what the
# call returns, not what the template renders. `tools` (and `documents`) come with each record.
RESERVED_KEYS = frozenset({
    "conversation", "messages", "tokenize", "add_generation_prompt", "continue_final_message", "return_dict",
    "return_tensors", "return_assistant_tokens_mask", "padding", "truncation", "max_length", "tokenizer_kwargs",
    "chat_template", "tools", "documents",
})


def parse_chat_template_kwargs(text: str | dict[str, Any] | None) -> dict[str, Any]:
    """The option's JSON object as a dict ({} for None or ''); ValueError, in one line, for anything else."""
    if text is None or text == "":
        return {}
    if isinstance(text, dict):
        value = text
    else:
        try:
            value = json.loads(text)
        except ValueError as e:
            raise ValueError(f"{OPTION} must be a JSON object, e.g. '{{\"enable_thinking\": false}}' ({e})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{OPTION} must be a JSON object, got a JSON {type(value).__name__}")
    reserved = sorted(RESERVED_KEYS.intersection(value))
    if reserved:
        raise ValueError(f"{OPTION}: {', '.join(reserved)} cannot be set here (the command sets it)")
    bad = [k for k in value if not k.isidentifier()]
    if bad:
        raise ValueError(f"{OPTION}: {bad[0]!r} is not a template variable name")
    return dict(value)


def template_variables(template: str) -> set[str]:
    """The variables a Jinja chat template reads from its caller."""
    import jinja2
    from jinja2 import meta

    env = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"])  # {% break %}, as transformers allows
    return set(meta.find_undeclared_variables(env.parse(template)))


def unused_template_kwargs(tokenizer: Any, kwargs: dict[str, Any]) -> list[str]:
    """Keys of `kwargs` the tokenizer's chat template never reads (each is then silently ignored)."""
    if not kwargs:
        return []
    template = getattr(tokenizer, "chat_template", None) or ""
    sources = list(template.values()) if isinstance(template, dict) else [template]
    read: set[str] = set()
    for source in sources:
        try:
            read |= template_variables(source)
        except Exception:  # a tag only transformers knows ({% generation %}): which variables it reads is unknown
            return []
    return sorted(k for k in kwargs if k not in read)
