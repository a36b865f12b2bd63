"""The AdamW update used for the non-matrix parameters inside Muon (pure function, foreach)."""

from __future__ import annotations

import torch
from torch import Tensor


def adamw_update(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    steps: list[Tensor],
    *,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
    cautious: bool = False,
) -> None:
    """One bias-corrected AdamW step with decoupled weight decay (Loshchilov & Hutter), in place.

    ``steps`` are per-parameter 0-dim float tensors (the torch.optim layout), incremented here.
    Matches torch.optim.AdamW (amsgrad off) to rounding. ``cautious``: the decay only where the
    update (the sign of the new first moment) and the weight agree in sign (arXiv 2510.12402).
    """
    if not params:
        return
    beta1, beta2 = betas
    torch._foreach_add_(steps, 1.0)
    torch._foreach_lerp_(exp_avgs, grads, 1.0 - beta1)
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1.0 - beta2)
    if weight_decay != 0.0 and cautious:
        for p, m in zip(params, exp_avgs):  # the update is m / (sqrt(v) + eps), scaled: m's sign
            p.sub_(p * (m * p > 0), alpha=lr * weight_decay)
    elif weight_decay != 0.0:
        torch._foreach_mul_(params, 1.0 - lr * weight_decay)
    step_sizes, bias2_roots = [], []
    for step in steps:
        t = float(step)
        step_sizes.append(-lr / (1.0 - beta1**t))
        bias2_roots.append((1.0 - beta2**t) ** 0.5)
    denom = torch._foreach_sqrt(exp_avg_sqs)
    torch._foreach_div_(denom, bias2_roots)
    torch._foreach_add_(denom, eps)
    torch._foreach_addcdiv_(params, exp_avgs, denom, step_sizes)
