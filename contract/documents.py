"""Structured training documents: JSONL rows, their checks, and the default chat layout.

A JSONL dataset holds one JSON object per line, in one of three shapes:

- ``{"text": str}``: a document, trained on in full;
- ``{"prompt": str, "completion": str}``: the two joined as they are (the prompt carries its own
  separator), trained on the completion only unless ``data.train_on_inputs``;
- ``{"messages": [{"role": "system" | "user" | "assistant" | "tool", "content": str}, ...]}``: a
  conversation with at least one assistant message, trained on the assistant messages only
  unless ``data.train_on_inputs``.

Other keys of a row are ignored. A document becomes a list of :class:`Segment`: pieces of text,
each trained on or not, and end-of-text tokens. Every document ends with one, so packed documents
are separated by it. Byte and char tokenizers spell end of text as the NUL character (id 0),
which no document may contain.

A conversation is laid out with the model's chat template when its tokenizer has one (the
engine renders it); otherwise with :func:`chat_segments`'s default layout, each message a line
``<|role|>`` followed by its content and an end of text::

    <|user|>\\nWhat is 2+2?<EOT><|assistant|>\\n4<EOT>
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

FORMATS = {".jsonl": "jsonl", ".parquet": "parquet"}  # a dataset file's format by its suffix; any other: text
ROLES = ("system", "user", "assistant", "tool")
SHAPES = ("text", "prompt", "messages")  # the key that names a row's shape
NUL = "\x00"  # end of text for the byte and char tokenizers
ROLE_HEADERS = tuple(f"<|{role}|>\n" for role in ROLES)  # the default layout's lines before a message


@dataclass(frozen=True)
class Segment:
    """A piece of a document: ``text`` (None: the end-of-text token) and whether the loss counts it."""

    text: str | None
    trained: bool


def file_format(filename: str) -> str:
    """text, jsonl or parquet: a dataset file's format, by its name's suffix."""
    suffix = filename.rsplit(".", 1)[-1].lower() if "." in filename else ""
    return FORMATS.get(f".{suffix}", "text")


def parse_row(line: str | bytes) -> dict[str, Any]:
    """One JSONL line as a checked row (its shape's keys only); ValueError saying what is wrong."""
    try:
        row = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not JSON ({exc.msg} at column {exc.colno})") from None
    if not isinstance(row, dict):
        raise ValueError(f"a row is a JSON object, not {type(row).__name__}")
    given = [k for k in SHAPES if k in row]
    if len(given) != 1:
        raise ValueError(
            'a row has exactly one of "text", "prompt" (with "completion") or "messages" '
            f"(got {', '.join(map(repr, given)) or 'none of them'})"
        )
    if given == ["text"]:
        return {"text": _text(row["text"], "text")}
    if given == ["prompt"]:
        if "completion" not in row:
            raise ValueError('a "prompt" row needs its "completion"')
        prompt = _text(row["prompt"], "prompt", empty=True)
        return {"prompt": prompt, "completion": _text(row["completion"], "completion")}
    messages = row["messages"]
    if not isinstance(messages, list) or not messages:
        raise ValueError('"messages" is a non-empty list of {"role", "content"} objects')
    checked = [_message(m, i) for i, m in enumerate(messages)]
    if not any(m["role"] == "assistant" for m in checked):
        raise ValueError('"messages" has no "assistant" message: there is nothing to train on')
    return {"messages": checked}


def _message(message: Any, index: int) -> dict[str, str]:
    where = f"messages[{index}]"
    if not isinstance(message, dict):
        raise ValueError(f'{where} is an object {{"role", "content"}}')
    role = message.get("role")
    if role not in ROLES:
        raise ValueError(f"{where}.role is one of {', '.join(ROLES)} (got {role!r})")
    return {"role": role, "content": _text(message.get("content"), f"{where}.content", empty=role != "assistant")}


def _text(value: Any, where: str, empty: bool = False) -> str:
    if not isinstance(value, str):
        raise ValueError(f'"{where}" is a string (got {type(value).__name__})')
    if not value and not empty:
        raise ValueError(f'"{where}" is empty')
    if NUL in value:
        raise ValueError(f'"{where}" holds the NUL character (U+0000), which marks the end of a text')
    return value


def segments(row: dict[str, Any], train_on_inputs: bool = False) -> list[Segment]:
    """A checked row as segments in the default layout, ending with an end of text."""
    if "text" in row:
        return [Segment(row["text"], True), Segment(None, True)]
    if "prompt" in row:
        return [Segment(row["prompt"], train_on_inputs), Segment(row["completion"], True), Segment(None, True)]
    return chat_segments(row["messages"], train_on_inputs)


def chat_segments(messages: list[dict[str, str]], train_on_inputs: bool = False) -> list[Segment]:
    """A conversation in the default layout: each message ``<|role|>\\n`` + content + end of text;
    the assistant's content and end of text are trained on (everything, with ``train_on_inputs``)."""
    out = []
    for m in messages:
        trained = train_on_inputs or m["role"] == "assistant"
        out += [Segment(f"<|{m['role']}|>\n", train_on_inputs), Segment(m["content"], trained), Segment(None, trained)]
    return out


def segments_text(parts: list[Segment]) -> str:
    """The text of a document's segments (end of text as NUL): what a char tokenizer must cover."""
    return "".join(NUL if s.text is None else s.text for s in parts)
