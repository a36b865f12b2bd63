"""split_params: routing by role (OPTIMIZER.md defect 7: ndim alone sends embeddings to Muon)."""

import pytest
import torch
from torch import nn

from optim import Muon, routes, routing, split_params


class Experts(nn.Module):
    """An MoE feed-forward whose [E, out, in] weights declare themselves as experts."""

    def __init__(self, n_experts=4, d=16, hidden=32):
        super().__init__()
        self.router = nn.Linear(d, n_experts, bias=False)
        self.w_in = nn.Parameter(torch.randn(n_experts, hidden, d))
        self.w_out = nn.Parameter(torch.randn(n_experts, d, hidden))

    def muon_param_roles(self):
        return {"w_in": "experts", "w_out": "experts"}


class TinyLM(nn.Module):
    def __init__(self, vocab=50, d=16, tied=True):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(8, d)
        self.ln = nn.LayerNorm(d)
        self.attn = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d, bias=False)
        self.conv = nn.Conv1d(d, d, 3)
        self.moe = Experts(d=d)
        self.gain = nn.Parameter(torch.ones(()))
        self.lm_head = nn.Linear(d, vocab, bias=False)
        if tied:
            self.lm_head.weight = self.wte.weight


def groups_by_role(groups):
    out = {}
    for g in groups:
        role = "adamw" if not g["use_muon"] else ("experts" if g.get("experts") else "muon")
        out[role] = {id(p) for p in g["params"]}
    return out


@pytest.mark.parametrize("tied", [True, False])
def test_roles_of_a_language_model(tied):
    m = TinyLM(tied=tied)
    roles = groups_by_role(split_params(m))
    assert roles["muon"] == {id(m.attn.weight), id(m.proj.weight), id(m.conv.weight), id(m.moe.router.weight)}
    assert roles["experts"] == {id(m.moe.w_in), id(m.moe.w_out)}
    adamw = {m.wte.weight, m.wpe.weight, m.ln.weight, m.ln.bias, m.attn.bias, m.conv.bias, m.gain, m.lm_head.weight}
    assert roles["adamw"] == {id(p) for p in adamw}


def test_every_parameter_lands_in_exactly_one_group_and_steps():
    m = TinyLM()
    groups = split_params(m)
    routed = [p for g in groups for p in g["params"]]
    assert len(routed) == len({id(p) for p in routed}) == len(list(m.parameters()))
    for p in m.parameters():
        p.grad = torch.randn_like(p)
    Muon(groups).step()  # accepted as param groups: shapes fit their optimizer


def test_mlp_without_embeddings_keeps_its_last_linear_on_adamw():
    m = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 10))
    roles = groups_by_role(split_params(m))
    assert roles["muon"] == {id(m[0].weight), id(m[2].weight)}
    assert id(m[4].weight) in roles["adamw"]


def test_explicit_output_head_and_declared_roles_win():
    m = TinyLM(tied=False)
    roles = groups_by_role(split_params(m, output_head=m.proj))
    assert id(m.proj.weight) in roles["adamw"]


def test_unknown_declared_role_is_an_error():
    m = TinyLM()
    m.moe.muon_param_roles = lambda: {"w_in": "sgd"}
    with pytest.raises(ValueError, match="sgd"):
        split_params(m)


@pytest.mark.parametrize("tied", [True, False])
def test_routes_name_every_parameter_once_with_the_rule_that_placed_it(tied):
    m = TinyLM(tied=tied)
    m.table = nn.Parameter(torch.zeros(4, 16))  # a matrix no rule knows the role of
    table = {r.name: r for r in routes(m)}
    assert set(table) == {n for n, _ in m.named_parameters()}  # a tied weight once, under its first name
    expect = {
        "wte.weight": ("adamw", routing.TABLE),
        "attn.weight": ("muon", routing.MATRIX),
        "attn.bias": ("adamw", routing.VECTOR),
        "conv.weight": ("muon", routing.MATRIX),
        "moe.w_in": ("experts", routing.DECLARED),
        "moe.router.weight": ("muon", routing.MATRIX),
        "gain": ("adamw", routing.VECTOR),
        "table": ("adamw", routing.UNRECOGNIZED),
    }
    if not tied:
        expect["lm_head.weight"] = ("adamw", routing.HEAD)
    assert {name: (table[name].group, table[name].reason) for name in expect} == expect
    assert table["table"].shape == (4, 16)
    groups = groups_by_role(split_params(m))  # the groups are the table's
    for name, p in m.named_parameters():
        assert id(p) in groups[table[name].group], name


def test_a_run_logs_the_routing_and_warns_of_a_matrix_no_rule_knows(tmp_path):
    from tests.engine.test_trainer import ListSink, spec, trainer

    sink = ListSink()
    t = trainer(spec("gpt", "muon", steps=2), tmp_path, sink)
    t.model.register_parameter("extra", nn.Parameter(torch.zeros(3, 5)))  # not in any Linear or norm
    t.optimizer.add_param_group({"params": [t.model.extra], "use_muon": False})
    t.run()
    info = [m for level, m in sink.logs if m.startswith("parameters:")]
    # 2 layers of 4 matrices 16 x 16 (q, k, v fused: 48 x 16) and 4 x 16 x 16 feed-forwards; the
    # tied embedding, the positions, 5 LayerNorms (weight and bias) and the extra matrix.
    assert info == [
        "parameters: Muon takes 8 (6,144 values: hidden matrix 8); "
        "AdamW takes 13 (1,455 values: embedding or norm 12, matrix of an unrecognized module 1)"
    ]
    warning = "parameter extra [3x5] is a matrix of an unrecognized module: AdamW takes it, not Muon"
    assert ("warning", warning) in sink.logs
