"""Muon: momentum orthogonalized by Newton–Schulz, with AdamW for the non-matrix parameters.

One optimizer following the torch.optim contract. Its step reads as phases:
finite check -> momentum -> orthogonalize (same-shape matrices batched) -> scale and apply.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from .adamw import adamw_update
from .newton_schulz import METHODS, default_dtype, orthogonalize, resolve_coefficients
from .timing import PhaseTimer

ADJUST_LR = ("original", "match_rms_adamw", "spectral")
NS_DTYPES = (None, torch.float32, torch.bfloat16, torch.float16, torch.float64)
# Same-shape matrices are stacked into batches of at most this many bytes of gradient (a matrix
# larger than that is a batch of its own): batching amortises per-call overhead on small
# matrices, the cap bounds the step's transient memory. On the benchmark's GPT set (CPU, bf16 NS)
# 1 MiB batches step as fast as 4 MiB ones and peak 6-8 MiB lower.
MAX_BATCH_BYTES = 1 << 20


def update_scale(rows: int, cols: int, adjust_lr: str) -> float:
    """Multiplier on lr for an orthogonalized [rows, cols] update (the flattened 2D shape)."""
    if adjust_lr == "original":  # Keller Jordan's reference and torch.optim.Muon's default
        return math.sqrt(max(1.0, rows / cols))
    if adjust_lr == "match_rms_adamw":  # Moonlight (arXiv 2502.16982): update RMS ~0.2, like AdamW
        return 0.2 * math.sqrt(max(rows, cols))
    if adjust_lr == "spectral":
        return math.sqrt(rows / cols)
    raise ValueError(f"adjust_lr must be one of {ADJUST_LR}, got {adjust_lr!r}")


def as_matrices(t: Tensor, experts: bool) -> Tensor:
    """View a Muon parameter (or its gradient) as a batch of matrices [k, rows, cols].

    2D -> [1, out, in]; experts [E, out, in] -> itself (one matrix per expert);
    any other >2D weight (conv) -> [1, out, prod(rest)].
    """
    if experts:
        return t
    if t.ndim == 2:
        return t.unsqueeze(0)
    return t.reshape(1, t.shape[0], -1)


def _check(name: str, value: Any, ok: bool, rule: str) -> None:
    if not ok:
        raise ValueError(f"invalid {name}: {value!r} ({rule})")


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def validate_group(group: dict[str, Any]) -> None:
    """Raise ValueError naming the first bad hyper-parameter of a param group (or of defaults)."""
    _check("lr", group["lr"], _is_number(group["lr"]) and group["lr"] >= 0, "must be a finite number >= 0")
    wd = group["weight_decay"]
    _check("weight_decay", wd, _is_number(wd) and wd >= 0, "must be a finite number >= 0")
    if not group["use_muon"]:
        betas = group["betas"]
        ok = isinstance(betas, (tuple, list)) and len(betas) == 2 and all(_is_number(b) and 0 <= b < 1 for b in betas)
        _check("adamw_betas", betas, ok, "must be two numbers in [0, 1)")
        _check("adamw_eps", group["eps"], _is_number(group["eps"]) and group["eps"] >= 0, "must be a number >= 0")
        return
    m = group["momentum"]
    _check("momentum", m, _is_number(m) and 0 <= m < 1, "must be in [0, 1)")
    _check("nesterov", group["nesterov"], isinstance(group["nesterov"], bool), "must be a bool")
    _check("ns_method", group["ns_method"], group["ns_method"] in METHODS, f"must be one of {METHODS}")
    _check("ns_dtype", group["ns_dtype"], group["ns_dtype"] in NS_DTYPES, f"must be one of {NS_DTYPES}")
    _check("adjust_lr", group["adjust_lr"], group["adjust_lr"] in ADJUST_LR, f"must be one of {ADJUST_LR}")
    resolve_coefficients(group["ns_coefficients"], group["ns_steps"])  # raises on bad steps or coefficients


@dataclass
class StepStats:
    """What one step did, for telemetry; tensors are read (and synced) only when asked for."""

    update_sq_sum: Tensor | float = 0.0
    update_numel: int = 0
    nonfinite_skipped: int = 0
    ns_timer: PhaseTimer | None = None
    extra: dict[str, Tensor | float] = field(default_factory=dict)

    def as_dict(self) -> dict[str, float]:
        """update_rms: RMS of the applied Muon updates (parameter change, decay excluded);
        ns_time_ms: wall time of the orthogonalization phase; nonfinite_skipped: parameters
        whose gradient or update was not finite, so they were left unchanged this step."""
        rms = math.sqrt(float(self.update_sq_sum) / self.update_numel) if self.update_numel else 0.0
        out = {
            "update_rms": rms,
            "ns_time_ms": self.ns_timer.elapsed_ms() if self.ns_timer else 0.0,
            "nonfinite_skipped": float(self.nonfinite_skipped),
        }
        out.update({k: float(v) for k, v in self.extra.items()})
        return out


@dataclass
class _Entry:
    """One Muon parameter as a batch of matrices [k, rows, cols], k = E for expert weights."""

    param: Tensor
    grad: Tensor
    buf: Tensor
    scale: float  # lr multiplier from the matrix shape (adjust_lr)

    @property
    def tall(self) -> bool:
        return self.grad.shape[-2] > self.grad.shape[-1]


class Muon(torch.optim.Optimizer):
    """Muon for hidden matrices and AdamW for the rest, in one torch.optim.Optimizer.

    A plain list of tensors: all Muon. Param groups with ``"use_muon": False`` are stepped with
    bias-corrected AdamW (``lr``/``betas``/``eps``/``weight_decay`` in the group, defaulting
    to ``adamw_*``); groups with ``"experts": True`` hold [E, out, in] weights orthogonalized per
    expert. See :func:`optim.split_params` for routing a model's parameters by role.
    ``ns_dtype``: the Newton–Schulz precision; None chooses per device (:func:`optim.auto_dtype`).

    Persistent state: ``momentum_buffer`` per Muon parameter; ``exp_avg``, ``exp_avg_sq`` and
    ``step`` per AdamW parameter.
    """

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 0.02,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_steps: int = 5,
        ns_coefficients: str | tuple = "keller",
        ns_method: str = "auto",
        ns_dtype: torch.dtype | None = None,
        adjust_lr: str = "original",
        weight_decay: float = 0.0,
        adamw_lr: float = 3e-3,  # tuned for the engine's models (docs/benchmarks.md); the JobSpec's default too
        adamw_betas: tuple[float, float] = (0.9, 0.95),
        adamw_eps: float = 1e-8,
        adamw_weight_decay: float = 0.0,
    ) -> None:
        self._adamw_defaults = {
            "lr": adamw_lr,
            "betas": adamw_betas,
            "eps": adamw_eps,
            "weight_decay": adamw_weight_decay,
        }
        validate_group({**self._adamw_defaults, "use_muon": False})
        defaults = dict(
            lr=lr, momentum=momentum, nesterov=nesterov, ns_steps=ns_steps, ns_coefficients=ns_coefficients,
            ns_method=ns_method, ns_dtype=ns_dtype, adjust_lr=adjust_lr, weight_decay=weight_decay,
            use_muon=True, experts=False,
        )  # fmt: skip
        validate_group(defaults)
        self._last_stats = StepStats()
        self._workspace: dict[tuple, Tensor] = {}  # (dtype, device) -> flat buffer the batches are stacked in
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        group = dict(param_group)
        if not group.get("use_muon", True):
            for key, value in self._adamw_defaults.items():
                group.setdefault(key, group.pop(f"adamw_{key}", value))
        super().add_param_group(group)
        group = self.param_groups[-1]
        validate_group(group)
        for p in group["params"]:
            if not group["use_muon"]:
                continue
            if group["experts"] and p.ndim != 3:
                raise ValueError(f"expert weights must be [E, out, in]; got a parameter of shape {tuple(p.shape)}")
            if p.ndim < 2:
                raise ValueError(
                    f"Muon needs matrices; a parameter of shape {tuple(p.shape)} belongs in a "
                    '"use_muon": False (AdamW) group'
                )

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        for group in self.param_groups:  # checkpoints from before a key existed stay loadable
            group.setdefault("use_muon", True)
            group.setdefault("experts", False)
            group.setdefault("ns_method", "auto")
            group.setdefault("ns_dtype", None)
        self.__dict__.setdefault("_last_stats", StepStats())
        self.__dict__.setdefault("_workspace", {})
        self.__dict__.setdefault("_adamw_defaults", {})

    def last_step_stats(self) -> dict[str, float]:
        """Statistics of the latest step: update_rms, ns_time_ms, nonfinite_skipped (+ subclass keys)."""
        return self._last_stats.as_dict()

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        stats = StepStats()
        finite = self._finite_grads()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None and finite[p]]
            if group["use_muon"]:
                self._muon_step(group, params, stats)
            else:
                self._adamw_step(group, params)
        stats.nonfinite_skipped += sum(1 for ok in finite.values() if not ok)
        self._last_stats = stats
        return loss

    def _finite_grads(self) -> dict[Tensor, bool]:
        """Whether each gradient is finite: one fused max-abs (which, unlike the L2 norm, cannot
        overflow for finite entries) and one host transfer per device."""
        params = [p for group in self.param_groups for p in group["params"] if p.grad is not None]
        for p in params:
            if p.grad.is_sparse:
                raise RuntimeError("Muon does not support sparse gradients")
            if torch.is_complex(p):
                raise RuntimeError("Muon does not support complex parameters")
        if not params:
            return {}
        by_device: dict[torch.device, list[Tensor]] = defaultdict(list)
        for p in params:
            by_device[p.grad.device].append(p)
        finite: dict[Tensor, bool] = {}
        for group in by_device.values():
            peaks = torch._foreach_norm([p.grad for p in group], ord=float("inf"))
            finite.update(zip(group, torch.stack([n.float() for n in peaks]).isfinite().tolist()))
        return finite

    def _muon_step(self, group: dict[str, Any], params: list[Tensor], stats: StepStats) -> None:
        if not params:
            return
        beta, lr = group["momentum"], group["lr"]
        bufs = []
        for p in params:
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            bufs.append(state["momentum_buffer"])
        grads = [p.grad for p in params]
        torch._foreach_lerp_(bufs, grads, 1.0 - beta)  # EMA momentum; p.grad is only read

        buckets: dict[tuple, list[_Entry]] = defaultdict(list)  # same oriented shape -> one batch
        for p, g, buf in zip(params, grads, bufs):
            g3, buf3 = as_matrices(g, group["experts"]), as_matrices(buf, group["experts"])
            rows, cols = g3.shape[-2:]
            entry = _Entry(p, g3, buf3, update_scale(rows, cols, group["adjust_lr"]))
            buckets[(min(rows, cols), max(rows, cols), g.dtype, g.device)].append(entry)

        timer = stats.ns_timer = stats.ns_timer or PhaseTimer(params[0].device)
        for entries in (chunk for bucket in buckets.values() for chunk in _batches(bucket)):
            X = _nesterov_input(entries, beta, group["nesterov"], self._stacking_buffer(entries))  # [B, m, n]
            dtype = group["ns_dtype"] or default_dtype(X)
            with timer:
                O = orthogonalize(
                    X, group["ns_steps"], group["ns_coefficients"], group["ns_method"], dtype,
                    overwrite_input=True, out_dtype=dtype,
                )  # fmt: skip
            del X
            _apply_updates(entries, O, lr, group["weight_decay"], stats)

    def _stacking_buffer(self, entries: list[_Entry]) -> Tensor:
        """A flat buffer, reused across batches and steps, for stacking a batch's NS inputs."""
        first = entries[0].grad
        numel = sum(e.grad.numel() for e in entries)
        key = (first.dtype, first.device)
        buffer = self._workspace.get(key)
        if buffer is None or buffer.numel() < numel:
            self._workspace.pop(key, None)  # free the old one before allocating
            buffer = self._workspace[key] = torch.empty(numel, dtype=first.dtype, device=first.device)
        return buffer

    def _adamw_step(self, group: dict[str, Any], params: list[Tensor]) -> None:
        exp_avgs, exp_avg_sqs, steps = [], [], []
        for p in params:
            state = self.state[p]
            if not state:
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["step"] = torch.tensor(0.0)
            exp_avgs.append(state["exp_avg"])
            exp_avg_sqs.append(state["exp_avg_sq"])
            steps.append(state["step"])
        adamw_update(
            params, [p.grad for p in params], exp_avgs, exp_avg_sqs, steps,
            lr=group["lr"], betas=tuple(group["betas"]), eps=group["eps"], weight_decay=group["weight_decay"],
        )  # fmt: skip


def _nesterov_input(entries: list[_Entry], beta: float, nesterov: bool, buffer: Tensor) -> Tensor:
    """Stack the entries' NS inputs, oriented wide (m <= n), into a [B, m, n] view of buffer."""
    m, n = sorted(entries[0].grad.shape[-2:])
    batch = sum(e.grad.shape[0] for e in entries)
    X = buffer[: batch * m * n].view(batch, m, n)
    i = 0
    for e in entries:
        k = e.grad.shape[0]
        g, buf = (e.grad.mT, e.buf.mT) if e.tall else (e.grad, e.buf)
        if nesterov:
            torch.lerp(g, buf, beta, out=X[i : i + k])  # (1 - beta) g + beta m
        else:
            X[i : i + k].copy_(buf)
        i += k
    return X


def _apply_updates(entries: list[_Entry], O: Tensor, lr: float, weight_decay: float, stats: StepStats) -> None:
    """W <- W (1 - lr wd) - lr scale O per parameter, skipping any whose update is not finite."""
    sq = torch.linalg.vector_norm(O, dim=(1, 2), dtype=torch.promote_types(O.dtype, torch.float32)).square()
    finite = sq.isfinite().tolist()  # one host sync per bucket
    weights = []  # per matrix: (lr * scale)^2 where applied, else 0 (for update_rms)
    for e in entries:
        first, k = len(weights), e.grad.shape[0]
        ok = all(finite[first : first + k])
        weights += [(lr * e.scale) ** 2 if ok else 0.0] * k
        if not ok:
            stats.nonfinite_skipped += 1
            continue
        update = O[first : first + k]
        if weight_decay:
            e.param.mul_(1.0 - lr * weight_decay)  # decoupled, with the unadjusted lr
        e.param.add_((update.mT if e.tall else update).reshape(e.param.shape), alpha=-lr * e.scale)
        stats.update_numel += update.numel()
    stats.update_sq_sum = stats.update_sq_sum + sq.nan_to_num(0.0).dot(sq.new_tensor(weights))


def _batches(entries: list[_Entry]) -> list[list[_Entry]]:
    """Split a bucket into batches of at most MAX_BATCH_BYTES (at least one entry each)."""
    batches: list[list[_Entry]] = [[]]
    size = 0
    for e in entries:
        n = e.grad.numel() * e.grad.element_size()
        if batches[-1] and size + n > MAX_BATCH_BYTES:
            batches.append([])
            size = 0
        batches[-1].append(e)
        size += n
    return batches
