"""Plain dataclass configs for the engine, and the one function that builds them from a dict.

The dict is a validated JobSpec's ``model_dump()``: the service and ``muonforge train``
validate, the engine trusts the shape and only fills what the spec leaves open.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any


@dataclass(frozen=True)
class ModelConfig:
    arch: str  # "gpt" | "moe" | "mlp"
    n_layer: int = 4
    n_head: int = 4
    d_model: int = 128
    seq_len: int = 128
    vocab_size: int = 256  # set from the tokenizer
    n_experts: int | None = None
    top_k: int | None = None
    mlp_ratio: int = 4
    router_aux_weight: float = 0.01  # Switch Transformer (arXiv 2101.03961) load-balancing coefficient


@dataclass(frozen=True)
class DataConfig:
    dataset_id: str | None = None
    builtin: str | None = None
    path: str | None = None
    tokenizer: str = "byte"
    val_fraction: float = 0.1


@dataclass(frozen=True)
class OptimizerConfig:
    name: str = "muon"
    lr: float = 0.02
    weight_decay: float = 0.0
    momentum: float = 0.95
    nesterov: bool = True
    ns_steps: int = 5
    ns_coefficients: str = "keller"
    ns_method: str = "auto"
    ns_dtype: str = "auto"  # "auto" | "fp32" | "bf16"
    adjust_lr: str = "original"
    qk_clip_tau: float | None = None
    qk_clip_remeasure: bool = False  # MuonClip: clip from the max logits measured again after the update
    qk_clip_remeasure_batches: int = 1  # ... on the step's batch and the N - 1 before it
    adamw_lr: float = 3e-3
    adamw_betas: tuple[float, float] = (0.9, 0.95)
    adamw_eps: float = 1e-8
    adamw_weight_decay: float = 0.0


@dataclass(frozen=True)
class EarlyStopConfig:
    metric: str = "val_loss"
    mode: str = "min"  # "min" | "max"
    patience: int = 5  # evaluations in a row without an improvement
    min_delta: float = 0.0


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 1000
    batch_size: int = 32
    eval_every: int = 100
    checkpoint_every: int = 500
    seed: int = 0
    grad_clip: float | None = 1.0
    lr_schedule: str = "constant"
    warmup_steps: int = 0
    keep_checkpoints: int = 3  # the service keeps the latest N plus the best val_loss (local runs keep all)
    max_restarts: int = 3
    device: str = "auto"
    precision: str = "auto"
    eval_batches: int = 8  # validation batches per evaluation (fixed, seeded)
    max_minutes: float | None = None  # the run's wall time, attempts end to end; None: no limit
    early_stop: EarlyStopConfig | None = None


@dataclass(frozen=True)
class TelemetryConfig:
    every: int = 1
    sample_tokens: int = 120
    per_head: bool = True  # attn_max_logit/l{i}h{j}
    per_expert: bool = True  # router/load/l{i}e{j}


@dataclass(frozen=True)
class InitFromConfig:
    job_id: str
    step: int | None = None  # resolved by the service before the run
    optimizer_state: bool = False


@dataclass(frozen=True)
class ResourcesConfig:
    nproc: int = 1  # processes per node (torchrun's --nproc-per-node)
    nnodes: int = 1

    @property
    def world_size(self) -> int:
        """The ranks of the job's torch.distributed group; 1: the job runs in one process, no group."""
        return self.nproc * self.nnodes


@dataclass(frozen=True)
class JobConfig:
    model: ModelConfig
    data: DataConfig
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    telemetry: TelemetryConfig = field(default_factory=TelemetryConfig)
    resources: ResourcesConfig = field(default_factory=ResourcesConfig)
    name: str | None = None
    init_from: InitFromConfig | None = None  # the caller hands the engine the checkpoint's file


def _build(cls: type, values: dict[str, Any] | None) -> Any:
    known = {f.name for f in fields(cls)}
    values = {k: v for k, v in (values or {}).items() if v is not None or k in _NULLABLE.get(cls, ())}
    unknown = set(values) - known
    if unknown:
        raise ValueError(f"unknown {cls.__name__} fields: {sorted(unknown)}")
    if "adamw_betas" in values:
        values["adamw_betas"] = tuple(values["adamw_betas"])
    for name, section in _NESTED.get(cls, {}).items():
        if name in values:
            values[name] = _build(section, values[name])
    return cls(**values)


# Fields whose explicit None means something (grad_clip: None turns clipping off).
_NULLABLE = {TrainConfig: ("grad_clip",)}
# Sections within sections, built as their own dataclass.
_NESTED = {TrainConfig: {"early_stop": EarlyStopConfig}}


def job_config_from_dict(spec: dict[str, Any]) -> JobConfig:
    """Build the engine's configs from a validated JobSpec's ``model_dump()``."""
    return JobConfig(
        model=_build(ModelConfig, spec["model"]),
        data=_build(DataConfig, spec["data"]),
        optimizer=_build(OptimizerConfig, spec.get("optimizer")),
        train=_build(TrainConfig, spec.get("train")),
        telemetry=_build(TelemetryConfig, spec.get("telemetry")),
        resources=_build(ResourcesConfig, spec.get("resources")),
        name=spec.get("name"),
        init_from=_build(InitFromConfig, spec["init_from"]) if spec.get("init_from") else None,
    )
