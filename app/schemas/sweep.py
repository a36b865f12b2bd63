"""SweepSpec: a hyperparameter sweep, the body of POST /v1/sweeps (and of `muonforge sweep`'s file).

A base JobSpec, a search space over its paths, how trials are drawn, how many run, the metric
that ranks them and, optionally, ASHA early termination. Each trial's spec (the base with the
trial's values set) is validated as a JobSpec at submission (app.services.sweeps).
"""

from __future__ import annotations

import itertools
import re
from typing import Annotated, Any, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from contract import metrics
from contract.spec import NO_NUL

# Numbers as numbers: strict, so that a JSON true or false is refused, not read as 1 or 0.
Number = Annotated[float, Field(strict=True)]
Integer = Annotated[int, Field(strict=True)]
PositiveInt = Annotated[int, Field(strict=True, gt=0)]

MAX_TRIALS = 100  # trials per sweep
PATH = r"^[a-z_]+(\.[a-z_0-9]+)*$"  # a dotted JobSpec path: optimizer.lr


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Param(_Strict):
    """One swept path: exactly one of values, uniform, log_uniform, int_uniform."""

    values: list[Any] | None = Field(None, min_length=1, max_length=MAX_TRIALS, description="Choices, in order.")
    uniform: tuple[Number, Number] | None = Field(None, description="[lo, hi]: uniform between them.")
    log_uniform: tuple[Number, Number] | None = Field(
        None, description="[lo, hi], 0 < lo: uniform in log space (learning rates)."
    )
    int_uniform: tuple[Integer, Integer] | None = Field(None, description="[lo, hi]: an integer, both ends included.")

    @model_validator(mode="after")
    def _one_kind(self) -> Self:
        given = [k for k in ("values", "uniform", "log_uniform", "int_uniform") if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError(f"give exactly one of values, uniform, log_uniform, int_uniform (got {given or 'none'})")
        kind = given[0]
        if kind != "values":
            lo, hi = getattr(self, kind)
            if lo > hi:
                raise ValueError(f"{kind}: lo ({lo}) must not exceed hi ({hi})")
            if kind == "log_uniform" and lo <= 0:
                raise ValueError(f"log_uniform: lo ({lo}) must be positive")
        return self

    @property
    def kind(self) -> str:
        return next(k for k in ("values", "uniform", "log_uniform", "int_uniform") if getattr(self, k) is not None)


class AshaSpec(_Strict):
    """ASHA early termination: at each rung (a step), about one trial in ``reduction_factor`` goes
    on, the best of the results recorded there; the others wait there to be promoted, or stop
    there with ``stop_once`` (docs/service.md, "Sweeps")."""

    rungs: list[PositiveInt] = Field(
        min_length=1, max_length=10, description="Steps at which trials are compared, ascending."
    )
    reduction_factor: int = Field(
        3, strict=True, ge=2, le=16, description="About one trial in this many continues at a rung."
    )
    stop_once: bool = Field(
        False,
        strict=True,
        description="false: a trial not in the top 1/reduction_factor of its rung's results so far waits there "
        "(status paused) and is promoted once it is, before any new trial starts; true: it stops there at once "
        "(stopped_early), and the first result at a rung always goes on.",
    )

    @field_validator("rungs")
    @classmethod
    def _ascending(cls, v: list[int]) -> list[int]:
        if any(b <= a for a, b in itertools.pairwise(v)):
            raise ValueError("rungs must be strictly ascending steps")
        return v


class SweepSpec(_Strict):
    """A sweep: trials of ``base`` with the ``space``'s values, run as ordinary jobs."""

    name: str | None = Field(None, max_length=200, pattern=NO_NUL, description="A label for people.")
    base: dict[str, Any] = Field(description="A JobSpec, less what the search space sets.")
    space: dict[str, Param] = Field(
        min_length=1, max_length=20, description="Spec path (e.g. `optimizer.lr`) -> its values or distribution."
    )
    method: Literal["grid", "random"] = Field(
        "random", description="grid: every combination of `values` lists; random: `max_trials` draws with `seed`."
    )
    seed: int = Field(0, strict=True, ge=0, le=2**31 - 1, description="Seeds the random draws.")
    max_trials: int | None = Field(
        None,
        strict=True,
        ge=1,
        le=MAX_TRIALS,
        description="Trials (random: required; grid: the first ones, default all).",
    )
    max_concurrent: int = Field(
        2, strict=True, ge=1, le=MAX_TRIALS, description="Trials queued or running at once, at most."
    )
    metric: metrics.EvaluationMetric = Field(
        metrics.VAL_LOSS, description="What ranks trials (evaluated at every rung)."
    )
    mode: Literal["min", "max"] = Field("min", description="min: lower is better.")
    asha: AshaSpec | None = Field(None, description="ASHA early termination; null: every trial runs to the end.")

    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={
            "examples": [
                {
                    "name": "lr-and-optimizer",
                    "base": {
                        "model": {"arch": "gpt", "n_layer": 2, "n_head": 4, "d_model": 64, "seq_len": 64},
                        "data": {"builtin": "synthetic"},
                        "train": {
                            "steps": 300,
                            "batch_size": 16,
                            "eval_every": 50,
                            "lr_schedule": "wsd",
                            "warmup_steps": 15,
                        },
                    },
                    "space": {
                        "optimizer.lr": {"log_uniform": [1e-3, 1e-1]},
                        "optimizer.name": {"values": ["muon", "muonclip", "adamw"]},
                    },
                    "method": "random",
                    "seed": 7,
                    "max_trials": 9,
                    "max_concurrent": 3,
                    "metric": metrics.VAL_LOSS,
                    "mode": "min",
                    "asha": {"rungs": [50, 150], "reduction_factor": 3},
                }
            ]
        },
    )

    @field_validator("space")
    @classmethod
    def _paths(cls, v: dict[str, Param]) -> dict[str, Param]:
        for path in v:
            if not re.fullmatch(PATH, path):
                raise ValueError(f"{path!r} is not a dotted spec path (e.g. optimizer.lr)")
        return v

    @model_validator(mode="after")
    def _method(self) -> Self:
        if self.method == "random" and self.max_trials is None:
            raise ValueError("method random needs max_trials")
        return self
