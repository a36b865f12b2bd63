"""Transformers decoders a job may train (``model.arch: hf``): the families, their shape fields.

A spec's ``model.hf.config`` holds transformers config fields (its ``model_type`` names the
family). Validation fills in every field that shapes the parameters with the default written
here, so that the engine builds exactly what admission counted, whatever the installed
transformers' own defaults are. This module is torch- and transformers-free: the API, the client
and the engine all read it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Family:
    """How one transformers decoder family names its sizes and which parameters it has.

    ``names`` maps our words (layers, heads, kv_heads, width, ffn, head_dim, positions) to the
    family's config fields; ``defaults`` are the fields a config may omit (a callable takes the
    config so far).
    """

    names: dict[str, str]
    defaults: dict[str, Any] = field(default_factory=dict)
    qkv_bias: str | bool = False  # a config field that switches the q, k, v biases, or a fixed answer
    o_bias: str | bool = False
    mlp_bias: str | bool = False
    qk_norm: bool = False  # per-head RMSNorm of q and k (gains of head_dim each, shared by the heads)
    norms_per_layer: int = 2  # RMSNorm gains of width per layer (Gemma 3: before and after each sublayer)
    gain_offset: float = 0.0  # Gemma's RMSNorm multiplies by (offset + weight): 1.0
    gated_mlp: bool = True  # gate, up and down projections (SwiGLU); else up and down (GPT-2's GELU)
    layer_norm: bool = False  # LayerNorm (gain and bias) rather than RMSNorm (gain)
    learned_positions: bool = False  # a position embedding table (GPT-2) rather than RoPE


_LLAMA_NAMES = {
    "layers": "num_hidden_layers",
    "heads": "num_attention_heads",
    "kv_heads": "num_key_value_heads",
    "width": "hidden_size",
    "ffn": "intermediate_size",
    "head_dim": "head_dim",
    "positions": "max_position_embeddings",
}
_LLAMA_DEFAULTS: dict[str, Any] = {
    "num_key_value_heads": lambda c: c["num_attention_heads"],
    "head_dim": lambda c: c["hidden_size"] // c["num_attention_heads"],
    "tie_word_embeddings": False,
}
SWITCHES = ("attention_bias", "mlp_bias")  # the bias switches a family may read

# The families tested end to end (tests/engine/test_hf_models.py builds each with transformers and
# checks the parameter count below against it): pre-norm decoders with RoPE, RMSNorm and SwiGLU.
FAMILIES: dict[str, Family] = {
    "llama": Family(
        _LLAMA_NAMES,
        _LLAMA_DEFAULTS | {"attention_bias": False, "mlp_bias": False},
        qkv_bias="attention_bias",
        o_bias="attention_bias",
        mlp_bias="mlp_bias",
    ),
    "mistral": Family(_LLAMA_NAMES, _LLAMA_DEFAULTS),
    "qwen2": Family(_LLAMA_NAMES, _LLAMA_DEFAULTS, qkv_bias=True),
    "qwen3": Family(
        _LLAMA_NAMES, _LLAMA_DEFAULTS | {"attention_bias": False}, "attention_bias", "attention_bias", qk_norm=True
    ),
    "gemma": Family(
        _LLAMA_NAMES,
        _LLAMA_DEFAULTS | {"attention_bias": False, "tie_word_embeddings": True},
        "attention_bias",
        "attention_bias",
        gain_offset=1.0,
    ),
    "gemma3_text": Family(
        _LLAMA_NAMES,
        _LLAMA_DEFAULTS | {"attention_bias": False, "tie_word_embeddings": True},
        "attention_bias",
        "attention_bias",
        qk_norm=True,
        norms_per_layer=4,
        gain_offset=1.0,
    ),
    "gpt2": Family(
        {"layers": "n_layer", "heads": "n_head", "width": "n_embd", "ffn": "n_inner", "positions": "n_positions"},
        {
            "n_inner": lambda c: 4 * c["n_embd"],
            "tie_word_embeddings": True,
            # No dropout, as the engine's own models and today's pretraining (transformers' default: 0.1).
            "resid_pdrop": 0.0,
            "embd_pdrop": 0.0,
            "attn_pdrop": 0.0,
        },
        qkv_bias=True,
        o_bias=True,
        mlp_bias=True,
        gated_mlp=False,
        layer_norm=True,
        learned_positions=True,
    ),
}

# Keys a config may not set: the vocabulary comes from the tokenizer, the attention kernel and the
# precision from the engine, and no code is ever loaded from a config.
RESERVED = {
    "vocab_size": "the vocabulary comes from data.tokenizer",
    "auto_map": "no code is loaded from a config",
    "trust_remote_code": "no code is loaded from a config",
    "attn_implementation": "the engine picks the attention kernel (it measures each head's max logit there)",
    "_attn_implementation": "the engine picks the attention kernel (it measures each head's max logit there)",
    "dtype": "the precision is train.precision",
    "torch_dtype": "the precision is train.precision",
    "quantization_config": "quantized training is not offered",
}
MAX_CONFIG_BYTES = 64 << 10  # a config is a few hundred bytes; this bounds what a spec may carry


def normalized(config: dict[str, Any]) -> dict[str, Any]:
    """The config with every shape field of its family filled in; ValueError names what is wrong."""
    model_type = config.get("model_type")
    if model_type not in FAMILIES:
        raise ValueError(f"model_type must be one of {', '.join(sorted(FAMILIES))} (got {model_type!r})")
    for key, why in RESERVED.items():
        if key in config:
            raise ValueError(f"{key} may not be set: {why}")
    family = FAMILIES[model_type]
    required = [family.names[w] for w in ("layers", "heads", "width", "ffn") if family.names[w] not in family.defaults]
    missing = [k for k in required if k not in config]
    if missing:
        raise ValueError(f"a {model_type} config needs {', '.join(missing)}")
    out = dict(config)
    for fill in (False, True):  # the sizes given, then the defaults computed from them
        for key, default in family.defaults.items():
            if fill and out.get(key) is None:
                out[key] = default(out) if callable(default) else default
        for key in family.names.values():
            value = out.get(key, 1)
            if value is None and not fill:  # null, as transformers writes an unset n_inner: the default
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{key} must be a whole number >= 1 (got {value!r})")
    for key in (*SWITCHES, "tie_word_embeddings"):
        if not isinstance(out.get(key, False), bool):
            raise ValueError(f"{key} must be true or false (got {out[key]!r})")
    shape = Shape.of(out)
    if shape.heads % shape.kv_heads:
        raise ValueError(
            f"num_attention_heads ({shape.heads}) must be a multiple of num_key_value_heads ({shape.kv_heads})"
        )
    if shape.head_dim * shape.heads != shape.width and not family.names.get("head_dim"):
        raise ValueError(f"{family.names['width']} ({shape.width}) must be divisible by {family.names['heads']}")
    return out


# An uploaded model's config.json fields that are the training's own, left out of the spec's config:
# the vocabulary (the model tokenizer's, data.tokenizer.vocab_size), the precision, the kernel.
UPLOAD_FIELDS_LEFT_OUT = ("vocab_size", "dtype", "torch_dtype", "attn_implementation", "_attn_implementation")


def from_upload(config: dict[str, Any]) -> dict[str, Any]:
    """An uploaded model's config.json as a spec's ``model.hf.config``: normalized, without the
    fields UPLOAD_FIELDS_LEFT_OUT names."""
    return normalized({k: v for k, v in config.items() if k not in UPLOAD_FIELDS_LEFT_OUT})


def positions(config: dict[str, Any]) -> str:
    """The config field of the longest context the model is set up for (its default: model.seq_len)."""
    return FAMILIES[config["model_type"]].names["positions"]


def sizes(config: dict[str, Any]) -> dict[str, str]:
    """Which of a config's fields give the spec's n_layer, n_head and d_model (its family's names)."""
    names = FAMILIES[config["model_type"]].names if config.get("model_type") in FAMILIES else _LLAMA_NAMES
    return {"n_layer": names["layers"], "n_head": names["heads"], "d_model": names["width"]}


@dataclass(frozen=True)
class Shape:
    """A normalized config's sizes in our words."""

    family: Family
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    width: int
    ffn: int
    positions: int
    tied: bool

    @classmethod
    def of(cls, config: dict[str, Any]) -> Shape:
        family = FAMILIES[config["model_type"]]
        get: dict[str, Any] = {w: config.get(k) for w, k in family.names.items()}
        heads = get["heads"]
        return cls(
            family=family,
            layers=get["layers"],
            heads=heads,
            kv_heads=get.get("kv_heads") or heads,
            head_dim=get.get("head_dim") or get["width"] // heads,
            width=get["width"],
            ffn=get["ffn"],
            positions=get["positions"] or 0,  # filled in from model.seq_len by the spec's validation
            tied=bool(config["tie_word_embeddings"]),
        )

    def flag(self, config: dict[str, Any], switch: str | bool) -> bool:
        """A family's bias switch read from the config (or its fixed answer)."""
        return bool(config.get(switch, False)) if isinstance(switch, str) else switch


def parameter_count(config: dict[str, Any], vocab: int) -> int:
    """Exact parameters of the transformers model a normalized config builds, with ``vocab`` tokens."""
    s = Shape.of(config)
    f = s.family
    d, q, kv = s.width, s.heads * s.head_dim, s.kv_heads * s.head_dim
    attention = d * (q + 2 * kv) + q * d
    attention += (q + 2 * kv) * s.flag(config, f.qkv_bias) + d * s.flag(config, f.o_bias)
    attention += 2 * s.head_dim * f.qk_norm
    if f.gated_mlp:  # gate, up, down
        mlp = 3 * d * s.ffn + (2 * s.ffn + d) * s.flag(config, f.mlp_bias)
    else:  # up, down
        mlp = 2 * d * s.ffn + (s.ffn + d) * s.flag(config, f.mlp_bias)
    norm = 2 * d if f.layer_norm else d
    layer = attention + mlp + f.norms_per_layer * norm
    embeddings = vocab * d + (s.positions * d if f.learned_positions else 0)
    head = 0 if s.tied else vocab * d
    return embeddings + s.layers * layer + norm + head


def largest_matrix(config: dict[str, Any], vocab: int) -> int:
    """Elements of the largest weight matrix of a normalized config's model."""
    s = Shape.of(config)
    return max(vocab * s.width, s.width * s.heads * s.head_dim, s.width * s.ffn)
