"""Muon: OPTIMIZER.md rows T5, T7-T11, T13, the AdamW side, state layout and bad hyper-parameters."""

import copy
import math

import pytest
import torch
from torch import nn

import optim.muon as muon_module
from optim import KELLER, Muon, auto_dtype, orthogonalize, update_scale
from optim.batches import MIXED_BLOCK, in_blocks
from optim.newton_schulz import working_bytes


def gaussian(*shape, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=dtype)


def params_with_grads(shapes, seed=0, dtype=torch.float32):
    ps = []
    for i, shape in enumerate(shapes):
        p = nn.Parameter(gaussian(*shape, seed=seed + 2 * i, dtype=dtype) * 0.02)
        p.grad = gaussian(*shape, seed=seed + 2 * i + 1, dtype=dtype)
        ps.append(p)
    return ps


def clone_params(ps):
    out = []
    for p in ps:
        q = nn.Parameter(p.detach().clone())
        q.grad = None if p.grad is None else p.grad.clone()
        out.append(q)
    return out


def reference_muon_step(p, buf, grad, lr, beta, nesterov, scale, wd=0.0):
    """Muon in float64 from the formulas of OPTIMIZER.md (textbook NS, no code shared)."""
    buf.mul_(beta).add_(grad, alpha=1 - beta)
    U = (1 - beta) * grad + beta * buf if nesterov else buf.clone()
    X = U.reshape(U.shape[0], -1)
    tall = X.shape[0] > X.shape[1]
    X = X.mT if tall else X
    X = X / X.norm()
    for a, b, c in [KELLER] * 5:
        A = X @ X.mT
        X = a * X + (b * A + c * A @ A) @ X
    O = (X.mT if tall else X).reshape(p.shape)
    p.mul_(1 - lr * wd).add_(O, alpha=-lr * scale)


GPT_SHAPES = [(192, 64), (64, 64), (256, 64), (64, 256), (192, 64), (64, 64)]
# update_rms against the parameters' change: a bf16 update's norm is summed in fp32 and rounded to
# bf16 (up to 2^-8 relative), an fp32 one is exact to fp32's rounding.
UPDATE_RMS_REL = {torch.bfloat16: 4e-3, torch.float32: 1e-5}[auto_dtype(torch.device("cpu"))]


# T7: the gradient is only read.
def test_t7_grad_is_not_mutated():
    ps = params_with_grads(GPT_SHAPES)
    grads = [p.grad.clone() for p in ps]
    opt = Muon(ps, lr=0.02)
    for _ in range(3):
        opt.step()
    assert all(torch.equal(p.grad, g) for p, g in zip(ps, grads))


# T9: parity with a float64 reference and with torch.optim.Muon.
@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("ns_method", ["standard", "gram", "auto"])
def test_t9_fp32_path_within_1e4_of_float64_reference(nesterov, ns_method):
    ps = params_with_grads(GPT_SHAPES)
    start = [p.detach().double().clone() for p in ps]
    ref = [s.clone() for s in start]
    bufs = [torch.zeros_like(r) for r in ref]
    opt = Muon(
        ps, lr=0.02, momentum=0.95, nesterov=nesterov, ns_method=ns_method, ns_dtype=torch.float32, weight_decay=0.1
    )
    for step in range(3):
        for i, (p, r, b) in enumerate(zip(ps, ref, bufs)):
            p.grad = gaussian(*p.shape, seed=100 * step + i)
            scale = math.sqrt(max(1, p.shape[0] / p.shape[1]))
            reference_muon_step(r, b, p.grad.double(), 0.02, 0.95, nesterov, scale, wd=0.1)
        opt.step()
    for p, r, s0 in zip(ps, ref, start):
        ours, theirs = p.detach().double() - s0, r - s0
        assert (ours - theirs).norm() / theirs.norm() < 1e-4


def test_float64_parameters_step_like_float32_ones():
    """A float64 model (a reference run, a test) is stepped, not refused; it agrees with fp32."""
    ps32 = params_with_grads(GPT_SHAPES)
    ps64 = [torch.nn.Parameter(p.detach().double().clone()) for p in ps32]
    for p32, p64 in zip(ps32, ps64):
        p64.grad = p32.grad.double()
    start = [p.detach().clone() for p in ps64]
    Muon(ps32, lr=0.02, ns_dtype=torch.float32).step()
    Muon(ps64, lr=0.02).step()
    for p32, p64, s0 in zip(ps32, ps64, start):
        assert p64.dtype == torch.float64
        d64, d32 = p64.detach() - s0, p32.detach().double() - s0
        assert (d64 - d32).norm() / d64.norm() < 1e-4


def test_t9_parity_with_torch_optim_muon():
    ps = params_with_grads(GPT_SHAPES)
    theirs = clone_params(ps)
    start = [p.detach().clone() for p in ps]
    ours_opt = Muon(ps, lr=0.02, momentum=0.95, nesterov=True, adjust_lr="original")
    ref_opt = torch.optim.Muon(theirs, lr=0.02, momentum=0.95, nesterov=True, weight_decay=0.0)
    for step in range(3):
        for p, q in zip(ps, theirs):
            p.grad = gaussian(*p.shape, seed=7 * step + p.shape[1])
            q.grad = p.grad.clone()
        ours_opt.step()
        ref_opt.step()
    for p, q, s in zip(ps, theirs, start):
        ours, ref = p.detach() - s, q.detach() - s
        # torch.optim.Muon runs NS in bf16 (8 bits of mantissa): agreement to a few percent.
        assert (ours - ref).norm() / ref.norm() < 0.03


# T8: match_rms_adamw gives an update RMS / lr near 0.2.
def test_t8_match_rms_adamw_update_rms():
    ps = params_with_grads([(512, 128), (128, 512), (256, 256)])
    start = [p.detach().clone() for p in ps]
    lr = 0.01
    opt = Muon(ps, lr=lr, adjust_lr="match_rms_adamw")
    opt.step()
    for p, s in zip(ps, start):
        rms = (p.detach() - s).square().mean().sqrt().item()
        assert 0.17 <= rms / lr <= 0.21
    total = math.sqrt(sum((p.detach() - s).square().sum().item() for p, s in zip(ps, start)) / 3 / 65536)
    assert opt.last_step_stats()["update_rms"] == pytest.approx(total, rel=UPDATE_RMS_REL)


def test_step_stats_sum_every_batch_of_every_precision_once(monkeypatch):
    """update_rms over groups of two precisions and several batches (tall, wide and square shapes,
    a cap that splits a bucket) is the RMS of the whole step's parameter change; a parameter with
    a non-finite gradient counts once and changes nothing."""
    f32 = params_with_grads([(256, 64), (64, 256), (64, 64), (64, 64)])
    f64 = params_with_grads([(128, 32), (32, 32)], seed=10, dtype=torch.float64)
    f32[2].grad[0, 0] = float("nan")
    start = [p.detach().clone() for p in f32 + f64]
    opt = Muon([{"params": f32}, {"params": f64}], lr=0.01)
    one_square = working_bytes(64, 64, auto_dtype(torch.device("cpu")))
    monkeypatch.setattr(muon_module, "MAX_BATCH_BYTES", one_square)  # each 64 x 64 alone: 4 fp32 batches
    opt.step()
    change = [p.detach() - s for p, s in zip(f32 + f64, start)]
    assert change[2].abs().max() == 0
    applied = [c for i, c in enumerate(change) if i != 2]
    rms = math.sqrt(sum(c.square().sum().item() for c in applied) / sum(c.numel() for c in applied))
    stats = opt.last_step_stats()
    assert stats["update_rms"] == pytest.approx(rms, rel=UPDATE_RMS_REL)
    assert stats["nonfinite_skipped"] == 1


# T10: a conv weight is scaled from its flattened 2D shape.
def test_t10_conv_scale_from_flattened_shape():
    assert update_scale(256, 9, "original") == pytest.approx(5.333, abs=1e-3)
    conv = nn.Parameter(gaussian(256, 1, 3, 3))
    conv.grad = gaussian(256, 1, 3, 3, seed=1)
    start = conv.detach().clone()
    Muon([conv], lr=0.01, momentum=0.0, nesterov=False).step()
    expected = orthogonalize(conv.grad.reshape(256, 9)).reshape(256, 1, 3, 3) * (0.01 * 16 / 3)
    assert torch.allclose(start - conv.detach(), expected, rtol=1e-4, atol=1e-6)


# T11: expert weights [E, out, in] are orthogonalized per expert; batched == a loop, exactly.
def test_t11_experts_batched_equals_loop_exactly():
    E, out_dim, in_dim = 4, 96, 32
    w = nn.Parameter(gaussian(E, out_dim, in_dim) * 0.02)
    singles = [nn.Parameter(w.detach()[e].clone()) for e in range(E)]
    batched = Muon([{"params": [w], "experts": True}], lr=0.02)
    looped = [Muon([s], lr=0.02) for s in singles]
    for step in range(3):
        w.grad = gaussian(E, out_dim, in_dim, seed=10 + step)
        for e, (s, opt) in enumerate(zip(singles, looped)):
            s.grad = w.grad[e].clone()
            opt.step()
        batched.step()
    for e, s in enumerate(singles):
        assert torch.equal(w.detach()[e], s.detach())


def test_t11_experts_marker_is_explicit():
    w = nn.Parameter(gaussian(4, 8, 8))
    w.grad = gaussian(4, 8, 8, seed=1)
    experts, conv = copy.deepcopy(w), copy.deepcopy(w)
    experts.grad, conv.grad = w.grad.clone(), w.grad.clone()
    Muon([{"params": [experts], "experts": True}], lr=0.1).step()
    Muon([conv], lr=0.1).step()  # rank 3 without the marker: a conv1d weight, flattened to [4, 64]
    assert not torch.allclose(experts, conv)
    with pytest.raises(ValueError, match=r"\[E, out, in\]"):
        Muon([{"params": [nn.Parameter(torch.zeros(8, 8))], "experts": True}])


# T13: a state_dict round trip takes the identical next step.
def test_t13_state_dict_round_trip():
    shapes = [*GPT_SHAPES, (64,), (100, 64)]
    ps = params_with_grads(shapes)

    def groups(params):
        return [{"params": params[:6]}, {"params": params[6:], "use_muon": False}]

    opt = Muon(groups(ps), lr=0.02, adamw_lr=1e-3, weight_decay=0.01, adamw_weight_decay=0.1)
    for step in range(2):
        for p in ps:
            p.grad = gaussian(*p.shape, seed=step * 31 + p.numel())
        opt.step()
    saved = copy.deepcopy(opt.state_dict())
    twin_params = clone_params(ps)
    twin = Muon(groups(twin_params), lr=0.5, adamw_lr=0.5)  # hyper-parameters come from the checkpoint
    twin.load_state_dict(saved)
    for p, q in zip(ps, twin_params):
        p.grad = gaussian(*p.shape, seed=999 + p.numel())
        q.grad = p.grad.clone()
    opt.step()
    twin.step()
    assert all(torch.equal(p, q) for p, q in zip(ps, twin_params))


# T5: a non-finite gradient is reported and not applied; zero gradient -> exact zero update.
def test_t5_nonfinite_gradient_is_skipped_and_reported():
    ps = params_with_grads([(64, 32), (64, 32), (16,)])
    opt = Muon([{"params": ps[:2]}, {"params": ps[2:], "use_muon": False}], lr=0.02, weight_decay=0.1)
    opt.step()
    before = [p.detach().clone() for p in ps]
    bufs = [opt.state[p]["momentum_buffer"].clone() for p in ps[:2]]
    adam_state = {k: v.clone() for k, v in opt.state[ps[2]].items()}
    ps[0].grad[3, 4] = float("nan")
    ps[2].grad[0] = float("inf")
    opt.step()
    assert opt.last_step_stats()["nonfinite_skipped"] == 2
    assert torch.equal(ps[0], before[0]) and torch.equal(opt.state[ps[0]]["momentum_buffer"], bufs[0])
    assert torch.equal(ps[2], before[2])
    assert all(torch.equal(opt.state[ps[2]][k], v) for k, v in adam_state.items())
    assert not torch.equal(ps[1], before[1]) and torch.isfinite(ps[1]).all()


def test_t5_zero_gradient_gives_exact_zero_update():
    p = nn.Parameter(gaussian(32, 48))
    p.grad = torch.zeros(32, 48)
    start = p.detach().clone()
    opt = Muon([p], lr=0.02)
    opt.step()
    assert torch.equal(p, start)
    assert opt.last_step_stats()["update_rms"] == 0.0


def test_large_finite_gradient_is_not_mistaken_for_nonfinite():
    # An L2 norm of this fp16 gradient overflows to inf; every entry is finite.
    p = nn.Parameter(torch.zeros(1024, 1024, dtype=torch.float16))
    p.grad = torch.full((1024, 1024), 100.0, dtype=torch.float16)
    opt = Muon([p], lr=0.02)
    opt.step()
    assert opt.last_step_stats()["nonfinite_skipped"] == 0
    assert p.abs().max() > 0 and torch.isfinite(p).all()


def test_batches_are_capped_and_equal_to_one_big_batch(monkeypatch):
    shapes = [(48, 16)] * 5
    capped, whole = params_with_grads(shapes), params_with_grads(shapes)
    Muon(whole, lr=0.02, ns_dtype=torch.float32).step()
    monkeypatch.setattr(muon_module, "MAX_BATCH_BYTES", 2 * working_bytes(48, 16, torch.float32))  # batches of 2, 2, 1
    batches = []

    def counting(X, *args, **kwargs):
        batches.append(len(X))
        return orthogonalize(X, *args, **kwargs)

    monkeypatch.setattr(muon_module, "orthogonalize", counting)
    Muon(capped, lr=0.02, ns_dtype=torch.float32).step()
    assert batches == [2, 2, 1]
    assert all(torch.equal(a, b) for a, b in zip(capped, whole))


@pytest.mark.parametrize("ns_dtype", [torch.float32, torch.bfloat16])
def test_a_warm_step_allocates_no_matrix(ns_dtype):
    # Stacking, Newton–Schulz and the update all run in scratch that lives across steps; an op
    # that mixes fp32 and bf16 converts through a temporary of one block (MIXED_BLOCK elements).
    ps = params_with_grads([(1024, 512), (512, 512), (512, 1024), (1024, 512)])  # each > a block
    opt = Muon(ps, lr=0.02, ns_dtype=ns_dtype)
    opt.step()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        opt.step()
    # What each op leaves allocated when it returns: a product's own workspace (oneDNN's bf16
    # GEMMs on CPUs with native bf16 take and free up to a few hundred KB inside the call) nets
    # to zero; a tensor made by the step does not.
    kept = [(e.self_cpu_memory_usage, e.name) for e in prof.events() if e.self_cpu_memory_usage > 0]
    block = MIXED_BLOCK * 4 if ns_dtype == torch.bfloat16 else 1024  # an fp32 block; fp32 steps mix nothing
    assert kept and max(kept)[0] <= block < min(p.numel() for p in ps) * 2, max(kept)  # below one bf16 matrix
    assert not any("scratch" in str(k) or "stack" in str(k) for k in opt.state_dict())  # scratch, not state


def test_mixed_precision_ops_in_blocks_equal_one_op_bit_for_bit():
    # fp32 into a bf16 stack and bf16 into fp32 parameters, in blocks of MIXED_BLOCK elements
    # (whole rows, so a block boundary falls inside neither matrix's row).
    g, m = gaussian(2, 700, 300), gaussian(2, 700, 300, seed=1)  # 420,000 elements: 7 blocks
    out = torch.empty(2, 700, 300, dtype=torch.bfloat16)
    in_blocks(out, lambda o, a, b: torch.lerp(a, b, 0.95, out=o), g, m)
    assert torch.equal(out, torch.lerp(g, m, 0.95).to(torch.bfloat16))
    p, q = gaussian(2, 700, 300, seed=2), gaussian(2, 700, 300, seed=2)
    in_blocks(p, lambda a, u: a.add_(u, alpha=-0.3), out)
    assert torch.equal(p, q.add_(out.float(), alpha=-0.3))


@pytest.mark.parametrize("ns_dtype", [torch.float16, torch.bfloat16])
def test_a_low_precision_step_follows_orthogonalize_in_that_precision(ns_dtype):
    # bf16 stacks in bf16 (converted, then normalised); fp16, whose range would lose small
    # gradients, stacks in fp32 and is normalised before it is converted.
    ps = params_with_grads([(192, 64), (64, 192)], seed=4)
    for p in ps:
        p.grad.mul_(1e-6)  # below fp16's normal range once squared: only a normalised fp16 keeps it
    start = [p.detach().clone() for p in ps]
    Muon(ps, lr=1.0, momentum=0.0, ns_dtype=ns_dtype).step()
    for p, s in zip(ps, start):
        scale = update_scale(*p.shape, "original")
        expected = orthogonalize(p.grad, dtype=ns_dtype, out_dtype=ns_dtype).float() * scale
        assert torch.allclose(s - p.detach(), expected, atol=1e-6)
        assert (s - p.detach()).abs().max() > 0.01


@pytest.mark.parametrize("ns_dtype", [torch.float32, torch.bfloat16])
def test_explicit_ns_dtype_matches_orthogonalize_in_that_dtype(ns_dtype):
    p = nn.Parameter(torch.zeros(96, 32))
    p.grad = gaussian(96, 32)
    Muon([p], lr=1.0, momentum=0.0, ns_dtype=ns_dtype).step()
    expected = orthogonalize(p.grad, dtype=ns_dtype, out_dtype=ns_dtype).float() * math.sqrt(3)
    assert torch.allclose(-p.detach(), expected, atol=1e-6)


def test_nonfinite_update_from_diverging_coefficients_is_skipped():
    p = nn.Parameter(gaussian(16, 32))
    p.grad = gaussian(16, 32, seed=1)
    start = p.detach().clone()
    opt = Muon([p], lr=0.02, ns_coefficients=[(1e10, 0.0, 0.0)], ns_steps=5)  # blows up to inf
    opt.step()
    assert torch.equal(p, start)
    assert opt.last_step_stats()["nonfinite_skipped"] == 1


def test_a_non_finite_expert_update_skips_its_whole_parameter(monkeypatch):
    # The finite check stays on the device: one bad matrix of an expert weight zeroes the updates
    # of all its matrices (and its decay); the other parameters step as usual, and the statistics
    # count the skipped parameter once and leave its matrices out of update_rms.
    real = muon_module.orthogonalize

    def one_bad_matrix(X, *args, **kwargs):
        O = real(X, *args, **kwargs)
        if O.shape[0] == 3:
            O[1, 0, 0] = float("nan")
        return O

    monkeypatch.setattr(muon_module, "orthogonalize", one_bad_matrix)
    experts, dense = nn.Parameter(gaussian(3, 8, 16)), nn.Parameter(gaussian(8, 24, seed=1))
    experts.grad, dense.grad = gaussian(3, 8, 16, seed=2), gaussian(8, 24, seed=3)
    start_experts, start_dense = experts.detach().clone(), dense.detach().clone()
    opt = Muon([{"params": [experts], "experts": True}, {"params": [dense]}], lr=0.02, weight_decay=0.1)
    opt.step()
    assert torch.equal(experts, start_experts)
    assert not torch.equal(dense, start_dense) and dense.isfinite().all()
    stats = opt.last_step_stats()
    assert stats["nonfinite_skipped"] == 1
    change = dense.detach() - start_dense * (1 - 0.02 * 0.1)  # the applied update, decay taken out
    assert stats["update_rms"] == pytest.approx(change.square().mean().sqrt().item(), rel=UPDATE_RMS_REL)


# The AdamW side matches torch.optim.AdamW.
def test_adamw_groups_match_torch_adamw():
    ps = params_with_grads([(50, 16), (16,), (7,)])
    theirs = clone_params(ps)
    ours = Muon([{"params": ps, "use_muon": False}], adamw_lr=3e-3, adamw_betas=(0.9, 0.95), adamw_weight_decay=0.1)
    ref = torch.optim.AdamW(theirs, lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    for step in range(5):
        for p, q in zip(ps, theirs):
            p.grad = gaussian(*p.shape, seed=step * 11 + p.numel())
            q.grad = p.grad.clone()
        ours.step()
        ref.step()
    for p, q in zip(ps, theirs):
        assert torch.allclose(p, q, rtol=0, atol=1e-6)


def test_group_overrides_and_scheduler_drive_group_lr():
    a, b = params_with_grads([(32, 16), (8,)])
    opt = Muon([{"params": [a]}, {"params": [b], "use_muon": False, "lr": 5e-3, "betas": (0.8, 0.9)}], adamw_lr=1e-4)
    assert opt.param_groups[1]["lr"] == 5e-3 and opt.param_groups[1]["betas"] == (0.8, 0.9)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5)
    assert [g["lr"] for g in opt.param_groups] == [0.01, 2.5e-3]
    opt.step()
    sched.step()
    assert [g["lr"] for g in opt.param_groups] == [0.01, 2.5e-3]


# Persistent state: one buffer per Muon parameter; exp_avg, exp_avg_sq and step per AdamW one.
def test_persistent_state_layout():
    ps = params_with_grads([(64, 32), (32, 64), (4, 8, 8), (10,)])
    opt = Muon(
        [{"params": ps[:2]}, {"params": [ps[2]], "experts": True}, {"params": [ps[3]], "use_muon": False}],
    )
    opt.step()
    for p in ps[:3]:
        assert set(opt.state[p]) == {"momentum_buffer"} and opt.state[p]["momentum_buffer"].shape == p.shape
    assert set(opt.state[ps[3]]) == {"exp_avg", "exp_avg_sq", "step"}
    assert float(opt.state[ps[3]]["step"]) == 1.0


def test_step_stats_and_closure():
    ps = params_with_grads([(64, 32)])
    opt = Muon(ps, lr=0.02)
    loss = opt.step(lambda: torch.tensor(3.0))
    stats = opt.last_step_stats()
    assert loss.item() == 3.0
    assert stats["update_rms"] > 0 and stats["ns_time_ms"] > 0 and stats["nonfinite_skipped"] == 0


def test_params_without_grad_are_left_alone():
    a, b = params_with_grads([(16, 16), (16, 16)])
    b.grad = None
    start = b.detach().clone()
    opt = Muon([a, b])
    opt.step()
    assert torch.equal(b, start) and b not in opt.state


def test_weight_decay_uses_unadjusted_lr():
    p = nn.Parameter(gaussian(64, 16))
    p.grad = torch.zeros(64, 16)
    start = p.detach().clone()
    Muon([p], lr=0.1, weight_decay=0.5).step()
    assert torch.allclose(p, start * (1 - 0.1 * 0.5))


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"lr": -1.0}, "lr"),
        ({"lr": float("nan")}, "lr"),
        ({"momentum": 1.0}, "momentum"),
        ({"momentum": -0.1}, "momentum"),
        ({"nesterov": "yes"}, "nesterov"),
        ({"ns_steps": 0}, "ns_steps"),
        ({"ns_steps": 2.5}, "ns_steps"),
        ({"ns_coefficients": "quintic"}, "quintic"),
        ({"ns_coefficients": [(1.0, 2.0, 3.0), (1.0, 2.0, 3.0)]}, "ns_steps is 5"),
        ({"ns_method": "svd"}, "ns_method"),
        ({"ns_dtype": torch.int32}, "ns_dtype"),
        ({"ns_dtype": "bf16"}, "ns_dtype"),
        ({"adjust_lr": "rms"}, "adjust_lr"),
        ({"weight_decay": -0.1}, "weight_decay"),
        ({"adamw_lr": -3e-4}, "lr"),
        ({"adamw_betas": (0.9, 1.0)}, "adamw_betas"),
        ({"adamw_betas": (0.9,)}, "adamw_betas"),
        ({"adamw_eps": -1e-8}, "adamw_eps"),
        ({"adamw_weight_decay": -1.0}, "weight_decay"),
    ],
)
def test_bad_hyper_parameters_raise_value_error_naming_them(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        Muon([nn.Parameter(torch.zeros(4, 4))], **kwargs)


def test_bad_group_values_raise_value_error():
    with pytest.raises(ValueError, match="momentum"):
        Muon([{"params": [nn.Parameter(torch.zeros(4, 4))], "momentum": 2.0}])
    with pytest.raises(ValueError, match="use_muon"):
        Muon([nn.Parameter(torch.zeros(4))])


def test_sparse_gradient_is_refused():
    p = nn.Parameter(torch.zeros(4, 4))
    p.grad = torch.zeros(4, 4).to_sparse()
    with pytest.raises(RuntimeError, match="sparse"):
        Muon([p]).step()
