"""The engine's facts that the service needs before a job runs, torch-free.

They are the vocabulary a spec trains with (and the characters of a text, which a char tokenizer
takes), its model's parameter count, the peak memory of its run and its telemetry series per
step. The engine builds its models and data from the same constants; the API calls these
functions at admission (app.services.caps) and at a dataset's intake.
"""

from __future__ import annotations

from contract import hf, metrics
from contract.spec import BPESpec, DataSpec, JobSpec, ModelSpec, ModelTokenizerSpec

MLP_RATIO = 4  # feed-forward width: d_model x 4
MLP_CONTEXT = 8  # the mlp baseline's window, in tokens
SYNTHETIC_VOCAB = 64  # tokens of the builtin synthetic task
PYSOURCE_TASKS = ("pysource", "pysource-instruct")  # the builtin ASCII texts of the standard library
PYSOURCE_CHAR_VOCAB = 128  # the builtin pysource text's char tokenizer: the ASCII alphabet on every Python
CHAR_VOCAB_MAX = 1 << 16  # the most distinct characters the char tokenizer takes (its ids are uint16)
BYTE_VOCAB = 256
CHARACTERS_SPAN = 1 << 20  # CharacterSet reads a text this many characters at a time
# A token cache entry's name starts with its text's sha256[:16] (a dataset's, for deletes).
TOKEN_NAME_DIGEST = 16
MAX_LOGIT_BLOCK = 256  # query rows per block of the exact max-logit recompute on CUDA
ROUTER_AUX_WEIGHT = 0.01  # Switch Transformer (arXiv 2101.03961) load-balancing coefficient
ROUTER_SERIES = len(metrics.ROUTER)

# Memory of a run (peak_memory_bytes): fp32 values kept per token, measured on the engine
# (tests/engine/test_memory_estimate.py checks the estimate against real runs).
BYTES_PER_FLOAT = 4
RUN_OVERHEAD_BYTES = 128 << 20  # the run's own buffers whatever its size (thread pools, allocator arenas)
# fp32 copies of the parameters: weights, gradients, optimizer state (Muon's momentum, or AdamW's two
# moments and the square root its foreach step makes of one). Muon's Newton-Schulz scratch is NS_WORK.
STATE_COPIES = 5
NS_WORK = 3  # copies of the largest matrix that Newton–Schulz works on
ACT_FLOATS_BLOCK = 10  # per layer x d_model: norms, q k v, attention output, projections, residuals
ACT_FLOATS_FFN = 12  # per layer x d_model: the feed-forward's up projection and GELU (4 d each) and more
# arch hf, per layer: x d_model (RMSNorms' fp32 copies, q k v, RoPE's rotated q and k, SDPA's
# output, projections, residuals) and x intermediate size (gate, up, the gate's SiLU, their product)
ACT_FLOATS_HF_BLOCK = 16
ACT_FLOATS_SWIGLU = 7
ACT_FLOATS_MOE = 10  # per layer x d_model x top_k: each routed copy's gather, up, GELU and down
ACT_FLOATS_MLP = 2  # per hidden layer x width: the linear output and its GELU
ATTENTION_TRANSIENT = 3  # score matrices alive at once beyond those kept: scaled, masked, their gradients
LOGIT_FLOATS = 5  # per token x vocab: logits, log-softmax, gradients and the telemetry's copy
# Per corpus byte while it is tokenized: byte: the file, its text and its ids (and for JSONL each
# segment's ids, their concatenation and the loss mask); char: text, UTF-32 codes, 64-bit search
# indexes; bpe: the text, the tokenizers library's work on each chunk, the ids. model: an uploaded
# model's tokenizer, encoded as a bpe one is. Measured on 20 MB: byte 2.99 (text), 3.75 (JSONL);
# char 22.0 / 7.7; bpe 18.7 / 7.3.
CORPUS_BYTES = {"byte": 4, "char": 24, "bpe": 24, "model": 24}
# A torch.distributed job's node (resources.nproc > 1): each rank is a process of its own.
RANK_PROCESS_BYTES = 384 << 20  # a rank's interpreter, torch and its process group (measured: about 300 MiB)
LAUNCHER_BYTES = 256 << 20  # torchrun's agent (measured: about 220 MiB)
DDP_COPIES = 1  # DDP's gradient buckets: one more fp32 copy of the parameters per rank


def hf_config(model: ModelSpec) -> dict:
    """An hf model's normalized config (an uploaded model's once the service filled it in)."""
    if model.hf is None or model.hf.config is None:
        raise ValueError("model.hf.config is not known yet: the service fills it in from the uploaded model")
    return model.hf.config


def tokenizer_kind(data: DataSpec) -> str:
    """byte, char, bpe or model."""
    return data.tokenizer.type if isinstance(data.tokenizer, BPESpec | ModelTokenizerSpec) else data.tokenizer


def vocabulary(data: DataSpec, dataset_char_vocab: int | None = None) -> int:
    """The vocabulary size the engine builds for a spec's ``data`` (with an uploaded dataset's
    distinct characters for its char tokenizer; an uploaded model's tokenizer: its config's
    vocab_size, which the service fills in)."""
    if data.builtin == "synthetic":
        return SYNTHETIC_VOCAB
    if isinstance(data.tokenizer, BPESpec):
        return data.tokenizer.vocab_size
    if isinstance(data.tokenizer, ModelTokenizerSpec):  # filled in from the uploaded model's config
        return data.tokenizer.vocab_size or 0
    if data.tokenizer == "byte":
        return BYTE_VOCAB
    return PYSOURCE_CHAR_VOCAB if data.builtin in PYSOURCE_TASKS else int(dataset_char_vocab or 0)


def parameter_count(model: ModelSpec, vocab: int) -> int:
    """Exact parameter count of the engine's model for a JobSpec ``model`` section (tied head)."""
    if model.hf is not None:
        return hf.parameter_count(hf_config(model), vocab)
    d, L, T = model.d_model, model.n_layer, model.seq_len
    hidden = MLP_RATIO * d
    if model.arch == "mlp":
        context = min(MLP_CONTEXT, T)
        layers = (context * d * hidden + hidden) + (L - 1) * (hidden * hidden + hidden)
        return vocab * d + layers + 2 * hidden + hidden * vocab
    ffn = 2 * d * hidden
    if model.arch == "moe":
        ffn = moe_experts(model) * (ffn + d)  # experts plus the router's row per expert
    block = 4 * d + 4 * d * d + ffn  # two LayerNorms, qkv + proj, feed-forward
    return vocab * d + T * d + L * block + 2 * d


def peak_memory_bytes(spec: JobSpec, vocab: int, corpus_bytes: int = 0, on_cuda: bool | None = None) -> int:
    """An upper estimate, in bytes, of the memory a training run of ``spec`` takes on one worker.

    It counts what the run takes beyond the worker's own: weights, gradients and optimizer state
    (STATE_COPIES fp32 copies of the parameters: Muon keeps one momentum, AdamW two moments); the
    Newton–Schulz work of the largest matrix; the activations the backward pass keeps, including the
    attention scores (B x H x T x T per layer on a CPU, where attention is computed plainly; fused
    attention on CUDA keeps none) and the logits (B x T x vocab, with their softmax and gradients);
    and the tokenized corpus.

    A torch.distributed job runs ``resources.nproc`` rank processes on each worker, each with a
    full replica of the model and its state (and DDP's gradient buckets) but only its share of the
    batch, plus torchrun's agent; the corpus is tokenized once per worker.

    The coefficients are measured (peak resident memory of real runs): the estimate is above the
    measured peak and within a small factor of it.
    """
    nproc, ranks = spec.resources.nproc, spec.resources.world_size
    data = corpus_bytes * CORPUS_BYTES[tokenizer_kind(spec.data)]
    if ranks == 1:
        return run_memory_bytes(spec, vocab, spec.train.batch_size, on_cuda) + data
    rank = RANK_PROCESS_BYTES + run_memory_bytes(spec, vocab, spec.train.batch_size // ranks, on_cuda, DDP_COPIES)
    return LAUNCHER_BYTES + nproc * rank + data


def run_memory_bytes(spec: JobSpec, vocab: int, B: int, on_cuda: bool | None, copies: int = 0) -> int:
    """peak_memory_bytes of one process training ``spec`` on batches of ``B`` sequences, its
    corpus aside; ``copies``: more fp32 copies of the parameters it keeps."""
    model = spec.model
    d, L, T = model.d_model, model.n_layer, model.seq_len
    tokens = B * T
    params = parameter_count(model, vocab)
    state = (STATE_COPIES + copies) * params + NS_WORK * max_matrix(model, vocab)
    if on_cuda is None:  # where the run will go is not known before a worker takes it: a CPU's cost
        on_cuda = spec.train.device == "cuda"
    if model.arch == "mlp":
        hidden = MLP_RATIO * d
        layer_floats = tokens * (MLP_CONTEXT * d + ACT_FLOATS_MLP * hidden * L)
        attention = 0
    else:
        block, ffn = ACT_FLOATS_BLOCK * d, ACT_FLOATS_FFN * d
        if model.hf is not None:
            block, ffn = ACT_FLOATS_HF_BLOCK * d, ACT_FLOATS_SWIGLU * hf.Shape.of(hf_config(model)).ffn
        if model.arch == "moe":
            ffn = ACT_FLOATS_MOE * d * moe_top_k(model) + moe_experts(model)
        layer_floats = tokens * L * (block + ffn)
        fused = on_cuda or model.hf is not None  # transformers models use SDPA on the CPU too
        scores = B * model.n_head * T * (min(T, MAX_LOGIT_BLOCK) if fused else T)
        attention = scores * (L * (0 if fused else 1) + ATTENTION_TRANSIENT)
    logits = LOGIT_FLOATS * tokens * vocab
    return RUN_OVERHEAD_BYTES + BYTES_PER_FLOAT * (state + layer_floats + attention + logits)


def max_matrix(model: ModelSpec, vocab: int) -> int:
    """Elements of the largest weight matrix (the Newton–Schulz work is a few of its size)."""
    if model.hf is not None:
        return hf.largest_matrix(hf_config(model), vocab)
    d = model.d_model
    hidden = MLP_RATIO * d
    if model.arch == "mlp":
        return max(vocab * hidden, min(MLP_CONTEXT, model.seq_len) * d * hidden, hidden * hidden)
    return max(vocab * d, 3 * d * d, hidden * d)


def series_per_step(spec: JobSpec) -> int:
    """The telemetry series a run reports at each telemetry step (contract.metrics): global ones,
    per layer, per head, per expert, the optimizer's."""
    model, telemetry = spec.model, spec.telemetry
    count = len(metrics.GLOBAL) + len(metrics.OPTIMIZER[spec.optimizer.name])
    if model.arch != "mlp":
        L = model.n_layer
        count += 1 + L + (L * model.n_head if telemetry.per_head else 0)  # attn_max_logit[/l{i}[h{j}]]
        if model.arch == "moe":
            count += ROUTER_SERIES + (L * moe_experts(model) if telemetry.per_expert else 0)
    return count


def moe_experts(model: ModelSpec) -> int:
    """An moe model's experts per layer (validation fills it in for arch moe; 0 for the others)."""
    return model.n_experts or 0


def moe_top_k(model: ModelSpec) -> int:
    """The experts each token of an moe model is routed to (0 for the other archs)."""
    return model.top_k or 0


class CharacterSet:
    """The distinct characters of the texts given to :meth:`update` (lone surrogates included), as
    ``set().update`` collects them.

    Each span of a text is first stripped of the characters already found, by ``str.translate`` in C
    (ASCII text at 1.15 GB/s on the Xeon AMX host, where ``set()`` hashes every character at 128
    MB/s: the largest cost of a dataset's intake); only what is left is hashed. Other text goes at
    about ``set()``'s speed.
    """

    def __init__(self) -> None:
        self.found: set[str] = set()
        self._found_deleted: dict[int, None] = {}  # str.translate's table: every character found, deleted

    def update(self, text: str) -> None:
        for start in range(0, len(text), CHARACTERS_SPAN):
            span = text[start : start + CHARACTERS_SPAN]
            new = set(span.translate(self._found_deleted) if self.found else span)
            if new:
                self.found |= new
                self._found_deleted.update(dict.fromkeys(map(ord, new)))
