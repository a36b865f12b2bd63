"""The engine's byte-level BPE against the tokenizers library run alone: learning a vocabulary
from a text and encoding the text, MB/s, side by side in one run.

    .venv/bin/python bench/bpe.py [--mb 100] [--vocab 16384] [--rounds 2] [--json PATH]

The text is the builtin pysource corpus (the standard library's sources, 4 MiB) repeated to
``--mb`` megabytes: nothing is downloaded. "ours" is what a job does (``Tokenizer.train_bpe``,
then ``Tokenizer.encode`` into one 16-bit array); "library alone" is the same tokenizers model,
pre-tokenizer and trainer fed the same pieces (``train_from_iterator``, then
``encode_batch_fast`` of every piece at once, keeping the ids as the library returns them). The
ratio ours / alone of each phase's MB/s is the service's cost (target: >= 0.9, overhead <= 10%).
Rounds alternate the order of the contenders.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

from worker.engine.data import pysource_text
from worker.engine.tokenizer import BPE_CHUNK, Tokenizer, text_chunks, untrained_bpe


def library_alone(text: str, vocab_size: int) -> tuple[float, float, int]:
    """Seconds to learn and to encode with tokenizers alone, and the tokens it gives."""
    start = time.perf_counter()
    pieces = list(text_chunks(text, BPE_CHUNK))  # the same pieces, cut the same way
    fast, trainer = untrained_bpe(vocab_size)  # the same model, pre-tokenizer and trainer
    fast.train_from_iterator(pieces, trainer=trainer)
    learned = time.perf_counter()
    ids = [e.ids for e in fast.encode_batch_fast(pieces)]
    encoded = time.perf_counter()
    return learned - start, encoded - learned, sum(map(len, ids))


def ours(text: str, vocab_size: int) -> tuple[float, float, int]:
    """Seconds to learn and to encode as a job does, and the tokens it gives."""
    start = time.perf_counter()
    tokenizer = Tokenizer.train_bpe(text, vocab_size)
    learned = time.perf_counter()
    ids = tokenizer.encode(text)
    encoded = time.perf_counter()
    return learned - start, encoded - learned, len(ids)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=100.0, help="megabytes of text")
    parser.add_argument("--vocab", type=int, default=16384)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()
    base = pysource_text()
    size = int(args.mb * 1e6)
    text = (base * (size // len(base) + 1))[:size]
    megabytes = len(text.encode()) / 1e6
    contenders = {"ours": ours, "library alone": library_alone}
    runs: dict[str, list[tuple[float, float, int]]] = {name: [] for name in contenders}
    for round_ in range(args.rounds):
        order = list(contenders) if round_ % 2 == 0 else list(reversed(contenders))
        for name in order:
            runs[name].append(contenders[name](text, args.vocab))
    print(f"{platform.processor() or platform.machine()}: {megabytes:.1f} MB of text, vocab {args.vocab}")
    print(f"{'contender':<16}{'learn MB/s':>12}{'encode MB/s':>13}{'tokens':>14}")
    best = {}
    for name, results in runs.items():
        learn = megabytes / statistics.median(r[0] for r in results)
        encode = megabytes / statistics.median(r[1] for r in results)
        best[name] = {"learn_mb_s": learn, "encode_mb_s": encode, "tokens": results[0][2]}
        print(f"{name:<16}{learn:>12.2f}{encode:>13.2f}{results[0][2]:>14,}")
    ratio = {k: best["ours"][k] / best["library alone"][k] for k in ("learn_mb_s", "encode_mb_s")}
    print(f"ours / alone: learn {ratio['learn_mb_s']:.3f}, encode {ratio['encode_mb_s']:.3f} (target >= 0.9)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"megabytes": megabytes, "vocab": args.vocab, "contenders": best, "ratio": ratio}, f, indent=2)


if __name__ == "__main__":
    main()
