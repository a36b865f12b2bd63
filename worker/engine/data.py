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
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from contract.documents import Segment
from contract.spec import BPESpec, DataSpec, ModelTokenizerSpec

from . import documents
from .facts import PYSOURCE_CHAR_VOCAB, SYNTHETIC_VOCAB, TOKEN_NAME_DIGEST
from .tokenizer import Tokenizer

SYNTHETIC_ALPHABET = (
    "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz+/"  # a token's character in samples
)
Log = Callable[[str], None]  # a line for the job's log
# The token cache: a directory that holds its entries, or what hands out an entry's directory by its
# name and keeps it in place until the run ends (a worker's bounded cache).
Tokens = Path | Callable[[str], Path]
TOKEN_FILE, MASK_FILE, META_FILE = "tokens.bin", "mask.bin", "meta.json"  # the meta last: the entry is whole
IGNORE = -100  # a target the loss leaves out (cross_entropy's ignore_index)
SYNTHETIC_TOKENS = 1 << 20
SYNTHETIC_BRANCHES = 4  # successors per token in the synthetic Markov chain
PYSOURCE_BYTES = 4 << 20  # the builtin pysource corpus: the first 4 MiB
MODEL_TOKENIZER = "tokenizer.json"  # an uploaded model's tokenizer (data.tokenizer {type: model})
# Directories left out: installed packages (not the stdlib), tests (fixtures, deliberately broken
# files) and the codecs' generated character tables.
PYSOURCE_SKIP = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "encodings"})
# The pysource text is ASCII, so its char tokenizer is the fixed ASCII alphabet rather than the
# characters one interpreter's text happens to use: the vocabulary (128) and every id are the
# same on every Python, the API's parameter count is exact and a checkpoint fits any worker.
PYSOURCE_CHARS = "".join(map(chr, range(PYSOURCE_CHAR_VOCAB)))


def target_loss(logits: Tensor, y: Tensor) -> Tensor:
    """Mean cross-entropy (fp32) over the targets the loss counts (those not IGNORE); 0 with a
    gradient of 0 where a batch has none."""
    losses = F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), ignore_index=IGNORE, reduction="sum")
    return losses / (y != IGNORE).sum().clamp(min=1)


@dataclass
class TokenData:
    """Train and validation token arrays (memory-mapped for corpora) and their tokenizer."""

    train: np.ndarray
    val: np.ndarray
    tokenizer: Tokenizer | None
    vocab_size: int
    entropy_floor: float | None = None  # nats/token a perfect model reaches (synthetic task)
    train_mask: np.ndarray | None = None  # 1 where a token is a target the loss counts (None: every token)
    val_mask: np.ndarray | None = None
    eos_id: int | None = None  # the end of text between documents (None: one text, no documents)

    def decode(self, ids) -> str:
        """Token ids as text (the synthetic task's tokens as characters of SYNTHETIC_ALPHABET)."""
        if self.tokenizer is not None:
            return self.tokenizer.decode(ids)
        return "".join(SYNTHETIC_ALPHABET[i] for i in ids)

    def sample_prompt(self, tokens: int, document_tokens: int) -> np.ndarray:
        """The samples' fixed prompt: the validation split's first ``tokens`` tokens; with a loss
        mask, the first held-out document's untrained beginning (a prompt: its last
        ``document_tokens`` tokens), so the sample is the model's answer to it."""
        if self.val_mask is not None:
            trained = np.flatnonzero(np.asarray(self.val_mask[: 1 << 16]))
            if len(trained) and trained[0] > 0:
                return np.asarray(self.val[max(0, trained[0] - document_tokens) : trained[0]])
        return np.asarray(self.val[:tokens])

    def batch(
        self, split: str, index: int, batch_size: int, seq_len: int, seed: int, rank: int = 0, world: int = 1
    ) -> tuple[Tensor, Tensor]:
        """Rank ``rank``'s rows (x, y) of the global batch of ``batch_size`` sequences.

        Both are int64 [batch_size / world, seq_len], y = x shifted by one, IGNORE where the loss
        mask leaves a target out; one process gets every row of the batch, so that a group of
        ``world`` ranks trains on the very batches one process does. A function of its arguments only.
        """
        tokens = self.train if split == "train" else self.val
        mask = self.train_mask if split == "train" else self.val_mask
        if len(tokens) < seq_len + 2:
            raise ValueError(f"the {split} split has {len(tokens)} tokens, fewer than seq_len + 2 = {seq_len + 2}")
        if batch_size % world:
            raise ValueError(f"batch_size {batch_size} does not split evenly over {world} ranks")
        rng = np.random.default_rng([seed, 0 if split == "train" else 1, index])
        share = batch_size // world
        starts = rng.integers(0, len(tokens) - seq_len - 1, size=batch_size)[rank * share : (rank + 1) * share]
        at = starts[:, None] + np.arange(seq_len + 1)  # [B, T + 1]
        w = torch.from_numpy(tokens[at].astype(np.int64))
        if mask is None:
            return w[:, :-1], w[:, 1:]
        y = w[:, 1:].masked_fill(torch.from_numpy(mask[at[:, 1:]] == 0), IGNORE)
        return w[:, :-1], y


def load_corpus(
    cfg: DataSpec, corpus: Path, tokens: Tokens, model_dir: Path | None = None, log: Log | None = None
) -> TokenData:
    """Tokenize a dataset file once into the token cache ``tokens`` and memory-map the result: UTF-8 text (one
    document), or JSONL rows or a parquet column (documents, data.format) read by documents.py."""
    fmt = documents.read_format(cfg, Path(corpus))
    if fmt == "text":
        raw = Path(corpus).read_bytes()
        try:
            raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ValueError(f"{corpus} is not UTF-8 text: {exc}") from None
        return load_text(cfg, raw, tokens, model_dir=model_dir, log=log)
    source = documents.file_documents(cfg, Path(corpus), fmt, model_dir)
    return tokenized(cfg, source, tokens, model_dir=model_dir, log=log)


def model_tokenizer(cfg: DataSpec, model_dir: Path | None) -> Tokenizer:
    """The uploaded model's own tokenizer (``data.tokenizer: {type: model}``): its tokenizer.json,
    in the vocabulary of its config's vocab_size (which the service wrote into the spec), with its
    end-of-text token."""
    if not isinstance(cfg.tokenizer, ModelTokenizerSpec) or not cfg.tokenizer.vocab_size:
        raise ValueError("data.tokenizer {type: model} needs its vocab_size (the service fills it in)")
    if model_dir is None:
        raise ValueError("data.tokenizer {type: model} needs the uploaded model's directory")
    path = Path(model_dir) / MODEL_TOKENIZER
    if not path.is_file():
        raise FileNotFoundError(f"the model has no {MODEL_TOKENIZER}")
    bpe = path.read_text(encoding="utf-8")
    return Tokenizer("bpe", bpe=bpe, vocab_size=cfg.tokenizer.vocab_size, eos=documents.model_eos(Path(model_dir)))


def load_text(
    cfg: DataSpec,
    raw: bytes,
    tokens: Tokens,
    chars: str | None = None,
    model_dir: Path | None = None,
    log: Log | None = None,
) -> TokenData:
    """UTF-8 text as one document (no end of text), tokenized once into ``tokens``: :func:`tokenized`."""
    digest = hashlib.sha256(raw).hexdigest()[:TOKEN_NAME_DIGEST]
    text = documents.Documents(digest, lambda: [[Segment(raw.decode("utf-8"), True)]], separated=False)
    return tokenized(cfg, text, tokens, chars=chars, model_dir=model_dir, log=log)


def tokenized(
    cfg: DataSpec,
    source: documents.Documents,
    tokens: Tokens,
    chars: str | None = None,
    model_dir: Path | None = None,
    log: Log | None = None,
) -> TokenData:
    """Documents tokenized once into an entry of the token cache ``tokens`` (named by their digest
    and the tokenizer) and memory-mapped, with the loss mask where some tokens are not trained on.
    The cache may be shared by jobs (a worker host's bounded cache): every one that reads the same
    documents with the same tokenizer reuses the entry.

    The tokenizer: a char tokenizer over ``chars`` when given, else over the documents' own
    characters; a BPE learned from the documents (and kept with its ids: every job that asks for the
    same one on the same documents reuses both); an uploaded model's from ``model_dir`` (the ids
    named by the documents and the tokenizer.json's sha256). The validation split starts after an
    end of text where the documents have them, so no document is cut in two. ``log`` hears
    how the tokenization goes (the job's log).
    """
    say = log or (lambda line: None)
    bpe = cfg.tokenizer if isinstance(cfg.tokenizer, BPESpec) else None
    given = model_tokenizer(cfg, model_dir) if isinstance(cfg.tokenizer, ModelTokenizerSpec) else None
    alphabet = chars if cfg.tokenizer == "char" else None
    suffix = f"-{hashlib.sha256(alphabet.encode()).hexdigest()[:8]}" if alphabet else ""
    if given is not None and given.bpe:
        suffix = f"-{hashlib.sha256(given.bpe.encode()).hexdigest()[:16]}"
    kind = f"bpe{bpe.vocab_size}" if bpe else f"model{given.vocab_size}" if given else cfg.tokenizer
    entry = token_entry(tokens, f"{source.digest}-{kind}{suffix}")
    meta_path, bin_path, mask_path = entry / META_FILE, entry / TOKEN_FILE, entry / MASK_FILE
    if meta_path.exists() and bin_path.exists():
        meta = json.loads(meta_path.read_text())
        tokenizer = Tokenizer(**{k: meta[k] for k in ("kind", "chars", "bpe", "vocab_size", "eos") if k in meta})
        say(f"tokenized earlier: {meta['tokens']:,} {tokenizer.kind} tokens from the cache")
    else:
        started = time.monotonic()
        if given is not None:
            tokenizer = given
        elif bpe:
            say(f"learning a byte-level BPE of {bpe.vocab_size:,} tokens from the corpus")
            tokenizer = Tokenizer.train_bpe(source.texts(), bpe.vocab_size)
        elif alphabet:
            tokenizer = Tokenizer(str(cfg.tokenizer), alphabet)
        else:
            tokenizer = Tokenizer.fit(str(cfg.tokenizer), source.texts(with_eos=True))
        ids, mask = documents.encode(tokenizer, source.documents(), say)
        share = "" if mask is None else f", {mask.mean():.0%} of them trained on (the rest are inputs)"
        say(f"tokenized in {time.monotonic() - started:.1f} s: {len(ids):,} {tokenizer.kind} tokens{share}")
        meta = {**tokenizer.to_dict(), "dtype": str(ids.dtype), "tokens": len(ids), "masked": mask is not None}
        for path, values in ((bin_path, ids), (mask_path, mask)):
            if values is not None:
                write_atomically(path, values)
        write_atomically(meta_path, json.dumps(meta).encode())  # last: the cache entry is whole once it is there
    stored = np.memmap(bin_path, dtype=np.dtype(meta["dtype"]), mode="r", shape=(meta["tokens"],))
    mask = np.memmap(mask_path, dtype=np.uint8, mode="r", shape=(meta["tokens"],)) if meta.get("masked") else None
    split = int(len(stored) * (1.0 - cfg.val_fraction))
    if source.separated:
        split = documents.split_point(stored, split, tokenizer.eos_id)
    return TokenData(
        stored[:split],
        stored[split:],
        tokenizer,
        tokenizer.vocab_size,
        train_mask=None if mask is None else mask[:split],
        val_mask=None if mask is None else mask[split:],
        eos_id=tokenizer.eos_id if source.separated else None,
    )


def token_entry(tokens: Tokens, name: str) -> Path:
    """The directory of the token cache's entry ``name``: made under ``tokens`` when that is a
    directory, else the one ``tokens`` hands out."""
    if callable(tokens):
        return tokens(name)
    entry = tokens / name
    entry.mkdir(parents=True, exist_ok=True)
    return entry


def write_atomically(path: Path, data: np.ndarray | bytes) -> None:
    """Write ``path`` whole or not at all (an array's bytes with no copy): a temp file of its own,
    then a rename (two jobs that tokenize the same text at once each write theirs; the same bytes win)."""
    with tempfile.NamedTemporaryFile(dir=path.parent, prefix=f".{path.name}.", delete=False) as f:
        if isinstance(data, np.ndarray):
            data.tofile(f)
        else:
            f.write(data)
    Path(f.name).replace(path)


@functools.cache
def pysource_text(max_bytes: int = PYSOURCE_BYTES) -> str:
    """The builtin ``pysource`` corpus: the running interpreter's own standard library sources.

    The files of :func:`stdlib_sources`, concatenated and cut at ``max_bytes`` (so as many
    characters). Nothing is downloaded or copied into the repository; the text (and its sha256)
    depends on the Python version (docs/engine.md gives it for the one CI uses).
    """
    parts, size = [], 0
    for _, data in stdlib_sources():
        parts.append(data)
        size += len(data)
        if size >= max_bytes:
            return b"".join(parts)[:max_bytes].decode("ascii")
    raise ValueError(
        f"the builtin pysource corpus needs {max_bytes:,} bytes of the standard library's .py sources; "
        f"{sysconfig.get_paths()['stdlib']} holds {size:,} (an interpreter installed without its sources?)"
    )


def stdlib_sources() -> Iterator[tuple[str, bytes]]:
    """The standard library's ``.py`` files as (relative path, bytes), each ending in a newline.

    Every file under ``sysconfig``'s stdlib directory outside the directories PYSOURCE_SKIP whose
    bytes are ASCII (a subset of UTF-8), in sorted relative-path order (POSIX spelling).
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    paths = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d not in PYSOURCE_SKIP]  # not walked at all: site-packages is large
        base = Path(folder).relative_to(root)
        paths += [(base / f).as_posix() for f in files if f.endswith(".py")]
    for rel in sorted(paths):
        data = (root / rel).read_bytes()
        if data and data.isascii():
            yield rel, data if data.endswith(b"\n") else data + b"\n"


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
    cfg: DataSpec,
    seed: int,
    tokens: Tokens,
    corpus: Path | None = None,
    model_dir: Path | None = None,
    log: Log | None = None,
) -> TokenData:
    """The job's data: the builtin task, or a corpus file (``corpus`` overrides ``cfg.path``);
    ``model_dir``: the uploaded model whose tokenizer ``{type: model}`` is; ``log``: a line of the
    job's log, the tokenization's progress."""
    if cfg.builtin == "synthetic":
        if isinstance(cfg.tokenizer, ModelTokenizerSpec):
            raise ValueError("the synthetic task has its own 64 tokens: a model's tokenizer applies to text")
        return synthetic_task(seed, cfg.val_fraction)
    if cfg.builtin == "pysource":
        return load_text(cfg, pysource_text().encode(), tokens, chars=PYSOURCE_CHARS, model_dir=model_dir, log=log)
    if cfg.builtin == "pysource-instruct":
        from .instruct import pysource_instruct, pysource_instruct_sha256

        pairs = documents.rows_documents(pysource_instruct_sha256(), pysource_instruct, cfg.train_on_inputs)
        return tokenized(cfg, pairs, tokens, chars=PYSOURCE_CHARS, model_dir=model_dir, log=log)
    if cfg.builtin is not None:
        raise ValueError(f"unknown builtin task {cfg.builtin!r}")
    path = corpus or (Path(cfg.path) if cfg.path else None)
    if path is None:
        raise ValueError("no corpus: give data.path, or the dataset's file for data.dataset_id")
    if not Path(path).is_file():
        raise FileNotFoundError(f"corpus {path} does not exist")
    return load_corpus(cfg, Path(path), tokens, model_dir, log)
