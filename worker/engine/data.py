"""Corpora as memory-mapped token arrays, deterministic batches, and the builtin tasks.

The builtin tasks are a synthetic Markov chain and ``pysource``, real text that needs no download.

A batch is a pure function of (seed, split, index): resuming at step s needs no saved reader
state, and the evaluation batches are the same at every evaluation.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from contract.spec import BPESpec, DataSpec, ModelTokenizerSpec

from .facts import CHAR_VOCAB_MAX, PYSOURCE_CHAR_VOCAB, SYNTHETIC_VOCAB

SYNTHETIC_ALPHABET = (
    "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz+/"  # a token's character in samples
)
SYNTHETIC_TOKENS = 1 << 20
SYNTHETIC_BRANCHES = 4  # successors per token in the synthetic Markov chain
PYSOURCE_BYTES = 4 << 20  # the builtin pysource corpus: the first 4 MiB
MODEL_TOKENIZER = "tokenizer.json"  # an uploaded model's tokenizer (data.tokenizer {type: model})
END_OF_TEXT = "<|endoftext|>"  # a BPE's one special token (GPT-2's name for it)
BPE_CHUNK = 1 << 18  # characters of text per piece the BPE learns from and encodes (text_chunks)
BPE_BATCH = 16  # pieces encoded at once: the library's work in flight stays a few MiB of text
# Directories left out: installed packages (not the stdlib), tests (fixtures, deliberately broken
# files) and the codecs' generated character tables.
PYSOURCE_SKIP = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "encodings"})
# The pysource text is ASCII, so its char tokenizer is the fixed ASCII alphabet rather than the
# characters one interpreter's text happens to use: the vocabulary (128) and every id are the
# same on every Python, the API's parameter count is exact and a checkpoint fits any worker.
PYSOURCE_CHARS = "".join(map(chr, range(PYSOURCE_CHAR_VOCAB)))


class Tokenizer:
    """byte: UTF-8 bytes, vocab 256. char: the corpus's distinct characters, sorted (or a fixed
    alphabet, for the builtin pysource text), at most CHAR_VOCAB_MAX of them. bpe: a tokenizer of
    the tokenizers library (``bpe``: its JSON; a byte-level BPE learned from the text, or an
    uploaded model's tokenizer.json) in a vocabulary of ``vocab_size`` ids. Text encodes without
    the special tokens a tokenizer's post-processor would add (a model's BOS at every piece)."""

    def __init__(self, kind: str, chars: str | None = None, bpe: str | None = None, vocab_size: int = 0) -> None:
        if kind not in ("byte", "char", "bpe"):
            raise ValueError(f"unknown tokenizer {kind!r}")
        if kind == "bpe":
            if not bpe or vocab_size < 1:
                raise ValueError("a bpe tokenizer needs its trained model and its vocabulary size")
            from tokenizers import Tokenizer as Fast

            self._fast = Fast.from_str(bpe)
            if self._fast.get_vocab_size() > vocab_size:
                raise ValueError(f"the BPE has {self._fast.get_vocab_size()} tokens, more than its {vocab_size}")
        self.bpe, self._vocab_size = bpe, vocab_size
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
    def fit(cls, kind: str, text: str) -> Tokenizer:
        return cls(kind, "".join(sorted(set(text))) if kind == "char" else None)

    @classmethod
    def train_bpe(cls, text: str, vocab_size: int) -> Tokenizer:
        """A byte-level BPE of at most ``vocab_size`` tokens learned from ``text`` (deterministic)."""
        fast, trainer = untrained_bpe(vocab_size)
        fast.train_from_iterator(text_chunks(text), trainer=trainer, length=None)
        return cls("bpe", bpe=fast.to_str(), vocab_size=vocab_size)

    @property
    def vocab_size(self) -> int:
        if self.kind == "bpe":
            return self._vocab_size
        return 256 if self.kind == "byte" else len(self._alphabet)

    def encode(self, text: str) -> np.ndarray:
        if self.kind == "byte":
            return np.frombuffer(text.encode("utf-8"), dtype=np.uint8)
        if self.kind == "bpe":  # in pieces, BPE_BATCH at a time encoded in parallel by the library
            dtype = np.uint16 if self._vocab_size <= 1 << 16 else np.uint32
            parts, pieces = [], list(text_chunks(text))
            for start in range(0, len(pieces), BPE_BATCH):
                encodings = self._fast.encode_batch_fast(pieces[start : start + BPE_BATCH], add_special_tokens=False)
                parts += [np.asarray(e.ids, dtype=dtype) for e in encodings]
            return np.concatenate(parts) if parts else np.zeros(0, dtype=dtype)
        codes = np.frombuffer(text.encode("utf-32-le", "surrogatepass"), dtype=np.uint32)
        at = np.minimum(np.searchsorted(self._codes, codes), len(self._codes) - 1)
        unknown = np.flatnonzero(self._codes[at] != codes)
        if len(unknown):
            raise ValueError(f"character {chr(codes[unknown[0]])!r} is not in the tokenizer's vocabulary")
        return self._order[at]

    def decode(self, ids) -> str:
        ids = np.asarray(ids, dtype=np.int64)
        if self.kind == "byte":
            return ids.astype(np.uint8).tobytes().decode("utf-8", errors="replace")
        if self.kind == "bpe":  # an id the BPE did not learn (an unused row of the model) reads as nothing
            return self._fast.decode([int(i) for i in ids if i < self._fast.get_vocab_size()])
        return "".join(self._alphabet[i] for i in ids)

    def to_dict(self) -> dict:
        if self.kind == "bpe":
            return {"kind": self.kind, "chars": None, "bpe": self.bpe, "vocab_size": self._vocab_size}
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


@dataclass
class TokenData:
    """Train and validation token arrays (memory-mapped for corpora) and their tokenizer."""

    train: np.ndarray
    val: np.ndarray
    tokenizer: Tokenizer | None
    vocab_size: int
    entropy_floor: float | None = None  # nats/token a perfect model reaches (synthetic task)

    def decode(self, ids) -> str:
        """Token ids as text (the synthetic task's tokens as characters of SYNTHETIC_ALPHABET)."""
        if self.tokenizer is not None:
            return self.tokenizer.decode(ids)
        return "".join(SYNTHETIC_ALPHABET[i] for i in ids)

    def batch(
        self, split: str, index: int, batch_size: int, seq_len: int, seed: int, rank: int = 0, world: int = 1
    ) -> tuple[Tensor, Tensor]:
        """Rank ``rank``'s rows (x, y) of the global batch of ``batch_size`` sequences.

        Both are int64 [batch_size / world, seq_len], y = x shifted by one; one process gets every row
        of the batch, so that a group of ``world`` ranks trains on the very batches one process does.
        A function of its arguments only.
        """
        tokens = self.train if split == "train" else self.val
        if len(tokens) < seq_len + 2:
            raise ValueError(f"the {split} split has {len(tokens)} tokens, fewer than seq_len + 2 = {seq_len + 2}")
        if batch_size % world:
            raise ValueError(f"batch_size {batch_size} does not split evenly over {world} ranks")
        rng = np.random.default_rng([seed, 0 if split == "train" else 1, index])
        share = batch_size // world
        starts = rng.integers(0, len(tokens) - seq_len - 1, size=batch_size)[rank * share : (rank + 1) * share]
        windows = tokens[starts[:, None] + np.arange(seq_len + 1)].astype(np.int64)  # [B, T + 1]
        w = torch.from_numpy(windows)
        return w[:, :-1], w[:, 1:]


def load_corpus(cfg: DataSpec, corpus: Path, cache_dir: Path, model_dir: Path | None = None) -> TokenData:
    """Tokenize a UTF-8 text file once into ``cache_dir`` and memory-map the result."""
    raw = Path(corpus).read_bytes()
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{corpus} is not UTF-8 text: {exc}") from None
    return load_text(cfg, raw, cache_dir, model_dir=model_dir)


def model_tokenizer(cfg: DataSpec, model_dir: Path | None) -> Tokenizer:
    """The uploaded model's own tokenizer (``data.tokenizer: {type: model}``): its tokenizer.json,
    in the vocabulary of its config's vocab_size (which the service wrote into the spec)."""
    if not isinstance(cfg.tokenizer, ModelTokenizerSpec) or not cfg.tokenizer.vocab_size:
        raise ValueError("data.tokenizer {type: model} needs its vocab_size (the service fills it in)")
    if model_dir is None:
        raise ValueError("data.tokenizer {type: model} needs the uploaded model's directory")
    path = Path(model_dir) / MODEL_TOKENIZER
    if not path.is_file():
        raise FileNotFoundError(f"the model has no {MODEL_TOKENIZER}")
    return Tokenizer("bpe", bpe=path.read_text(encoding="utf-8"), vocab_size=cfg.tokenizer.vocab_size)


def load_text(
    cfg: DataSpec, raw: bytes, cache_dir: Path, chars: str | None = None, model_dir: Path | None = None
) -> TokenData:
    """UTF-8 text tokenized once into ``cache_dir`` (named by its sha256 and the tokenizer) and
    memory-mapped; a char tokenizer over ``chars`` when given, else over the text's own characters;
    a BPE learned from the text (and kept with its ids: every job that asks for the same one on
    the same text reuses both); an uploaded model's tokenizer from ``model_dir`` (the ids named by
    the text and the tokenizer.json's sha256)."""
    digest = hashlib.sha256(raw).hexdigest()[:16]
    cache_dir.mkdir(parents=True, exist_ok=True)
    bpe = cfg.tokenizer if isinstance(cfg.tokenizer, BPESpec) else None
    given = model_tokenizer(cfg, model_dir) if isinstance(cfg.tokenizer, ModelTokenizerSpec) else None
    alphabet = chars if cfg.tokenizer == "char" else None
    suffix = f"-{hashlib.sha256(alphabet.encode()).hexdigest()[:8]}" if alphabet else ""
    if given is not None and given.bpe:
        suffix = f"-{hashlib.sha256(given.bpe.encode()).hexdigest()[:16]}"
    kind = f"bpe{bpe.vocab_size}" if bpe else f"model{given.vocab_size}" if given else cfg.tokenizer
    stem = cache_dir / f"{digest}-{kind}{suffix}"
    meta_path, bin_path = stem.with_suffix(".json"), stem.with_suffix(".bin")
    if meta_path.exists() and bin_path.exists():
        meta = json.loads(meta_path.read_text())
        tokenizer = Tokenizer(**{k: meta[k] for k in ("kind", "chars", "bpe", "vocab_size") if k in meta})
    else:
        text = raw.decode("utf-8")
        if given is not None:
            tokenizer = given
        elif bpe:
            tokenizer = Tokenizer.train_bpe(text, bpe.vocab_size)
        else:
            kind = str(cfg.tokenizer)
            tokenizer = Tokenizer(kind, alphabet) if alphabet else Tokenizer.fit(kind, text)
        ids = tokenizer.encode(text)
        tmp = bin_path.with_suffix(".tmp")
        ids.tofile(tmp)
        tmp.replace(bin_path)
        meta = {**tokenizer.to_dict(), "dtype": str(ids.dtype), "tokens": len(ids)}
        meta_path.write_text(json.dumps(meta))
    tokens = np.memmap(bin_path, dtype=np.dtype(meta["dtype"]), mode="r", shape=(meta["tokens"],))
    split = int(len(tokens) * (1.0 - cfg.val_fraction))
    return TokenData(tokens[:split], tokens[split:], tokenizer, tokenizer.vocab_size)


@functools.cache
def pysource_text(max_bytes: int = PYSOURCE_BYTES) -> str:
    """The builtin ``pysource`` corpus: the running interpreter's own standard library sources.

    Every ``.py`` file under ``sysconfig``'s stdlib directory outside the directories PYSOURCE_SKIP
    whose bytes are ASCII (a subset of UTF-8), in sorted relative-path order (POSIX spelling), each
    ending in a newline, concatenated and cut at ``max_bytes`` (so as many characters). Nothing is
    downloaded or copied into the repository; the text (and its sha256) depends on the Python
    version (docs/engine.md gives it for the one CI uses).
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    paths = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d not in PYSOURCE_SKIP]  # not walked at all: site-packages is large
        base = Path(folder).relative_to(root)
        paths += [(base / f).as_posix() for f in files if f.endswith(".py")]
    parts, size = [], 0
    for rel in sorted(paths):
        data = (root / rel).read_bytes()
        if not data or not data.isascii():
            continue
        parts.append(data if data.endswith(b"\n") else data + b"\n")
        size += len(parts[-1])
        if size >= max_bytes:
            break
    if size < max_bytes:
        raise ValueError(
            f"the builtin pysource corpus needs {max_bytes:,} bytes of the standard library's .py sources; "
            f"{root} holds {size:,} (an interpreter installed without its sources?)"
        )
    return b"".join(parts)[:max_bytes].decode("ascii")


def pysource_sha256(max_bytes: int = PYSOURCE_BYTES) -> str:
    """The sha256 of :func:`pysource_text` (its UTF-8 bytes): which text this interpreter gives."""
    return hashlib.sha256(pysource_text(max_bytes).encode()).hexdigest()


def synthetic_task(seed: int, val_fraction: float = 0.1, tokens: int = SYNTHETIC_TOKENS) -> TokenData:
    """A first-order Markov chain over SYNTHETIC_VOCAB tokens, generated from the seed.

    Each token has SYNTHETIC_BRANCHES successors of fixed probabilities: learnable structure with a
    known floor (the chain's entropy rate, in nats/token), nothing read from disk.
    """
    rng = np.random.default_rng([seed, 7])
    V, K = SYNTHETIC_VOCAB, SYNTHETIC_BRANCHES
    successors = np.stack([rng.choice(V, size=K, replace=False) for _ in range(V)])  # [V, K]
    probs = np.array([0.5, 0.25, 0.15, 0.10])  # same for every token
    draws = rng.choice(K, size=tokens, p=probs)
    table, picks, state, out = successors.tolist(), draws.tolist(), 0, [0] * tokens
    for t in range(1, tokens):  # a chain: each token depends on the one before
        state = out[t] = table[state][picks[t]]
    seq = np.asarray(out, dtype=np.uint8)
    floor = float(-(probs * np.log(probs)).sum())
    split = int(tokens * (1.0 - val_fraction))
    return TokenData(seq[:split], seq[split:], None, V, entropy_floor=floor)


def load_data(
    cfg: DataSpec, seed: int, cache_dir: Path, corpus: Path | None = None, model_dir: Path | None = None
) -> TokenData:
    """The job's data: the builtin task, or a corpus file (``corpus`` overrides ``cfg.path``);
    ``model_dir``: the uploaded model whose tokenizer ``{type: model}`` is."""
    if cfg.builtin == "synthetic":
        if isinstance(cfg.tokenizer, ModelTokenizerSpec):
            raise ValueError("the synthetic task has its own 64 tokens: a model's tokenizer applies to text")
        return synthetic_task(seed, cfg.val_fraction)
    if cfg.builtin == "pysource":
        return load_text(cfg, pysource_text().encode(), cache_dir, chars=PYSOURCE_CHARS, model_dir=model_dir)
    if cfg.builtin is not None:
        raise ValueError(f"unknown builtin task {cfg.builtin!r}")
    path = corpus or (Path(cfg.path) if cfg.path else None)
    if path is None:
        raise ValueError("no corpus: give data.path, or the dataset's file for data.dataset_id")
    if not Path(path).is_file():
        raise FileNotFoundError(f"corpus {path} does not exist")
    return load_corpus(cfg, Path(path), cache_dir, model_dir)
