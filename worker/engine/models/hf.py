"""Transformers decoders (``model.arch: hf``), built from their config, their max logits measured.

The model is transformers' own (``AutoModelForCausalLM.from_config``: nothing is downloaded), with
two changes. Its attention runs through a function registered in transformers' attention registry,
which records each head's exact max logit (q.k x scaling, the layer's mask respected: causal,
sliding window) and then calls transformers' SDPA attention, so the hot path stays the fused
kernel. And GPT-2's Conv1D layers ([in, out] weights) become ``nn.Linear`` ([out, in]), its fused
``c_attn`` three of them (q, k, v): Muon then orthogonalizes each projection on its own, in the
orientation its shape scale assumes, and QK-Clip finds q and k as in the other families. QK-Clip
scales what bounds a head's logit: the rows of W_q (and W_k, without grouped-query attention) of
the head, or, for QK-norm families (qwen3), the norms' gains, which every head of the layer
shares, by the layer's largest factor (docs/engine.md, "Transformers models").
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, cast

import torch
from torch import Tensor, nn

from contract.hf import Shape
from optim import QKClipSource, QKClipTarget, separate_qk_targets

from ..config import ModelConfig
from .attention import MaxLogitRecord, causal_max_logits, masked_max_logits
from .base import AttentionLayer, LanguageModel

ATTENTION = "muonforge_max_logit"  # the name of our function in transformers' attention registry
PROBE = "_muonforge_probe"  # the attribute of a transformers attention module that holds its HeadProbe


class HeadProbe(MaxLogitRecord):
    """One attention layer's per-head max logits, recorded by the registered attention function.

    It implements :class:`optim.QKClipSource` for telemetry (one value per query head); QK-Clip
    of a QK-norm layer goes through :class:`SharedGainClip` instead.
    """

    def __init__(self, attention: nn.Module, shape: Shape) -> None:
        self.attention, self.shape = attention, shape

    def qk_clip_targets(self) -> list[QKClipTarget]:
        q, k = query_key(self.attention)
        s = self.shape
        return separate_qk_targets(q.weight, k.weight, s.heads, s.head_dim, s.kv_heads, q.bias, k.bias)

    def head_blocks(self) -> dict[Tensor, tuple[int, ...]]:
        """Every query head's rows of W_q and every key head's of W_k (grouped-query keys too)."""
        q, k = query_key(self.attention)
        s = self.shape
        return {q.weight: (s.head_dim,) * s.heads, k.weight: (s.head_dim,) * s.kv_heads}


class SharedGainClip:
    """QK-Clip of a QK-norm layer: q = g_q * rmsnorm(W_q x), k = g_k * rmsnorm(W_k x) (Gemma 3
    stores each gain as g - 1).

    The norm undoes any scaling of W_q and W_k, and the gains g_q, g_k [head_dim] are shared by
    every head, so the clip scales both gains by sqrt(gamma) of the layer's hottest head: every
    head's logit is then multiplied by that gamma, the hottest ends at tau and the others below.
    """

    def __init__(self, probe: HeadProbe) -> None:
        self.probe = probe

    def qk_max_logits(self) -> Tensor | None:
        s = self.probe.qk_max_logits()
        return None if s is None else s.amax().reshape(1)

    def reset_qk_max_logits(self) -> None:
        self.probe.reset_qk_max_logits()

    def qk_clip_targets(self) -> list[QKClipTarget]:
        a, shift = self.probe.attention, self.probe.shape.family.gain_offset
        gains = (cast(nn.RMSNorm, a.q_norm).weight, cast(nn.RMSNorm, a.k_norm).weight)
        return [QKClipTarget(g.view(1, -1), heads=1, rows=1, shift=shift) for g in gains]


def _attention_with_max_logits(
    module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None, **kwargs: Any
) -> tuple[Tensor, Tensor | None]:
    """transformers' SDPA attention, recording each head's max logit on ``module``'s probe first.

    query [B, H, T, D], key and value [B, H_kv, S, D] (after RoPE and QK-norm); attention_mask None
    (causal) or a boolean [B or 1, 1, T, S] mask, True where a query may attend.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    probe: HeadProbe | None = getattr(module, PROBE, None)
    if probe is not None and module.training and probe.record_max_logits:
        scaling = kwargs.get("scaling") or query.shape[-1] ** -0.5
        k = key.detach().repeat_interleave(query.shape[1] // key.shape[1], dim=1)  # [B, H, S, D]: GQA groups
        if attention_mask is None:
            per_head = causal_max_logits(query.detach(), k, scale=scaling)
        else:
            per_head = masked_max_logits(query.detach(), k, attention_mask, scale=scaling)
        probe.remember(per_head)
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTENTION, _attention_with_max_logits)
    AttentionMaskInterface.register(ATTENTION, sdpa_mask)  # the masks SDPA takes (None where causal)


class SplitQKV(nn.Module):
    """GPT-2's fused ``c_attn`` as three projections: the same [B, T, 3 x width] output."""

    def __init__(self, fused: nn.Module) -> None:
        super().__init__()
        weight, bias = cast(Tensor, fused.weight), cast(Tensor, fused.bias)  # [in, 3 width], [3 width]
        width = weight.shape[1] // 3
        self.q, self.k, self.v = (nn.Linear(weight.shape[0], width) for _ in range(3))
        with torch.no_grad():
            for i, part in enumerate((self.q, self.k, self.v)):
                part.weight.copy_(weight[:, i * width : (i + 1) * width].T)
                part.bias.copy_(bias[i * width : (i + 1) * width])

    def forward(self, x: Tensor) -> Tensor:
        return torch.cat([self.q(x), self.k(x), self.v(x)], dim=-1)


def as_linear(conv: nn.Module) -> nn.Linear:
    """A transformers Conv1D (y = x W + b, W [in, out]) as the nn.Linear it is."""
    weight, bias = cast(Tensor, conv.weight), cast(Tensor, conv.bias)
    linear = nn.Linear(weight.shape[0], weight.shape[1])
    with torch.no_grad():
        linear.weight.copy_(weight.T)
        linear.bias.copy_(bias)
    return linear


def unfuse_conv1d(net: nn.Module) -> None:
    """Every Conv1D of a transformers model as nn.Linear, a fused q, k, v one as SplitQKV."""
    from transformers.pytorch_utils import Conv1D

    for module in list(net.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, Conv1D):
                setattr(module, name, SplitQKV(child) if name == "c_attn" else as_linear(child))


def attention_modules(net: nn.Module) -> list[nn.Module]:
    """A transformers decoder's self-attention modules, first layer first."""
    base = cast(nn.Module, net.base_model)
    layers = cast(nn.ModuleList, getattr(base, "layers", None) or base.h)  # llama-like, GPT-2
    return [cast(nn.Module, getattr(layer, "self_attn", None) or layer.attn) for layer in layers]


def query_key(attention: nn.Module) -> tuple[nn.Linear, nn.Linear]:
    """The q and k projections of a transformers attention module (GPT-2's once split)."""
    split = getattr(attention, "c_attn", None)
    if isinstance(split, SplitQKV):
        return split.q, split.k
    return cast(nn.Linear, attention.q_proj), cast(nn.Linear, attention.k_proj)


WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"


def weight_files(directory: Path) -> list[Path]:
    """A model directory's safetensors files: ``model.safetensors``, or the shards its index names."""
    if (directory / WEIGHTS).is_file():
        return [directory / WEIGHTS]
    index = directory / INDEX
    if not index.is_file():
        raise FileNotFoundError(f"{directory.name} has neither {WEIGHTS} nor {INDEX}")
    shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    return [directory / name for name in shards]


def load_weights(net: nn.Module, directory: Path) -> None:
    """A transformers model's weights from the safetensors of ``directory``, strictly.

    Every tensor of the model must be there and nothing else, bar a tensor tied to one that is
    (a tied lm_head, which ``save_pretrained`` leaves out). The values are copied into the
    model's own parameters (converted to their dtype), so tied ones stay tied.
    """
    from safetensors.torch import load_file

    state: dict[str, Tensor] = {}
    for path in weight_files(directory):
        state |= load_file(str(path))
    missing, unexpected = net.load_state_dict(state, strict=False)
    tensors = dict(net.named_parameters(remove_duplicate=False)) | dict(net.named_buffers(remove_duplicate=False))
    loaded = {id(tensors[name]) for name in state if name in tensors}
    missing = [name for name in missing if id(tensors.get(name)) not in loaded]
    if missing or unexpected:
        parts = [f"{what} {', '.join(names[:5])}" for what, names in (("missing", missing), ("unexpected", unexpected))]
        detail = "; ".join(part for part, names in zip(parts, (missing, unexpected), strict=True) if names)
        raise ValueError(f"the model's weights do not match its config: {detail}")


class HFCausalLM(LanguageModel):
    """A transformers decoder of ``cfg.hf`` (a normalized config), token ids in, logits out."""

    def __init__(self, cfg: ModelConfig, pretrained: Path | None = None) -> None:
        """``pretrained``: an uploaded model's directory, whose safetensors weights the model starts
        from (loaded into transformers' own layout, before GPT-2's Conv1D layers become Linear)."""
        super().__init__()
        from transformers import AutoConfig, AutoModelForCausalLM

        if cfg.hf is None:
            raise ValueError("arch hf needs model.hf.config")
        _register()
        self.cfg = cfg
        fields = {k: v for k, v in cfg.hf.items() if k != "model_type"}
        config = AutoConfig.for_model(cfg.hf["model_type"], vocab_size=cfg.vocab_size, **fields)
        self.net = AutoModelForCausalLM.from_config(config, attn_implementation=ATTENTION)
        if pretrained is not None:
            load_weights(self.net, Path(pretrained))
        unfuse_conv1d(self.net)
        shape = Shape.of(cfg.hf)
        self.probes = [HeadProbe(attention, shape) for attention in attention_modules(self.net)]
        for probe in self.probes:
            setattr(probe.attention, PROBE, probe)
        self.clip_sources: list[QKClipSource] = (
            [SharedGainClip(p) for p in self.probes] if shape.family.qk_norm else list(self.probes)
        )

    def forward(self, idx: Tensor) -> Tensor:
        """idx [B, T] token ids -> logits [B, T, vocab]."""
        return self.net(input_ids=idx, use_cache=False).logits

    def attention_layers(self) -> list[AttentionLayer]:
        return list(self.probes)

    def qk_clip_sources(self) -> list[QKClipSource]:
        return list(self.clip_sources)


ARCHITECTURES = {"hf": HFCausalLM}
