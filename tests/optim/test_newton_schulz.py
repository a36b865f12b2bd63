"""Newton–Schulz family: OPTIMIZER.md rows T1-T6, the gram form, and properties over shapes."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import optim.precision as precision
from optim import KELLER, POLAR_EXPRESS, Muon, orthogonalize, resolve_coefficients, scalar_map, singular_value_band
from optim.newton_schulz import _left_multiply_, choose_method, normalize
from optim.precision import auto_dtype
from optim.scratch import SCRATCH_ALIGN, Scratch, fit

CPU = torch.device("cpu")
FP32 = torch.float32


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


BANDS = [("keller", 0.68, 1.14), ("polar_express", 0.855, 1.143)]  # T2, T3
# T2's Gaussian and its transpose, and the non-square shapes of bench/optim_step.py's GPT set.
BENCH_SHAPES = [(768, 3072), (3072, 768), (1152, 384), (1536, 384), (384, 1536)]


# T2 / T3: fp32 in both forms.
@pytest.mark.parametrize("method", ["standard", "gram"])
@pytest.mark.parametrize("shape", [(768, 3072), (3072, 768)])
@pytest.mark.parametrize(("coefficients", "lo", "hi"), BANDS)
def test_t2_t3_singular_values_in_band(shape, method, coefficients, lo, hi):
    s = svals(orthogonalize(gaussian(*shape), coefficients=coefficients, method=method, dtype=FP32))
    assert lo <= s.min() and s.max() <= hi, (s.min().item(), s.max().item())


# T2 / T3 for the bf16 path (method "auto", which is the standard form in bf16) on every benchmarked shape.
@pytest.mark.parametrize("shape", BENCH_SHAPES)
@pytest.mark.parametrize(("coefficients", "lo", "hi"), BANDS)
def test_t2_t3_bf16_path_in_band(shape, coefficients, lo, hi):
    s = svals(orthogonalize(gaussian(*shape, seed=3), coefficients=coefficients, dtype=torch.bfloat16))
    assert lo <= s.min() and s.max() <= hi, (s.min().item(), s.max().item())


# T2 / T3 for the fp16 path (CUDA's automatic precision; method "auto": the gram form with one restart for
# every non-square shape here) on every benchmarked shape.
@pytest.mark.parametrize("shape", BENCH_SHAPES)
@pytest.mark.parametrize(("coefficients", "lo", "hi"), BANDS)
def test_t2_t3_fp16_path_in_band(shape, coefficients, lo, hi):
    assert choose_method(*sorted(shape), dtype=torch.float16) == "gram"
    s = svals(orthogonalize(gaussian(*shape, seed=3), coefficients=coefficients, dtype=torch.float16))
    assert lo <= s.min() and s.max() <= hi, (s.min().item(), s.max().item())


@pytest.mark.parametrize("coefficients", ["keller", "polar_express"])
def test_fp16_gram_is_closer_to_float64_than_bf16_standard(coefficients):
    # fp16's 3 more mantissa bits: its gram form lands nearer the exact iteration than bf16's standard form.
    G = gaussian(384, 1536, seed=4)
    steps = resolve_coefficients(coefficients, 5)
    ref = reference_ns(G, steps.steps, steps.norm_factor)

    def error(dtype, method):
        out = orthogonalize(G, coefficients=coefficients, method=method, dtype=dtype).double()
        return float((out - ref).norm() / ref.norm())

    fp16_gram, bf16_standard = error(torch.float16, "gram"), error(torch.bfloat16, "standard")
    assert fp16_gram < 5e-3 and fp16_gram < bf16_standard / 2, (fp16_gram, bf16_standard)


# The square 384x384 of the benchmark: a Gaussian's smallest singular value is ~1e-4 of its norm, which five
# steps cannot lift into T2's band, so the band is the scalar map's over that input's [low, 1], plus bf16 rounding.
@pytest.mark.parametrize("coefficients", ["keller", "polar_express"])
def test_bf16_path_square_matrix_follows_the_scalar_map(coefficients):
    G = gaussian(384, 384, seed=3)
    low = float(torch.linalg.svdvals(G.double()).min() / G.double().norm())
    band_lo, band_hi = singular_value_band(coefficients, low=low)
    s = svals(orthogonalize(G, coefficients=coefficients, dtype=torch.bfloat16))
    assert band_lo * 0.9 <= s.min() and s.max() <= band_hi + 5e-3, (s.min().item(), s.max().item(), band_lo, band_hi)


# T4: scale invariance, including a Frobenius norm of 1e-9 (the +1e-7 eps collapses it).
def test_t4_scale_invariance():
    G = gaussian(256, 512)
    for dtype, tol in ((FP32, 1e-5), (torch.float16, 0.01), (torch.bfloat16, 0.05)):
        base = orthogonalize(G, dtype=dtype)
        for scale in (1e-3, 1e3, 1e-9 / G.norm().item(), 1e-25 / G.norm().item(), 1e30 / G.norm().item()):
            out = orthogonalize(G * scale, dtype=dtype)
            assert (out - base).norm() / base.norm() < tol, (dtype, scale)


# T5: zero input gives exact zeros; non-finite input is not silently turned into numbers.
def test_t5_zero_input_is_exact_zero():
    out = orthogonalize(torch.zeros(3, 64, 32))
    assert torch.equal(out, torch.zeros(3, 64, 32))


def test_t5_zero_matrix_in_a_batch_leaves_the_others_alone():
    G = gaussian(3, 16, 48)
    G[1] = 0
    out = orthogonalize(G, dtype=FP32)
    assert torch.equal(out[1], torch.zeros(16, 48))
    assert torch.allclose(out[0], orthogonalize(G[0], dtype=FP32), atol=1e-6)


# T6: NS(G^T) == NS(G)^T.
@pytest.mark.parametrize("method", ["standard", "gram"])
def test_t6_transpose_equivariance(method):
    G = gaussian(200, 600)
    out = orthogonalize(G, method=method, dtype=FP32)
    assert torch.allclose(orthogonalize(G.mT, method=method, dtype=FP32), out.mT, atol=1e-6)


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
    out = orthogonalize(G, method=method, dtype=FP32).double()
    assert (out - ref).norm() / ref.norm() < 1e-4


def test_polar_express_matches_reference_table():
    G = gaussian(128, 384)
    ref = reference_ns(G, POLAR_EXPRESS, norm_factor=1.02)
    out = orthogonalize(G, coefficients="polar_express", dtype=FP32).double()
    assert (out - ref).norm() / ref.norm() < 2e-4


def test_gram_in_bf16_with_restart_stays_in_band():
    s = svals(orthogonalize(gaussian(128, 512), method="gram", dtype=torch.bfloat16))
    assert 0.6 <= s.min() and s.max() <= 1.2


def test_auto_picks_gram_only_for_wide_shapes_with_fp16_mantissa_or_more():
    assert choose_method(384, 1536) == "gram"
    assert choose_method(384, 1536, dtype=torch.float64) == "gram"
    assert choose_method(384, 1536, dtype=torch.float16) == "gram"
    assert choose_method(384, 384, dtype=torch.float16) == "standard"
    assert choose_method(384, 384) == "standard"
    assert choose_method(384, 384, "gram") == "gram"
    assert choose_method(384, 1536, dtype=torch.bfloat16) == "standard"  # bf16 gram leaves the T2/T3 bands
    assert choose_method(384, 1536, "gram", torch.bfloat16) == "gram"


def test_auto_takes_gram_on_cuda_only_for_large_matrices():
    # On CUDA the gram form's extra launches lose at m = 384 and its saved flops win at m = 1024.
    assert choose_method(384, 1536, dtype=torch.float16, device_type="cuda") == "standard"
    assert choose_method(1024, 4096, dtype=torch.float16, device_type="cuda") == "gram"
    assert choose_method(1024, 4096, dtype=torch.bfloat16, device_type="cuda") == "standard"
    assert choose_method(1024, 1024, dtype=torch.float16, device_type="cuda") == "standard"
    assert choose_method(384, 1536, "gram", torch.float16, "cuda") == "gram"


@pytest.fixture
def probe(monkeypatch):
    """Fake device facts for auto_dtype: set probe.capable and probe.speedup; counts the probes."""

    class Probe:
        capable, speedup, calls = True, 1.0, 0

        def measure(self, device):
            self.calls += 1
            return self.speedup

    fake = Probe()
    monkeypatch.setattr(precision, "narrow_capable", lambda device: fake.capable)
    monkeypatch.setattr(precision, "narrow_speedup", fake.measure)
    auto_dtype.cache_clear()
    yield fake
    auto_dtype.cache_clear()


def test_auto_dtype_is_fp32_where_the_probe_measures_bf16_slower(probe):
    probe.speedup = 0.05  # bf16 20x slower: a CPU without native bf16
    assert auto_dtype(CPU) == FP32
    G = gaussian(96, 400)
    assert torch.equal(orthogonalize(G), orthogonalize(G, dtype=FP32))


def test_auto_dtype_is_bf16_where_the_probe_measures_bf16_faster(probe):
    probe.speedup = 2.5
    assert auto_dtype(CPU) == torch.bfloat16
    G = gaussian(96, 400)
    assert torch.equal(orthogonalize(G), orthogonalize(G, dtype=torch.bfloat16))
    assert orthogonalize(G).dtype == FP32  # the output keeps the input's dtype
    assert orthogonalize(G.double()).dtype == torch.float64  # fp64 input stays in fp64


def test_auto_dtype_is_fp16_on_cuda_where_the_probe_measures_it_faster(probe):
    probe.speedup = 10.0
    assert auto_dtype(torch.device("cuda", 0)) == torch.float16
    assert auto_dtype(CPU) == torch.bfloat16
    assert precision.narrow_dtype(torch.device("cuda")) == torch.float16


def test_auto_dtype_needs_a_clear_speedup_and_native_bf16(probe):
    probe.speedup = precision.MIN_SPEEDUP * 0.9
    assert auto_dtype(CPU) == FP32
    auto_dtype.cache_clear()
    probe.capable, probe.speedup = False, 10.0
    assert auto_dtype(CPU) == FP32
    assert probe.calls == 1  # no native bf16: no probe


def test_auto_dtype_is_decided_once_per_process(probe):
    probe.speedup = 2.5
    for _ in range(3):
        orthogonalize(gaussian(16, 32))
    p = torch.nn.Parameter(gaussian(16, 32))
    p.grad = gaussian(16, 32, seed=1)
    Muon([p], lr=0.02).step()
    assert probe.calls == 1


def test_explicit_dtype_wins_over_the_automatic_choice(probe):
    G = gaussian(96, 400)
    probe.speedup = 0.05
    fp32_auto = orthogonalize(G)
    auto_dtype.cache_clear()
    probe.speedup = 2.5
    assert torch.equal(orthogonalize(G, dtype=FP32), fp32_auto)
    assert not torch.equal(orthogonalize(G), fp32_auto)


def test_the_probe_measures_a_positive_speedup():
    assert precision.narrow_speedup(CPU) > 0


def test_left_multiply_in_place_equals_the_product():
    M, X = gaussian(2, 24, 24), gaussian(2, 24, 61, seed=1)  # 61 columns: two full blocks of 24 and one of 13
    expected = M @ X
    W = torch.empty(2, 24, 24)
    assert _left_multiply_(M, X, W) is X
    assert torch.allclose(X, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_normalize_survives_tiny_entries_and_keeps_zero_exact(dtype):
    X = (gaussian(3, 20, 50) * 1e-30).to(dtype)  # squares below fp32's range
    X[1] = 0
    dst = torch.empty(3, 20, 50)
    normalize(X, dst=dst)
    norms = torch.linalg.vector_norm(dst, dim=(-2, -1))
    assert torch.allclose(norms[[0, 2]], torch.ones(2), atol=1e-5) and norms[1] == 0
    if dtype == torch.float32:
        assert normalize(X) is X and torch.equal(X, dst)  # in place


def test_bf16_normalizes_in_place_and_rescales_only_out_of_range_norms():
    # In place in bf16 (fp32's range): the squares are summed in fp32; a norm whose squares
    # would leave fp32's range (entries near 1e-30, 1e25) takes the exact power-of-two rescale.
    for scale in (1.0, 1e-30, 1e25):
        X = (gaussian(3, 20, 50) * scale).to(torch.bfloat16)
        X[1] = 0
        expected = X.double() / torch.linalg.vector_norm(X.double(), dim=(-2, -1), keepdim=True).clamp_min(1e-300)
        assert normalize(X) is X and X.dtype == torch.bfloat16
        assert (X.double() - expected).abs().max() < 1.5e-2 * expected.abs().max(), scale  # two bf16 roundings
        norms = torch.linalg.vector_norm(X.double(), dim=(-2, -1))
        assert torch.allclose(norms[[0, 2]], torch.ones(2, dtype=torch.float64), atol=1e-2) and norms[1] == 0
    with pytest.raises(ValueError, match="fp32 or wider"):
        normalize(gaussian(2, 4, 8).half())  # fp16 in place would lose small gradients


def test_tall_standard_form_runs_untransposed_and_equals_the_wide_one():
    G = gaussian(2, 300, 96)  # tall: A = X^T X, X <- a X + X P, no transposed copy
    tall = orthogonalize(G, method="standard", dtype=FP32)
    wide = orthogonalize(G.mT.contiguous(), method="standard", dtype=FP32).mT
    assert tall.is_contiguous() and torch.allclose(tall, wide, atol=1e-5)
    X, scratch = G.clone(), Scratch()
    out = orthogonalize(X, method="standard", dtype=FP32, overwrite_input=True, scratch=scratch)
    assert out.shape == G.shape and out.is_contiguous() and torch.allclose(out, tall, atol=1e-6)
    assert scratch.nbytes <= (2 * 96 * 96 + 300 * 96 + 3 * SCRATCH_ALIGN) * 2 * 4  # A, P, one of X's shape


@pytest.mark.parametrize("shape", [(96, 400), (400, 96), (3, 64, 64)])  # gram, gram transposed, standard
def test_a_scratch_is_reused_and_changes_nothing(shape):
    G = gaussian(*shape)
    scratch = Scratch()
    first = orthogonalize(G, dtype=FP32, scratch=scratch).clone()
    pointers = {key: t.data_ptr() for key, t in scratch._flat.items()}
    again = orthogonalize(G, dtype=FP32, scratch=scratch)
    assert {key: t.data_ptr() for key, t in scratch._flat.items()} == pointers
    assert torch.equal(first, again) and torch.equal(again, orthogonalize(G, dtype=FP32))
    # four m x m matrices, a copy of G and (small) the result: O(m^2 + m n), nothing per iteration
    assert 0 < scratch.nbytes <= (4 * 96 * 96 + 2 * 96 * 400 + 6 * SCRATCH_ALIGN) * 4


@pytest.mark.parametrize(
    ("shape", "method", "inside"),
    [
        ((2, 96, 400), "standard", 3),
        ((2, 96, 150), "standard", 2),
        ((2, 64, 64), "standard", 2),
        ((2, 96, 400), "gram", 5),
    ],
)
def test_bf16_work_in_the_input_memory_changes_nothing(shape, method, inside):
    # With overwrite_input, a scratch and a narrower working precision, the input's own memory
    # (free once copied to bf16) holds the iteration's matrices as far as they fit: n >= 2m all
    # three of the standard form, else A and P (the gram form's four m x m and its result here);
    # the result is moved out of it before it is converted back into the input. Same numbers, a
    # smaller scratch.
    G = gaussian(*shape)
    expected = orthogonalize(G, dtype=torch.bfloat16, method=method)
    X, scratch = G.clone(), Scratch()
    got = orthogonalize(X, dtype=torch.bfloat16, method=method, overwrite_input=True, scratch=scratch)
    assert got.data_ptr() == X.data_ptr() and got.dtype == FP32 and torch.equal(got, expected)
    B, m, n = shape
    mats = [(B, m, m)] * 4 + [(B, m, n)] if method == "gram" else [(B, m, m), (B, m, m), (B, m, n)]
    kept = fit(X.view(-1).view(torch.bfloat16), mats)
    assert len(kept[0]) == inside
    outside = sum(math.prod(s) for s in kept[1]) + B * m * n  # what did not fit, and the bf16 copy
    assert scratch.nbytes <= (outside + 4 * SCRATCH_ALIGN) * 2


def test_a_smaller_carve_reuses_the_buffer_and_a_larger_one_replaces_it():
    scratch = Scratch()
    a, b = scratch.carve(FP32, CPU, (10, 10), (3,))
    assert b.data_ptr() - a.data_ptr() == 2 * SCRATCH_ALIGN * 4  # 100 elements: two aligned spans of 64
    (c,) = scratch.carve(FP32, CPU, (5, 5))
    assert c.data_ptr() == a.data_ptr()
    (d,) = scratch.carve(FP32, CPU, (100, 100))
    assert d.shape == (100, 100) and 100 * 100 * 4 <= scratch.nbytes < (100 * 100 + SCRATCH_ALIGN) * 4


def test_explicit_coefficients_one_triple_or_one_per_step():
    G = gaussian(32, 64)
    assert torch.equal(orthogonalize(G, coefficients=[KELLER]), orthogonalize(G, coefficients="keller"))
    assert torch.equal(orthogonalize(G, coefficients=KELLER), orthogonalize(G, coefficients="keller"))
    explicit = orthogonalize(G, coefficients=list(POLAR_EXPRESS), dtype=FP32).double()
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
    work = torch.float64 if dtype == torch.float64 else FP32
    out = orthogonalize(G, method=method, dtype=work)
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
        single = orthogonalize(flat_in[i], method=method, dtype=work)
        assert torch.allclose(single.double(), flat_out[i].double(), atol=atol)
    assert torch.allclose(orthogonalize(G.mT, method=method, dtype=work).double(), out.mT.double(), atol=atol)


@settings(deadline=None)
@given(rows=st.integers(2, 40), cols=st.integers(2, 40), seed=st.integers(0, 2**16))
def test_output_keeps_the_singular_vectors(rows, cols, seed):
    # O = U f(S) V^T with f >= 0: O^T G = V f(S) S V^T is symmetric positive semi-definite.
    G = gaussian(rows, cols, seed=seed, dtype=torch.float64)
    O = orthogonalize(G, dtype=torch.float64)
    M = O.mT @ G
    assert torch.allclose(M, M.mT, atol=1e-8)
    assert torch.linalg.eigvalsh((M + M.mT) / 2).min() > -1e-8
