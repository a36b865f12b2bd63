"""QK-Clip (Kimi K2, arXiv 2507.20534) and MuonClip = Muon + QK-Clip.

After each optimizer step, every attention head whose max logit S_max = max q.k / sqrt(d)
over the step's batch exceeds tau gets gamma = tau / S_max folded into its query/key weights
(sqrt(gamma) on each side by default), so the same inputs give a max logit of exactly tau.
Heads at or under tau are multiplied by exactly 1.0: bitwise untouched.

An attention module takes part by implementing :class:`QKClipSource`: it records the
per-head max logit of its forward passes and describes where each head's rows live in its
weights as :class:`QKClipTarget` s. Helpers build the targets for the common layouts.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
import torch.distributed as dist
from torch import Tensor, nn

from .muon import Muon


@dataclass(frozen=True)
class QKClipTarget:
    """Rows of one tensor that belong to each head, and the power of gamma they take.

    Head h owns rows [offset + h * stride, offset + h * stride + rows). On a clip, they are
    multiplied by gamma_h ** exponent; with a ``shift``, the values they stand for are: a gain
    stored as ``w`` and applied as ``shift + w`` (Gemma's RMSNorm, shift 1) becomes
    ``(shift + w) * factor - shift``.
    """

    tensor: Tensor
    heads: int
    rows: int
    offset: int = 0
    stride: int | None = None  # defaults to rows (heads stacked back to back)
    exponent: float = 0.5
    shift: float = 0.0

    def head_view(self) -> Tensor:
        """[heads, rows, *rest] view into the tensor (no copy), for in-place scaling."""
        t = self.tensor
        stride = self.rows if self.stride is None else self.stride
        if self.offset < 0 or self.heads < 1 or self.rows < 1 or stride < self.rows:
            raise ValueError(
                f"QK-Clip target must have offset >= 0, heads >= 1, rows >= 1 and stride >= rows (heads may "
                f"not overlap); got offset={self.offset}, heads={self.heads}, rows={self.rows}, stride={stride}"
            )
        last_row = self.offset + (self.heads - 1) * stride + self.rows
        if last_row > t.shape[0]:
            raise ValueError(f"QK-Clip target needs {last_row} rows but the tensor has {t.shape[0]}")
        return t.as_strided(
            (self.heads, self.rows, *t.shape[1:]),
            (stride * t.stride(0), *t.stride()),
            t.storage_offset() + self.offset * t.stride(0),
        )


@runtime_checkable
class QKClipSource(Protocol):
    """What an attention module implements to take part in QK-Clip."""

    def qk_max_logits(self) -> Tensor | None:
        """[n_head] signed max of q.k * softmax_scale per head over the forward passes since the
        last reset (fp32, detached); None if there was no forward pass."""

    def reset_qk_max_logits(self) -> None:
        """Forget the recorded maxima (called after each clip)."""

    def qk_clip_targets(self) -> Sequence[QKClipTarget]:
        """Where each head's query/key rows (and biases) live, with the share of gamma each takes."""


def separate_qk_targets(
    q: Tensor,
    k: Tensor,
    n_head: int,
    head_dim: int,
    n_kv_head: int | None = None,
    q_bias: Tensor | None = None,
    k_bias: Tensor | None = None,
) -> list[QKClipTarget]:
    """Separate W_q [n_head*d, in] and W_k [n_kv_head*d, in]. With grouped-query attention
    (n_kv_head < n_head) a key head is shared, so all of gamma goes on the query side."""
    kv = n_head if n_kv_head is None else n_kv_head
    q_share = 0.5 if kv == n_head else 1.0
    targets = [QKClipTarget(t, n_head, head_dim, exponent=q_share) for t in (q, q_bias) if t is not None]
    if kv == n_head:
        targets += [QKClipTarget(t, n_head, head_dim, exponent=0.5) for t in (k, k_bias) if t is not None]
    return targets


def fused_qkv_targets(
    qkv: Tensor, n_head: int, head_dim: int, n_kv_head: int | None = None, bias: Tensor | None = None
) -> list[QKClipTarget]:
    """Fused W_qkv [(n_head + 2 n_kv_head) * d, in] laid out as [Q heads | K heads | V heads]."""
    kv = n_head if n_kv_head is None else n_kv_head
    q_share = 0.5 if kv == n_head else 1.0
    targets = []
    for t in (qkv, bias):
        if t is None:
            continue
        targets.append(QKClipTarget(t, n_head, head_dim, exponent=q_share))
        if kv == n_head:
            targets.append(QKClipTarget(t, n_head, head_dim, offset=n_head * head_dim, exponent=0.5))
    return targets


def mla_targets(
    q_up: Tensor, kv_up: Tensor, n_head: int, qk_nope_dim: int, qk_rope_dim: int, v_head_dim: int
) -> list[QKClipTarget]:
    """The QK-Clip targets of multi-head latent attention (DeepSeek-V3 layout).

    q_up [n_head*(nope+rope), q_rank] holds each head's q^C then q^R rows; kv_up
    [n_head*(nope+v), kv_rank] holds each head's k^C then v rows. q^C and k^C take sqrt(gamma), the
    head's rotary q^R takes gamma, and the shared rotary key k^R is left alone (Kimi K2,
    section 2.1).
    """
    q_stride, kv_stride = qk_nope_dim + qk_rope_dim, qk_nope_dim + v_head_dim
    return [
        QKClipTarget(q_up, n_head, qk_nope_dim, 0, q_stride, 0.5),  # q^C
        QKClipTarget(q_up, n_head, qk_rope_dim, qk_nope_dim, q_stride, 1.0),  # q^R
        QKClipTarget(kv_up, n_head, qk_nope_dim, 0, kv_stride, 0.5),  # k^C
    ]


def qk_clip_sources(model_or_modules: nn.Module | Iterable[Any]) -> list[QKClipSource]:
    """The attention modules of a model (or of an explicit list) that implement QKClipSource."""
    modules = model_or_modules.modules() if isinstance(model_or_modules, nn.Module) else model_or_modules
    return [m for m in modules if isinstance(m, QKClipSource)]


@torch.no_grad()
def qk_clip(sources: Sequence[QKClipSource], tau: float) -> tuple[Tensor, Tensor]:
    """Apply QK-Clip to every source from its recorded max logits, then reset them.

    S_max is a global-batch quantity: when torch.distributed is initialised it is all-reduced
    with MAX first, so every rank applies the same gamma. Returns (heads_clipped, min_gamma)
    as 0-dim tensors (no host sync).
    """
    heads = [source_heads(src) for src in sources]
    maxima = []
    for src, n in zip(sources, heads):
        s = src.qk_max_logits()
        maxima.append(torch.full((n,), float("-inf")) if s is None else s.detach().float().reshape(n))
    if not maxima:
        return torch.tensor(0), torch.tensor(1.0)
    # Sources without a forward give CPU -inf; fall back to the weights' device, since an nccl
    # all-reduce takes CUDA tensors only.
    devices = [m.device for m in maxima] + [t.tensor.device for src in sources for t in src.qk_clip_targets()]
    device = next((d for d in devices if d.type != "cpu"), devices[0])
    s_max = torch.cat([m.to(device) for m in maxima])  # [total heads]
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(s_max, op=dist.ReduceOp.MAX)
    # A non-finite maximum (a diverged forward) is not clipped: gamma = tau / inf would zero the
    # head for good; the trainer's non-finite loss check stops such a run instead.
    clipped = torch.isfinite(s_max) & (s_max > tau)
    gamma = torch.where(clipped, tau / s_max, torch.ones_like(s_max))  # exactly 1.0 where not clipped
    for src, g in zip(sources, gamma.split(heads)):
        for target in src.qk_clip_targets():
            view = target.head_view()  # [heads, rows, ...]
            factor = g.pow(target.exponent).to(device=view.device, dtype=view.dtype)
            factor = factor.view(-1, *([1] * (view.ndim - 1)))
            if target.shift:
                view.add_(target.shift).mul_(factor).sub_(target.shift)
            else:
                view.mul_(factor)
        src.reset_qk_max_logits()
    return clipped.sum(), gamma.min()


def source_heads(src: QKClipSource) -> int:
    """Number of heads a source clips (all of its targets must agree)."""
    counts = {t.heads for t in src.qk_clip_targets()}
    if len(counts) != 1:
        raise ValueError(f"QK-Clip targets of {type(src).__name__} disagree on the head count: {sorted(counts)}")
    return counts.pop()


class MuonClip(Muon):
    """Muon followed, after every step, by QK-Clip of the given attention modules.

    ``attention``: a model (its QKClipSource modules are found) or the modules themselves.
    ``last_step_stats()`` adds ``qk_clip/heads_clipped`` and ``qk_clip/min_gamma``. Every Muon
    keyword passes through (``distributed``, ``process_group``, ``shard_momentum`` included).

    The clip scales each head from the max logit its sources recorded in the step's training
    forward, with the weights before the update (Kimi K2's QK-Clip); ``step(remeasure=...)``
    measures it again after the update instead (docs/optimizer.md, "Re-measured QK-Clip").
    """

    def __init__(self, params, attention: nn.Module | Iterable[Any], qk_clip_tau: float = 100.0, **kwargs) -> None:
        if not (isinstance(qk_clip_tau, (int, float)) and not isinstance(qk_clip_tau, bool) and qk_clip_tau > 0):
            raise ValueError(f"invalid qk_clip_tau: {qk_clip_tau!r} (must be a number > 0)")
        self.qk_clip_tau = float(qk_clip_tau)
        self.qk_sources = qk_clip_sources(attention)
        super().__init__(params, **kwargs)

    @torch.no_grad()
    def step(self, closure=None, remeasure: Callable[[], object] | None = None):
        """The Muon step, then QK-Clip.

        ``remeasure``: a forward of the step's batch (run here, with no grad, between the update and
        the clip) whose recorded max logits the clip uses: each head's maximum on that batch with the
        updated weights, rather than the training forward's with the weights before the update. Every
        head then ends at or below tau on the batch it was measured on, for one more forward per step.
        """
        loss = super().step(closure)
        if remeasure is not None:
            for src in self.qk_sources:
                src.reset_qk_max_logits()
            remeasure()
        heads_clipped, min_gamma = qk_clip(self.qk_sources, self.qk_clip_tau)
        self._last_stats.extra.update({"qk_clip/heads_clipped": heads_clipped, "qk_clip/min_gamma": min_gamma})
        return loss
