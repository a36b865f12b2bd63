"""Transformers decoders (arch hf): the admitted sizes, exact per-head max logits, QK-Clip, routing."""

from __future__ import annotations

import random

import pytest
import torch
from pydantic import ValidationError

import optim
from contract import hf
from contract.spec import JobSpec, ModelSpec
from tests.engine.test_trainer import ListSink
from worker.engine.config import ModelConfig, job_config
from worker.engine.data import synthetic_task
from worker.engine.facts import parameter_count
from worker.engine.models import build_model
from worker.engine.models.hf import attention_modules, query_key
from worker.engine.trainer import Trainer

transformers = pytest.importorskip("transformers")

VOCAB = 50


def hf_config(family: str, **kw) -> dict:
    if family == "gpt2":
        return {"model_type": family, "n_embd": 32, "n_layer": 2, "n_head": 4} | kw
    base = {"model_type": family, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2}
    return base | {"num_attention_heads": 4, "num_key_value_heads": 2} | kw


def model_spec(config: dict, seq_len: int = 16) -> ModelSpec:
    return ModelSpec.model_validate({"arch": "hf", "seq_len": seq_len, "hf": {"config": config}})


def build(config: dict, seq_len: int = 16):
    spec = model_spec(config, seq_len)
    torch.manual_seed(0)
    return build_model(ModelConfig.of(spec, vocab_size=VOCAB)).train()


def random_configs(family: str, n: int) -> list[dict]:
    rng = random.Random(family)
    out = []
    for i in range(n):
        if family == "gpt2":
            heads = rng.choice([2, 4, 8])
            config = hf_config(family, n_embd=8 * heads, n_layer=rng.randint(1, 3), n_head=heads)
            out.append(config | ({"n_inner": rng.choice([24, 48])} if i % 2 else {"tie_word_embeddings": False}))
            continue
        heads = rng.choice([2, 4, 8])
        config = hf_config(
            family,
            hidden_size=rng.choice([16, 32, 64]),
            intermediate_size=rng.choice([24, 48, 96]),
            num_hidden_layers=rng.randint(1, 3),
            num_attention_heads=heads,
            num_key_value_heads=rng.choice([k for k in (1, 2, 4, 8) if heads % k == 0]),
            tie_word_embeddings=bool(i % 2),
        )
        if i % 3 == 1:
            config["head_dim"] = rng.choice([8, 12, 24])
        if i % 3 == 2 and family in ("llama", "qwen3"):
            config["attention_bias"] = True
        if i % 3 == 2 and family == "llama":
            config["mlp_bias"] = True
        out.append(config)
    return out


@pytest.mark.parametrize("family", sorted(hf.FAMILIES))
def test_admitted_parameter_count_is_what_transformers_builds(family):
    for config in random_configs(family, 6):
        spec = model_spec(config)
        with torch.device("meta"):
            model = build_model(ModelConfig.of(spec, vocab_size=VOCAB))
        assert parameter_count(spec, VOCAB) == sum(p.numel() for p in model.parameters()), config


def test_spec_fills_sizes_from_the_config_and_refuses_what_it_cannot_honour():
    spec = model_spec(hf_config("llama"), seq_len=24)
    assert (spec.n_layer, spec.n_head, spec.d_model) == (2, 4, 32)
    assert spec.hf is not None
    assert spec.hf.config["max_position_embeddings"] == 24 and spec.hf.config["head_dim"] == 8
    again = ModelSpec.model_validate(spec.model_dump())  # a stored spec validates again unchanged
    assert again == spec

    def refused(model: dict) -> str:
        with pytest.raises(ValidationError) as err:
            ModelSpec.model_validate(model)
        return str(err.value)

    assert "model_type must be one of" in refused({"arch": "hf", "hf": {"config": hf_config("bert")}})
    assert "vocabulary comes from data.tokenizer" in refused(
        {"arch": "hf", "hf": {"config": hf_config("llama", vocab_size=100)}}
    )
    assert "no code is loaded" in refused({"arch": "hf", "hf": {"config": hf_config("llama", auto_map={})}})
    assert "needs intermediate_size" in refused(
        {"arch": "hf", "hf": {"config": {k: v for k, v in hf_config("llama").items() if k != "intermediate_size"}}}
    )
    assert "it comes from hf.config.num_hidden_layers" in refused(
        {"arch": "hf", "n_layer": 3, "hf": {"config": hf_config("llama")}}
    )
    assert "exceeds config.max_position_embeddings" in refused(
        {"arch": "hf", "seq_len": 64, "hf": {"config": hf_config("llama", max_position_embeddings=32)}}
    )
    assert "multiple of num_key_value_heads" in refused(
        {"arch": "hf", "hf": {"config": hf_config("llama", num_key_value_heads=3)}}
    )
    assert "arch hf needs model.hf" in refused({"arch": "hf"})
    assert "only arch hf takes it" in refused({"arch": "gpt", "hf": {"config": hf_config("llama")}})


def reference_max_logits(model, idx: torch.Tensor) -> list[torch.Tensor]:
    """Each layer's per-head max of q.k x scaling over the pairs its mask allows, from transformers'
    own eager attention (the full score matrix, built independently of the engine's recording)."""
    from transformers.integrations.sdpa_attention import repeat_kv
    from transformers.masking_utils import sdpa_mask

    seen: list[torch.Tensor] = []

    def eager(module, query, key, value, attention_mask, scaling=None, **kwargs):
        keys = repeat_kv(key, query.shape[1] // key.shape[1])
        scores = query @ keys.transpose(-1, -2) * scaling  # [B, H, T, S]
        T = scores.shape[-1]
        allowed = torch.ones(T, T, dtype=torch.bool).tril() if attention_mask is None else attention_mask
        seen.append(scores.masked_fill(~allowed, float("-inf")).amax(dim=(0, 2, 3)))
        return kwargs["original"](module, query, key, value, attention_mask, scaling=scaling, **kwargs)

    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register("reference", lambda *a, **k: eager(*a, original=sdpa_attention_forward, **k))
    AttentionMaskInterface.register("reference", sdpa_mask)
    net = model.net
    net.config._attn_implementation = "reference"
    try:
        with torch.no_grad():
            net(input_ids=idx, use_cache=False)
    finally:
        net.config._attn_implementation = "muonforge_max_logit"
    return seen


@pytest.mark.parametrize(
    "config",
    [
        hf_config("llama"),  # grouped-query attention: 2 query heads per key head
        hf_config("mistral", sliding_window=5),  # a sliding window shorter than the context
        hf_config("qwen2"),  # q, k, v biases
        hf_config("qwen3", head_dim=12),  # QK-norm, head_dim not hidden / heads
        hf_config("gpt2"),  # a fused Conv1D c_attn, split in three
        hf_config("gemma3_text", sliding_window=4, layer_types=["sliding_attention", "full_attention"]),
    ],
    ids=["llama-gqa", "mistral-window", "qwen2-bias", "qwen3-qknorm", "gpt2-split", "gemma3-mixed"],
)
def test_recorded_max_logits_equal_the_full_score_matrix(config):
    model = build(config)
    idx = torch.randint(0, VOCAB, (3, 16))
    model(idx)
    recorded = [layer.qk_max_logits() for layer in model.attention_layers()]
    expected = reference_max_logits(model, idx)
    spec = model_spec(config)
    assert len(recorded) == len(expected) == spec.n_layer
    for got, want in zip(recorded, expected, strict=True):
        assert got is not None and got.shape == (spec.n_head,)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_sliding_window_changes_the_maximum():
    # The window must matter for the test above to test it: with scores that grow with distance,
    # the full causal maximum lies outside a short window.
    windowed = build(hf_config("mistral", sliding_window=2))
    full = build(hf_config("mistral"))
    full.load_state_dict(windowed.state_dict())
    idx = torch.randint(0, VOCAB, (2, 16))
    windowed(idx), full(idx)
    a = torch.stack([layer.qk_max_logits() for layer in windowed.attention_layers()])
    b = torch.stack([layer.qk_max_logits() for layer in full.attention_layers()])
    assert (a <= b + 1e-6).all() and (a < b - 1e-6).any()


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3_text", "gpt2"])
def test_qk_clip_leaves_every_head_at_or_below_tau(family):
    # One layer: a clip of layer l changes what layer l + 1 reads, so deeper layers' maxima move too.
    one = {"n_layer": 1} if family == "gpt2" else {"num_hidden_layers": 1}
    model = build(hf_config(family, **one))
    qk_norm, shift = hf.FAMILIES[family].qk_norm, hf.FAMILIES[family].gain_offset
    idx = torch.randint(0, VOCAB, (4, 16))
    with torch.no_grad():  # make the logits large, as a run that needs the clip has them
        for a in attention_modules(model.net):
            for w in (a.q_norm.weight, a.k_norm.weight) if qk_norm else [p.weight for p in query_key(a)]:
                w.add_(shift).mul_(4.0).sub_(shift)  # the gain applied is shift + w (Gemma: 1 + w)
    model(idx)
    before = torch.stack([layer.qk_max_logits() for layer in model.attention_layers()])
    tau = float(before.max()) / 3
    clipped, _ = optim.qk_clip(model.qk_clip_sources(), tau)
    assert int(clipped) > 0
    model(idx)  # the same batch with the clipped weights
    after = torch.stack([layer.qk_max_logits() for layer in model.attention_layers()])
    assert float(after.max()) <= tau * (1 + 1e-5)
    assert float(after.max()) >= tau * (1 - 1e-4)  # the hottest head ends at tau, not below
    if not qk_norm:  # per head: a head already below tau is left alone
        cold = before < tau
        torch.testing.assert_close(after[cold], before[cold], rtol=1e-5, atol=1e-6)


def routed(model) -> tuple[set[str], set[str]]:
    groups = optim.split_params(model)
    names = {p: n for n, p in model.named_parameters()}
    muon = {names[p] for g in groups if g["use_muon"] for p in g["params"]}
    return muon, {names[p] for g in groups if not g["use_muon"] for p in g["params"]}


def test_routing_sends_hidden_matrices_to_muon_and_the_rest_to_adamw():
    model = build(hf_config("qwen2", tie_word_embeddings=False))
    muon, adamw = routed(model)
    hidden = tuple(f"{m}_proj.weight" for m in ("q", "k", "v", "o", "gate", "up", "down"))
    assert muon == {n for n, _ in model.named_parameters() if n.endswith(hidden)}
    assert {"net.model.embed_tokens.weight", "net.lm_head.weight", "net.model.norm.weight"} <= adamw
    assert all(n in adamw for n, _ in model.named_parameters() if n.endswith("bias") or "norm" in n)


def test_gpt2_conv1d_layers_become_linear_and_its_fused_qkv_three_matrices_for_muon():
    from transformers import AutoModelForCausalLM

    model = build(hf_config("gpt2"))
    muon, adamw = routed(model)
    hidden = ("c_attn.q.weight", "c_attn.k.weight", "c_attn.v.weight", "attn.c_proj.weight", "c_fc.weight")
    assert muon == {n for n, _ in model.named_parameters() if n.endswith((*hidden, "mlp.c_proj.weight"))}
    assert len(muon) == 2 * 6
    mlp = model.net.transformer.h[0].mlp
    assert mlp.c_fc.weight.shape == (128, 32) and mlp.c_proj.weight.shape == (32, 128)  # [out, in]
    assert {"net.transformer.wte.weight", "net.transformer.wpe.weight"} <= adamw
    # The same function as transformers' own GPT-2 with the same weights.
    spec = model_spec(hf_config("gpt2"))
    torch.manual_seed(0)
    fields = {k: v for k, v in spec.hf.config.items() if k != "model_type"}
    config = transformers.AutoConfig.for_model("gpt2", vocab_size=VOCAB, **fields)
    reference = AutoModelForCausalLM.from_config(config).eval()
    idx = torch.randint(0, VOCAB, (2, 16))
    torch.testing.assert_close(model.eval()(idx), reference(input_ids=idx).logits, rtol=0, atol=1e-6)


@pytest.mark.parametrize("family", sorted(hf.FAMILIES))
def test_a_muonclip_run_reports_every_head_and_resumes_bitwise(tmp_path, family):
    spec = JobSpec.model_validate(
        {
            "model": {"arch": "hf", "seq_len": 16, "hf": {"config": hf_config(family)}},
            "data": {"builtin": "synthetic"},
            "optimizer": {"name": "muonclip", "qk_clip_tau": 0.1},
            "train": {"steps": 12, "batch_size": 4, "eval_every": 4, "checkpoint_every": 5},
            "telemetry": {"sample_tokens": 8},
        }
    ).model_dump()

    def trainer(where: str, sink: ListSink, cancel=None) -> Trainer:
        job = job_config(spec)
        return Trainer(job, synthetic_task(job.train.seed), tmp_path / where, sink, cancel)

    full_sink = ListSink()
    full = trainer("a", full_sink)
    assert full.run().status == "succeeded"
    losses = [values["loss"] for _, values in full_sink.records if "loss" in values]
    assert losses[-1] < losses[0]
    heads = {k for _, values in full_sink.records for k in values if k.startswith("attn_max_logit/l")}
    assert {f"attn_max_logit/l{i}h{j}" for i in range(2) for j in range(4)} <= heads
    assert max(values.get("qk_clip/heads_clipped", 0) for _, values in full_sink.records) > 0

    cut = trainer("b", ListSink(), cancel=lambda: cut.step == 7)
    assert cut.run().status == "cancelled"
    resumed = trainer("b", ListSink())
    assert resumed.run().status == "succeeded"
    for (name, a), b in zip(full.model.state_dict().items(), resumed.model.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
