"""NorMuon: the batched normalization against the paper's steps, and the optimizer's step on our GPT,
our MoE and a transformers llama against a loop of the reference, matrix by matrix, in fp32."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import optim
from optim.normuon import SECOND_MOMENT, normalize_batch, normalize_reference, second_moment
from tests.engine.test_hf_models import build as build_hf
from tests.engine.test_hf_models import hf_config
from tests.engine.test_models import config
from worker.engine.models import build_model

TOL = 1e-6  # max abs difference / max abs value, per tensor
STEPS = 3
KWARGS = dict(lr=0.02, momentum=0.95, weight_decay=0.01, ns_dtype=torch.float32, normuon_beta2=0.9)


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def test_the_batch_normalization_equals_the_reference_matrix_by_matrix():
    """Entries of 1 and 2 matrices in one batch, over steps (v carries over), rows of unequal
    scale (what NorMuon evens out), wide and tall shapes."""
    gen = torch.Generator().manual_seed(0)
    for rows, cols in [(32, 48), (48, 32), (8, 8)]:
        counts = [1, 2, 1]
        moments = [torch.zeros(k, rows, 1) for k in counts]
        references = [m.clone() for m in moments]
        row_scale = torch.logspace(-2, 1, rows).view(rows, 1)
        for _ in range(4):
            O = torch.randn(sum(counts), rows, cols, generator=gen) * row_scale
            want = torch.cat(
                [normalize_reference(O[i], references[e][j], 0.9) for e, i, j in matrices_of(counts)]
            ).view_as(O)
            got = O.clone()
            spread = normalize_batch(got, moments, 0.9)
            assert rel_diff(got, want) <= TOL
            factors = (want / O).mean(dim=-1)  # each row's scale, the same along the row
            assert torch.allclose(spread, factors.amax(dim=1) / factors.amin(dim=1), rtol=1e-5)
            for m, r in zip(moments, references):
                assert rel_diff(m, r) <= TOL
            assert torch.allclose(got.norm(dim=(1, 2)), O.norm(dim=(1, 2)), rtol=1e-5)  # the norm is kept
        spread = got.pow(2).mean(dim=-1)  # after a few steps each row's mean square is about even
        assert float(spread.max() / spread.min()) < float(O.pow(2).mean(dim=-1).max() / O.pow(2).mean(dim=-1).min())


def matrices_of(counts: list[int]) -> list[tuple[int, int, int]]:
    """(entry, batch index, index within the entry) of every matrix of a batch, in order."""
    out, i = [], 0
    for e, k in enumerate(counts):
        for j in range(k):
            out.append((e, i, j))
            i += 1
    return out


def test_a_non_finite_matrix_leaves_its_second_moment_alone():
    O = torch.ones(2, 4, 4)
    O[1, 0, 0] = float("inf")
    moments = [torch.full((1, 4, 1), 0.5), torch.full((1, 4, 1), 0.5)]
    normalize_batch(O, moments, 0.9)
    assert torch.equal(moments[1], torch.full((1, 4, 1), 0.5)) and not torch.equal(moments[0], moments[1])


def reference_step(model: nn.Module, states: dict, group: dict, lr: float, wd: float) -> None:
    """NorMuon on one parameter at a time, each matrix orthogonalized alone, then normalize_reference."""
    beta, beta2 = group["momentum"], group["normuon_beta2"]
    for p in group["params"]:
        state = states.setdefault(p, {})
        buf = state.setdefault("momentum", torch.zeros_like(p))
        buf.lerp_(p.grad, 1 - beta)
        U = torch.lerp(p.grad, buf, beta)
        matrices = optim.as_matrices(U, group["experts"])
        v = state.setdefault("v", second_moment(matrices))
        rows, cols = matrices.shape[-2:]
        scale = optim.update_scale(rows, cols, group["adjust_lr"])
        updates = []
        for i in range(matrices.shape[0]):
            O = optim.orthogonalize(matrices[i : i + 1].clone(), 5, "keller", "auto", torch.float32)[0]
            updates.append(normalize_reference(O, v[i], beta2))
        with torch.no_grad():
            p.mul_(1 - lr * wd).add_(torch.stack(updates).reshape(p.shape), alpha=-lr * scale)


def models() -> dict[str, nn.Module]:
    torch.manual_seed(0)
    return {
        "gpt": build_model(config("gpt")),
        "moe": build_model(config("moe")),
        "llama": build_hf(hf_config("llama")),
    }


@pytest.mark.parametrize("name", ["gpt", "moe", "llama"])
def test_the_step_equals_the_reference_on_gpt_moe_and_a_llama(name):
    model = models()[name]
    twin = build_hf(hf_config("llama")) if name == "llama" else models()[name]
    twin.load_state_dict(model.state_dict())
    opt = optim.Muon(optim.split_params(model), normuon=True, **KWARGS)
    groups = [g for g in optim.Muon(optim.split_params(twin), normuon=True, **KWARGS).param_groups if g["use_muon"]]
    assert any(g["experts"] for g in groups) == (name == "moe")
    states: dict = {}
    for step in range(STEPS):
        for i, (p, q) in enumerate(zip(model.parameters(), twin.parameters())):
            p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(100 * step + i))
            q.grad = p.grad.clone()
        opt.step()
        for group in groups:
            reference_step(twin, states, group, KWARGS["lr"], KWARGS["weight_decay"])
    muon = {id(p) for g in opt.param_groups if g["use_muon"] for p in g["params"]}
    compared = 0
    for (key, p), q in zip(model.named_parameters(), twin.parameters()):
        if id(p) in muon:
            assert rel_diff(p.detach(), q.detach()) <= TOL, key
            assert rel_diff(opt.state[p][SECOND_MOMENT], states[q]["v"]) <= TOL, key
            compared += 1
    assert compared >= 4
    spread = opt.last_step_stats()["normuon/scale_spread"]
    assert spread > 1.0 and spread == pytest.approx(mean_spread(opt), rel=1e-5)


def mean_spread(opt: optim.Muon) -> float:
    """The mean over the Muon matrices of max / min of the latest step's row scales, recomputed:
    a row's scale is 1 / (sqrt(v) + eps) times the norm-keeping factor, so max / min is that of v."""
    ratios = []
    for group in opt.param_groups:
        for p in group["params"] if group["use_muon"] else []:
            scale = 1.0 / (opt.state[p][SECOND_MOMENT].sqrt() + 1e-10)
            ratios += (scale.amax(dim=1) / scale.amin(dim=1)).view(-1).tolist()
    return sum(ratios) / len(ratios)


def test_the_state_holds_the_second_moment_and_round_trips():
    torch.manual_seed(1)
    ps = [nn.Parameter(torch.randn(16, 8)), nn.Parameter(torch.randn(4, 8, 6))]
    groups = [{"params": [ps[0]]}, {"params": [ps[1]], "experts": True}]
    opt = optim.Muon(groups, normuon=True, **KWARGS)
    for p in ps:
        p.grad = torch.randn_like(p)
    opt.step()
    assert opt.state[ps[0]][SECOND_MOMENT].shape == (1, 16, 1)
    assert opt.state[ps[1]][SECOND_MOMENT].shape == (4, 8, 1)
    saved = opt.state_dict()
    again = optim.Muon([{"params": [ps[0]]}, {"params": [ps[1]], "experts": True}], **KWARGS)
    again.load_state_dict(saved)
    assert again.param_groups[0]["normuon"] and again.param_groups[0]["normuon_beta2"] == 0.9
    assert torch.equal(again.state[ps[0]][SECOND_MOMENT], opt.state[ps[0]][SECOND_MOMENT])


def test_bad_normuon_values_are_refused():
    p = nn.Parameter(torch.randn(4, 4))
    for kwargs, needle in [({"normuon": 1}, "normuon"), ({"normuon_beta2": 1.0}, "normuon_beta2")]:
        with pytest.raises(ValueError, match=needle):
            optim.Muon([p], **kwargs)
