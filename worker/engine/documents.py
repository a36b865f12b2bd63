"""Datasets of documents: JSONL rows and parquet columns read, laid out, and encoded with a loss mask.

The rows' shapes, their checks and the default chat layout are contract.documents (the API checks
an upload with the same code). Here they are read from a file, a conversation is laid out with
the model's chat template where its tokenizer has one, and the documents are encoded into one
packed id array, each ending with the end-of-text id, beside a mask of the targets the loss
counts.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from contract.documents import NUL, Segment, file_format, parse_row, segments
from contract.spec import DataSpec, ModelTokenizerSpec

from .facts import TOKEN_NAME_DIGEST
from .tokenizer import Tokenizer

ENCODE_SEGMENTS = 1 << 14  # segments encoded at once (a BPE encodes them in parallel)
PROGRESS_SECONDS = 10.0  # the tokenization's progress in the job's log, at most this often
PARQUET_BATCH = 1 << 12  # rows read at once from a parquet file
TOKENIZER_CONFIG = "tokenizer_config.json"
CHAT_TEMPLATE = "chat_template.jinja"  # where transformers 4.43+ saves a chat template of its own


@dataclass(frozen=True)
class Documents:
    """A corpus as documents: ``digest`` names it in the token cache (its text's sha256[:16], then
    how it is read);
    ``documents()`` reads it afresh each time; ``separated``: its documents end with end of text
    (a plain text file is one document with none)."""

    digest: str
    documents: Callable[[], Iterable[list[Segment]]]
    separated: bool = True

    def texts(self, with_eos: bool = False) -> Iterator[str]:
        """Each document's text, the end of text as NUL when ``with_eos`` (a char tokenizer covers it)."""
        for doc in self.documents():
            yield "".join(NUL if s.text is None else s.text for s in doc if with_eos or s.text is not None)


def read_format(cfg: DataSpec, path: Path) -> str:
    """text, jsonl or parquet: ``data.format``, or by the file's suffix when it is auto."""
    return file_format(path.name) if cfg.format == "auto" else cfg.format


def file_documents(cfg: DataSpec, path: Path, fmt: str, model_dir: Path | None = None) -> Documents:
    """A JSONL or parquet file's documents, laid out for ``cfg`` (the model's chat template with
    its tokenizer {type: model}, train_on_inputs); named by the file's sha256 and the layout."""
    content = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            content.update(chunk)
    render, template = None, ""
    if isinstance(cfg.tokenizer, ModelTokenizerSpec) and model_dir is not None:
        template = template_source(Path(model_dir)) or ""
        render = chat_template(Path(model_dir)) if template else None
    layout = f"{fmt}|{cfg.text_column if fmt == 'parquet' else ''}|{cfg.train_on_inputs}|{template}"
    digest = f"{content.hexdigest()[:TOKEN_NAME_DIGEST]}-{hashlib.sha256(layout.encode()).hexdigest()[:8]}"

    def rows() -> Iterator[dict[str, Any]]:
        return jsonl_rows(path) if fmt == "jsonl" else parquet_rows(path, cfg.text_column)

    def docs() -> Iterator[list[Segment]]:
        for row in rows():
            if render is not None and "messages" in row:
                yield templated_segments(row["messages"], render, cfg.train_on_inputs)
            else:
                yield segments(row, cfg.train_on_inputs)

    return Documents(digest, docs)


def rows_documents(name: str, rows: Callable[[], Iterable[dict[str, Any]]], train_on_inputs: bool) -> Documents:
    """Documents of checked rows held in memory (a builtin set), named by ``name`` (their sha256)
    and their layout."""
    digest = f"{name[:TOKEN_NAME_DIGEST]}-{hashlib.sha256(str(train_on_inputs).encode()).hexdigest()[:8]}"
    return Documents(digest, lambda: (segments(row, train_on_inputs) for row in rows()))


def jsonl_rows(path: Path) -> Iterator[dict[str, Any]]:
    """A JSONL file's checked rows (blank lines skipped); ValueError naming the first bad line."""
    with path.open("rb") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield parse_row(line)
            except ValueError as exc:
                raise ValueError(f"{path.name} line {number}: {exc}") from None


def parquet_rows(path: Path, column: str) -> Iterator[dict[str, Any]]:
    """A parquet file's ``column``, a {text} row per non-empty value."""
    import pyarrow.parquet as pq

    table = pq.ParquetFile(path)
    names = table.schema_arrow.names
    if column not in names:
        raise ValueError(f"{path.name} has no column {column!r} (data.text_column); it has {', '.join(names)}")
    for batch in table.iter_batches(batch_size=PARQUET_BATCH, columns=[column]):
        for value in batch.column(0).to_pylist():
            if value:
                yield parse_row(json.dumps({"text": value if isinstance(value, str) else str(value)}))


def model_eos(model_dir: Path) -> str:
    """An uploaded model's end-of-text token: its tokenizer_config.json's eos_token, else the token
    of its config.json's eos_token_id (read from its tokenizer.json)."""
    config = _json(model_dir / TOKENIZER_CONFIG)
    eos = config.get("eos_token")
    if isinstance(eos, dict):
        eos = eos.get("content")
    if isinstance(eos, str) and eos:
        return eos
    eos_id = _json(model_dir / "config.json").get("eos_token_id")
    eos_id = eos_id[0] if isinstance(eos_id, list) and eos_id else eos_id
    if isinstance(eos_id, int):
        from tokenizers import Tokenizer as Fast

        token = Fast.from_file(str(model_dir / "tokenizer.json")).id_to_token(eos_id)
        if token is not None:
            return token
    raise ValueError(
        "the model names no end-of-text token (eos_token in tokenizer_config.json or eos_token_id in config.json): "
        "packed documents are separated by it"
    )


def _json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def template_source(model_dir: Path) -> str | None:
    """The model's chat template (its tokenizer_config.json's, else its chat_template.jinja), or None."""
    given = _json(model_dir / TOKENIZER_CONFIG).get("chat_template")
    if given:
        return json.dumps(given)  # a template, or a list of named ones
    path = model_dir / CHAT_TEMPLATE
    return path.read_text(encoding="utf-8") if path.is_file() else None


def chat_template(model_dir: Path) -> Callable[[list[dict[str, str]], bool], str] | None:
    """The model's chat template as a function (messages, generation prompt) -> text, or None
    when its tokenizer has none (the default layout applies)."""
    if template_source(model_dir) is None:
        return None
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)

    def render(messages: list[dict[str, str]], generation_prompt: bool) -> str:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
        if not isinstance(text, str):
            raise ValueError("the model's chat template rendered no text")
        return text

    return render


def templated_segments(
    messages: list[dict[str, str]], render: Callable[[list[dict[str, str]], bool], str], train_on_inputs: bool = False
) -> list[Segment]:
    """A conversation laid out by a chat template, the assistant's part of each turn trained on.

    The text the template adds for each message is what rendering the conversation up to it adds
    to the rendering before it; an assistant message's part starts after the template's
    generation prompt (its header), which is trained on only with ``train_on_inputs``. A template
    that rewrites earlier turns as the conversation grows cannot be split this way: ValueError.
    """
    out, before = [], ""
    for i, message in enumerate(messages):
        if message["role"] == "assistant":
            header = render(messages[:i], True) if i else render([], True)
            out.append(Segment(_added(before, header), train_on_inputs))
            before = header
        text = render(messages[: i + 1], False)
        out.append(Segment(_added(before, text), train_on_inputs or message["role"] == "assistant"))
        before = text
    return [*out, Segment(None, out[-1].trained)]


def _added(before: str, after: str) -> str:
    if not after.startswith(before):
        raise ValueError(
            "the model's chat template renders a conversation's beginning differently once it goes on (it rewrites "
            "earlier turns), so its assistant turns cannot be found: give prompt/completion rows instead"
        )
    return after[len(before) :]


def encode(
    tokenizer: Tokenizer, docs: Iterable[list[Segment]], log: Callable[[str], None] | None = None
) -> tuple[np.ndarray, np.ndarray | None]:
    """Documents as one packed id array and the mask of the ids the loss counts (None: all of
    them); ``log`` hears the progress every PROGRESS_SECONDS."""
    eos: list[np.ndarray] = []  # the end-of-text id, looked up once a document has one
    ids: list[np.ndarray] = []
    trained: list[bool] = []
    pending: list[Segment] = []

    def flush() -> None:
        encoded = iter(tokenizer.encode_many([s.text for s in pending if s.text is not None]))
        for s in pending:
            if s.text is None and not eos:
                eos.append(np.asarray([tokenizer.eos_id], dtype=tokenizer.dtype))
            ids.append(eos[0] if s.text is None else next(encoded))
            trained.append(s.trained)
        pending.clear()

    said, count = time.monotonic(), 0
    for count, doc in enumerate(docs, 1):
        pending += doc
        if len(pending) >= ENCODE_SEGMENTS:
            flush()
            if log is not None and time.monotonic() - said >= PROGRESS_SECONDS:
                said = time.monotonic()
                log(f"tokenizing: {count:,} documents, {sum(map(len, ids)):,} tokens so far")
    flush()
    if not ids:
        raise ValueError("the dataset holds no document")
    lengths = np.fromiter((len(a) for a in ids), dtype=np.int64, count=len(ids))
    flags = np.asarray(trained, dtype=np.uint8)
    mask = None if flags.all() else np.repeat(flags, lengths)
    return (ids[0] if len(ids) == 1 else np.concatenate(ids)), mask


def split_point(tokens: np.ndarray, at: int, eos_id: int) -> int:
    """Where the validation split starts: just after the first end of text at or after ``at`` (the
    documents stay whole), else ``at`` (none in the first half of what follows it)."""
    step, stop = 1 << 16, at + (len(tokens) - at) // 2
    for start in range(at, stop, step):
        hits = np.flatnonzero(np.asarray(tokens[start : min(start + step, stop)]) == eos_id)
        if len(hits):
            return start + int(hits[0]) + 1
    return at
