"""Models the engine trains, built from a ModelConfig."""

from .attention import CausalSelfAttention, causal_max_logits
from .gpt import GPT, LanguageModel, MLPLanguageModel, build_model
from .moe import MoEFeedForward, load_balancing_loss, top_k_routing

__all__ = [
    "GPT",
    "CausalSelfAttention",
    "LanguageModel",
    "MLPLanguageModel",
    "MoEFeedForward",
    "build_model",
    "causal_max_logits",
    "load_balancing_loss",
    "top_k_routing",
]
