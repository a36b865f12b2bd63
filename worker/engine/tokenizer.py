"""Tokenizers: UTF-8 bytes, a corpus's characters, or a byte-level BPE of the tokenizers library."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np

from contract.documents import NUL

from .facts import CHAR_VOCAB_MAX, CharacterSet

END_OF_TEXT = "<|endoftext|>"  # a BPE's one special token (GPT-2's name for it)
BPE_CHUNK = 1 << 18  # characters of text per piece the BPE learns from and encodes (text_chunks)
BPE_BATCH = 16  # pieces' worth of text encoded at once: the library's work in flight stays a few MiB


class Tokenizer:
    """byte: UTF-8 bytes, vocab 256. char: the corpus's distinct characters, sorted (or a fixed
    alphabet, for the builtin pysource text), at most CHAR_VOCAB_MAX of them. bpe: a tokenizer of
    the tokenizers library (``bpe``: its JSON; a byte-level BPE learned from the text, or an
    uploaded model's tokenizer.json) in a vocabulary of ``vocab_size`` ids. Text encodes without
    the special tokens a tokenizer's post-processor would add (a model's BOS at every piece)."""

    def __init__(
        self, kind: str, chars: str | None = None, bpe: str | None = None, vocab_size: int = 0, eos: str = END_OF_TEXT
    ) -> None:
        if kind not in ("byte", "char", "bpe"):
            raise ValueError(f"unknown tokenizer {kind!r}")
        if kind == "bpe":
            if not bpe or vocab_size < 1:
                raise ValueError("a bpe tokenizer needs its trained model and its vocabulary size")
            from tokenizers import Tokenizer as Fast

            self._fast = Fast.from_str(bpe)
            if self._fast.get_vocab_size() > vocab_size:
                raise ValueError(f"the BPE has {self._fast.get_vocab_size()} tokens, more than its {vocab_size}")
        self.bpe, self._vocab_size, self.eos = bpe, vocab_size, eos
        if kind == "char":
            if not chars:
                raise ValueError("a char tokenizer needs its character set")
            if len(chars) > CHAR_VOCAB_MAX:
                raise ValueError(
                    f"the text has {len(chars):,} distinct characters; the char tokenizer holds at most "
                    f"{CHAR_VOCAB_MAX:,}: use the byte tokenizer"
                )
        self.kind, self.chars = kind, chars
        self._alphabet = chars or ""  # a char tokenizer's characters (a byte tokenizer has none)
        if chars:  # code points sorted, and each one's id: encoding is a vectorized search
            codes = np.frombuffer(chars.encode("utf-32-le", "surrogatepass"), dtype=np.uint32)
            self._order = np.argsort(codes, kind="stable").astype(np.uint16)
            self._codes = codes[self._order]

    @classmethod
    def fit(cls, kind: str, texts: str | Iterable[str]) -> Tokenizer:
        """A byte tokenizer, or a char tokenizer over the characters of ``texts``."""
        if kind != "char":
            return cls(kind)
        chars = CharacterSet()
        for text in [texts] if isinstance(texts, str) else texts:
            chars.update(text)
        return cls(kind, "".join(sorted(chars.found)))

    @classmethod
    def train_bpe(cls, texts: str | Iterable[str], vocab_size: int) -> Tokenizer:
        """A byte-level BPE of at most ``vocab_size`` tokens learned from ``texts`` (deterministic)."""
        fast, trainer = untrained_bpe(vocab_size)
        pieces = (p for text in ([texts] if isinstance(texts, str) else texts) for p in text_chunks(text))
        fast.train_from_iterator(pieces, trainer=trainer, length=None)
        return cls("bpe", bpe=fast.to_str(), vocab_size=vocab_size)

    @property
    def vocab_size(self) -> int:
        if self.kind == "bpe":
            return self._vocab_size
        return 256 if self.kind == "byte" else len(self._alphabet)

    @property
    def dtype(self) -> np.dtype:
        """The ids' integer type."""
        if self.kind == "bpe":
            return np.dtype(np.uint16 if self._vocab_size <= 1 << 16 else np.uint32)
        return np.dtype(np.uint8 if self.kind == "byte" else np.uint16)

    @property
    def eos_id(self) -> int:
        """The end-of-text id between packed documents: the NUL character's for byte and char (no
        document holds it), the BPE's ``eos`` token's (END_OF_TEXT, or an uploaded model's own)."""
        if self.kind == "byte":
            return 0
        if self.kind == "char":
            if not self._alphabet.startswith(NUL):
                raise ValueError("the char tokenizer's characters have no NUL, its end of text")
            return 0  # NUL sorts first
        eos = self._fast.token_to_id(self.eos)
        if eos is None:
            raise ValueError(f"the tokenizer has no end-of-text token {self.eos!r}")
        return eos

    def encode(self, text: str) -> np.ndarray:
        if self.kind == "bpe":
            return self.encode_many([text])[0]
        if self.kind == "byte":
            return np.frombuffer(text.encode("utf-8"), dtype=np.uint8)
        codes = np.frombuffer(text.encode("utf-32-le", "surrogatepass"), dtype=np.uint32)
        at = np.minimum(np.searchsorted(self._codes, codes), len(self._codes) - 1)
        unknown = np.flatnonzero(self._codes[at] != codes)
        if len(unknown):
            raise ValueError(f"character {chr(codes[unknown[0]])!r} is not in the tokenizer's vocabulary")
        return self._order[at]

    def encode_many(self, texts: list[str]) -> list[np.ndarray]:
        """Each text's ids. A BPE encodes a text in pieces (text_chunks), in parallel, about
        BPE_BATCH pieces' worth of text at a time."""
        if self.kind != "bpe":
            return [self.encode(t) for t in texts]
        pieces, owner = [], []
        for i, text in enumerate(texts):
            for piece in text_chunks(text):
                pieces.append(piece)
                owner.append(i)
        parts: list[list[np.ndarray]] = [[] for _ in texts]
        start = 0
        while start < len(pieces):
            stop, size = start, 0
            # Pieces up to BPE_BATCH pieces' worth: 16 whole ones (an even share per thread), or
            # many small ones (documents).
            while stop < len(pieces) and (stop == start or size + len(pieces[stop]) <= BPE_BATCH * BPE_CHUNK):
                size, stop = size + len(pieces[stop]), stop + 1
            encodings = self._fast.encode_batch_fast(pieces[start:stop], add_special_tokens=False)
            for i, e in zip(owner[start:stop], encodings, strict=True):
                parts[i].append(np.asarray(e.ids, dtype=self.dtype))
            start = stop
        empty = np.zeros(0, dtype=self.dtype)
        return [np.concatenate(p) if len(p) > 1 else p[0] if p else empty for p in parts]

    def decode(self, ids) -> str:
        ids = np.asarray(ids, dtype=np.int64)
        if self.kind == "byte":
            return ids.astype(np.uint8).tobytes().decode("utf-8", errors="replace")
        if self.kind == "bpe":  # an id the BPE did not learn (an unused row of the model) reads as nothing
            return self._fast.decode([int(i) for i in ids if i < self._fast.get_vocab_size()])
        return "".join(self._alphabet[i] for i in ids)

    def to_dict(self) -> dict:
        if self.kind == "bpe":
            return {"kind": self.kind, "chars": None, "bpe": self.bpe, "vocab_size": self._vocab_size, "eos": self.eos}
        return {"kind": self.kind, "chars": self.chars}


def untrained_bpe(vocab_size: int) -> tuple[Any, Any]:
    """The tokenizers library's byte-level BPE before learning, and its trainer for ``vocab_size``
    tokens: GPT-2's byte alphabet and pre-tokenizer, one special token, END_OF_TEXT."""
    from tokenizers import Tokenizer as Fast
    from tokenizers import decoders, models, pre_tokenizers, trainers

    fast = Fast(models.BPE())
    fast.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    fast.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[END_OF_TEXT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    return fast, trainer


def text_chunks(text: str, size: int = BPE_CHUNK) -> Iterator[str]:
    """``text`` in pieces of about ``size`` characters, each cut after a newline where one is near.

    The BPE learns and encodes piece by piece, so no token spans a cut (a cut falls between lines,
    where GPT-2's pre-tokenizer splits anyway, unless a line is longer than a piece).
    """
    start = 0
    while start < len(text):
        stop = min(start + size, len(text))
        if stop < len(text):
            newline = text.rfind("\n", start, stop)
            stop = newline + 1 if newline > start else stop
        yield text[start:stop]
        start = stop
