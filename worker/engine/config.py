"""The engine's configs: a job's validated spec, and the network that the engine builds for it.

Every field and default of the spec is declared in contract.spec.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from contract.spec import (
    DataSpec,
    InitFromSpec,
    JobSpec,
    ModelSpec,
    OptimizerSpec,
    ResourcesSpec,
    TelemetrySpec,
    TrainSpec,
)

from .facts import BYTE_VOCAB, MLP_RATIO, ROUTER_AUX_WEIGHT

EVAL_BATCHES = 8  # validation batches per evaluation (fixed, seeded)
SECTIONS = ("data", "optimizer", "train", "telemetry", "resources", "init_from")  # a JobConfig's spec sections


@dataclass(frozen=True)
class ModelConfig:
    """The network to build: the spec's model section, the tokenizer's vocabulary and the engine's
    fixed ratios (an export's config.json holds these fields)."""

    arch: str  # "gpt" | "moe" | "mlp" | "hf"
    n_layer: int
    n_head: int
    d_model: int
    seq_len: int
    vocab_size: int = BYTE_VOCAB  # set from the tokenizer
    n_experts: int | None = None
    top_k: int | None = None
    mlp_ratio: int = MLP_RATIO
    router_aux_weight: float = ROUTER_AUX_WEIGHT
    hf: dict[str, Any] | None = None  # arch hf: the transformers config (normalized by contract.hf)

    @classmethod
    def of(cls, model: ModelSpec, vocab_size: int = BYTE_VOCAB) -> ModelConfig:
        fields = model.model_dump()
        return cls(**fields | {"hf": model.hf.config if model.hf else None}, vocab_size=vocab_size)


@dataclass(frozen=True)
class JobConfig:
    """A job as the engine runs it: its spec's sections and the network to build
    (``eval_batches``: a benchmark may evaluate on fewer)."""

    model: ModelConfig
    data: DataSpec
    optimizer: OptimizerSpec
    train: TrainSpec
    telemetry: TelemetrySpec
    resources: ResourcesSpec
    init_from: InitFromSpec | None = None  # the caller hands the engine the checkpoint's file
    eval_batches: int = EVAL_BATCHES

    def as_dict(self) -> dict[str, Any]:
        """Plain data, as a checkpoint keeps it: the network's fields and each section's values."""
        sections = (self.data, self.optimizer, self.train, self.telemetry, self.resources, self.init_from)
        plain = {"model": asdict(self.model), "eval_batches": self.eval_batches}
        for name, section in zip(SECTIONS, sections, strict=True):
            plain[name] = section.model_dump() if section is not None else None
        return plain


def job_config(spec: JobSpec | dict[str, Any]) -> JobConfig:
    """The engine's config of a job: a JobSpec, or a dict that validates as one (a stored spec, a
    spec file's contents); its vocabulary is set once the data is loaded."""
    spec = spec if isinstance(spec, JobSpec) else JobSpec.model_validate(spec)
    return JobConfig(
        model=ModelConfig.of(spec.model),
        data=spec.data,
        optimizer=spec.optimizer,
        train=spec.train,
        telemetry=spec.telemetry,
        resources=spec.resources,
        init_from=spec.init_from,
    )
