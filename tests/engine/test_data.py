"""The builtin pysource corpus, the char tokenizer's limit and a text's distinct characters."""

from __future__ import annotations

import platform
import re
import sysconfig
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from contract.spec import DataSpec
from worker.engine import facts
from worker.engine.data import PYSOURCE_BYTES, PYSOURCE_CHARS, load_data, pysource_sha256, pysource_text
from worker.engine.facts import CHAR_VOCAB_MAX, CharacterSet
from worker.engine.tokenizer import Tokenizer, text_chunks

ENGINE_DOC = Path(__file__).resolve().parents[2] / "docs" / "engine.md"


def test_pysource_is_the_stdlib_sources_cut_at_4_mib():
    text = pysource_text()
    assert len(text) == PYSOURCE_BYTES == len(text.encode()) and text.isascii()
    assert text.startswith((Path(sysconfig.get_paths()["stdlib"]) / "__future__.py").read_text())
    assert "def " in text and "import " in text
    assert pysource_text.__wrapped__(PYSOURCE_BYTES) == text  # built again from disk: the same text


def test_pysource_sha256_is_the_documented_one_on_the_documented_python():
    """docs/engine.md gives the text's sha256 for one CPython version; the text differs between
    versions, so only that interpreter can check it (CI runs it)."""
    doc = ENGINE_DOC.read_text()
    version, sha = re.search(r"CPython (\d+\.\d+\.\d+) \(what CI runs\) yields sha256\s+`([0-9a-f]{64})`", doc).groups()
    assert re.fullmatch(r"[0-9a-f]{64}", pysource_sha256())
    if platform.python_version() == version:
        assert pysource_sha256() == sha


def test_pysource_refuses_an_interpreter_without_its_sources(tmp_path, monkeypatch):
    (tmp_path / "a.py").write_text("x = 1\n")
    (tmp_path / "site-packages").mkdir()
    (tmp_path / "site-packages" / "big.py").write_text("y = 2\n" * 1000)
    monkeypatch.setattr(sysconfig, "get_paths", lambda: {"stdlib": str(tmp_path)})
    assert pysource_text.__wrapped__(6) == "x = 1\n"
    with pytest.raises(ValueError, match=r"needs 1,000 bytes .* holds 6"):
        pysource_text.__wrapped__(1000)


def test_pysource_tokenizers(tmp_path):
    """char is the fixed ASCII alphabet (128 on every Python), so its ids are the byte ids."""
    data = {kind: load_data(DataSpec(builtin="pysource", tokenizer=kind), 0, tmp_path) for kind in ("byte", "char")}
    assert data["byte"].vocab_size == 256 and data["char"].vocab_size == len(PYSOURCE_CHARS) == 128
    assert np.array_equal(data["byte"].train, data["char"].train)
    assert np.array_equal(data["byte"].val, data["char"].val)
    assert data["char"].decode(data["char"].val[:200]) == pysource_text()[len(data["char"].train) :][:200]
    again = load_data(DataSpec(builtin="pysource", tokenizer="char"), 0, tmp_path)  # from the cache
    assert again.tokenizer.chars == PYSOURCE_CHARS and np.array_equal(again.val, data["char"].val)


def test_char_tokenizer_refuses_more_than_65536_characters():
    Tokenizer("char", "".join(map(chr, range(CHAR_VOCAB_MAX))))  # the most it takes
    text = "".join(chr(c) for c in range(CHAR_VOCAB_MAX + 0x800 + 1) if not 0xD800 <= c < 0xE000)
    with pytest.raises(ValueError, match=r"65,537 distinct characters.*at most 65,536: use the byte tokenizer"):
        Tokenizer.fit("char", text)


def test_char_tokenizer_ids_follow_its_alphabet_and_refuse_other_characters():
    tok = Tokenizer("char", "c🙂ab")  # ids in the alphabet's order, sorted or not
    assert tok.encode("abc🙂").tolist() == [2, 3, 0, 1] and tok.decode([2, 3, 0, 1]) == "abc🙂"
    assert tok.encode("").tolist() == []
    with pytest.raises(ValueError, match="'d' is not in the tokenizer's vocabulary"):
        tok.encode("abd")


def test_bpe_is_learned_once_per_text_deterministically_and_round_trips(tmp_path):
    spec = DataSpec(builtin="pysource", tokenizer={"type": "bpe", "vocab_size": 2048})
    data = load_data(spec, 0, tmp_path)
    assert data.vocab_size == 2048 and data.tokenizer.kind == "bpe"
    text = pysource_text()
    tokens = np.concatenate([data.train, data.val])
    assert tokens.dtype == np.uint16 and 0 < tokens.max() < 2048
    assert len(tokens) < len(text) / 3  # merges learned: fewer tokens than a third of the bytes
    assert data.decode(tokens) == text  # every piece decodes back exactly
    # The same text and size: the cached BPE and ids, with no second training; learned again from
    # scratch, the same merges.
    cached = sorted(p.name for p in tmp_path.iterdir())
    again = load_data(spec, 0, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == cached and np.array_equal(again.val, data.val)
    assert Tokenizer.train_bpe(text, 2048).bpe == data.tokenizer.bpe
    # Any text, the alphabet's bytes included, round trips; an id it never learned reads as nothing.
    sample = "héllo wörld — 日本語 🎉\n\tdef f(x):\n        return x ** 2\n"
    assert data.tokenizer.decode(data.tokenizer.encode(sample)) == sample
    tiny = Tokenizer.train_bpe("ab ab ab abc\n" * 10, 512)  # learns far fewer than 512 tokens
    assert tiny.vocab_size == 512 and tiny._fast.get_vocab_size() < 300
    assert tiny.decode([*tiny.encode("ab").tolist(), 511]) == "ab"
    # Another vocabulary size is another tokenizer, cached beside the first.
    smaller = load_data(DataSpec(builtin="pysource", tokenizer={"type": "bpe", "vocab_size": 1024}), 0, tmp_path)
    assert smaller.vocab_size == 1024 and len(smaller.train) > len(data.train)
    restored = Tokenizer(**data.tokenizer.to_dict())
    assert np.array_equal(restored.encode(sample), data.tokenizer.encode(sample))


def test_text_chunks_cut_after_newlines_and_lose_nothing():
    text = "".join(f"line {i} " + "x" * (i % 50) + "\n" for i in range(5000)) + "tail without newline"
    pieces = list(text_chunks(text, size=1000))
    assert "".join(pieces) == text and len(pieces) > 10
    assert all(p.endswith("\n") for p in pieces[:-1]) and all(len(p) <= 1000 for p in pieces)
    assert list(text_chunks("y" * 2500, size=1000)) == ["y" * 1000, "y" * 1000, "y" * 500]  # no newline: cut at size


@settings(max_examples=200, deadline=None)
@given(st.lists(st.text(st.characters() | st.integers(0xD800, 0xDFFF).map(chr), max_size=200)), st.integers(1, 64))
def test_a_character_set_is_the_texts_set_of_characters(texts, span):
    # Every plane and lone surrogates too, texts one after another, over spans that cut them anywhere.
    saved, facts.CHARACTERS_SPAN = facts.CHARACTERS_SPAN, span
    try:
        chars = CharacterSet()
        for text in texts:
            chars.update(text)
        assert chars.found == set().union(*texts)
    finally:
        facts.CHARACTERS_SPAN = saved
