"""Datasets of documents: JSONL rows checked line by line, the default chat layout and a model's
chat template, loss masks that leave prompts out, end of text between packed documents, parquet
columns, and the builtin pysource-instruct set."""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from contract.documents import Segment, file_format, parse_row, segments
from contract.spec import DataSpec
from worker.engine.data import IGNORE, load_data, pysource_text, target_loss
from worker.engine.documents import templated_segments
from worker.engine.instruct import function_pairs, pysource_instruct, pysource_instruct_sha256
from worker.engine.sample import generate

ROWS = [
    {"text": "plain words"},
    {"prompt": "Q: 2+2?\nA: ", "completion": "4"},
    {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
                  {"role": "assistant", "content": "hey"}]},
]  # fmt: skip


def write_jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.mark.parametrize(
    ("line", "words"),
    [
        ("{not json", "not JSON"),
        ("[1, 2]", "a JSON object, not list"),
        ('{"text": "a", "prompt": "b"}', "exactly one of"),
        ('{"id": 3}', "none of them"),
        ('{"text": ""}', '"text" is empty'),
        ('{"text": 5}', '"text" is a string (got int)'),
        ('{"prompt": "x"}', 'needs its "completion"'),
        ('{"messages": []}', "non-empty list"),
        ('{"messages": [{"role": "user", "content": "hi"}]}', 'no "assistant" message'),
        ('{"messages": [{"role": "bot", "content": "hi"}]}', "messages[0].role is one of"),
        ('{"text": "a\\u0000b"}', "NUL character"),
    ],
)
def test_a_bad_row_says_what_is_wrong(line, words):
    with pytest.raises(ValueError) as caught:
        parse_row(line)
    assert words in str(caught.value)


def test_rows_are_laid_out_with_only_completions_and_assistant_messages_trained():
    rows = [parse_row(json.dumps(r)) for r in ROWS]
    assert segments(rows[0]) == [Segment("plain words", True), Segment(None, True)]
    assert segments(rows[1]) == [Segment("Q: 2+2?\nA: ", False), Segment("4", True), Segment(None, True)]
    chat = segments(rows[2])
    assert [(s.text, s.trained) for s in chat] == [
        ("<|system|>\n", False), ("be brief", False), (None, False),
        ("<|user|>\n", False), ("hi", False), (None, False),
        ("<|assistant|>\n", False), ("hey", True), (None, True),
    ]  # fmt: skip
    assert all(s.trained for r in rows for s in segments(r, train_on_inputs=True))
    assert file_format("a.JSONL") == "jsonl" and file_format("x.parquet") == "parquet" and file_format("c") == "text"


def numbered(n: int) -> list[dict]:
    """ROWS n times over, each copy's trained text numbered (every window of tokens is unique)."""
    return [
        row
        for i in range(n)
        for row in (
            {"text": f"plain words {i}"},
            {"prompt": "Q: 2+2?\nA: ", "completion": f"4 {i}"},
            {"messages": [*ROWS[2]["messages"][:2], {"role": "assistant", "content": f"hey {i}"}]},
        )
    ]


@pytest.mark.parametrize("tokenizer", ["byte", "char", {"type": "bpe", "vocab_size": 512}])
def test_packed_documents_are_separated_by_end_of_text_and_masked_per_target(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "d.jsonl", numbered(40))
    data = load_data(DataSpec(path=path, tokenizer=tokenizer), 0, tmp_path / "cache")
    tokens = np.concatenate([data.train, data.val])
    mask = np.concatenate([data.train_mask, data.val_mask])
    eos = data.tokenizer.eos_id
    assert (tokens == eos).sum() == 40 * (2 + 3)  # one after each text and completion, one per message
    assert data.val[0] != eos and data.train[-1] == eos  # the split falls between documents
    trained = data.tokenizer.decode(tokens[(mask == 1) & (tokens != eos)])
    assert trained == "".join(f"plain words {i}4 {i}hey {i}" for i in range(40))  # no prompt, no user turn
    x, y = data.batch("train", 3, 8, 24, seed=0)
    windows = np.lib.stride_tricks.sliding_window_view(np.asarray(data.train), 24)
    for row_x, row_y in zip(x.numpy(), y.numpy(), strict=True):  # y: the targets after x where some window has x
        expected = []
        for at in np.flatnonzero((windows == row_x).all(axis=1)):
            targets = np.asarray(data.train[at + 1 : at + 25]).astype(np.int64)
            expected.append(np.where(data.train_mask[at + 1 : at + 25] == 1, targets, IGNORE).tolist())
        assert row_y.tolist() in expected
    again = load_data(DataSpec(path=path, tokenizer=tokenizer), 0, tmp_path / "cache")  # from the cache
    assert (np.asarray(again.train_mask) == np.asarray(data.train_mask)).all()


def test_train_on_inputs_trains_on_every_token(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", ROWS * 10)
    data = load_data(DataSpec(path=path, train_on_inputs=True), 0, tmp_path / "cache")
    assert data.train_mask is None and data.val_mask is None
    _, y = data.batch("train", 0, 4, 16, seed=0)
    assert (y != IGNORE).all()


def test_a_bad_line_of_a_jsonl_file_fails_the_load_with_its_number(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"text": "a"}\n\n{"text": "b"}\n{"prompt": 1, "completion": "c"}\n')
    with pytest.raises(ValueError, match=r'd.jsonl line 4: "prompt" is a string \(got int\)'):
        load_data(DataSpec(path=str(path)), 0, tmp_path / "cache")


def test_a_parquet_column_is_a_document_per_row(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "d.parquet"
    pq.write_table(pa.table({"id": list(range(30)), "body": [f"row {i} says hello" for i in range(30)]}), path)
    data = load_data(DataSpec(path=str(path), text_column="body"), 0, tmp_path / "cache")
    tokens = np.concatenate([data.train, data.val])
    assert data.train_mask is None and (tokens == 0).sum() == 30
    assert data.tokenizer.decode(tokens).split("\x00")[:2] == ["row 0 says hello", "row 1 says hello"]
    with pytest.raises(ValueError, match=r"has no column 'text'.*it has id, body"):
        load_data(DataSpec(path=str(path)), 0, tmp_path / "cache2")


CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def chatml(messages, generation_prompt):
    text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    return text + ("<|im_start|>assistant\n" if generation_prompt else "")


def test_a_chat_template_trains_each_assistant_turn_after_its_header():
    messages = parse_row(json.dumps(ROWS[2]))["messages"] + [
        {"role": "user", "content": "bye"},
        {"role": "assistant", "content": "ciao"},
    ]
    parts = templated_segments(messages, chatml)
    assert "".join(s.text for s in parts if s.text) == chatml(messages, False)
    assert [s.text for s in parts if s.trained and s.text] == ["hey<|im_end|>\n", "ciao<|im_end|>\n"]
    assert parts[-1] == Segment(None, True)

    def rewriting(msgs, generation_prompt):  # drops earlier turns once the conversation goes on
        return chatml(msgs[-1:], generation_prompt)

    with pytest.raises(ValueError, match="rewrites earlier turns"):
        templated_segments(messages, rewriting)


def test_a_models_tokenizer_lays_out_chats_with_its_template(tmp_path):
    from tokenizers import Tokenizer as Fast
    from tokenizers import models, pre_tokenizers

    words = ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]
    vocab = {w: i for i, w in enumerate(words)} | {chr(c): 3 + i for i, c in enumerate(range(32, 127))} | {"\n": 98}
    fast = Fast(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    fast.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    fast.add_special_tokens(words)
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    fast.save(str(model_dir / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "chat_template": CHATML}
    (model_dir / "tokenizer_config.json").write_text(json.dumps(config))
    path = write_jsonl(tmp_path / "chat.jsonl", [ROWS[2]] * 20)
    spec = DataSpec(path=path, tokenizer={"type": "model", "vocab_size": 128})
    data = load_data(spec, 0, tmp_path / "cache", model_dir=model_dir)
    ids = np.asarray(data.train[: np.flatnonzero(np.asarray(data.train) == 1)[3] + 1])  # the first conversation
    trained = ids[np.asarray(data.train_mask[: len(ids)]) == 1]
    assert data.tokenizer.eos_id == 1  # <|im_end|>, the tokenizer_config's eos_token
    assert "".join(fast.id_to_token(int(i)) for i in trained) == "hey<|im_end|>\n<|im_end|>"
    heard: list[str] = []
    other = CHATML.replace("<|im_end|>\n", "<|im_end|>\n\n")
    (model_dir / "tokenizer_config.json").write_text(json.dumps(config | {"chat_template": other}))
    load_data(spec, 0, tmp_path / "cache", model_dir=model_dir, log=heard.append)  # another template, another entry
    assert heard[-1].startswith("tokenized in "), heard


def test_the_loss_counts_only_the_targets_not_ignored():
    logits = torch.randn(2, 5, 7, requires_grad=True)
    y = torch.randint(0, 7, (2, 5))
    masked = y.clone()
    masked[:, :3] = IGNORE
    expected = F.cross_entropy(logits[:, 3:].flatten(0, 1), y[:, 3:].flatten())
    assert torch.allclose(target_loss(logits, masked), expected)
    none = target_loss(logits, torch.full_like(y, IGNORE))
    none.backward()
    assert none.item() == 0.0 and logits.grad is not None and (logits.grad == 0).all()


def test_function_pairs_are_a_signature_and_docstring_then_the_body():
    source = (
        "class A:\n"
        "    def f(self, x):\n"
        '        """Double x."""\n'
        "        y = x * 2\n"
        "\n"
        "        return y\n"
        "    def g(self):\n"
        '        """No body after the docstring."""\n'
        "def h(): return 1\n"
    )
    assert function_pairs(source) == [
        {"prompt": 'def f(self, x):\n    """Double x."""\n', "completion": "    y = x * 2\n\n    return y\n"}
    ]
    assert function_pairs("def broken(:\n") == []


def test_pysource_instruct_comes_from_files_pysource_does_not_hold(tmp_path):
    pairs = pysource_instruct()
    assert len(pairs) > 1000 and all(set(p) == {"prompt", "completion"} for p in pairs)
    corpus = pysource_text()
    assert not any(p["prompt"] + p["completion"] in corpus for p in pairs[:200])
    if sys.version_info[:3] == (3, 11, 7):  # the interpreter CI runs (docs/engine.md gives the figure)
        assert len(pairs) == 3854
        assert pysource_instruct_sha256() == "ca1740b70aeb5bb6a2acbbe6df23f0a6da5c00b2e0b2ddef26e054dcdd96275f"
    data = load_data(DataSpec(builtin="pysource-instruct", tokenizer="char"), 0, tmp_path / "cache")
    assert data.vocab_size == 128 and 0.4 < float(np.asarray(data.train_mask).mean()) < 0.8
    prompt = data.tokenizer.decode(data.sample_prompt(32, 4096))
    assert prompt.startswith(("def ", "async def ")) and prompt.rstrip().endswith(('"""', "'''"))


def test_a_sample_of_documents_ends_at_the_first_end_of_text():
    class Counts(torch.nn.Module):
        """Predicts token (last + 1) mod 5 with certainty."""

        def __init__(self) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.zeros(1))

        def forward(self, tokens):
            return F.one_hot((tokens + 1) % 5, 5).float() * 100.0

    prompt = torch.tensor([1, 2])
    draws = torch.Generator().manual_seed(0)
    assert generate(Counts(), prompt, 10, 8, draws).tolist() == [3, 4, 0, 1, 2, 3, 4, 0, 1, 2]
    assert generate(Counts(), prompt, 10, 8, draws, stop=0).tolist() == [3, 4]


def test_jobs_that_share_a_token_directory_tokenize_a_text_once(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", numbered(20))
    spec = DataSpec(path=path, tokenizer={"type": "bpe", "vocab_size": 512})
    heard: list[list[str]] = [[], [], []]
    first = load_data(spec, 0, tmp_path / "tokens", log=heard[0].append)
    again = load_data(spec, 1, tmp_path / "tokens", log=heard[1].append)  # another job, another seed
    assert heard[0][0] == "learning a byte-level BPE of 512 tokens from the corpus"
    assert heard[0][-1].startswith("tokenized in ") and "of them trained on" in heard[0][-1]
    assert heard[1] == [f"tokenized earlier: {len(first.train) + len(first.val):,} bpe tokens from the cache"]
    assert again.tokenizer.bpe == first.tokenizer.bpe
    inputs = load_data(spec.model_copy(update={"train_on_inputs": True}), 0, tmp_path / "tokens", log=heard[2].append)
    assert heard[2][-1].startswith("tokenized in ") and inputs.train_mask is None  # another layout, its own entry
    names = sorted(p.name for p in (tmp_path / "tokens").iterdir())
    assert all(n.startswith(hashlib.sha256(Path(path).read_bytes()).hexdigest()[:16]) for n in names), names
