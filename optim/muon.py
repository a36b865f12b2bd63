"""Muon: momentum orthogonalized by Newton–Schulz, with AdamW for the non-matrix parameters.

One optimizer following the torch.optim contract. Its step reads as phases:
finite check -> momentum -> orthogonalize (same-shape matrices batched in the working precision,
optim/batches.py) -> scale and apply;
under data parallelism (``distributed=True``) each rank orthogonalizes and applies only the
matrices it owns, then the owners' parameters are all-gathered (optim/distributed.py).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from .adamw import adamw_update
from .batches import Entry, apply_updates, as_matrices, entries_of, grad_of, matrix_shape, nesterov_input, split_batches
from .distributed import Ownership, ns_flops
from .hyperparams import check, validate_group
from .newton_schulz import normalizing_dtype, orthogonalize, working_bytes
from .normuon import SCALE_SPREAD, SECOND_MOMENT, normalize_batch, second_moment
from .precision import default_dtype
from .scratch import Scratch
from .stats import PhaseTimer, StepStats

# Same-shape matrices are stacked into batches whose Newton–Schulz working set (the stacked input
# in the working precision and the form's matrices, newton_schulz.working_bytes) is at most this
# many bytes; a matrix larger than that is a batch of its own. Batching amortises per-call
# overhead; the cap bounds the step's transient memory. On the benchmark's GPT set (CPU, bf16)
# 3 MiB takes the 384 x 384 matrices in pairs and the larger ones (384 x 1536: 2.8 MiB) alone, and
# the step's tensors stay under torch.optim.Muon's. Pairs of the larger ones (6 MiB) step faster
# on a 2-core AMX host, where one wide bf16 product leaves the second core idle and a batch of two
# does not, but peak above torch.optim.Muon (docs/benchmarks.md). On CUDA a call costs kernel
# launches rather than flops at these sizes, so batches there are larger (MAX_BATCH_BYTES_CUDA):
# issuing a batch's kernels took the host about 1.2 ms on an H100 machine, so that a 151 M-parameter
# step in batches of 64 MiB (13 batches) waited on the host (27.0 ms), in batches of 256 MiB (one
# per shape, 4) on the device (14.4 ms), for 1,272 MiB of peak growth against 808 (docs/benchmarks.md).
MAX_BATCH_BYTES = 3 << 20
MAX_BATCH_BYTES_CUDA = 256 << 20


class Muon(torch.optim.Optimizer):
    """Muon for hidden matrices and AdamW for the rest, in one torch.optim.Optimizer.

    A plain list of tensors: all Muon. Param groups with ``"use_muon": False`` are stepped with
    bias-corrected AdamW (``lr``/``betas``/``eps``/``weight_decay`` in the group, defaulting
    to ``adamw_*``); groups with ``"experts": True`` hold [E, out, in] weights orthogonalized per
    expert; groups with ``"row_blocks": (h1, h2, ...)`` hold 2D weights whose rows those heights
    cut exactly, each block orthogonalized on its own, with its own shape's lr scale (attention
    heads: :func:`optim.split_by_heads`). See :func:`optim.split_params` for routing a model's
    parameters by role.
    ``ns_dtype``: the Newton–Schulz precision; None chooses per device (:func:`optim.auto_dtype`).

    ``weight_decay_mode="cautious"`` (every group's, AdamW's too): decay only the entries whose
    update and weight agree in sign (Cautious Weight Decay, arXiv 2510.12402); ``"decoupled"``:
    every entry.

    ``normuon=True`` (a group's ``"normuon"``): NorMuon's update (optim/normuon.py), each
    neuron's second moment (EMA ``normuon_beta2``) normalized away after Newton–Schulz.

    Persistent state: ``momentum_buffer`` (and with NorMuon ``second_moment``) per Muon
    parameter; ``exp_avg``, ``exp_avg_sq`` and ``step`` per AdamW parameter.

    Data parallelism (``distributed=True``, torch.distributed initialised first): the gradients
    must already be averaged across the ranks of ``process_group`` (DDP does that; the optimizer
    does not reduce them) and every rank steps every time. Each Muon parameter has one owner
    (:func:`optim.distributed.assign_owners` on Newton–Schulz flops, from the shapes alone), which
    alone orthogonalizes and applies its update; an all-gather per step then gives every rank
    the owners' parameters. AdamW parameters are stepped on every rank. ``shard_momentum=True``
    keeps each momentum buffer on its owner only (ZeRO-1); ``state_dict()`` then gathers them
    and must be called on every rank. Either way ``state_dict()`` has the single-process
    layout, so a checkpoint loads at any world size. World size 1 is the plain optimizer.
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
        weight_decay_mode: str = "decoupled",
        normuon: bool = False,
        normuon_beta2: float = 0.95,
        adamw_lr: float = 3e-3,  # tuned for the engine's models (docs/benchmarks.md); the JobSpec's default too
        adamw_betas: tuple[float, float] = (0.9, 0.95),
        adamw_eps: float = 1e-8,
        adamw_weight_decay: float = 0.0,
        distributed: bool = False,
        process_group: dist.ProcessGroup | None = None,
        shard_momentum: bool = False,
    ) -> None:
        self._init_distributed(distributed, process_group, shard_momentum)
        self._adamw_defaults = {
            "lr": adamw_lr,
            "betas": adamw_betas,
            "eps": adamw_eps,
            "weight_decay": adamw_weight_decay,
            "weight_decay_mode": weight_decay_mode,
        }
        validate_group({**self._adamw_defaults, "use_muon": False})
        defaults = dict(
            lr=lr,
            momentum=momentum,
            nesterov=nesterov,
            ns_steps=ns_steps,
            ns_coefficients=ns_coefficients,
            ns_method=ns_method,
            ns_dtype=ns_dtype,
            adjust_lr=adjust_lr,
            weight_decay=weight_decay,
            weight_decay_mode=weight_decay_mode,
            normuon=normuon,
            normuon_beta2=normuon_beta2,
            use_muon=True,
            experts=False,
            row_blocks=None,
        )
        validate_group(defaults)
        self._last_stats = StepStats()
        self._stack = Scratch()  # where a batch's NS inputs are stacked (and orthogonalized in place)
        self._scratch = Scratch()  # Newton–Schulz's matrices
        super().__init__(params, defaults)

    def _init_distributed(self, distributed: bool, process_group: Any, shard_momentum: bool) -> None:
        check("distributed", distributed, isinstance(distributed, bool), "must be a bool")
        check("shard_momentum", shard_momentum, isinstance(shard_momentum, bool), "must be a bool")
        self._group, self._rank, self._world, self._shard = None, 0, 1, False
        self._owners: Ownership | None = None  # computed on first use, from the param groups
        if not distributed:
            if shard_momentum or process_group is not None:
                raise ValueError("shard_momentum and process_group apply only with distributed=True")
            return
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("Muon(distributed=True) needs torch.distributed initialised first (init_process_group)")
        rank = dist.get_rank(process_group)
        if rank < 0:
            raise ValueError("this process is not a member of process_group")
        self._group, self._rank, self._world = process_group, rank, dist.get_world_size(process_group)
        self._shard = shard_momentum and self._world > 1  # one rank owns everything: nothing to shard

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if self._shard and any("momentum_buffer" in s for s in self.state.values()):
            # A new group re-deals the owners: buffers would be left on ranks that no longer own them.
            raise RuntimeError("with shard_momentum=True, add every param group before the first step")
        self._owners = None
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
            heights = group["row_blocks"]
            if heights is not None and (group["experts"] or p.ndim != 2 or sum(heights) != p.shape[0]):
                raise ValueError(
                    f"row_blocks {list(heights)} must cut a 2D parameter's rows exactly (not expert weights); "
                    f"got a parameter of shape {tuple(p.shape)}"
                )
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
            group.setdefault("weight_decay_mode", "decoupled")
            group.setdefault("normuon", False)
            group.setdefault("normuon_beta2", 0.95)
            group.setdefault("row_blocks", None)
        self.__dict__.setdefault("_last_stats", StepStats())
        self.__dict__.setdefault("_stack", Scratch())
        self.__dict__.setdefault("_scratch", Scratch())
        self.__dict__.setdefault("_adamw_defaults", {})
        # A copy or unpickled optimizer has no process group: it is a single-process one.
        for key, value in {"_group": None, "_rank": 0, "_world": 1, "_shard": False, "_owners": None}.items():
            self.__dict__.setdefault(key, value)

    def last_step_stats(self) -> dict[str, float]:
        """Statistics of the latest step: update_rms, ns_time_ms, nonfinite_skipped (with NorMuon
        normuon/scale_spread; + subclass keys)."""
        return self._last_stats.as_dict()

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        stats = StepStats()
        if any(g["use_muon"] and g["normuon"] for g in self.param_groups):
            stats.means[SCALE_SPREAD] = [0.0, 0.0]  # on every rank, owner or not: one shape of all-reduce
        finite = self._finite_grads()
        owners = self._ownership()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None and finite[p]]
            if not group["use_muon"]:
                self._adamw_step(group, params)
            elif owners is None:
                self._muon_step(group, params, stats)
            else:  # momentum for all (replicated state) or for the owned only (sharded); NS for the owned
                mine = [p for p in params if owners.rank_of[p] == self._rank]
                self._muon_step(group, mine if self._shard else params, stats, update=mine)
        stats.settle()
        if owners is not None:
            self._share_updates(owners, stats)
        stats.nonfinite_skipped += sum(1 for ok in finite.values() if not ok)  # grads are alike on every rank
        self._last_stats = stats
        return loss

    def _ownership(self) -> Ownership | None:
        """Who owns each Muon parameter, or None when there is nothing to split.

        None for one rank, or no Muon parameters. Dealt from the shapes in param-group order, not from
        which gradients a step has, so it is the same on every rank and every step.
        """
        if self._world == 1:
            return None
        if self._owners is None:
            params = [(p, g["experts"]) for g in self.param_groups if g["use_muon"] for p in g["params"]]
            self._owners = Ownership.deal(params, [ns_flops(matrix_shape(p.shape, e)) for p, e in params], self._world)
        return self._owners if self._owners.rank_of else None

    def _share_updates(self, owners: Ownership, stats: StepStats) -> None:
        """Give every rank the owners' parameters (:meth:`Ownership.share_parameters`) and make
        the step's statistics global (one small all-reduce)."""
        owners.share_parameters(self._rank, self._group)
        totals = [stats.update_sq_sum, stats.update_numel, stats.nonfinite_skipped]  # nonfinite: updates so far
        totals += [value for pair in stats.means.values() for value in pair]
        summed = owners.sum_over_ranks(totals, self._group)
        stats.update_sq_sum, stats.update_numel, stats.nonfinite_skipped = summed[:3]
        for i, name in enumerate(stats.means):
            stats.means[name] = [summed[3 + 2 * i], summed[4 + 2 * i]]

    def _finite_grads(self) -> dict[Tensor, bool]:
        """Whether each gradient is finite: one fused L2 norm and one host transfer per device.

        A finite norm means finite entries; a norm that is not finite is either a non-finite entry or
        an overflow of finite ones, which an exact check of that gradient tells apart. (A fused
        max-abs would need no second look but is not vectorised on CPU: about 20x slower.)
        """
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
            norms = torch._foreach_norm([grad_of(p) for p in group])
            for p, ok in zip(group, torch.stack([n.float() for n in norms]).isfinite().tolist()):
                finite[p] = ok or bool(grad_of(p).isfinite().all())
        return finite

    def _muon_step(
        self, group: dict[str, Any], params: list[Tensor], stats: StepStats, update: list[Tensor] | None = None
    ) -> None:
        """Momentum for ``params``; orthogonalize and apply for ``update`` (default: the same
        parameters; under data parallelism the ones this rank owns)."""
        if not params:
            return
        beta, lr = group["momentum"], group["lr"]
        bufs = []
        for p in params:
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            bufs.append(state["momentum_buffer"])
        torch._foreach_lerp_(bufs, [grad_of(p) for p in params], 1.0 - beta)  # EMA momentum; p.grad is only read

        buckets: dict[tuple, list[Entry]] = defaultdict(list)  # same shape -> one batch
        for p in params if update is None else update:
            buf = self.state[p]["momentum_buffer"]
            for entry in entries_of(p, buf, group["experts"], group["row_blocks"], group["adjust_lr"]):
                rows, cols = entry.grad.shape[-2:]
                buckets[(rows, cols, entry.grad.dtype, entry.grad.device)].append(entry)
        if not buckets:
            return

        timer = stats.ns_timer = stats.ns_timer or PhaseTimer(params[0].device)
        cap = MAX_BATCH_BYTES_CUDA if params[0].device.type == "cuda" else MAX_BATCH_BYTES
        for (rows, cols, grad_dtype, device), bucket in buckets.items():
            dtype = group["ns_dtype"] or default_dtype(bucket[0].grad)
            per_matrix = working_bytes(rows, cols, dtype, group["ns_method"], device.type)
            for entries in split_batches(bucket, [e.grad.shape[0] * per_matrix for e in bucket], cap):
                X = nesterov_input(entries, beta, group["nesterov"], self._stack, normalizing_dtype(grad_dtype, dtype))
                with timer:
                    O = orthogonalize(  # in X's dtype and orientation, in X or in the scratch
                        X,
                        group["ns_steps"],
                        group["ns_coefficients"],
                        group["ns_method"],
                        dtype,
                        overwrite_input=True,
                        scratch=self._scratch,
                    )
                    if group["normuon"]:
                        moments = [self._second_moment(e) for e in entries]
                        stats.add_to_mean(SCALE_SPREAD, normalize_batch(O, moments, group["normuon_beta2"]))
                apply_updates(entries, O, lr, group["weight_decay"], stats, group["weight_decay_mode"] == "cautious")

    def _second_moment(self, entry: Entry) -> Tensor:
        """The entry's NorMuon second moment, [k, rows, 1] in fp32, made at its first step (a
        parameter split into row blocks keeps one [1, rows, 1], each entry viewing its rows)."""
        state, whole = self.state[entry.param], entry.rows == slice(None)
        if SECOND_MOMENT not in state:  # split parameters are 2D (add_param_group)
            state[SECOND_MOMENT] = second_moment(entry.grad if whole else as_matrices(entry.param, False))
        v = state[SECOND_MOMENT]
        return v if whole else v[0, entry.rows].view(*entry.weight.shape[:-1], 1)

    def state_dict(self) -> dict[str, Any]:
        """The torch.optim state dict, complete at any world size.

        Under data parallelism what only owners hold (sharded momentum buffers, NorMuon's second
        moments) is gathered from them (a collective: every rank must call it, like a full state
        dict under FSDP), so every rank returns the same, single-process layout.
        """
        state_dict = super().state_dict()
        owners = self._ownership()
        if owners is None:
            return state_dict
        index = {p: i for i, p in enumerate(p for group in self.param_groups for p in group["params"])}
        experts = {p: g["experts"] for g in self.param_groups for p in g["params"]}
        for key, like in self._owned_state():
            template = partial(lambda p, like: like(p, experts[p]), like=like)
            for p, buf in owners.gather_state(self.state, key, self._rank, self._group, template).items():
                state_dict["state"].setdefault(index[p], {})[key] = buf
        state_dict["state"] = dict(sorted(state_dict["state"].items()))
        return state_dict

    def _owned_state(self) -> list[tuple[str, Callable[[Tensor, bool], Tensor]]]:
        """The state only owners hold under data parallelism, each key with a tensor like its buffer
        for a parameter (and its group's experts flag): sharded momentum, NorMuon's second moments."""
        held: list[tuple[str, Callable[[Tensor, bool], Tensor]]] = []
        if self._shard:
            held.append(("momentum_buffer", lambda p, experts: p))
        if any(g["use_muon"] and g["normuon"] for g in self.param_groups):
            held.append((SECOND_MOMENT, lambda p, experts: second_moment(as_matrices(p, experts))))
        return held

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a complete state dict (from any world size); each rank then keeps the owned-only
        state (sharded momentum, NorMuon's second moments) of the parameters it owns only."""
        super().load_state_dict(state_dict)
        owners = self._ownership()
        if owners is not None:
            for key, _ in self._owned_state():
                owners.drop_others(self.state, key, self._rank)

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
            params,
            [grad_of(p) for p in params],
            exp_avgs,
            exp_avg_sqs,
            steps,
            lr=group["lr"],
            betas=tuple(group["betas"]),
            eps=group["eps"],
            weight_decay=group["weight_decay"],
            cautious=group["weight_decay_mode"] == "cautious",
        )
