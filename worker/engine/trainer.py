"""The training loop: one job config in, a trained model, telemetry and checkpoints out."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

import optim
from contract import metrics
from contract.status import JobStatus

from .checkpoints import latest_checkpoint, load_checkpoint, restore_rng, save_checkpoint
from .config import JobConfig
from .data import TokenData, target_loss
from .device import resolve_device
from .distributed import Group
from .early_stop import EarlyStop, RungCheck
from .models import LanguageModel, build_model
from .optimizer import NS_DTYPES, build_optimizer, lr_factor, report_routing
from .outcome import RunResult, TimeLimitReached, TrainingError
from .sample import PROMPT_TOKENS, generate
from .telemetry import Report, TelemetrySink, model_metrics, to_floats

STOPS = (None, "time_limit", "cancel")  # why a run stops before a step (Trainer._stop), by number


class Trainer:
    """Runs one job.

    ``sink`` receives telemetry, ``should_cancel`` is asked before every step, checkpoints go to
    ``checkpoint_dir`` and the latest one there is resumed from.

    In a torch.distributed ``group`` every rank runs this same loop on its share of each global
    batch, under DDP; rank 0 alone asks ``should_cancel``, writes checkpoints and samples (the
    other ranks' sinks drop what they get), and every rank resumes from the same checkpoint. The
    loss, val_loss and attention maxima reported are the global batch's, as one process reports
    them; the other per-batch statistics (logits/*, router/*) are rank 0's share's.
    """

    def __init__(
        self,
        job: JobConfig,
        data: TokenData,
        checkpoint_dir: Path | None,
        sink: TelemetrySink,
        should_cancel: Callable[[], bool] | None = None,
        group: Group | None = None,
        rungs: RungCheck | None = None,
        pretrained: Path | None = None,
    ) -> None:
        self.job = replace(job, model=replace(job.model, vocab_size=data.vocab_size))
        self.pretrained = pretrained  # an uploaded model's directory, whose weights a fresh run starts from
        self.data, self.sink, self.checkpoint_dir, self.group = data, sink, checkpoint_dir, group
        self.lead = group is None or group.lead
        self.should_cancel = should_cancel or (lambda: False)
        self.device, self.autocast_dtype = resolve_device(job.train, group.local_rank if group else None)
        torch.manual_seed(job.train.seed)  # the same on every rank: the replicas start equal
        self.model = self._build_model().to(self.device)
        # The training forward and backward: through DDP in a group (the gradients arrive averaged
        # over the ranks), the model itself otherwise. Evaluation and sampling use the model.
        self.net: nn.Module = self.model
        if group is not None:
            on_cuda = self.device.type == "cuda"
            self.net = DistributedDataParallel(self.model, device_ids=[self.device] if on_cuda else None)
        # The one place the optimizer is built. In a group Muon is data-parallel: DDP averages the
        # gradients, each rank orthogonalizes the matrices it owns and the owners' parameters are
        # all-gathered (AdamW parameters are stepped on every rank, on the same gradients).
        self.optimizer = build_optimizer(
            self.model, job.optimizer, distributed=group is not None, ns_dtype=self._group_ns_dtype()
        )
        self.base_lrs = [g["lr"] for g in self.optimizer.param_groups]
        self.step = 0
        self.last: dict[str, float] = {}  # latest value of every metric (kept in checkpoints)
        self._clock = (time.perf_counter(), 0.0)  # (when this attempt's run started, elapsed_s before it)
        self.early_stop = EarlyStop.of(job.train.early_stop) if job.train.early_stop else None
        self.stopped_at: int | None = None  # the step the run stopped at, early (before train.steps)
        self.stop_reason: str | None = None
        self.rungs = rungs
        self.rung_status: JobStatus | None = None  # how ``rungs`` ended the run (stopped_early, paused), if they did

    def _build_model(self) -> LanguageModel:
        """The job's model: freshly initialised, or with the uploaded model's weights (``pretrained``)."""
        if self.pretrained is None:
            return build_model(self.job.model)
        try:
            return build_model(self.job.model, self.pretrained)
        except (RuntimeError, ValueError, OSError) as exc:
            detail = " ".join(str(exc).split())[:400] or type(exc).__name__
            raise TrainingError(f"the uploaded model's weights do not load: {detail}") from None

    def _group_ns_dtype(self) -> torch.dtype | None:
        """In a group, rank 0's Newton-Schulz precision for ``ns_dtype: auto``, taken by every rank.

        Rank 0's is its device's probe (optim.auto_dtype); each process probes on its own and could
        choose otherwise. None: the spec's own choice (one process, or an explicit ns_dtype).
        """
        if self.group is None or self.job.optimizer.name == "adamw" or self.job.optimizer.ns_dtype != "auto":
            return None
        choices = [dtype for dtype in NS_DTYPES.values() if dtype is not None]
        mine = choices.index(optim.auto_dtype(self.device)) if self.lead else 0
        return choices[self.group.decide(mine)]

    @property
    def summary(self) -> dict[str, Any]:
        """The run's summary so far: the latest value of each metrics.SUMMARY metric, and, once it
        stopped early, where and why."""
        summary: dict[str, Any] = {k: self.last[k] for k in metrics.SUMMARY if k in self.last}
        if self.stopped_at is not None:
            summary.update(stopped_at=self.stopped_at, stop_reason=self.stop_reason)
        return summary

    # -- the loop -------------------------------------------------------------------------------
    def run(self, resume: bool = True, init_from: Path | None = None) -> RunResult:
        """Train to the end (or a stop); resume from the latest checkpoint in ``checkpoint_dir``
        if ``resume``, else (nothing to resume) start from the weights in ``init_from``."""
        cfg, start_wall = self.job.train, time.perf_counter()
        if not (resume and self._resume()):
            if init_from is not None:
                self._warm_start(init_from)
            elif self.pretrained is not None:
                count = sum(p.numel() for p in self.model.parameters())
                self.sink.log("info", f"starting from model {self.pretrained.name} ({count:,} parameters)")
        first = self.step
        if self.lead:  # every attempt's table replaces the last; the log says it once
            report_routing(self.sink, self.model, self.job.optimizer.name, log=first == 0)
        # elapsed_s continues from the checkpoint: the run's wall time, attempts end to end.
        self._clock = (start_wall, self.last.get(metrics.ELAPSED_S, 0.0))
        tokens = step_seconds = 0.0
        while True:
            step = self.step
            values: dict[str, Any] = {}
            at_rung = self.rungs is not None and step in self.rungs.steps and 0 < step < cfg.steps
            if step % cfg.eval_every == 0 or step == cfg.steps or at_rung:
                values[metrics.VAL_LOSS] = self.evaluate()
                self.last[metrics.VAL_LOSS] = float(values[metrics.VAL_LOSS])  # in the checkpoint written next
                self.write_sample()
                self._judge(step, values)
            if step > first and (step % cfg.checkpoint_every == 0 or step in (cfg.steps, self.stopped_at)):
                self.save_checkpoint()
            if step in (cfg.steps, self.stopped_at):
                self._report(step, values)
                break
            stop = self._stop()
            if stop == "time_limit":
                if step > first and step % cfg.checkpoint_every:
                    self.save_checkpoint()
                kept = "; its state at that step is kept in a checkpoint" if step and self.checkpoint_dir else ""
                limit = f"train.max_minutes ({cfg.max_minutes:g})"
                raise TimeLimitReached(f"the run reached {limit} after {step:,} of {cfg.steps:,} steps{kept}")
            if stop == "cancel":
                if step > first and step % cfg.checkpoint_every:
                    self.save_checkpoint()
                self.sink.log("info", f"cancelled before step {step}")
                return self._result(JobStatus.CANCELLED, tokens, step_seconds, start_wall)
            report = step % self.job.telemetry.every == 0
            t0 = time.perf_counter()
            values.update(self.train_step(report))
            dt = time.perf_counter() - t0
            n_tokens = cfg.batch_size * self.job.model.seq_len
            tokens, step_seconds = tokens + n_tokens, step_seconds + dt
            if report or metrics.VAL_LOSS in values:
                if report:
                    values |= {metrics.STEP_TIME_MS: dt * 1e3, metrics.TOKENS_PER_S: n_tokens / dt}
                self._report(step, values)
        return self._result(self.rung_status or JobStatus.SUCCEEDED, tokens, step_seconds, start_wall)

    def _judge(self, step: int, values: dict[str, Any]) -> None:
        """Decide whether the run stops at the evaluation at ``step``: early stopping, then the rungs.

        Early stopping (``train.early_stop``) is asked first, then the rung decider (``rungs``, at its
        steps): the run stops here if it is to stop before its last step (at the last step it simply
        ends). Every rank keeps the early-stop rule's state on the same all-reduced value, but in a
        group the stop is rank 0's decision, taken by all (Group.decide), like a cancel: no rank can
        stop at another step. Rungs come with trials of one process only (sweeps with ASHA take no
        others).
        """
        stop, rungs = self.early_stop, self.rungs
        if stop is not None:
            stopping = stop.judge(step, float(values[stop.metric])) and step < self.job.train.steps
            if self.group is not None:
                stopping = bool(self.group.decide(int(stopping)))
            if stopping:
                self.stopped_at, self.stop_reason = step, stop.reason()
                self.sink.log("info", f"stopped early at step {step}: {self.stop_reason}")
        if self.stopped_at is None and rungs is not None and step in rungs.steps and 0 < step < self.job.train.steps:
            outcome = rungs.decide(step, float(values[rungs.metric]))
            if outcome is not None:
                status, reason = outcome
                self.rung_status = JobStatus(status)
                self.stopped_at, self.stop_reason = step, reason
                ended = self.rung_status.value.replace("_", " ")  # paused, stopped early
                self.sink.log("info", f"{ended} at step {step}: {reason}")

    def _stop(self) -> str | None:
        """Why the run stops before this step: "time_limit", "cancel" or None.

        In a group, rank 0 decides for all (its clock, its cancel flag), so that every rank stops at
        the same step.
        """
        stop = None
        if self.lead:
            stop = "time_limit" if self._past_time_limit() else "cancel" if self.should_cancel() else None
        return stop if self.group is None else STOPS[self.group.decide(STOPS.index(stop))]

    def _past_time_limit(self) -> bool:
        """Whether the run's wall time (``elapsed_s``, attempts end to end) passed ``max_minutes``."""
        limit = self.job.train.max_minutes
        started, before = self._clock
        return limit is not None and before + time.perf_counter() - started >= 60.0 * limit

    def _report(self, step: int, values: dict[str, Any]) -> None:
        """Hand the values measured at ``step`` to the sink, with the steps completed by now."""
        started, before = self._clock
        floats = to_floats(values) | {metrics.ELAPSED_S: before + time.perf_counter() - started}
        self.last.update(floats)
        self.sink.metrics(Report(step, floats, completed=self.step, summary=self.summary))

    def train_step(self, report: bool) -> dict[str, Tensor | float]:
        """One optimizer step on batch ``self.step``; returns telemetry values if ``report``."""
        cfg, step = self.job.train, self.step
        for group, base in zip(self.optimizer.param_groups, self.base_lrs):
            group["lr"] = base * lr_factor(step, cfg)
        clipping = isinstance(self.optimizer, optim.MuonClip)
        for layer in self.model.attention_layers():
            layer.reset_qk_max_logits()
            layer.record_max_logits = clipping or report
        x, y = self._batch("train", step)
        with self._autocast():
            logits = self.net(x)  # [B, T, V]
            loss = target_loss(logits, y)
            aux = self.model.aux_loss()
            total = loss if aux is None else loss + self.job.model.router_aux_weight * aux
        # The global batch's losses: every rank of a group sees the same, so all stop together on
        # a non-finite one.
        batch_loss, batch_total = loss.detach(), total.detach()
        if self.group is not None:
            batch_loss, batch_total = self.group.mean(torch.stack([batch_loss, batch_total])).unbind()
        if not torch.isfinite(batch_total):
            raise TrainingError(f"non-finite loss ({batch_total.item()}) at step {step}")
        total.backward()
        max_norm = cfg.grad_clip if cfg.grad_clip is not None else float("inf")
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)
        values: dict[str, Tensor | float] = {}
        if report:  # measured in this forward, before this step's clip
            if self.group is not None:  # the global batch's maxima, in the layers' own tensors (QK-Clip reads them)
                maxima = [layer.qk_max_logits() for layer in self.model.attention_layers()]
                self.group.max_([m for m in maxima if m is not None])
            lr = self.optimizer.param_groups[0]["lr"]
            values = {metrics.LOSS: batch_loss, metrics.LR: lr, metrics.GRAD_NORM: grad_norm}
            telemetry = self.job.telemetry
            values.update(model_metrics(self.model, logits, telemetry.per_head, telemetry.per_expert))
        if isinstance(self.optimizer, optim.MuonClip) and self.job.optimizer.qk_clip_remeasure:
            self.optimizer.step(remeasure=partial(self._measure_max_logits, x))
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if report and isinstance(self.optimizer, optim.Muon):
            stats = self.optimizer.last_step_stats()
            values.update({metrics.optimizer_series(k): v for k, v in stats.items()})
        self.step += 1
        return values

    def _measure_max_logits(self, x: Tensor) -> None:
        """Forwards that only record the attention layers' max logits, for MuonClip's re-measure.

        The re-measure runs with no grad between the update and the clip (every rank on its shard; the
        clip all-reduces the maxima): one forward of the step's batch ``x`` and, with
        ``optimizer.qk_clip_remeasure_batches`` = N, one of each of the N - 1 training batches before
        it (the layers keep the running max), so no forward is larger than training's.
        """
        earlier = range(1, min(self.job.optimizer.qk_clip_remeasure_batches, self.step + 1))
        with self._autocast():
            self.model(x)
            for back in earlier:
                self.model(self._batch("train", self.step - back)[0])

    @torch.no_grad()
    def evaluate(self) -> Tensor:
        """Mean validation loss over the fixed evaluation batches."""
        self.model.eval()
        losses = []
        for i in range(self.job.eval_batches):
            x, y = self._batch("val", i)
            with self._autocast():
                logits = self.model(x)
            losses.append(target_loss(logits, y))
        self.model.train()
        loss = torch.stack(losses).mean()
        return loss if self.group is None else self.group.mean(loss)

    def write_sample(self) -> None:
        """Hand the sink what the model writes after the fixed prompt now (telemetry.sample_tokens)."""
        n_tokens = self.job.telemetry.sample_tokens
        prompt = torch.from_numpy(self.data.sample_prompt(PROMPT_TOKENS, self.job.model.seq_len // 2).astype("int64"))
        if n_tokens == 0 or len(prompt) == 0 or not self.lead:
            return
        self.model.eval()
        with self._autocast():
            draws = torch.Generator().manual_seed(self.job.train.seed)
            ids = generate(self.model, prompt, n_tokens, self.job.model.seq_len, draws, stop=self.data.eos_id)
        self.model.train()
        self.sink.sample(self.step, self.data.decode(prompt.tolist()), self.data.decode(ids.tolist()))

    # -- checkpoints ----------------------------------------------------------------------------
    def save_checkpoint(self) -> None:
        if self.checkpoint_dir is None or not self.lead:  # the replicas are equal: rank 0 writes for all
            return
        payload = {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "data_position": self.step,  # batches are a function of (seed, step)
            "last_metrics": dict(self.last),
            "config": self.job.as_dict(),
            "tokenizer": self.data.tokenizer.to_dict() if self.data.tokenizer else None,
            "early_stop": self.early_stop.state_dict() if self.early_stop else None,
        }
        path, nbytes = save_checkpoint(self.checkpoint_dir, self.step, payload)
        self.sink.checkpoint(self.step, path, nbytes, dict(self.last))

    def _resume(self) -> bool:
        """Continue from the latest checkpoint in ``checkpoint_dir``; whether there was one."""
        path = latest_checkpoint(self.checkpoint_dir) if self.checkpoint_dir else None
        if path is None:
            return False
        state = load_checkpoint(path)
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        restore_rng(state["rng"])
        self.step = state["step"]
        self.last.update(state.get("last_metrics", {}))
        if self.early_stop is not None and state.get("early_stop"):
            self.early_stop.load_state_dict(state["early_stop"])
        self.sink.log("info", f"resumed from {path.name} at step {self.step}")
        return True

    def _warm_start(self, path: Path) -> None:
        """Start from another run's checkpoint (``init_from``).

        Its weights, strictly, and its optimizer state if ``init_from.optimizer_state``. What makes
        this run its own stays so: its hyperparameters (a fine-tune may change them), step counter
        (0), RNG and metrics.
        """
        state = load_checkpoint(path)
        with_optimizer = self.job.init_from is not None and self.job.init_from.optimizer_state
        try:
            self.model.load_state_dict(state["model"])
            if with_optimizer:
                ours = [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]
                self.optimizer.load_state_dict(state["optimizer"])
                for group, hyperparameters in zip(self.optimizer.param_groups, ours):
                    group.update(hyperparameters)
        except (RuntimeError, ValueError, KeyError) as exc:
            detail = " ".join(str(exc).split())[:400] or type(exc).__name__
            raise TrainingError(f"the warm start's checkpoint does not fit this model: {detail}") from None
        loaded = "weights and optimizer state" if with_optimizer else "weights"
        self.sink.log("info", f"warm start: the {loaded} of {path.name} (step {state['step']}); this run counts from 0")

    # -- helpers --------------------------------------------------------------------------------
    def _batch(self, split: str, index: int) -> tuple[Tensor, Tensor]:
        cfg = self.job.train
        rank, world = (self.group.rank, self.group.world) if self.group else (0, 1)
        x, y = self.data.batch(split, index, cfg.batch_size, self.job.model.seq_len, cfg.seed, rank, world)
        return x.to(self.device), y.to(self.device)

    def _autocast(self):
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def _result(self, status: JobStatus, tokens: float, seconds: float, start: float) -> RunResult:
        return RunResult(
            status=status,
            steps=self.step,
            summary=self.summary,
            tokens_per_s=tokens / seconds if seconds else None,
            wall_s=time.perf_counter() - start,
        )
