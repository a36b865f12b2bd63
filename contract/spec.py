"""JobSpec: the training job contract shared by the REST API, `muonforge train` and the worker.

Unknown fields are rejected everywhere; every field but ``model.arch`` and ``data`` has a
documented default. A validated spec's ``model_dump()`` is what the engine consumes.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Annotated, Any, Literal, Self, get_args, get_origin

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    ModelWrapValidatorHandler,
    Tag,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import InitErrorDetails, PydanticCustomError

from contract import hf, metrics

PositiveInt = Annotated[int, Field(gt=0)]

NO_NUL = r"^[^\x00]*$"  # text the database stores: Postgres holds no NUL character
# A model staged by the operators under MUONFORGE_MODEL_DIR is named by its directory: staged:<name>,
# which no upload's id (mdl_…, no colon) can be.
STAGED_PREFIX = "staged:"
STAGED_NAME = r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}"
MODEL_ID = rf"^(?:[A-Za-z0-9_-]{{1,64}}|{STAGED_PREFIX}{STAGED_NAME})$"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_default=True)


class HFSpec(_Strict):
    """A transformers decoder built from its config, or an uploaded model: nothing is downloaded
    (docs/engine.md)."""

    config: dict[str, Any] | None = Field(
        None,
        description="transformers config fields: model_type (one of "
        + ", ".join(sorted(hf.FAMILIES))
        + ") and its sizes (hidden_size, intermediate_size, num_hidden_layers, num_attention_heads; "
        "num_key_value_heads, head_dim, tie_word_embeddings and the bias switches default as docs/engine.md says). "
        "The vocabulary comes from data.tokenizer. With model_id the service fills it in from the upload's "
        "config.json.",
    )
    model_id: str | None = Field(
        None,
        min_length=1,
        max_length=len(STAGED_PREFIX) + 100,
        pattern=MODEL_ID,
        description="A model of GET /v1/models: an upload's id (`mdl_…`, POST /v1/models) or a model the "
        "operators staged (`staged:<directory>`, MUONFORGE_MODEL_DIR). The run starts from its weights, with its "
        "tokenizer (data.tokenizer {type: model}). Give it or config.",
    )

    @field_validator("config")
    @classmethod
    def _known_family(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        if v is None:
            return v
        if len(json.dumps(v, default=str)) > hf.MAX_CONFIG_BYTES:
            raise ValueError(f"a config of at most {hf.MAX_CONFIG_BYTES:,} bytes")
        return hf.normalized(v)

    @model_validator(mode="after")
    def _config_or_upload(self) -> Self:
        if self.config is None and self.model_id is None:
            raise ValueError("give model.hf.config (a transformers config) or model.hf.model_id (an uploaded model)")
        return self


class ModelSpec(_Strict):
    """The network. ``mlp`` is an attention-free language model over a fixed context window; ``hf``
    a transformers decoder whose sizes its ``hf.config`` gives."""

    arch: Literal["gpt", "moe", "mlp", "hf"] = Field(description="Architecture.")
    n_layer: int = Field(4, ge=1, le=64, description="Transformer blocks (hidden layers for mlp).")
    n_head: int = Field(4, ge=1, le=64, description="Attention heads (gpt, moe).")
    d_model: int = Field(128, ge=8, le=8192, description="Residual width.")
    seq_len: int = Field(128, ge=2, le=8192, description="Context length in tokens.")
    n_experts: int | None = Field(None, ge=2, le=256, description="Experts per MoE layer (moe only; default 8).")
    top_k: int | None = Field(None, ge=1, le=16, description="Experts each token is routed to (moe only; default 2).")
    hf: HFSpec | None = Field(None, description="arch hf only: the transformers model.")

    @model_validator(mode="before")
    @classmethod
    def _hf_sizes(cls, data: Any) -> Any:
        """arch hf: n_layer, n_head and d_model are its config's (written there, and filled in here)."""
        if not isinstance(data, dict) or data.get("arch") != "hf":
            return data
        config = data.get("hf", {}).get("config") if isinstance(data.get("hf"), dict) else None
        if not isinstance(config, dict):
            if isinstance(data.get("hf"), dict) and data["hf"].get("model_id") is not None:
                for ours in ("n_layer", "n_head", "d_model", "n_experts", "top_k"):
                    if data.get(ours) is not None:
                        raise ValueError(f"{ours} is not set for arch hf: it comes from the uploaded model's config")
            return data  # the hf field's own validation says what is missing
        sizes = hf.sizes(config)
        for ours, theirs in (("n_experts", None), ("top_k", None), *sizes.items()):
            if data.get(ours) is not None and (theirs is None or data[ours] != config.get(theirs)):
                where = f"hf.config.{theirs}" if theirs else "nowhere"
                raise ValueError(f"{ours} is not set for arch hf: it comes from {where}")
        return data | {ours: config[theirs] for ours, theirs in sizes.items() if theirs in config}

    # Cross-field rules are field validators (fields validate in declaration order), so an
    # error names the offending field, e.g. model.top_k.
    @field_validator("d_model")
    @classmethod
    def _heads_divide_width(cls, v: int, info: ValidationInfo) -> int:
        n_head = info.data.get("n_head")
        if info.data.get("arch") in ("gpt", "moe") and n_head and v % n_head:
            raise ValueError(f"d_model ({v}) must be divisible by n_head ({n_head})")
        return v

    @field_validator("n_experts", "top_k")
    @classmethod
    def _moe_only(cls, v: int | None, info: ValidationInfo) -> int | None:
        if info.data.get("arch") != "moe":
            if v is not None:
                raise ValueError(f"{info.field_name} applies only to arch 'moe'")
            return v
        if v is None:
            v = 8 if info.field_name == "n_experts" else 2
        n_experts = info.data.get("n_experts")
        if info.field_name == "top_k" and n_experts is not None and v > n_experts:
            raise ValueError(f"top_k ({v}) must not exceed n_experts ({n_experts})")
        return v

    @field_validator("hf")
    @classmethod
    def _hf_only(cls, v: HFSpec | None, info: ValidationInfo) -> HFSpec | None:
        if (info.data.get("arch") == "hf") != (v is not None):
            raise ValueError("arch hf needs model.hf (and only arch hf takes it)")
        seq_len = info.data.get("seq_len")
        if v is not None and seq_len is not None:  # the context RoPE or the position table is set up for
            if v.config is None:  # an uploaded model's: the service fills it in and checks again
                return v
            field = hf.positions(v.config)
            positions = v.config.setdefault(field, seq_len)
            if positions < seq_len:
                raise ValueError(f"model.seq_len ({seq_len}) exceeds config.{field} ({positions})")
        return v


class BPESpec(_Strict):
    """A byte-level BPE trained on the job's text with the tokenizers library (docs/engine.md)."""

    type: Literal["bpe"] = Field(description="Byte-level BPE (GPT-2's byte alphabet, its pre-tokenizer).")
    vocab_size: int = Field(
        8192,
        ge=512,
        le=65536,
        description="The model's vocabulary: 256 bytes, <|endoftext|> and the merges learned (a small text may "
        "give fewer; their rows stay unused).",
    )


class ModelTokenizerSpec(_Strict):
    """The uploaded model's own tokenizer (its tokenizer.json), with ``model.hf.model_id``."""

    type: Literal["model"] = Field(description="The tokenizer of the uploaded model that model.hf.model_id names.")
    vocab_size: int | None = Field(
        None,
        ge=1,
        le=1 << 20,
        description="The model's vocabulary: filled in by the service from the upload's config.json vocab_size.",
    )


def _tokenizer_kind(value: Any) -> str:
    """Which member of the tokenizer union a value is read as (a word, a BPE's or a model's section)."""
    if isinstance(value, ModelTokenizerSpec) or (isinstance(value, dict) and value.get("type") == "model"):
        return "Model"
    return "BPE" if isinstance(value, dict | BPESpec) else "Word"


# One member is tried, chosen by the value's type, so an error speaks of that one alone (a member's
# tag is capitalized: error_path leaves it out of the field's path).
TokenizerChoice = Annotated[
    Annotated[Literal["byte", "char"], Tag("Word")]
    | Annotated[BPESpec, Tag("BPE")]
    | Annotated[ModelTokenizerSpec, Tag("Model")],
    Discriminator(_tokenizer_kind),
]


class DataSpec(_Strict):
    """Exactly one source: an uploaded dataset, a builtin task, or (local runs only) a file path."""

    dataset_id: str | None = Field(
        None, min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$", description="An uploaded dataset's id."
    )
    builtin: Literal["synthetic", "pysource", "pysource-instruct"] | None = Field(
        None,
        description="synthetic: a generated Markov chain with a known loss floor (its own 64 tokens); "
        "pysource: the worker's Python standard library sources, 4 MiB of real ASCII text "
        "(its char vocabulary is the 128 ASCII characters; docs/engine.md); pysource-instruct: prompt/"
        "completion pairs (a function's signature and docstring, then its body) from the standard library "
        "files after those pysource holds.",
    )
    path: str | None = Field(None, min_length=1, description="A UTF-8 text file (`muonforge train` only).")
    tokenizer: TokenizerChoice = Field(
        "byte",
        description="byte: vocab 256; char: the corpus's distinct characters (at most 65,536); "
        "{type: bpe, vocab_size: N}: a byte-level BPE trained on the corpus; {type: model}: the tokenizer of "
        "the uploaded model that model.hf.model_id names.",
    )
    format: Literal["auto", "text", "jsonl", "parquet"] = Field(
        "auto",
        description="How the file is read. auto: by the dataset's kind (its file name's suffix .jsonl or "
        ".parquet, else text); text: one document; jsonl: one row per line, {text}, {prompt, completion} or "
        "{messages} (docs/data.md); parquet: a text column, a document per row.",
    )
    text_column: str = Field(
        "text", min_length=1, max_length=200, description="The column of a parquet file that holds the text."
    )
    train_on_inputs: bool = Field(
        False,
        description="Train on the prompts and the non-assistant messages too; by default the loss counts only "
        "completions and assistant messages (and the end of text after them).",
    )
    val_fraction: float = Field(0.1, gt=0.0, lt=0.5, description="Share of the corpus held out for validation.")

    @model_validator(mode="after")
    def _one_source(self) -> Self:
        given = [k for k in ("dataset_id", "builtin", "path") if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError(f"give exactly one of dataset_id, builtin, path (got {given or 'none'})")
        return self

    @model_validator(mode="after")
    def _builtin_format(self) -> Self:
        if self.builtin is not None and self.format != "auto":
            raise ValueError(f"the builtin {self.builtin} has its own format: leave data.format out")
        return self

    @field_validator("tokenizer")
    @classmethod
    def _text_tokenizer(cls, v: Any, info: ValidationInfo) -> Any:
        if isinstance(v, ModelTokenizerSpec) and info.data.get("builtin") == "synthetic":
            raise ValueError("the synthetic task has its own 64 tokens: a model's tokenizer reads text")
        return v


OptimizerName = Literal["muon", "muonclip", "normuon", "normuonclip", "adamw"]
CLIPPED: tuple[OptimizerName, ...] = ("muonclip", "normuonclip")  # Muon or NorMuon, then QK-Clip
NORMUON: tuple[OptimizerName, ...] = ("normuon", "normuonclip")  # NorMuon's update in place of Muon's


class OptimizerSpec(_Strict):
    """Muon, NorMuon (Muon with each neuron's second moment normalized away), either followed by
    QK-Clip (muonclip, normuonclip), or an AdamW baseline.

    For ``adamw`` the ``lr`` and ``weight_decay`` apply to every parameter and the Muon fields are
    ignored.
    """

    name: OptimizerName = Field(
        "muon",
        description="Optimizer: muon; muonclip (Muon + QK-Clip); normuon (NorMuon, arXiv 2510.05491); normuonclip "
        "(NorMuon + QK-Clip); adamw.",
    )
    lr: float | None = Field(
        None, gt=0.0, le=10.0, description="Default 0.02 for muon, normuon and their clips, 3e-3 for adamw."
    )
    weight_decay: float = Field(0.0, ge=0.0, le=1.0, description="Decoupled weight decay (unadjusted lr).")
    weight_decay_mode: Literal["decoupled", "cautious"] = Field(
        "decoupled",
        description="decoupled: every weight decays by lr x weight_decay each step (the lr follows its schedule); "
        "cautious: only the entries whose update and weight agree in sign (arXiv 2510.12402), for every optimizer "
        "and every parameter group (AdamW's included).",
    )
    momentum: float = Field(0.95, ge=0.0, lt=1.0, description="Muon momentum (EMA).")
    nesterov: bool = Field(True, description="Nesterov momentum for Muon.")
    ns_steps: int = Field(5, ge=1, le=20, description="Newton–Schulz iterations.")
    ns_coefficients: Literal["keller", "polar_express"] = Field("keller", description="Newton–Schulz coefficients.")
    ns_method: Literal["auto", "standard", "gram"] = Field("auto", description="Newton–Schulz form.")
    ns_dtype: Literal["auto", "fp32", "bf16", "fp16"] = Field(
        "auto",
        description="Newton–Schulz precision. auto: fp16 on a CUDA device, bf16 on a CPU with AVX512-BF16 or "
        "AMX, where the device runs those matrix products measurably faster; else fp32.",
    )
    adjust_lr: Literal["original", "match_rms_adamw", "spectral"] = Field(
        "original", description="Muon update scale from the matrix shape."
    )
    orthogonalize: Literal["matrix", "per_head"] = Field(
        "matrix",
        description="matrix: every weight orthogonalized whole (a fused QKV projection as one matrix); per_head: "
        "the query and key projections split by head first, each head's rows orthogonalized on their own (values "
        "and the output projection whole), each with its own shape's lr scale. Muon-family optimizers, models with "
        "attention.",
    )
    normuon_beta2: float = Field(
        0.95,
        ge=0.0,
        lt=1.0,
        description="NorMuon (normuon, normuonclip): EMA coefficient of each neuron's second moment.",
    )
    qk_clip_tau: float | None = Field(
        None, gt=0.0, description="QK-Clip threshold (muonclip and normuonclip only; default 100)."
    )
    qk_clip_remeasure: bool = Field(
        False,
        description="muonclip and normuonclip only: after the update, one more forward of the step's batch (no "
        "grad) measures each head's max logit again and QK-Clip scales from that, so every head ends at or below tau "
        "on that batch (the clip holds closer to tau; a step costs that forward more).",
    )
    qk_clip_remeasure_batches: int = Field(
        1,
        ge=1,
        le=8,
        description="With qk_clip_remeasure: the re-measure reads the step's batch and the N - 1 training batches "
        "before it (one no-grad forward each), so every head ends at or below tau on all N and the next, unseen "
        "batch reads above tau less often; 1: the step's batch only.",
    )
    adamw_lr: float = Field(3e-3, gt=0.0, le=10.0, description="AdamW lr for embeddings, head, norms, biases.")
    adamw_betas: tuple[Annotated[float, Field(ge=0.0, lt=1.0)], Annotated[float, Field(ge=0.0, lt=1.0)]] = Field(
        (0.9, 0.95), description="AdamW betas."
    )
    adamw_eps: float = Field(1e-8, gt=0.0, le=1.0, description="AdamW epsilon.")
    adamw_weight_decay: float = Field(0.0, ge=0.0, le=1.0, description="AdamW weight decay (non-Muon parameters).")

    @field_validator("lr")
    @classmethod
    def _lr_default(cls, v: float | None, info: ValidationInfo) -> float | None:
        if v is None and "name" in info.data:
            return 3e-3 if info.data["name"] == "adamw" else 0.02
        return v

    @field_validator("qk_clip_tau")
    @classmethod
    def _muonclip_only(cls, v: float | None, info: ValidationInfo) -> float | None:
        if info.data.get("name") in CLIPPED:
            return 100.0 if v is None else v
        if v is not None:
            raise ValueError("qk_clip_tau applies only to optimizers 'muonclip' and 'normuonclip'")
        return v

    @field_validator("qk_clip_remeasure")
    @classmethod
    def _remeasure_muonclip_only(cls, v: bool, info: ValidationInfo) -> bool:
        if v and info.data.get("name") not in CLIPPED:
            raise ValueError("qk_clip_remeasure applies only to optimizers 'muonclip' and 'normuonclip'")
        return v

    @field_validator("orthogonalize")
    @classmethod
    def _per_head_muon_only(cls, v: str, info: ValidationInfo) -> str:
        if v == "per_head" and info.data.get("name") == "adamw":
            raise ValueError("orthogonalize per_head applies to the Muon family (muon, muonclip, normuon, normuonclip)")
        return v

    @field_validator("qk_clip_remeasure_batches")
    @classmethod
    def _batches_need_remeasure(cls, v: int, info: ValidationInfo) -> int:
        if v != 1 and not info.data.get("qk_clip_remeasure"):
            raise ValueError("qk_clip_remeasure_batches applies only with qk_clip_remeasure: true")
        return v


class EarlyStopSpec(_Strict):
    """Ends a run whose evaluations stopped improving, judged at every evaluation (``train.eval_every``)."""

    metric: metrics.EvaluationMetric = Field(metrics.VAL_LOSS, description="The evaluation's metric that is judged.")
    mode: Literal["min", "max"] = Field("min", description="min: lower is better; max: higher is better.")
    patience: int = Field(
        5, ge=1, le=100_000, description="Evaluations in a row without an improvement that end the run."
    )
    min_delta: float = Field(
        0.0, ge=0.0, description="An improvement betters the best value so far by more than this (the metric's units)."
    )


class TrainSpec(_Strict):
    """The loop. A run of ``steps`` optimizer steps; evals and checkpoints every N steps and at the end."""

    steps: PositiveInt = Field(1000, le=10_000_000, description="Optimizer steps.")
    batch_size: PositiveInt = Field(32, le=4096, description="Sequences per step.")
    eval_every: PositiveInt = Field(100, description="Validation loss every N steps (and at the end).")
    checkpoint_every: PositiveInt = Field(500, description="Checkpoint every N steps (and at the end).")
    seed: int = Field(0, ge=0, le=2**31 - 1, description="Seeds the model, the batches and everything else.")
    grad_clip: float | None = Field(1.0, gt=0.0, description="Clip the global grad norm (raw gradients); null: off.")
    lr_schedule: Literal["constant", "cosine", "wsd"] = Field("constant", description="Learning-rate schedule.")
    warmup_steps: int = Field(0, ge=0, description="Linear warmup steps.")
    keep_checkpoints: int = Field(
        3, ge=1, le=100, description="Checkpoints kept: the latest N, plus the one with the best val_loss."
    )
    max_restarts: int = Field(3, ge=0, le=10, description="Resumes from checkpoint after a worker loss.")
    max_minutes: float | None = Field(
        None,
        gt=0.0,
        le=525_600,
        description="Wall time the run may take, its attempts end to end; past it the job stops with its "
        "state checkpointed and ends failed (code time_limit). Unset: the server's limit "
        "(MUONFORGE_MAX_JOB_MINUTES) for a service job, none for `muonforge train`.",
    )
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto: CUDA if present, else CPU.")
    precision: Literal["auto", "fp32", "bf16"] = Field("auto", description="auto: bf16 autocast on CUDA, fp32 on CPU.")
    early_stop: EarlyStopSpec | None = Field(
        None,
        description="Early stopping: the run ends once `patience` evaluations in a row have not improved "
        "`metric`; it ends succeeded, with a checkpoint at that step and summary.stopped_at and "
        "summary.stop_reason. null: off.",
    )

    @field_validator("warmup_steps")
    @classmethod
    def _warmup_fits(cls, v: int, info: ValidationInfo) -> int:
        steps = info.data.get("steps")
        if steps is not None and v >= steps:
            raise ValueError(f"warmup_steps ({v}) must be below steps ({steps})")
        return v

    @field_validator("early_stop")
    @classmethod
    def _evaluations_to_judge(cls, v: EarlyStopSpec | None, info: ValidationInfo) -> EarlyStopSpec | None:
        # The first evaluation (step 0) sets the best value; `patience` more must fit before the last step.
        steps, every = info.data.get("steps"), info.data.get("eval_every")
        if v is not None and steps and every and v.patience * every >= steps:
            raise ValueError(
                f"early_stop needs evaluations to judge: {v.patience} evaluations every {every:,} steps "
                f"(eval_every) take {v.patience * every:,} steps, and the run has {steps:,}; "
                "lower eval_every or patience"
            )
        return v


class TelemetrySpec(_Strict):
    every: PositiveInt = Field(1, description="Report telemetry every k steps.")
    sample_tokens: int = Field(
        120,
        ge=0,
        le=1000,
        description="Tokens of text the model writes after a fixed prompt at every evaluation (0: none).",
    )
    per_head: bool = Field(True, description="Report attn_max_logit/l{i}h{j}, one series per attention head.")
    per_expert: bool = Field(True, description="Report router/load/l{i}e{j}, one series per MoE expert.")


class InitFromSpec(_Strict):
    """Warm start: a checkpoint of one of the tenant's own jobs, whose weights the run starts from."""

    job_id: str = Field(
        min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$", description="The job to start from (yours)."
    )
    step: int | None = Field(
        None, ge=0, le=10_000_000, description="Its checkpoint's step; omitted: its latest (the stored spec names it)."
    )
    optimizer_state: bool = Field(
        False,
        description="Also load its optimizer state (momentum, AdamW moments); needs the same optimizer.name. "
        "The hyperparameters stay this spec's.",
    )


class ResourcesSpec(_Strict):
    """The processes that train the job.

    More than one in all makes it a torch.distributed job: PyTorch's launcher (torchrun) starts
    ``nproc`` ranks on each of ``nnodes`` workers, DDP keeps their replicas equal (gloo on the CPU,
    nccl on CUDA), and ``train.batch_size`` is the global batch, split evenly over the ranks, so the
    run sees the batches one process would.
    """

    nproc: int = Field(1, ge=1, description="Processes per node (one per GPU on CUDA). Cap: MUONFORGE_MAX_NPROC.")
    nnodes: int = Field(
        1,
        ge=1,
        description="Workers that train the job together, each running nproc processes; it starts once "
        "that many hold it (gang-scheduled). Cap: MUONFORGE_MAX_NNODES.",
    )

    @property
    def world_size(self) -> int:
        return self.nproc * self.nnodes


class JobSpec(_Strict):
    """A training job: what to train, on what, with which optimizer, for how long."""

    name: str | None = Field(None, max_length=200, pattern=NO_NUL, description="A label for people (no NUL character).")
    model: ModelSpec
    data: DataSpec
    optimizer: OptimizerSpec = Field(default_factory=OptimizerSpec)
    train: TrainSpec = Field(default_factory=TrainSpec)
    telemetry: TelemetrySpec = Field(default_factory=TelemetrySpec)
    init_from: InitFromSpec | None = Field(
        None,
        description="Warm start from a checkpoint of the tenant's own job: its weights (strictly: the same "
        "model and vocabulary), to continue or fine-tune on other data. The run is a new one: its steps, "
        "schedule, evaluations and checkpoints count from 0. null: a freshly initialised model.",
    )
    resources: ResourcesSpec = Field(default_factory=ResourcesSpec)

    @model_validator(mode="wrap")
    @classmethod
    def _batch_splits_over_ranks(cls, data: object, handler: ModelWrapValidatorHandler[Self]) -> Self:
        """train.batch_size is the global batch: each rank takes an equal share.

        The error names train.batch_size (a rule across sections, raised where pydantic keeps its
        location).
        """
        spec = handler(data)
        from_upload = spec.model.hf is not None and spec.model.hf.model_id is not None
        if from_upload != isinstance(spec.data.tokenizer, ModelTokenizerSpec):
            message = (
                "an uploaded model (model.hf.model_id) trains with its own tokenizer: set data.tokenizer to "
                "{type: model}"
                if from_upload
                else "tokenizer {type: model} is the tokenizer of an uploaded model: it needs model.hf.model_id"
            )
            error = PydanticCustomError("value_error", message)
            details = InitErrorDetails(type=error, loc=("data", "tokenizer"), input=spec.data.model_dump()["tokenizer"])
            raise ValidationError.from_exception_data(cls.__name__, [details])
        if spec.optimizer.orthogonalize == "per_head" and spec.model.arch == "mlp":
            error = PydanticCustomError(
                "value_error", "orthogonalize per_head needs a model with attention (arch mlp has none)"
            )
            details = InitErrorDetails(type=error, loc=("optimizer", "orthogonalize"), input="per_head")
            raise ValidationError.from_exception_data(cls.__name__, [details])
        batch, ranks = spec.train.batch_size, spec.resources.world_size
        if batch % ranks:
            message = (
                f"batch_size ({batch}) is the global batch, split evenly over resources.nproc x resources.nnodes = "
                f"{ranks} processes: use a multiple of {ranks}"
            )
            error = PydanticCustomError("value_error", message)
            details = InitErrorDetails(type=error, loc=("train", "batch_size"), input=batch)
            raise ValidationError.from_exception_data(cls.__name__, [details])
        return spec

    def stored(self) -> dict[str, Any]:
        """The spec as the service stores and shows it (JSON types, every default filled in)."""
        return self.model_dump(mode="json")

    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={
            "examples": [
                {
                    "name": "muonclip-my-corpus",
                    "model": {"arch": "gpt", "n_layer": 2, "n_head": 4, "d_model": 128, "seq_len": 128},
                    "data": {"dataset_id": "ds_01J9Z3", "tokenizer": "byte"},
                    "optimizer": {"name": "muonclip", "lr": 0.02, "qk_clip_tau": 100.0},
                    "train": {"steps": 1000, "batch_size": 32, "eval_every": 100},
                }
            ]
        },
    )


def error_path(loc: Sequence[int | str]) -> str:
    """A validation error's location as the spec's dotted path (``data.tokenizer``).

    pydantic puts the member of a union it tried into the location (``literal['byte','char']``,
    ``BPESpec``); those are not fields and are left out. Fields are snake_case, members are not.
    """
    return ".".join(str(p) for p in loc if not (isinstance(p, str) and (p.startswith("literal[") or p[:1].isupper())))


def choices(model: type[BaseModel] = JobSpec, prefix: str = "") -> dict[str, list[str]]:
    """Every field of the spec that takes one of a fixed set of words, by its path
    (``{"model.arch": ["gpt", "moe", "mlp"], …}``): what the new-job form offers."""
    out: dict[str, list[str]] = {}
    for name, field in model.model_fields.items():
        for arg in (field.annotation, *get_args(field.annotation)):
            if get_origin(arg) is Annotated:  # a tagged member of a union
                arg = get_args(arg)[0]
            if get_origin(arg) is Literal:
                out[f"{prefix}{name}"] = [str(v) for v in get_args(arg)]
            elif isinstance(arg, type) and issubclass(arg, BaseModel):  # members of a union add their words
                for path, words in choices(arg, f"{prefix}{name}.").items():
                    out[path] = [*out.get(path, []), *(w for w in words if w not in out.get(path, []))]
    return out


def in_field_order(doc: dict[str, Any], model: type[BaseModel] = JobSpec) -> dict[str, Any]:
    """A stored spec (or a section of one) with its keys in the order ``model`` declares its fields,
    at every level, and any key it does not declare after them.

    That is the order ``JobSpec.stored`` writes; Postgres's jsonb keeps no key order (it sorts
    keys by length, then bytes), so a spec read back is put in this order again."""
    out: dict[str, Any] = {}
    for name, field in model.model_fields.items():
        if name not in doc:
            continue
        value = doc[name]
        kinds = (field.annotation, *get_args(field.annotation))
        section = next((a for a in kinds if isinstance(a, type) and issubclass(a, BaseModel)), None)
        out[name] = in_field_order(value, section) if section is not None and isinstance(value, dict) else value
    return out | {key: value for key, value in doc.items() if key not in out}
