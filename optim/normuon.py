"""NorMuon (Li et al., arXiv 2510.05491): Muon's orthogonalized update with each neuron's second
moment normalized away, the update's Frobenius norm kept.

Per matrix, O [rows, cols] is the orthogonalized momentum (one row per output neuron) and v
[rows, 1] the neuron's second-moment EMA (state, zero at first, no bias correction, as the paper's
reference):

    v <- beta2 v + (1 - beta2) mean_cols(O * O)
    N  = O / (sqrt(v) + eps)                       (row by row)
    N <- N ||O||_F / (||N||_F + eps)

N then takes Muon's place: its lr scale from the shape (adjust_lr), the lr, the decoupled weight
decay. :func:`normalize_reference` is that, one matrix at a time; :func:`normalize_batch` is the
step's path, a batch of matrices at once, equal to it (tests/optim/test_normuon.py).
"""

from __future__ import annotations

import torch
from torch import Tensor

EPS = 1e-10  # the paper's reference: on the root of v, and on the normalized update's norm
SECOND_MOMENT = "second_moment"  # the state key of a parameter's v, [k, rows, 1] in fp32
SCALE_SPREAD = "normuon/scale_spread"  # telemetry: the step's mean, over matrices, of max / min row scale


def normalize_reference(O: Tensor, v: Tensor, beta2: float) -> Tensor:
    """One matrix's NorMuon update from its orthogonalized ``O`` [rows, cols], in fp32, its
    second moment ``v`` [rows, 1] updated in place: the paper's steps one by one."""
    O = O.float()
    norm = O.norm()
    v.lerp_((O * O).mean(dim=-1, keepdim=True), 1.0 - beta2)
    N = O / (v.sqrt() + EPS)
    return N * (norm / (N.norm() + EPS))


def normalize_batch(O: Tensor, moments: list[Tensor], beta2: float) -> Tensor:
    """NorMuon's normalization of a batch ``O`` [B, rows, cols] in place; ``moments``: the batch's
    second-moment buffers in order, each [k, rows, 1] in fp32 (k matrices of the batch), updated.
    Returns each matrix's scale spread [B]: its largest row scale over its smallest (1: NorMuon
    changed nothing but the norm; telemetry's ``normuon/scale_spread``, SCALE_SPREAD).

    One pass reads O (each row's mean square, summed in fp32) and one scales it: both Frobenius
    norms come from the row means (||O||^2 = cols sum_r m_r, ||N||^2 = cols sum_r s_r^2 m_r for
    the row scales s). A matrix whose update is not finite leaves its v unchanged (the step then
    skips its update).
    """
    cols = O.shape[-1]
    mean_sq = torch.linalg.vector_norm(O, dim=-1, keepdim=True, dtype=torch.float32).square_().div_(cols)
    finite = mean_sq.isfinite().all(dim=1, keepdim=True)  # [B, 1, 1]
    counts = [m.shape[0] for m in moments]
    olds = torch.cat(moments)
    torch._foreach_lerp_(moments, list(torch.where(finite, mean_sq, olds).split(counts)), 1.0 - beta2)
    scale = torch.cat(moments).sqrt_().add_(EPS).reciprocal_()  # [B, rows, 1]
    before = mean_sq.sum(dim=1, keepdim=True)  # ||O||^2 / cols
    after = (scale.square() * mean_sq).sum(dim=1, keepdim=True)  # ||N||^2 / cols
    scale.mul_(before.sqrt_().div_(after.sqrt_().add_(EPS / cols**0.5)))
    O.mul_(scale.to(O.dtype))
    return (scale.amax(dim=1) / scale.amin(dim=1)).view(-1)


def second_moment(matrices: Tensor) -> Tensor:
    """A new second-moment buffer for a parameter viewed as ``matrices`` [k, rows, cols]."""
    return torch.zeros(*matrices.shape[:-1], 1, dtype=torch.float32, device=matrices.device)
