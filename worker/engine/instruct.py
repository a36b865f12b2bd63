"""The builtin ``pysource-instruct`` set: docstring → function body pairs from the standard library.

Each pair is a prompt/completion row: the prompt is a function's ``def`` line(s) and docstring,
the completion the rest of its body, both dedented to the ``def``. The functions come from the
standard library files after those the ``pysource`` corpus holds (the one its cut falls in
included), so a model pretrained on pysource has not seen them. Pairs are taken in file order,
then line order, and the set ends once it holds PYSOURCE_INSTRUCT_BYTES of text.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import json

from .data import PYSOURCE_BYTES, stdlib_sources

PYSOURCE_INSTRUCT_BYTES = 2 << 20  # text of the prompts and completions (the set holds less where the stdlib does)
PAIR_MAX_CHARS = 4096  # a longer function is left out: a pair fits a few sequences of a small model


def function_pairs(source: str) -> list[dict[str, str]]:
    """The prompt/completion pairs of a module's functions and methods with a docstring and a
    body after it, in line order (nested ones too)."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    lines = source.splitlines(keepends=True)
    nodes = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]
    pairs = []
    for node in sorted(nodes, key=lambda n: n.lineno):
        if ast.get_docstring(node) is None or len(node.body) < 2:
            continue
        doc_end, end = node.body[0].end_lineno, node.end_lineno
        if doc_end is None or end is None or node.body[1].lineno <= doc_end:  # code on the docstring's line
            continue
        indent = len(lines[node.lineno - 1]) - len(lines[node.lineno - 1].lstrip())
        prompt = _dedent(lines[node.lineno - 1 : doc_end], indent)
        completion = _dedent(lines[doc_end:end], indent)
        if prompt and completion.strip() and len(prompt) + len(completion) <= PAIR_MAX_CHARS:
            pairs.append({"prompt": prompt, "completion": completion})
    return pairs


def _dedent(lines: list[str], indent: int) -> str:
    """``lines`` with their first ``indent`` characters removed where those are blanks."""
    out = []
    for line in lines:
        if not line.strip():
            out.append("\n")
        else:
            out.append(line[indent:] if line[:indent].isspace() or not indent else line.lstrip(" \t"))
    return "".join(out)


@functools.cache
def pysource_instruct(max_bytes: int = PYSOURCE_INSTRUCT_BYTES) -> tuple[dict[str, str], ...]:
    """The set's rows (see the module's docstring): the same on every run of one Python version."""
    rows, seen, size = [], 0, 0
    for _, data in stdlib_sources():
        seen += len(data)
        if seen - len(data) < PYSOURCE_BYTES:  # a file pysource holds (in part, where its cut falls)
            continue
        for pair in function_pairs(data.decode("ascii")):
            if "\x00" in pair["prompt"] + pair["completion"]:
                continue
            rows.append(pair)
            size += len(pair["prompt"]) + len(pair["completion"])
            if size >= max_bytes:
                return tuple(rows)
    return tuple(rows)


def pysource_instruct_sha256() -> str:
    """The sha256 of the set's rows as JSON lines: which set this interpreter gives."""
    text = "".join(json.dumps(r) + "\n" for r in pysource_instruct())
    return hashlib.sha256(text.encode()).hexdigest()
