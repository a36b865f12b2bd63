"""Per-head orthogonalization: Q and K split by head before Newton–Schulz, against a loop that
orthogonalizes each head's rows alone, on our GPT (fused QKV), a transformers llama (grouped-query
keys) and GPT-2 (its fused c_attn unfused), in fp32; its state and its refusals."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import optim
from optim.normuon import SECOND_MOMENT, normalize_reference
from tests.engine.test_hf_models import build as build_hf
from tests.engine.test_hf_models import hf_config
from tests.engine.test_models import config
from worker.engine.models import build_model

TOL = 1e-6  # max abs difference / max abs value, per tensor
KWARGS = dict(lr=0.02, momentum=0.95, weight_decay=0.01, ns_dtype=torch.float32, normuon_beta2=0.9)


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def build(name: str) -> nn.Module:
    torch.manual_seed(0)
    if name == "gpt":
        return build_model(config("gpt"))
    return build_hf(hf_config(name))


def per_head_groups(model: nn.Module) -> list[dict]:
    return optim.split_by_heads(optim.split_params(model), model.head_blocks())


def reference_step(model: nn.Module, states: dict, blocks: dict, normuon: bool) -> None:
    """Muon (or NorMuon) one parameter at a time: a parameter of ``blocks`` one row block at a
    time, each with its own shape's lr scale; the rest whole."""
    beta, lr, wd = KWARGS["momentum"], KWARGS["lr"], KWARGS["weight_decay"]
    for p in model.parameters():
        if p not in states:
            continue
        state = states[p]
        buf = state.setdefault("momentum", torch.zeros_like(p))
        buf.lerp_(p.grad, 1 - beta)
        U = torch.lerp(p.grad, buf, beta)
        v = state.setdefault("v", torch.zeros(p.shape[0], 1))
        heights = blocks.get(p, (p.shape[0],))
        update, start = torch.empty_like(p), 0
        for h in heights:
            rows = slice(start, start + h)
            O = optim.orthogonalize(U[rows].clone(), 5, "keller", "auto", torch.float32)
            if normuon:
                O = normalize_reference(O, v[rows], KWARGS["normuon_beta2"])
            update[rows] = O * optim.update_scale(h, p.shape[1], "original")
            start += h
        with torch.no_grad():
            p.mul_(1 - lr * wd).sub_(update, alpha=lr)


@pytest.mark.parametrize("normuon", [False, True], ids=["muon", "normuon"])
@pytest.mark.parametrize("name", ["gpt", "llama", "gpt2"])
def test_each_head_is_orthogonalized_alone(name, normuon):
    model, twin = build(name), build(name)
    twin.load_state_dict(model.state_dict())
    blocks = model.head_blocks()
    assert len(blocks) == 2 * (1 if name == "gpt" else 2)  # gpt: one fused W_qkv a layer; hf: W_q and W_k
    opt = optim.Muon(per_head_groups(model), normuon=normuon, **KWARGS)
    split = [g for g in opt.param_groups if g["row_blocks"] is not None]
    heights = {tuple(g["row_blocks"]) for g in split}
    want = {"gpt": {(8,) * 8 + (32,)}, "llama": {(8,) * 4, (8,) * 2}, "gpt2": {(8,) * 4}}[name]
    assert heights == want  # llama: 4 query heads, 2 key heads (grouped-query attention)
    twin_blocks = {q: blocks[p] for p, q in zip(model.parameters(), twin.parameters()) if p in blocks}
    stepped = {id(p) for g in opt.param_groups if g["use_muon"] for p in g["params"]}
    muon = {q for p, q in zip(model.parameters(), twin.parameters()) if id(p) in stepped}
    states: dict = {q: {} for q in muon}
    for step in range(3):
        for i, (p, q) in enumerate(zip(model.parameters(), twin.parameters())):
            p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(100 * step + i))
            q.grad = p.grad.clone()
        opt.step()
        reference_step(twin, states, twin_blocks, normuon)
    for (key, p), q in zip(model.named_parameters(), twin.parameters()):
        if q in muon:
            assert rel_diff(p.detach(), q.detach()) <= TOL, key
            if normuon:
                assert rel_diff(opt.state[p][SECOND_MOMENT].view(-1, 1), states[q]["v"]) <= TOL, key


def test_a_head_update_is_orthogonal_where_the_whole_matrix_update_is_not():
    """One step from zero momentum on W_qkv: per head, each query head's update has its singular
    values in Keller's band; the whole fused matrix's update restricted to a head does not."""
    heads, head_dim, width = 4, 8, 32
    updates = {}
    for mode in ("matrix", "per_head"):
        torch.manual_seed(0)
        w = nn.Parameter(torch.zeros(3 * width, width))
        groups = [
            {"params": [w]} | ({"row_blocks": optim.fused_qkv_blocks(heads, head_dim)} if mode == "per_head" else {})
        ]
        opt = optim.Muon(groups, lr=1.0, nesterov=False, momentum=0.0, ns_dtype=torch.float32)
        w.grad = torch.randn(3 * width, width) * torch.logspace(-1, 1, 3 * width).view(-1, 1)
        opt.step()
        updates[mode] = -w.detach()
    for h in range(2 * heads):  # query and key heads
        rows = slice(h * head_dim, (h + 1) * head_dim)
        s = torch.linalg.svdvals(updates["per_head"][rows])
        assert 0.6 <= float(s.min()) and float(s.max()) <= 1.2, (h, s)
    spread = [torch.linalg.svdvals(updates["matrix"][h * head_dim : (h + 1) * head_dim]) for h in range(2 * heads)]
    assert max(float(s.max() / s.min()) for s in spread) > 2.0  # whole: the heads' scales differ


def test_the_state_keeps_one_second_moment_per_parameter_and_round_trips():
    torch.manual_seed(1)
    w = nn.Parameter(torch.randn(24, 8))
    blocks = (4, 4, 16)
    opt = optim.Muon([{"params": [w], "row_blocks": blocks}], normuon=True, **KWARGS)
    w.grad = torch.randn_like(w)
    opt.step()
    assert opt.state[w][SECOND_MOMENT].shape == (1, 24, 1)
    saved = opt.state_dict()
    assert saved["param_groups"][0]["row_blocks"] == blocks
    again = optim.Muon([{"params": [w], "row_blocks": blocks}], **KWARGS)
    again.load_state_dict(saved)
    assert torch.equal(again.state[w][SECOND_MOMENT], opt.state[w][SECOND_MOMENT])
    w.grad = torch.randn_like(w)
    before = again.state[w][SECOND_MOMENT].clone()
    again.step()
    assert not torch.equal(again.state[w][SECOND_MOMENT], before)  # each block's view writes the one buffer


@pytest.mark.parametrize(
    ("group", "needle"),
    [
        ({"row_blocks": (4, 4)}, r"row_blocks \[4, 4\] must cut"),  # 8 rows of 12
        ({"row_blocks": (4, 8), "experts": True}, "must cut"),
        ({"row_blocks": ()}, "row_blocks"),
        ({"row_blocks": (4, 0, 8)}, "row_blocks"),
        ({"row_blocks": (4.0, 8)}, "row_blocks"),
    ],
)
def test_row_blocks_that_do_not_cut_the_rows_are_refused(group, needle):
    p = nn.Parameter(torch.randn(12, 6) if not group.get("experts") else torch.randn(2, 12, 6))
    with pytest.raises(ValueError, match=needle):
        optim.Muon([{"params": [p], **group}])


def test_split_by_heads_moves_only_muon_matrices_and_keeps_their_options():
    model = build("gpt")
    groups = optim.split_params(model)
    groups[0]["lr"] = 0.5
    out = optim.split_by_heads(groups, model.head_blocks())
    qkv = [b.attn.qkv.weight for b in model.blocks]
    split = [g for g in out if "row_blocks" in g]
    assert len(split) == 1 and [id(p) for p in split[0]["params"]] == [id(p) for p in qkv] and split[0]["lr"] == 0.5
    assert sum(len(g["params"]) for g in out) == sum(len(g["params"]) for g in groups)
    whole = {id(p) for g in out if "row_blocks" not in g for p in g["params"]}
    assert not whole & {id(p) for p in qkv}
