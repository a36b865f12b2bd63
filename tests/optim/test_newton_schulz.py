"""Newton–Schulz family: OPTIMIZER.md rows T1-T6, the gram form, and properties over shapes."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from optim import KELLER, POLAR_EXPRESS, orthogonalize, resolve_coefficients, scalar_map, singular_value_band
from optim.newton_schulz import choose_method, symmetric_matmul


def reference_ns(G: torch.Tensor, steps, norm_factor: float = 1.0) -> torch.Tensor:
    """The textbook quintic iteration in float64 (independent of the code under test)."""
    X = G.double()
    tall = X.shape[-2] > X.shape[-1]
    if tall:
        X = X.mT
    X = X / (norm_factor * X.norm())
    for a, b, c in steps:
        A = X @ X.mT
        X = a * X + (b * A + c * A @ A) @ X
    return X.mT if tall else X


def svals(O: torch.Tensor) -> torch.Tensor:
    return torch.linalg.svdvals(O.double())


def gaussian(*shape, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=dtype)


# T1: the scalar map of 5 Keller steps.
@pytest.mark.parametrize(("low", "lo", "hi"), [(0.0015, 0.680, 1.203), (0.01, 0.682, 1.135)])
def test_t1_keller_scalar_band(low, lo, hi):
    band_lo, band_hi = singular_value_band("keller", steps=5, low=low)
    # Lands in the stated band (given to 3 decimals), and the band is tight.
    assert lo - 5e-4 <= band_lo < band_hi <= hi + 5e-4
    assert band_lo == pytest.approx(lo, abs=2e-3) and band_hi == pytest.approx(hi, abs=2e-3)


def test_scalar_map_matches_one_step_by_hand():
    x = torch.tensor([0.1, 0.5, 1.0], dtype=torch.float64)
    a, b, c = KELLER
    assert torch.allclose(scalar_map(x, "keller", 1), a * x + b * x**3 + c * x**5)


# T2 / T3: a Gaussian 768x3072 and its transpose, both forms.
@pytest.mark.parametrize("method", ["standard", "gram"])
@pytest.mark.parametrize("shape", [(768, 3072), (3072, 768)])
@pytest.mark.parametrize(("coefficients", "lo", "hi"), [("keller", 0.68, 1.14), ("polar_express", 0.855, 1.143)])
def test_t2_t3_singular_values_in_band(shape, method, coefficients, lo, hi):
    s = svals(orthogonalize(gaussian(*shape), coefficients=coefficients, method=method))
    assert lo <= s.min() and s.max() <= hi, (s.min().item(), s.max().item())


# T4: scale invariance, including a Frobenius norm of 1e-9 (the +1e-7 eps collapses it).
def test_t4_scale_invariance():
    G = gaussian(256, 512)
    base = orthogonalize(G)
    for scale in (1e-3, 1e3, 1e-9 / G.norm().item(), 1e-25 / G.norm().item(), 1e30 / G.norm().item()):
        out = orthogonalize(G * scale)
        assert (out - base).norm() / base.norm() < 1e-5, scale


# T5: zero input gives exact zeros; non-finite input is not silently turned into numbers.
def test_t5_zero_input_is_exact_zero():
    out = orthogonalize(torch.zeros(3, 64, 32))
    assert torch.equal(out, torch.zeros(3, 64, 32))


def test_t5_zero_matrix_in_a_batch_leaves_the_others_alone():
    G = gaussian(3, 16, 48)
    G[1] = 0
    out = orthogonalize(G)
    assert torch.equal(out[1], torch.zeros(16, 48))
    assert torch.allclose(out[0], orthogonalize(G[0]), atol=1e-6)


# T6: NS(G^T) == NS(G)^T.
@pytest.mark.parametrize("method", ["standard", "gram"])
def test_t6_transpose_equivariance(method):
    G = gaussian(200, 600)
    assert torch.allclose(orthogonalize(G.mT, method=method), orthogonalize(G, method=method).mT, atol=1e-6)


@pytest.mark.parametrize("coefficients", ["keller", "polar_express"])
def test_gram_equals_standard_in_float64(coefficients):
    G = gaussian(96, 400, dtype=torch.float64)
    std = orthogonalize(G, coefficients=coefficients, method="standard", dtype=torch.float64)
    gram = orthogonalize(G, coefficients=coefficients, method="gram", dtype=torch.float64)
    assert (gram - std).abs().max() < 1e-12


@pytest.mark.parametrize("method", ["standard", "gram"])
def test_fp32_within_1e4_of_float64_reference(method):
    G = gaussian(384, 1536)
    ref = reference_ns(G, [KELLER] * 5)
    out = orthogonalize(G, method=method).double()
    assert (out - ref).norm() / ref.norm() < 1e-4


def test_polar_express_matches_reference_table():
    G = gaussian(128, 384)
    ref = reference_ns(G, POLAR_EXPRESS, norm_factor=1.02)
    out = orthogonalize(G, coefficients="polar_express").double()
    assert (out - ref).norm() / ref.norm() < 2e-4


def test_gram_in_bf16_with_restart_stays_in_band():
    s = svals(orthogonalize(gaussian(128, 512), method="gram", dtype=torch.bfloat16))
    assert 0.6 <= s.min() and s.max() <= 1.2


def test_auto_picks_gram_only_for_wide_shapes():
    assert choose_method(384, 1536) == "gram"
    assert choose_method(384, 384) == "standard"
    assert choose_method(384, 384, "gram") == "gram"


def test_symmetric_matmul_equals_plain_product():
    S = gaussian(2, 300, 300)
    S = S + S.mT
    out = symmetric_matmul(S, S, add=S, alpha=2.0, beta=-3.0)
    assert torch.equal(out, out.mT)
    assert torch.allclose(out, -3.0 * S + 2.0 * S @ S, rtol=1e-5, atol=1e-3)


def test_explicit_coefficients_one_triple_or_one_per_step():
    G = gaussian(32, 64)
    assert torch.equal(orthogonalize(G, coefficients=[KELLER]), orthogonalize(G, coefficients="keller"))
    assert torch.equal(orthogonalize(G, coefficients=KELLER), orthogonalize(G, coefficients="keller"))
    explicit = orthogonalize(G, coefficients=list(POLAR_EXPRESS)).double()
    ref = reference_ns(G, POLAR_EXPRESS)  # explicit triples carry no 1.02 safety factor
    assert (explicit - ref).norm() / ref.norm() < 2e-4


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"steps": 0}, "ns_steps"),
        ({"coefficients": "cubic"}, "cubic"),
        ({"coefficients": [(1.0, 2.0)]}, "triples"),
        ({"coefficients": [KELLER, KELLER], "steps": 5}, "2 triples"),
        ({"coefficients": [(float("nan"), 1.0, 1.0)]}, "finite"),
        ({"method": "svd"}, "svd"),
    ],
)
def test_bad_arguments_raise_value_error_naming_them(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        orthogonalize(gaussian(8, 16), **kwargs)


def test_polar_express_past_its_table_repeats_the_last_row():
    sched = resolve_coefficients("polar_express", 7)
    assert sched.steps[5] == sched.steps[6] == POLAR_EXPRESS[-1]


dims = st.integers(min_value=1, max_value=48)


@settings(deadline=None)
@given(
    rows=dims,
    cols=dims,
    batch=st.lists(st.integers(1, 3), max_size=2),
    dtype=st.sampled_from([torch.float32, torch.float64, torch.bfloat16]),
    method=st.sampled_from(["auto", "standard", "gram"]),
    seed=st.integers(0, 2**16),
)
def test_properties_over_shapes_dtypes_and_batch_dims(rows, cols, batch, dtype, method, seed):
    G = gaussian(*batch, rows, cols, seed=seed).to(dtype)
    out = orthogonalize(G, method=method)
    assert out.shape == G.shape and out.dtype == dtype
    assert torch.isfinite(out).all()
    # Upper end of the Keller map (T1) plus rounding of the working precision.
    tol = 0.05 if dtype == torch.bfloat16 else 1e-3
    assert svals(out).max() <= 1.2037 + tol
    # Batched equals one matrix at a time; transposing commutes with the iteration.
    flat_in, flat_out = G.reshape(-1, rows, cols), out.reshape(-1, rows, cols)
    # The gram form squares the condition number (it iterates on X X^T): on ill-conditioned
    # inputs its fp32 error reaches ~1e-4 relative (OPTIMIZER.md), a few 1e-4 absolute here.
    gram = method == "gram" or (method == "auto" and choose_method(min(rows, cols), max(rows, cols)) == "gram")
    atol = {torch.bfloat16: 0.02, torch.float32: 2e-3 if gram else 1e-4, torch.float64: 1e-8 if gram else 1e-10}[dtype]
    for i in range(flat_in.shape[0]):
        single = orthogonalize(flat_in[i], method=method)
        assert torch.allclose(single.double(), flat_out[i].double(), atol=atol)
    assert torch.allclose(orthogonalize(G.mT, method=method).double(), out.mT.double(), atol=atol)


@settings(deadline=None)
@given(rows=st.integers(2, 40), cols=st.integers(2, 40), seed=st.integers(0, 2**16))
def test_output_keeps_the_singular_vectors(rows, cols, seed):
    # O = U f(S) V^T with f >= 0: O^T G = V f(S) S V^T is symmetric positive semi-definite.
    G = gaussian(rows, cols, seed=seed, dtype=torch.float64)
    O = orthogonalize(G, dtype=torch.float64)
    M = O.mT @ G
    assert torch.allclose(M, M.mT, atol=1e-8)
    assert torch.linalg.eigvalsh((M + M.mT) / 2).min() > -1e-8
