"""Resource caps checked before a job is queued: parameters, steps, tokens per batch."""

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


def check_caps(spec: dict[str, Any], vocab: int, settings: Settings) -> None:
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
