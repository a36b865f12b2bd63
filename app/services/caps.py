"""Resource caps checked before a job is queued, with the engine's own figures (worker.engine.facts).

They bound parameters, steps, tokens per batch, the memory a run will take, its telemetry volume,
its checkpoints and its run time.
"""

from __future__ import annotations

from app.errors import ValidationFailed
from app.settings import Settings
from contract.spec import JobSpec
from worker.engine.facts import moe_experts, parameter_count, peak_memory_bytes, series_per_step


def check_caps(spec: JobSpec, vocab: int, corpus_bytes: int, settings: Settings) -> None:
    """Every cap a job's spec must fit before it is queued; the first one it misses is a 422
    naming the field and giving the limit."""
    for name, cap in (("nproc", settings.max_nproc), ("nnodes", settings.max_nnodes)):
        if (wanted := getattr(spec.resources, name)) > cap:
            setting = f"MUONFORGE_MAX_{name.upper()}"
            raise ValidationFailed(
                f"resources.{name} {wanted} exceeds this server's cap of {cap} ({setting})",
                param=f"resources.{name}",
            )
    model, train, telemetry = spec.model, spec.train, spec.telemetry
    params = parameter_count(model, vocab)
    if params > settings.max_params:
        raise ValidationFailed(
            f"the model has {params:,} parameters; this server's cap is {settings.max_params:,}", param="model"
        )
    if train.steps > settings.max_steps:
        raise ValidationFailed(
            f"{train.steps:,} steps exceed this server's cap of {settings.max_steps:,}", param="train.steps"
        )
    tokens = train.batch_size * model.seq_len
    if tokens > settings.max_batch_tokens:
        raise ValidationFailed(
            f"batch_size x seq_len = {tokens:,} tokens exceeds this server's cap of {settings.max_batch_tokens:,}",
            param="train.batch_size",
        )
    needed = peak_memory_bytes(spec, vocab, corpus_bytes)
    if needed > settings.worker_memory_bytes:
        raise ValidationFailed(
            f"this job needs about {gib(needed)} of memory at its peak (weights, optimizer state, activations, "
            f"attention scores and logits); a worker here gives a job {gib(settings.worker_memory_bytes)}: "
            "lower train.batch_size, model.seq_len or the model's size",
            param="train.batch_size",
        )
    series = series_per_step(spec)
    if series > settings.max_series_per_step:
        finest: dict[str, int] = {}  # the switched-on per-unit families, by their series per step
        if model.arch != "mlp" and telemetry.per_head:
            finest["telemetry.per_head"] = model.n_layer * model.n_head
        if model.arch == "moe" and telemetry.per_expert:
            finest["telemetry.per_expert"] = model.n_layer * moe_experts(model)
        fine = max(finest, key=finest.__getitem__) if finest else None  # the larger; per_head on a tie
        advice = f": set {fine} to false" if fine else ""
        raise ValidationFailed(
            f"the run would report {series:,} telemetry series per step; this server's cap is "
            f"{settings.max_series_per_step:,}{advice}",
            param=fine or "model.n_layer",
        )
    checkpoints = -(-train.steps // train.checkpoint_every)
    if checkpoints > settings.max_checkpoints:
        floor = -(-train.steps // settings.max_checkpoints)
        raise ValidationFailed(
            f"checkpoint_every {train.checkpoint_every:,} writes {checkpoints:,} checkpoints; this server's cap is "
            f"{settings.max_checkpoints:,} per job: use checkpoint_every {floor:,} or more",
            param="train.checkpoint_every",
        )
    minutes = train.max_minutes
    if minutes is not None and minutes > settings.max_job_minutes:
        raise ValidationFailed(
            f"max_minutes {minutes:g} exceeds this server's limit of {settings.max_job_minutes:g} minutes per job",
            param="train.max_minutes",
        )


def gib(n: int) -> str:
    return f"{n / 2**30:,.2f} GiB"
