"""Models: shapes, MoE routing and load balancing, exact max logits, QK-Clip on the real attention."""

import math

import pytest
import torch

import optim
from worker.engine.config import ModelConfig
from worker.engine.models import GPT, build_model, causal_max_logits, load_balancing_loss, top_k_routing


def config(arch: str, **kw) -> ModelConfig:
    moe = {"n_experts": 4, "top_k": 2} if arch == "moe" else {}
    return ModelConfig(arch=arch, n_layer=2, n_head=4, d_model=32, seq_len=16, vocab_size=50, **moe, **kw)


@pytest.mark.parametrize("arch", ["gpt", "moe", "mlp"])
def test_forward_backward_shapes(arch):
    torch.manual_seed(0)
    model = build_model(config(arch))
    idx = torch.randint(0, 50, (3, 16))
    logits = model(idx)
    assert logits.shape == (3, 16, 50)
    logits.logsumexp(-1).mean().backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.shape == p.shape, name
    aux = model.aux_loss()
    assert (aux is not None) == (arch == "moe")


@pytest.mark.parametrize("arch", ["gpt", "moe"])
def test_forward_backward_under_bf16_autocast(arch):
    # bf16 autocast is the default on CUDA: matmul outputs are bf16, norm outputs stay fp32.
    torch.manual_seed(0)
    model = build_model(config(arch)).train()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(torch.randint(0, 50, (3, 16)))
    assert logits.shape == (3, 16, 50) and torch.isfinite(logits).all()
    logits.float().logsumexp(-1).mean().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


def test_models_are_causal():
    torch.manual_seed(0)
    for arch in ("gpt", "moe", "mlp"):
        model = build_model(config(arch)).eval()
        idx = torch.randint(0, 50, (1, 16))
        changed = idx.clone()
        changed[0, 10:] = (changed[0, 10:] + 1) % 50
        assert torch.allclose(model(idx)[0, :10], model(changed)[0, :10], atol=1e-5), arch


def test_top_k_routing_equals_brute_force():
    torch.manual_seed(0)
    logits = torch.randn(64, 6)
    probs, experts, weights = top_k_routing(logits, 2)
    for n in range(64):
        p = torch.softmax(logits[n], -1)
        best = sorted(range(6), key=lambda e: -p[e].item())[:2]
        assert experts[n].tolist() == best
        assert torch.allclose(weights[n], p[best] / p[best].sum())
    assert torch.allclose(probs.sum(-1), torch.ones(64))


def test_load_balancing_loss_is_one_when_uniform_and_higher_when_skewed():
    n, E = 1000, 4
    uniform_probs = torch.full((n, E), 1 / E)
    experts = torch.arange(n * 2).remainder(E).view(n, 2)
    loss, load = load_balancing_loss(uniform_probs, experts, E)
    assert loss.item() == pytest.approx(1.0) and torch.allclose(load, torch.full((E,), 0.25))
    skewed = torch.tensor([[0.7, 0.1, 0.1, 0.1]]).expand(n, E)
    loss, _ = load_balancing_loss(skewed, torch.zeros(n, 2, dtype=torch.long), E)
    assert loss.item() == pytest.approx(4 * 0.7)


def test_load_balancing_evens_out_expert_load():
    """With the auxiliary loss, a router that starts collapsed onto one expert spreads out."""
    torch.manual_seed(0)
    cfg = config("moe", router_aux_weight=1.0)
    model = build_model(cfg)
    moe = model.moe_layers()[0]
    with torch.no_grad():
        for m in model.moe_layers():
            m.router.zero_()
            m.router[0] += 0.5  # every token prefers expert 0
    x = torch.randn(8, 16, 32)
    imbalance = []
    opt = torch.optim.Adam([m.router for m in model.moe_layers()], lr=0.05)
    for _ in range(60):
        moe(x)
        opt.zero_grad()
        moe.aux_loss.backward()
        opt.step()
        imbalance.append(moe.last_load.max().item() * 4)
    assert imbalance[0] > 1.9  # top-2 of 4 with expert 0 always chosen: its share is 0.5
    assert imbalance[-1] < 1.2


def test_split_params_marks_expert_weights():
    model = build_model(config("moe"))
    groups = optim.split_params(model)
    experts = next(g for g in groups if g.get("experts"))
    names = {n for n, p in model.named_parameters() if any(p is q for q in experts["params"])}
    assert names == {f"blocks.{i}.ffn.{w}" for i in range(2) for w in ("w_in", "w_out")}
    adamw = next(g for g in groups if not g["use_muon"])
    assert any(p is model.wte.weight for p in adamw["params"])
    assert all(any(p is q for q in adamw["params"]) for m in model.moe_layers() for p in [m.router])


def brute_force_max_logits(model: GPT, idx: torch.Tensor) -> torch.Tensor:
    """[L, H] max over batch and causal pairs of q.k / sqrt(d), recomputed by explicit loops."""
    out = []
    x = model.wte(idx) + model.wpe(torch.arange(idx.shape[1]))
    for block in model.blocks:
        a = block.attn
        h = block.ln_1(x)
        q, k, _ = a.qkv(h).split(h.shape[-1], dim=2)
        B, T, _C = q.shape
        best = torch.full((a.n_head,), -math.inf)
        for head in range(a.n_head):
            sl = slice(head * a.head_dim, (head + 1) * a.head_dim)
            for b in range(B):
                for i in range(T):
                    scores = (q[b, i, sl] * k[b, : i + 1, sl]).sum(-1) / math.sqrt(a.head_dim)
                    best[head] = max(best[head], scores.max())
        out.append(best)
        x = block(x)
    return torch.stack(out)


@torch.no_grad()
def test_captured_max_logits_equal_brute_force():
    torch.manual_seed(0)
    model = build_model(config("gpt")).train()
    idx = torch.randint(0, 50, (2, 16))
    model(idx)
    captured = torch.stack([layer.qk_max_logits() for layer in model.attention_layers()])
    assert torch.allclose(captured, brute_force_max_logits(model, idx), atol=1e-5)


@torch.no_grad()
def test_blockwise_max_logits_equal_full():
    torch.manual_seed(0)
    q, k = torch.randn(2, 3, 40, 8), torch.randn(2, 3, 40, 8)
    full = causal_max_logits(q, k, block=1000)
    assert torch.equal(causal_max_logits(q, k, block=7), full)
    s = (q @ k.mT) / math.sqrt(8)
    s = s.masked_fill(~torch.ones(40, 40, dtype=torch.bool).tril(), -math.inf)
    assert torch.allclose(full, s.amax(dim=(0, 2, 3)))


@torch.no_grad()
@pytest.mark.parametrize("autocast", [False, True])
def test_max_logits_of_bf16_q_and_k_are_exact(autocast):
    # Under bf16 autocast (the CUDA default) q and k are bf16; a bf16 product would round the
    # logits near 100 by up to 0.25, and QK-Clip would leave heads above tau.
    torch.manual_seed(0)
    q, k = (torch.randn(2, 3, 40, 16) * 6.0).bfloat16(), (torch.randn(2, 3, 40, 16) * 6.0).bfloat16()
    s = (q.double() @ k.double().mT) / 4.0
    exact = s.masked_fill(~torch.ones(40, 40, dtype=torch.bool).tril(), -math.inf).amax(dim=(0, 2, 3))
    assert exact.min() > 50
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        got = causal_max_logits(q, k, block=16)
    assert got.dtype == torch.float32
    assert torch.allclose(got.double(), exact, rtol=1e-6, atol=0)


@torch.no_grad()
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_max_logits_on_cuda_are_exact(dtype):
    # On CUDA 16-bit q and k are multiplied on tensor cores into fp32: exact products, fp32 sums.
    # Later keys are made large, so a mask that leaked would raise the maxima.
    torch.manual_seed(0)
    q, k = torch.randn(2, 3, 600, 64) * 3.0, torch.randn(2, 3, 600, 64) * 3.0
    k[:, :, 300:] *= torch.linspace(1.0, 4.0, 300).view(-1, 1)
    q, k = q.to(dtype), k.to(dtype)
    s = (q.double() @ k.double().mT) / 8.0
    exact = s.masked_fill(~torch.ones(600, 600, dtype=torch.bool).tril(), -math.inf).amax(dim=(0, 2, 3))
    assert (s.amax(dim=(0, 2, 3)) > exact).all()  # the mask matters in every head
    got = causal_max_logits(q.cuda(), k.cuda(), block=256).cpu()
    assert got.dtype == torch.float32
    assert torch.allclose(got.double(), exact, rtol=1e-5, atol=0)


@torch.no_grad()
def test_max_logits_not_recorded_in_eval_and_reset_works():
    model = build_model(config("gpt")).eval()
    model(torch.randint(0, 50, (1, 16)))
    assert all(layer.qk_max_logits() is None for layer in model.attention_layers())
    model.train()
    model(torch.randint(0, 50, (1, 16)))
    layer = model.attention_layers()[0]
    assert layer.qk_max_logits() is not None
    layer.reset_qk_max_logits()
    assert layer.qk_max_logits() is None


@torch.no_grad()
def test_qk_clip_alone_brings_recomputed_max_logit_to_tau():
    torch.manual_seed(0)
    model = build_model(config("gpt")).train()
    idx = torch.randint(0, 50, (2, 16))
    with torch.no_grad():
        for layer in model.attention_layers():
            layer.qkv.weight[: 2 * 32].mul_(6.0)  # q and k rows: logits x36
    model(idx)
    before = torch.stack([layer.qk_max_logits() for layer in model.attention_layers()])
    tau = before.min().item() + 0.5 * (before.max() - before.min()).item()
    heads_clipped, min_gamma = optim.qk_clip(model.attention_layers(), tau)
    assert heads_clipped.item() == int((before > tau).sum())
    assert min_gamma.item() == pytest.approx(tau / before.max().item(), rel=1e-6)
    after = brute_force_max_logits(model, idx)
    # Only the first layer's inputs are unchanged by clipping; compare it exactly, the rest by bound.
    expected_first = torch.where(before[0] > tau, torch.full_like(before[0], tau), before[0])
    assert torch.allclose(after[0], expected_first, atol=1e-4)
