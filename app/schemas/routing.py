"""The answer of GET /v1/jobs/{id}/routing: where each parameter of a job's model goes, and why."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

# The rules of optim.routes, as worker.engine.optimizer.ROLE_CODES names them.
ROLES = "declared, output_head, embedding_or_norm, hidden_matrix, bias_or_vector, unrecognized"


class RoutedParameter(BaseModel):
    name: str = Field(description="Its name in the model (a tied parameter once, under its first name).")
    shape: list[int]
    optimizer: Literal["muon", "adamw"] = Field(description="What steps it in this job.")
    role: str = Field(description=f"The rule that routed it, one of: {ROLES}.")
    reason: str = Field(description="The rule in words, as the job's log says it.")
    values: int = Field(description="Its number of values: the product of its shape.")
    warning: str | None = Field(
        description="A matrix whose role no rule knows (`role: unrecognized`): why AdamW takes it; else null."
    )


class OptimizerShare(BaseModel):
    parameters: int = Field(description="Parameters (tensors) it steps.")
    values: int = Field(description="Their values, summed.")


class RoutingSummary(BaseModel):
    muon: OptimizerShare
    adamw: OptimizerShare
    total: OptimizerShare = Field(description="Every parameter of the model: `values` is its parameter count.")


class Routing(BaseModel):
    job_id: str
    state: Literal["recorded", "awaiting", "unavailable"] = Field(
        description="recorded: the table below. awaiting: no worker has built the job's model yet (queued, or "
        "starting): ask again once it runs. unavailable: the job ended without one (before its model was built)."
    )
    message: str | None = Field(description="Why there is no table (awaiting, unavailable); null once recorded.")
    optimizer: str = Field(description="The spec's `optimizer.name`: with `adamw`, AdamW steps every parameter.")
    attempt: int | None = Field(
        description="The worker attempt whose model the table describes (a resumed job records it again); null "
        "before one did."
    )
    parameters: list[RoutedParameter] = Field(
        description="Every parameter once, in the model's module order; empty until recorded."
    )
    summary: RoutingSummary | None = Field(description="Each optimizer's share; null until recorded.")
    warnings: list[str] = Field(description="Every parameter's `warning`, in order.")

    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {
                    "job_id": "job_01hx…",
                    "state": "recorded",
                    "message": None,
                    "optimizer": "muon",
                    "attempt": 1,
                    "parameters": [
                        {
                            "name": "tok_emb.weight",
                            "shape": [256, 64],
                            "optimizer": "adamw",
                            "role": "embedding_or_norm",
                            "reason": "embedding or norm",
                            "values": 16384,
                            "warning": None,
                        },
                        {
                            "name": "blocks.0.attn.qkv.weight",
                            "shape": [192, 64],
                            "optimizer": "muon",
                            "role": "hidden_matrix",
                            "reason": "hidden matrix",
                            "values": 12288,
                            "warning": None,
                        },
                    ],
                    "summary": {
                        "muon": {"parameters": 1, "values": 12288},
                        "adamw": {"parameters": 1, "values": 16384},
                        "total": {"parameters": 2, "values": 28672},
                    },
                    "warnings": [],
                }
            ]
        }
    )
