"""Cautious weight decay: the decay lands only where the update and the weight agree in sign, on
Muon's matrices (fp32 and bf16 updates) and on AdamW's parameters alike."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from optim import Muon


def params(seed: int = 0) -> list[nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    shapes = [(48, 32), (32, 32), (4, 16, 8), (32,), (20, 8)]
    ps = [nn.Parameter(torch.randn(shape, generator=gen)) for shape in shapes]
    for p in ps:
        p.grad = torch.randn(p.shape, generator=gen)
    return ps


def groups(ps: list[nn.Parameter]) -> list[dict]:
    return [{"params": ps[:2]}, {"params": [ps[2]], "experts": True}, {"params": ps[3:], "use_muon": False}]


@pytest.mark.parametrize("ns_dtype", [torch.float32, torch.bfloat16])
def test_cautious_decay_only_where_update_and_weight_agree(ns_dtype):
    lr, wd = 0.05, 0.2
    kwargs = dict(lr=lr, adamw_lr=lr, ns_dtype=ns_dtype)
    start, plain, cautious = params(), params(), params()
    Muon(groups(plain), **kwargs).step()  # no decay: W1 = W0 - lr u, u the update
    Muon(groups(cautious), weight_decay=wd, adamw_weight_decay=wd, weight_decay_mode="cautious", **kwargs).step()
    for w0, w1, got in zip(start, plain, cautious):
        step = (w1 - w0).detach()
        agree = step * w0 < 0  # W moves toward zero: the update and W agree in sign
        want = w0.detach() * torch.where(agree, 1 - lr * wd, 1.0) + step
        assert torch.allclose(got.detach(), want, rtol=0, atol=1e-6)
        assert 0.2 < float(agree.float().mean()) < 0.8  # both cases occur


def test_decoupled_decay_is_unchanged_and_modes_are_checked():
    a, b = params(), params()
    Muon(groups(a), weight_decay=0.1, adamw_weight_decay=0.1, ns_dtype=torch.float32).step()
    decay = dict(weight_decay=0.1, adamw_weight_decay=0.1, weight_decay_mode="decoupled")
    opt = Muon(groups(b), **decay, ns_dtype=torch.float32)
    opt.step()
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert all(g["weight_decay_mode"] == "decoupled" for g in opt.param_groups)
    with pytest.raises(ValueError, match="weight_decay_mode"):
        Muon(groups(params()), weight_decay_mode="sometimes")
