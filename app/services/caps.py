"""Resource caps checked before a job is queued: parameters, steps, tokens per batch, the memory a
run will take, its telemetry volume, its checkpoints and its run time."""

from __future__ import annotations

from typing import Any

from app.errors import ValidationFailed
from app.settings import Settings

# Facts of the engine's models and data that the API needs before a job runs (the app never
# imports the worker); tests/test_parity.py pins each to the engine's own value.
MLP_RATIO = 4  # feed-forward width: d_model x 4
MLP_CONTEXT = 8  # the mlp baseline's window, in tokens
SYNTHETIC_VOCAB = 64  # tokens of the builtin synthetic task
PYSOURCE_CHAR_VOCAB = 128  # the builtin pysource text's char tokenizer: the ASCII alphabet on every Python
CHAR_VOCAB_MAX = 1 << 16  # the most distinct characters the char tokenizer takes (uint16 ids)
MAX_LOGIT_BLOCK = 256  # query rows per block of the exact max-logit recompute on CUDA

# Telemetry series per step (series_per_step), beyond the attention and router ones: loss, val_loss,
# lr, grad_norm, logits/max_abs, logits/std, step_time_ms, tokens_per_s, elapsed_s.
GLOBAL_SERIES = 9
OPTIMIZER_SERIES = {"adamw": 0, "muon": 3, "muonclip": 5}  # update_rms, optim/*; qk_clip/*
ROUTER_SERIES = 4  # router/aux_loss, router/entropy, router/load_max, router/load_min

# Memory of a run (peak_memory_bytes): fp32 values kept per token, measured on the engine.
BYTES_PER_FLOAT = 4
RUN_OVERHEAD_BYTES = 128 << 20  # the run's own buffers whatever its size (thread pools, allocator arenas)
# fp32 copies of the parameters: weights, gradients, optimizer state (Muon's momentum, or AdamW's two
# moments and the square root its foreach step makes of one). Muon's Newton-Schulz scratch is NS_WORK.
STATE_COPIES = 5
NS_WORK = 3  # copies of the largest matrix that Newton–Schulz works on
ACT_FLOATS_BLOCK = 10  # per layer x d_model: norms, q k v, attention output, projections, residuals
ACT_FLOATS_FFN = 12  # per layer x d_model: the feed-forward's up projection and GELU (4 d each) and more
ACT_FLOATS_MOE = 10  # per layer x d_model x top_k: each routed copy's gather, up, GELU and down
ACT_FLOATS_MLP = 2  # per hidden layer x width: the linear output and its GELU
ATTENTION_TRANSIENT = 3  # score matrices alive at once beyond those kept: scaled, masked, their gradients
LOGIT_FLOATS = 5  # per token x vocab: logits, log-softmax, gradients and the telemetry's copy
CORPUS_BYTES_BYTE = 3  # per corpus byte while it is tokenized: the file, its text and its ids
CORPUS_BYTES_CHAR = 24  # per corpus byte, char tokenizer: text, UTF-32 codes, 64-bit search indexes
# A torch.distributed job's node (resources.nproc > 1): each rank is a process of its own.
RANK_PROCESS_BYTES = 384 << 20  # a rank's interpreter, torch and its process group (measured: about 300 MiB)
LAUNCHER_BYTES = 256 << 20  # torchrun's agent (measured: about 220 MiB)
DDP_COPIES = 1  # DDP's gradient buckets: one more fp32 copy of the parameters per rank


def vocabulary(data: dict[str, Any], dataset_char_vocab: int | None = None) -> int:
    """The vocabulary size the engine builds for a spec's ``data`` (with an uploaded dataset's
    distinct characters for its char tokenizer)."""
    if data.get("builtin") == "synthetic":
        return SYNTHETIC_VOCAB
    if data.get("tokenizer", "byte") == "byte":
        return 256
    return PYSOURCE_CHAR_VOCAB if data.get("builtin") == "pysource" else int(dataset_char_vocab or 0)


def parameter_count(model: dict[str, Any], vocab: int) -> int:
    """Exact parameter count of the engine's model for a JobSpec ``model`` section (tied head)."""
    d, L, T = model["d_model"], model["n_layer"], model["seq_len"]
    hidden = MLP_RATIO * d
    if model["arch"] == "mlp":
        context = min(MLP_CONTEXT, T)
        layers = (context * d * hidden + hidden) + (L - 1) * (hidden * hidden + hidden)
        return vocab * d + layers + 2 * hidden + hidden * vocab
    ffn = 2 * d * hidden
    if model["arch"] == "moe":
        ffn = model["n_experts"] * (ffn + d)  # experts plus the router's row per expert
    block = 4 * d + 4 * d * d + ffn  # two LayerNorms, qkv + proj, feed-forward
    return vocab * d + T * d + L * block + 2 * d


def peak_memory_bytes(spec: dict[str, Any], vocab: int, corpus_bytes: int = 0, on_cuda: bool | None = None) -> int:
    """An upper estimate of the memory a training run of ``spec`` takes on one worker beyond the
    worker's own, in bytes: weights, gradients and optimizer state (STATE_COPIES fp32 copies of
    the parameters: Muon keeps one momentum, AdamW two moments); the Newton–Schulz work of the largest
    matrix; the activations the backward pass keeps, including the attention scores (B x H x T x T
    per layer on a CPU, where attention is computed plainly; fused attention on CUDA keeps none)
    and the logits (B x T x vocab, with their softmax and gradients); and the tokenized corpus.

    A torch.distributed job runs ``resources.nproc`` rank processes on each worker, each with a
    full replica of the model and its state (and DDP's gradient buckets) but only its share of the
    batch, plus torchrun's agent; the corpus is tokenized once per worker.

    The coefficients are measured (peak resident memory of real runs, tests/engine/
    test_memory_estimate.py checks the estimate against it): the estimate is above the measured
    peak and within a small factor of it."""
    resources = spec.get("resources") or {"nproc": 1, "nnodes": 1}
    nproc, ranks = resources["nproc"], resources["nproc"] * resources["nnodes"]
    data = corpus_bytes * (CORPUS_BYTES_CHAR if spec["data"].get("tokenizer") == "char" else CORPUS_BYTES_BYTE)
    if ranks == 1:
        return run_memory_bytes(spec, vocab, spec["train"]["batch_size"], on_cuda) + data
    rank = RANK_PROCESS_BYTES + run_memory_bytes(spec, vocab, spec["train"]["batch_size"] // ranks, on_cuda, DDP_COPIES)
    return LAUNCHER_BYTES + nproc * rank + data


def run_memory_bytes(spec: dict[str, Any], vocab: int, B: int, on_cuda: bool | None, copies: int = 0) -> int:
    """peak_memory_bytes of one process training ``spec`` on batches of ``B`` sequences, its
    corpus aside; ``copies``: more fp32 copies of the parameters it keeps."""
    model, train = spec["model"], spec["train"]
    d, L, T = model["d_model"], model["n_layer"], model["seq_len"]
    tokens = B * T
    params = parameter_count(model, vocab)
    state = (STATE_COPIES + copies) * params + NS_WORK * max_matrix(model, vocab)
    if on_cuda is None:  # where the run will go is not known before a worker takes it: a CPU's cost
        on_cuda = train.get("device") == "cuda"
    if model["arch"] == "mlp":
        hidden = MLP_RATIO * d
        layer_floats = tokens * (MLP_CONTEXT * d + ACT_FLOATS_MLP * hidden * L)
        attention = 0
    else:
        ffn = ACT_FLOATS_FFN * d
        if model["arch"] == "moe":
            ffn = ACT_FLOATS_MOE * d * model["top_k"] + model["n_experts"]
        layer_floats = tokens * L * (ACT_FLOATS_BLOCK * d + ffn)
        scores = B * model["n_head"] * T * (min(T, MAX_LOGIT_BLOCK) if on_cuda else T)
        attention = scores * (L * (0 if on_cuda else 1) + ATTENTION_TRANSIENT)
    logits = LOGIT_FLOATS * tokens * vocab
    return RUN_OVERHEAD_BYTES + BYTES_PER_FLOAT * (state + layer_floats + attention + logits)


def max_matrix(model: dict[str, Any], vocab: int) -> int:
    """Elements of the largest weight matrix (the Newton–Schulz work is a few of its size)."""
    d = model["d_model"]
    hidden = MLP_RATIO * d
    if model["arch"] == "mlp":
        return max(vocab * hidden, min(MLP_CONTEXT, model["seq_len"]) * d * hidden, hidden * hidden)
    return max(vocab * d, 3 * d * d, hidden * d)


def series_per_step(spec: dict[str, Any]) -> int:
    """The telemetry series a run reports at each telemetry step (docs/service.md, "Telemetry
    names"): global ones, per layer, per head, per expert, the optimizer's."""
    model, telemetry, optimizer = spec["model"], spec["telemetry"], spec["optimizer"]["name"]
    count = GLOBAL_SERIES + OPTIMIZER_SERIES[optimizer]
    if model["arch"] != "mlp":
        L = model["n_layer"]
        count += 1 + L + (L * model["n_head"] if telemetry["per_head"] else 0)  # attn_max_logit[/l{i}[h{j}]]
        if model["arch"] == "moe":
            count += ROUTER_SERIES + (L * model["n_experts"] if telemetry["per_expert"] else 0)
    return count


def check_caps(spec: dict[str, Any], vocab: int, corpus_bytes: int, settings: Settings) -> None:
    """Every cap a job's spec must fit before it is queued; the first one it misses is a 422
    naming the field and giving the limit."""
    resources = spec["resources"]
    for name, cap in (("nproc", settings.max_nproc), ("nnodes", settings.max_nnodes)):
        if resources[name] > cap:
            setting = f"MUONFORGE_MAX_{name.upper()}"
            raise ValidationFailed(
                f"resources.{name} {resources[name]} exceeds this server's cap of {cap} ({setting})",
                param=f"resources.{name}",
            )
    params = parameter_count(spec["model"], vocab)
    if params > settings.max_params:
        raise ValidationFailed(
            f"the model has {params:,} parameters; this server's cap is {settings.max_params:,}", param="model"
        )
    if spec["train"]["steps"] > settings.max_steps:
        raise ValidationFailed(
            f"{spec['train']['steps']:,} steps exceed this server's cap of {settings.max_steps:,}", param="train.steps"
        )
    tokens = spec["train"]["batch_size"] * spec["model"]["seq_len"]
    if tokens > settings.max_batch_tokens:
        raise ValidationFailed(
            f"batch_size x seq_len = {tokens:,} tokens exceeds this server's cap of {settings.max_batch_tokens:,}",
            param="train.batch_size",
        )
    needed = peak_memory_bytes(spec, vocab, corpus_bytes)
    if needed > settings.worker_memory_bytes:
        raise ValidationFailed(
            f"this job needs about {gib(needed)} of memory at its peak (weights, optimizer state, activations, "
            f"attention scores and logits); a worker here gives a job {gib(settings.worker_memory_bytes)}: "
            "lower train.batch_size, model.seq_len or the model's size",
            param="train.batch_size",
        )
    series = series_per_step(spec)
    if series > settings.max_series_per_step:
        model, telemetry = spec["model"], spec["telemetry"]
        finest = {}  # the switched-on per-unit families, by their series per step
        if model["arch"] != "mlp" and telemetry["per_head"]:
            finest["telemetry.per_head"] = model["n_layer"] * model["n_head"]
        if model["arch"] == "moe" and telemetry["per_expert"]:
            finest["telemetry.per_expert"] = model["n_layer"] * model["n_experts"]
        fine = max(finest, key=finest.get) if finest else None  # the larger; per_head on a tie
        advice = f": set {fine} to false" if fine else ""
        raise ValidationFailed(
            f"the run would report {series:,} telemetry series per step; this server's cap is "
            f"{settings.max_series_per_step:,}{advice}",
            param=fine or "model.n_layer",
        )
    train = spec["train"]
    checkpoints = -(-train["steps"] // train["checkpoint_every"])
    if checkpoints > settings.max_checkpoints:
        floor = -(-train["steps"] // settings.max_checkpoints)
        raise ValidationFailed(
            f"checkpoint_every {train['checkpoint_every']:,} writes {checkpoints:,} checkpoints; this server's cap is "
            f"{settings.max_checkpoints:,} per job: use checkpoint_every {floor:,} or more",
            param="train.checkpoint_every",
        )
    minutes = train.get("max_minutes")
    if minutes is not None and minutes > settings.max_job_minutes:
        raise ValidationFailed(
            f"max_minutes {minutes:g} exceeds this server's limit of {settings.max_job_minutes:g} minutes per job",
            param="train.max_minutes",
        )


def gib(n: int) -> str:
    return f"{n / 2**30:,.2f} GiB"
