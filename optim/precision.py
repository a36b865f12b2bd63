"""The working precision of Newton–Schulz when none is given, decided once per process and device.

A 16-bit precision where the device multiplies it natively and a short probe measures it clearly
faster than fp32: fp16 on CUDA, bf16 on CPUs with AVX512-BF16 or AMX; fp32 elsewhere
(docs/optimizer.md, "The working precision").
"""

from __future__ import annotations

import functools
import math
import time

import torch
from torch import Tensor

# A 16-bit precision is the automatic choice only where a probe measures its matrix products at
# least this much faster than fp32 (a margin against timing noise).
MIN_SPEEDUP = 1.25
# The probe: PROBE_REPEATS interleaved fp32 / 16-bit products of two PROBE_SIZE^2 matrices, best of each.
# On CUDA a 512^3 product takes microseconds, about what a launch and a sync cost, so the ratio
# there is noise: an H200 read 1.16-1.32 in five fresh processes and so chose fp32 or bf16 by
# chance. At 4096^3 it read 10.3-13.3, for a few tens of ms once per process.
PROBE_SIZE = 512
PROBE_SIZE_CUDA = 4096
PROBE_REPEATS = 10
# /proc/cpuinfo flags of CPUs with native bf16 matrix instructions.
CPU_BF16_FLAGS = ("avx512_bf16", "amx_bf16")


def cpu_has_bf16() -> bool | None:
    """Whether /proc/cpuinfo lists a native bf16 matrix instruction set (AVX512-BF16 or AMX);
    None where there is no /proc/cpuinfo to read."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        return None
    return any(flag in flags for flag in CPU_BF16_FLAGS)


def narrow_dtype(device: torch.device) -> torch.dtype:
    """The 16-bit precision Newton–Schulz may run in on a device: fp16 on CUDA, bf16 elsewhere.

    The iterates are normalised (singular values up to about 1.2, the Gram form's Q up to the
    product of the steps' slopes, about 1e3), so fp16's range holds them, and its 10-bit mantissa
    (bf16: 7) keeps the update closer to the exact one and the Gram form inside the bands. CUDA
    tensor cores multiply both at one rate; CPUs have bf16 matrix instructions, not fp16 ones.
    """
    return torch.float16 if device.type == "cuda" else torch.bfloat16


def narrow_capable(device: torch.device) -> bool:
    """Whether the device multiplies its :func:`narrow_dtype` natively: any CUDA device (the probe
    then decides), or a CPU with AVX512-BF16 / AMX (one whose flags cannot be read is left to the probe)."""
    if device.type == "cuda":
        return True
    if device.type == "cpu":
        return cpu_has_bf16() is not False
    return False


def narrow_speedup(device: torch.device) -> float:
    """fp32 time / 16-bit time (:func:`narrow_dtype`) of a PROBE_SIZE^3 (CUDA: PROBE_SIZE_CUDA^3)
    matrix product on the device, best of PROBE_REPEATS interleaved runs each (after one warm-up);
    > 1 means the 16-bit product is faster."""
    size = PROBE_SIZE_CUDA if device.type == "cuda" else PROBE_SIZE
    a = torch.randn(size, size, device=device)
    operands = {dtype: a.to(dtype) for dtype in (torch.float32, narrow_dtype(device))}
    best = {dtype: math.inf for dtype in operands}
    for repeat in range(PROBE_REPEATS + 1):
        for dtype, x in operands.items():
            _sync(device)
            start = time.perf_counter()
            torch.mm(x, x)
            _sync(device)
            if repeat:  # the first round warms up kernels and caches
                best[dtype] = min(best[dtype], time.perf_counter() - start)
    return best[torch.float32] / best[narrow_dtype(device)]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@functools.cache
def auto_dtype(device: torch.device) -> torch.dtype:
    """The Newton–Schulz precision for fp32/fp16/bf16 input on a device, decided once per process.

    :func:`narrow_dtype` (fp16 on CUDA, bf16 on CPU) where the device multiplies it natively and
    the probe measures it at least MIN_SPEEDUP faster than fp32; fp32 everywhere else.
    """
    if narrow_capable(device) and narrow_speedup(device) >= MIN_SPEEDUP:
        return narrow_dtype(device)
    return torch.float32


def default_dtype(G: Tensor) -> torch.dtype:
    """The working precision for G when none is given: fp64 for fp64 input, else auto_dtype."""
    if G.dtype == torch.float64:
        return torch.float64
    return auto_dtype(G.device)
