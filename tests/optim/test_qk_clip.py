"""QK-Clip and MuonClip: OPTIMIZER.md row T12 on every attention layout, heads under tau, MuonClip's
step statistics, the MAX all-reduce of S_max across two gloo ranks, and QKClipTarget bounds."""

from __future__ import annotations

import copy
import math
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import optim
from tests.optim.tiny_models import LAYOUTS, CausalSelfAttention, TinyGPT
from tests.support.net import free_port

TAU = 100.0
S_TARGET = 250.0
GAMMA = TAU / S_TARGET  # 0.4
SQRT_GAMMA = math.sqrt(GAMMA)  # 0.6325
HEAD = 1  # the head pushed to 250
D_MODEL, N_HEAD = 32, 4


def make_attention(layout: str, seed: int = 0) -> CausalSelfAttention:
    torch.manual_seed(seed)
    kv = {"n_kv_head": 2} if layout == "gqa" else {}
    return CausalSelfAttention(D_MODEL, N_HEAD, layout, **kv)


def fixed_batch(seed: int = 1) -> torch.Tensor:
    return torch.randn(3, 12, D_MODEL, generator=torch.Generator().manual_seed(seed))


def max_logits(attn: CausalSelfAttention, x: torch.Tensor) -> torch.Tensor:
    """The recorded per-head maxima of one forward on x (the running max is reset first)."""
    attn.reset_qk_max_logits()
    with torch.no_grad():
        attn(x)
    s = attn.qk_max_logits()
    assert s is not None and s.shape == (N_HEAD,)
    return s.clone()


def reference_max_logits(attn: CausalSelfAttention, x: torch.Tensor) -> torch.Tensor:
    """Per-head max over batch and causal pairs from the logits, independently of forward()."""
    with torch.no_grad():
        att, _ = attn.logits(x)  # [B, H, T, T]
    T = x.shape[1]
    i, j = torch.tril_indices(T, T)
    return att[:, :, i, j].amax(dim=(0, 2))


def head_layout(attn: CausalSelfAttention, h: int) -> tuple[list[tuple[str, slice]], dict[str, list]]:
    """For head h: the weight rows that make up its query (scaling them scales every logit of the
    head), and per parameter the rows QK-Clip must touch with the power of gamma each takes."""
    d = attn.head_dim
    rows = slice(h * d, (h + 1) * d)
    if attn.layout == "separate":
        return [("W_q.weight", rows)], {"W_q.weight": [(rows, 0.5)], "W_k.weight": [(rows, 0.5)]}
    if attn.layout == "fused":
        k_rows = slice(N_HEAD * d + h * d, N_HEAD * d + (h + 1) * d)
        return [("qkv.weight", rows)], {"qkv.weight": [(rows, 0.5), (k_rows, 0.5)]}
    if attn.layout == "gqa":  # shared key heads: all of gamma on Q
        return [("W_q.weight", rows)], {"W_q.weight": [(rows, 1.0)]}
    n, r, v = attn.nope, attn.rope_dim, attn.v_dim
    q0, kv0 = h * (n + r), h * (n + v)
    q_c, q_r, k_c = slice(q0, q0 + n), slice(q0 + n, q0 + n + r), slice(kv0, kv0 + n)
    return [("q_up.weight", slice(q0, q0 + n + r))], {
        "q_up.weight": [(q_c, 0.5), (q_r, 1.0)],
        "kv_up.weight": [(k_c, 0.5)],
    }


def push_head_to(attn: CausalSelfAttention, x: torch.Tensor, h: int, target: float) -> None:
    """Scale head h's query rows (no optimizer update) so its max logit on x becomes ``target``."""
    s = max_logits(attn, x)
    assert s[h] > 0.1, f"pick a head with a positive max logit, got {s.tolist()}"
    params = dict(attn.named_parameters())
    q_rows, _ = head_layout(attn, h)
    with torch.no_grad():
        for name, rows in q_rows:
            params[name][rows] *= target / float(s[h])


def expected_factors(attn: CausalSelfAttention, h: int) -> dict[str, torch.Tensor]:
    """Per parameter, the expected per-row factor: 1 everywhere but head h's clip rows."""
    _, clip_rows = head_layout(attn, h)
    factors = {}
    for name, p in attn.named_parameters():
        f = torch.ones(p.shape[0], dtype=torch.float64)
        for rows, exponent in clip_rows.get(name, []):
            f[rows] = GAMMA**exponent
        factors[name] = f
    return factors


# T12: S = 250, tau = 100 -> gamma 0.4, per-side factor 0.6325, recomputed max logit 100.
@pytest.mark.parametrize("layout", LAYOUTS)
def test_t12_clip_brings_head_to_tau(layout):
    attn = make_attention(layout)
    x = fixed_batch()
    push_head_to(attn, x, HEAD, S_TARGET)
    before = {k: v.clone() for k, v in attn.state_dict().items()}
    s = max_logits(attn, x)  # the forward whose maxima the clip uses
    assert s[HEAD].item() == pytest.approx(S_TARGET, abs=1e-3)
    assert torch.allclose(s, reference_max_logits(attn, x), rtol=1e-6, atol=1e-6)
    assert (s[torch.arange(N_HEAD) != HEAD] < TAU).all()

    heads_clipped, min_gamma = optim.qk_clip([attn], TAU)

    assert heads_clipped.item() == 1
    assert min_gamma.item() == pytest.approx(GAMMA, abs=1e-6)
    assert min_gamma.item() == pytest.approx(TAU / s[HEAD].item(), rel=1e-6)
    assert attn.qk_max_logits() is None  # reset after the clip

    after = attn.state_dict()
    factors = expected_factors(attn, HEAD)
    touched = 0
    for name, old in before.items():
        new, f = after[name], factors[name]
        same = f == 1.0
        assert torch.equal(new[same], old[same]), f"{name}: rows outside head {HEAD}'s Q/K changed"
        if (~same).any():
            touched += int((~same).sum())
            ratio = (new[~same].double() / old[~same].double()).reshape(int((~same).sum()), -1)
            want = f[~same].view(-1, 1).expand_as(ratio)
            assert torch.allclose(ratio, want, rtol=0, atol=1e-6), f"{name}: wrong clip factor"
    # What the spec names: sqrt(gamma) = 0.6325 per side, the full 0.4 on GQA's Q and MLA's q^R.
    d = attn.head_dim
    q_name = {"separate": "W_q.weight", "gqa": "W_q.weight", "fused": "qkv.weight", "mla": "q_up.weight"}[layout]
    q_first = HEAD * (attn.nope + attn.rope_dim) if layout == "mla" else HEAD * d
    q_factor = after[q_name][q_first] / before[q_name][q_first]
    assert q_factor.mean().item() == pytest.approx(0.4 if layout == "gqa" else 0.6325, abs=1e-4)
    if layout == "mla":
        q_r = HEAD * (attn.nope + attn.rope_dim) + attn.nope
        assert (after["q_up.weight"][q_r] / before["q_up.weight"][q_r]).mean().item() == pytest.approx(0.4, abs=1e-6)
        assert torch.equal(after["k_rope.weight"], before["k_rope.weight"])  # the shared k^R
        assert touched == attn.nope + attn.rope_dim + attn.nope
    elif layout == "gqa":
        assert torch.equal(after["W_k.weight"], before["W_k.weight"])
        assert touched == d
    else:
        assert touched == 2 * d
    for v_name in ("W_v.weight", "proj.weight", "q_down.weight", "kv_down.weight"):
        if v_name in before:
            assert torch.equal(after[v_name], before[v_name])
    if layout == "fused":
        v_rows = slice(2 * N_HEAD * d, 3 * N_HEAD * d)
        assert torch.equal(after["qkv.weight"][v_rows], before["qkv.weight"][v_rows])
    if layout == "mla":  # the v rows that sit between the heads' k^C rows in kv_up
        n, v = attn.nope, attn.v_dim
        v_rows = torch.cat([torch.arange(h * (n + v) + n, (h + 1) * (n + v)) for h in range(N_HEAD)])
        assert torch.equal(after["kv_up.weight"][v_rows], before["kv_up.weight"][v_rows])

    s_after = max_logits(attn, x)
    assert abs(s_after[HEAD].item() - TAU) <= 1e-4
    others = torch.arange(N_HEAD) != HEAD
    assert torch.allclose(s_after[others], s[others], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_heads_under_tau_are_bitwise_untouched(layout):
    attn = make_attention(layout)
    x = fixed_batch()
    before = {k: v.clone() for k, v in attn.state_dict().items()}
    s = max_logits(attn, x)
    assert (s < TAU).all() and (s > -TAU).all()
    heads_clipped, min_gamma = optim.qk_clip([attn], TAU)
    assert heads_clipped.item() == 0
    assert min_gamma.item() == 1.0
    for name, old in before.items():
        assert torch.equal(attn.state_dict()[name], old), name


@pytest.mark.parametrize("layout", LAYOUTS)
def test_second_clip_without_forward_clips_nothing(layout):
    attn = make_attention(layout)
    x = fixed_batch()
    push_head_to(attn, x, HEAD, S_TARGET)
    max_logits(attn, x)
    first, _ = optim.qk_clip([attn], TAU)
    assert first.item() == 1
    after_first = {k: v.clone() for k, v in attn.state_dict().items()}
    second, min_gamma = optim.qk_clip([attn], TAU)  # no forward in between: the maxima were reset
    assert second.item() == 0
    assert min_gamma.item() == 1.0
    for name, old in after_first.items():
        assert torch.equal(attn.state_dict()[name], old), name


def test_running_max_spans_forwards_until_reset():
    attn = make_attention("separate")
    x1, x2 = fixed_batch(1), fixed_batch(2) * 3.0
    s1, s2 = max_logits(attn, x1), max_logits(attn, x2)
    attn.reset_qk_max_logits()
    with torch.no_grad():
        attn(x1)
        attn(x2)
    assert torch.equal(attn.qk_max_logits(), torch.maximum(s1, s2))
    assert not torch.equal(s1, s2)


def test_muonclip_step_reports_clip_computed_by_hand():
    torch.manual_seed(0)
    model = TinyGPT(vocab=64, n_layer=2, n_head=4, d_model=32, seq_len=16, layout="fused")
    plain = copy.deepcopy(model)
    g = torch.Generator().manual_seed(3)
    idx, tgt = torch.randint(0, 64, (4, 16), generator=g), torch.randint(0, 64, (4, 16), generator=g)
    for m in (model, plain):
        for attn in m.attention():
            attn.reset_qk_max_logits()
        m(idx, tgt)[1].backward()
    S = torch.cat([attn.qk_max_logits() for attn in model.attention()])  # [layers * heads]
    ordered = S.sort().values
    tau = float((ordered[3] + ordered[4]) / 2)  # half of the 8 heads above tau
    gamma = torch.where(S > tau, tau / S, torch.ones_like(S))

    kw = dict(lr=0.02, adamw_lr=3e-3)
    opt = optim.MuonClip(optim.split_params(model), attention=model, qk_clip_tau=tau, **kw)
    ref = optim.Muon(optim.split_params(plain), **kw)
    opt.step()
    ref.step()

    stats = opt.last_step_stats()
    assert stats["qk_clip/heads_clipped"] == 4 > 0
    assert stats["qk_clip/min_gamma"] < 1.0
    assert stats["qk_clip/min_gamma"] == pytest.approx(tau / S.max().item(), rel=1e-6)
    assert "qk_clip/heads_clipped" not in ref.last_step_stats()
    assert all(attn.qk_max_logits() is None for attn in model.attention())

    # MuonClip = the Muon step, then the clip of the recorded maxima folded into Q and K rows.
    d, H = model.attention()[0].head_dim, 4
    plain_params = dict(plain.named_parameters())
    for name, p in model.named_parameters():
        want = plain_params[name].detach()
        if not name.endswith("attn.qkv.weight"):
            assert torch.equal(p, want), name
            continue
        layer = int(name.split(".")[1])
        row_factor = torch.ones(p.shape[0])
        for h in range(H):
            s = gamma[layer * H + h].sqrt()
            row_factor[h * d : (h + 1) * d] = s
            row_factor[H * d + h * d : H * d + (h + 1) * d] = s
        same = row_factor == 1.0
        assert torch.equal(p[same], want[same]), name
        assert torch.allclose(p[~same], want[~same] * row_factor[~same, None], rtol=1e-6, atol=0), name


def test_a_remeasured_clip_holds_every_head_at_tau_on_its_batch_after_the_update():
    """With remeasure the clip scales from the maxima of the step's batch measured after the
    update: every head of the first layer ends at or below tau on that batch (the plain clip,
    which scales from the maxima before the update, does not). A later layer's input changes with
    the clip of the layers before it, so its heads end near tau, not exactly."""
    torch.manual_seed(0)
    model = TinyGPT(vocab=64, n_layer=2, n_head=4, d_model=32, seq_len=16, layout="fused")
    plain = copy.deepcopy(model)
    g = torch.Generator().manual_seed(3)
    idx, tgt = torch.randint(0, 64, (4, 16), generator=g), torch.randint(0, 64, (4, 16), generator=g)

    def maxima(m) -> torch.Tensor:  # each head's max logit on the batch with the weights as they are
        for attn in m.attention():
            attn.reset_qk_max_logits()
        with torch.no_grad():
            m(idx, tgt)
        out = torch.cat([attn.qk_max_logits() for attn in m.attention()])
        for attn in m.attention():
            attn.reset_qk_max_logits()
        return out

    before = maxima(model)
    tau = float(before.sort().values[4])  # a lr large enough that the update moves the maxima
    kw = dict(lr=0.2, adamw_lr=3e-3, qk_clip_tau=tau)
    opts = {
        "remeasured": optim.MuonClip(optim.split_params(model), attention=model, **kw),
        "plain": optim.MuonClip(optim.split_params(plain), attention=plain, **kw),
    }
    for m in (model, plain):
        for attn in m.attention():
            attn.reset_qk_max_logits()
        m(idx, tgt)[1].backward()
    calls = []

    def remeasure():
        calls.append(1)
        model(idx, tgt)

    opts["remeasured"].step(remeasure=remeasure)
    opts["plain"].step()
    assert calls == [1] and all(attn.qk_max_logits() is None for attn in model.attention())
    after, after_plain = maxima(model), maxima(plain)
    first = slice(0, 4)  # layer 0's heads
    assert after[first].max() <= tau * (1 + 1e-5) and after.max() <= tau * 1.02
    assert after_plain[first].max() > tau * 1.001  # what the update added since the training forward
    assert opts["remeasured"].last_step_stats()["qk_clip/heads_clipped"] > 0


# ---- distributed: S_max is a global-batch quantity, all-reduced with MAX ----

DIST_TAU = 100.0
RANK_MAXIMA = {  # per rank: (separate module, fused module) maxima
    0: ([300.0, 10.0, 20.0, 5.0], [1.0, 2.0, 3.0, 150.0]),
    1: ([20.0, 500.0, 30.0, 5.0], [1.0, 2.0, 3.0, 40.0]),
}
GLOBAL_MAXIMA = ([300.0, 500.0, 30.0, 5.0], [1.0, 2.0, 3.0, 150.0])


def _dist_modules(maxima) -> list[CausalSelfAttention]:
    mods = [make_attention("separate", seed=5), make_attention("fused", seed=6)]
    for m, s in zip(mods, maxima):
        m.record(torch.tensor(s))
    return mods


def _dist_worker(rank: int, world_size: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=30),
    )
    try:
        mods = _dist_modules(RANK_MAXIMA[rank])
        clipped, min_gamma = optim.qk_clip(mods, DIST_TAU)
        torch.save(
            {"states": [m.state_dict() for m in mods], "clipped": clipped, "min_gamma": min_gamma},
            Path(out_dir) / f"rank{rank}.pt",
        )
    finally:
        dist.destroy_process_group()


def test_all_reduced_maxima_live_on_the_weights_device(monkeypatch):
    # nccl all-reduces CUDA tensors only: with no recorded forward (every maximum a CPU -inf),
    # S_max must still be placed where the weights are. "meta" stands in for CUDA here.
    seen = []
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "all_reduce", lambda t, op=None: seen.append(t.device))
    with torch.device("meta"):
        mod = make_attention("fused", seed=0)
    optim.qk_clip([mod], DIST_TAU)
    assert seen == [torch.device("meta")]


def test_distributed_max_all_reduce_two_gloo_ranks(tmp_path):
    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=_dist_worker, args=(r, 2, port, str(tmp_path))) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=90)
    hung = [p.pid for p in procs if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(5)
    assert not hung, f"distributed QK-Clip did not finish (pids {hung})"
    assert [p.exitcode for p in procs] == [0, 0]

    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    expected = _dist_modules(GLOBAL_MAXIMA)
    clipped, min_gamma = optim.qk_clip(expected, DIST_TAU)  # single process: the global maxima
    assert clipped.item() == 3 and min_gamma.item() == pytest.approx(0.2, rel=1e-6)
    local0 = _dist_modules(RANK_MAXIMA[0])
    optim.qk_clip(local0, DIST_TAU)  # what rank 0 would do without the all-reduce
    assert not torch.equal(local0[0].W_q.weight, expected[0].W_q.weight)
    for res in results:
        assert res["clipped"].item() == 3
        assert res["min_gamma"].item() == min_gamma.item()
        for state, mod in zip(res["states"], expected):
            for name, t in mod.state_dict().items():
                assert torch.equal(state[name], t), name
    for a, b in zip(results[0]["states"], results[1]["states"]):
        assert all(torch.equal(a[k], b[k]) for k in a)


# ---- QKClipTarget ----


def test_head_view_raises_past_the_tensor():
    t = torch.zeros(10, 3)
    with pytest.raises(ValueError):
        optim.QKClipTarget(t, heads=3, rows=4).head_view()  # needs 12 rows
    with pytest.raises(ValueError):
        optim.QKClipTarget(t, heads=2, rows=4, offset=3).head_view()  # needs 11
    with pytest.raises(ValueError):
        optim.QKClipTarget(t, heads=3, rows=2, stride=5).head_view()  # needs 12
    with pytest.raises(ValueError):
        optim.QKClipTarget(t[:8], heads=3, rows=3).head_view()  # needs 9: the slice has 8, its storage 10

    view = optim.QKClipTarget(t, heads=3, rows=2, offset=1, stride=3).head_view()  # needs exactly 10
    assert view.shape == (3, 2, 3)
    view[1].fill_(1.0)  # a view, not a copy: rows 4 and 5
    assert t[:, 0].tolist() == [0, 0, 0, 0, 1, 1, 0, 0, 0, 0]


def test_head_view_rejects_rows_before_the_tensor():
    """A negative offset runs past the tensor's start. On a tensor that is a slice of a larger buffer
    (a flat parameter buffer, a fused weight cut into parts) as_strided accepts it, so the clip would
    scale rows of the neighbouring tensor; the bounds check must catch it like the end overrun."""
    base = torch.arange(30.0).view(10, 3)
    t = base[2:]  # rows 2..9 of base
    with pytest.raises(ValueError):
        optim.QKClipTarget(t, heads=1, rows=2, offset=-1).head_view()  # would view base rows 1..2


def test_overlapping_heads_are_rejected():
    with pytest.raises(ValueError, match="stride >= rows"):
        optim.QKClipTarget(torch.zeros(10, 3), heads=2, rows=4, stride=2).head_view()


def test_a_non_finite_max_logit_leaves_the_head_alone():
    attn = make_attention("fused")
    before = {k: v.clone() for k, v in attn.state_dict().items()}
    attn.record(torch.tensor([float("inf"), float("nan"), 1.0, 2.0])[:N_HEAD])
    heads_clipped, min_gamma = optim.qk_clip([attn], TAU)
    assert heads_clipped.item() == 0 and min_gamma.item() == 1.0
    for name, old in before.items():
        assert torch.equal(attn.state_dict()[name], old), name
