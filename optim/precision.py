"""The working precision of Newton–Schulz when none is given, decided once per process and device.

bf16 where the device has native bf16 matrix products and a short probe measures them clearly
faster than fp32; fp32 elsewhere (docs/optimizer.md, "The working precision").
"""

from __future__ import annotations

import functools
import math
import time

import torch
from torch import Tensor

# bf16 is the automatic choice only where a probe measures bf16 matrix products at least this
# much faster than fp32 (a margin against timing noise).
BF16_MIN_SPEEDUP = 1.25
# The probe: PROBE_REPEATS interleaved fp32 / bf16 products of two PROBE_SIZE^2 matrices, best of each.
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


def bf16_capable(device: torch.device) -> bool:
    """Whether the device has native bf16 matrix products: CUDA that supports bf16, or a CPU
    with AVX512-BF16 / AMX (a CPU whose flags cannot be read is left to the probe)."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    if device.type == "cpu":
        return cpu_has_bf16() is not False
    return False


def bf16_speedup(device: torch.device) -> float:
    """fp32 time / bf16 time of a PROBE_SIZE^3 (CUDA: PROBE_SIZE_CUDA^3) matrix product on the
    device, best of PROBE_REPEATS interleaved runs each (after one warm-up); > 1 means bf16 is faster."""
    size = PROBE_SIZE_CUDA if device.type == "cuda" else PROBE_SIZE
    a = torch.randn(size, size, device=device)
    operands = {dtype: a.to(dtype) for dtype in (torch.float32, torch.bfloat16)}
    best = {dtype: math.inf for dtype in operands}
    for repeat in range(PROBE_REPEATS + 1):
        for dtype, x in operands.items():
            _sync(device)
            start = time.perf_counter()
            torch.mm(x, x)
            _sync(device)
            if repeat:  # the first round warms up kernels and caches
                best[dtype] = min(best[dtype], time.perf_counter() - start)
    return best[torch.float32] / best[torch.bfloat16]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@functools.cache
def auto_dtype(device: torch.device) -> torch.dtype:
    """The Newton–Schulz precision for fp32/fp16/bf16 input on a device, decided once per process.

    bf16 where the device has native bf16 products and the probe measures them at least
    BF16_MIN_SPEEDUP faster than fp32; fp32 everywhere else.
    """
    if bf16_capable(device) and bf16_speedup(device) >= BF16_MIN_SPEEDUP:
        return torch.bfloat16
    return torch.float32


def default_dtype(G: Tensor) -> torch.dtype:
    """The working precision for G when none is given: fp64 for fp64 input, else auto_dtype."""
    if G.dtype == torch.float64:
        return torch.float64
    return auto_dtype(G.device)
