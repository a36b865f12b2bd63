"""Mixture-of-experts feed-forward: top-k routing over experts stored as [E, out, in]."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def top_k_routing(router_logits: Tensor, top_k: int) -> tuple[Tensor, Tensor, Tensor]:
    """Choose each token's experts. router_logits: [N, E].

    Returns (probs [N, E] softmax over all experts, experts [N, k] chosen ids by decreasing
    probability, weights [N, k] their probabilities renormalised to sum to 1).
    """
    probs = F.softmax(router_logits.float(), dim=-1)
    weights, experts = probs.topk(top_k, dim=-1)
    return probs, experts, weights / weights.sum(dim=-1, keepdim=True)


def load_balancing_loss(probs: Tensor, experts: Tensor, n_experts: int) -> tuple[Tensor, Tensor]:
    """Switch Transformer auxiliary loss (arXiv 2101.03961, eq. 4) generalised to top-k.

    E * sum_e f_e * P_e, with f_e the share of routing slots taken by expert e and P_e its mean
    router probability. It is 1 when load and probability are uniform. Returns (loss, f).
    """
    load = torch.bincount(experts.flatten(), minlength=n_experts).float() / experts.numel()  # [E]
    return n_experts * (load * probs.mean(dim=0)).sum(), load


class MoEFeedForward(nn.Module):
    """E experts (GELU MLPs), each token routed to its top_k; expert weights [E, out, in].

    ``muon_param_roles`` marks the expert weights so Muon orthogonalizes each expert
    separately, and keeps the router (a tiny gating layer) on AdamW. After each forward,
    ``aux_loss`` holds the load-balancing loss and ``last_load`` the expert load shares.
    """

    def __init__(self, d_model: int, n_experts: int, top_k: int, hidden: int) -> None:
        super().__init__()
        self.n_experts, self.top_k = n_experts, top_k
        self.router = nn.Parameter(torch.empty(n_experts, d_model))  # [E, C]
        self.w_in = nn.Parameter(torch.empty(n_experts, hidden, d_model))
        self.w_out = nn.Parameter(torch.empty(n_experts, d_model, hidden))
        nn.init.normal_(self.router, std=0.02)
        nn.init.normal_(self.w_in, std=0.02)
        nn.init.normal_(self.w_out, std=0.02)
        self.aux_loss: Tensor | None = None
        self.last_load: Tensor | None = None
        self.last_probs_entropy: Tensor | None = None

    def routing_stats(self) -> tuple[Tensor, Tensor, Tensor]:
        """The latest forward's load-balancing loss (detached), expert load shares and routing entropy."""
        if self.aux_loss is None or self.last_load is None or self.last_probs_entropy is None:
            raise RuntimeError("a MoE layer's routing statistics are read before its first forward")
        return self.aux_loss.detach(), self.last_load, self.last_probs_entropy

    def muon_param_roles(self) -> dict[str, str]:
        return {"w_in": "experts", "w_out": "experts", "router": "adamw"}

    def forward(self, x: Tensor) -> Tensor:
        B, T, C = x.shape
        tokens = x.reshape(-1, C)  # [N, C]
        probs, experts, weights = top_k_routing(tokens @ self.router.T, self.top_k)  # [N, E], [N, k], [N, k]
        self.aux_loss, load = load_balancing_loss(probs, experts, self.n_experts)
        self.last_load = load.detach()
        self.last_probs_entropy = -(probs * probs.clamp_min(1e-9).log()).sum(-1).mean().detach()
        out = torch.zeros_like(tokens)
        for e in range(self.n_experts):
            token_idx, slot = (experts == e).nonzero(as_tuple=True)  # tokens routed to expert e
            if token_idx.numel() == 0:
                continue
            h = F.gelu(tokens[token_idx] @ self.w_in[e].T)  # [n_e, hidden]
            y = h @ self.w_out[e].T  # [n_e, C]
            # Under autocast y is bf16 while out follows the (fp32) norm output: index_add_ needs one dtype.
            out.index_add_(0, token_idx, (y * weights[token_idx, slot].unsqueeze(-1)).to(out.dtype))
        return out.view(B, T, C)
