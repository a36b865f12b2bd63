"""Request and response schemas; JobSpec is the training job contract."""

from .job_spec import DataSpec, JobSpec, ModelSpec, OptimizerSpec, ResourcesSpec, TelemetrySpec, TrainSpec

__all__ = ["DataSpec", "JobSpec", "ModelSpec", "OptimizerSpec", "ResourcesSpec", "TelemetrySpec", "TrainSpec"]
