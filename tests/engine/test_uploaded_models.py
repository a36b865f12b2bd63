"""Starting from an uploaded model: tiny transformers models saved with ``save_pretrained`` and a
tokenizer trained here load into the engine with their weights and tokenizer; the engine's logits
are transformers', and training lowers the loss."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer as Fast
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from contract import hf
from contract.spec import JobSpec
from tests.engine.test_trainer import ListSink
from worker.engine.config import ModelConfig
from worker.engine.data import load_data, pysource_text
from worker.engine.models import build_model
from worker.engine.request import RunRequest
from worker.engine.run import run_job
from worker.engine.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")

VOCAB = 320  # the config's vocabulary: the tokenizer's 300 tokens and unused rows
TEXT = pysource_text()[:200_000]


def llama_style_tokenizer() -> Fast:
    """A byte-level BPE with BOS and EOS, whose post-processor puts BOS before every text (as llama's)."""
    fast = Fast(models.BPE())
    fast.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    fast.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    fast.train_from_iterator([TEXT], trainer=trainer)
    fast.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    return fast


def save_upload(directory: Path, family: str) -> Path:
    """A tiny model of ``family`` and its tokenizer, as ``save_pretrained`` writes them."""
    from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

    if family == "gpt2":
        sizes = {"n_embd": 32, "n_layer": 2, "n_head": 4, "n_positions": 64}
    else:
        sizes = {"hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4}
        sizes |= {"num_key_value_heads": 2, "max_position_embeddings": 64}
    torch.manual_seed(1)
    config = AutoConfig.for_model(family, vocab_size=VOCAB, **sizes)
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    wrapped = PreTrainedTokenizerFast(tokenizer_object=llama_style_tokenizer(), bos_token="<s>", eos_token="</s>")
    wrapped.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module", params=["llama", "gpt2"])
def upload(request, tmp_path_factory) -> tuple[str, Path]:
    return request.param, save_upload(tmp_path_factory.mktemp(request.param), request.param)


def spec_of(directory: Path, **train) -> JobSpec:
    config = hf.from_upload(json.loads((directory / "config.json").read_text()))
    return JobSpec.model_validate(
        {
            "model": {"arch": "hf", "seq_len": 32, "hf": {"config": config, "model_id": directory.name}},
            "data": {"builtin": "pysource", "tokenizer": {"type": "model", "vocab_size": VOCAB}},
            "optimizer": {"name": "muonclip"},
            "train": {"batch_size": 4, "eval_every": 5, "checkpoint_every": 10, **train},
            "telemetry": {"sample_tokens": 0},
        }
    )


def test_the_engine_starts_from_the_weights_and_computes_what_transformers_does(upload):
    from transformers import AutoModelForCausalLM

    family, directory = upload
    spec = spec_of(directory)
    ours = build_model(ModelConfig.of(spec.model, vocab_size=VOCAB), directory).eval()
    theirs = AutoModelForCausalLM.from_pretrained(directory).eval()
    idx = torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(ours(idx), theirs(input_ids=idx).logits, atol=1e-5, rtol=1e-5)
        fresh = build_model(ModelConfig.of(spec.model, vocab_size=VOCAB)).eval()
        assert not torch.allclose(fresh(idx), theirs(input_ids=idx).logits, atol=1e-3)
    if family == "gpt2":  # the Conv1D surgery ran after the load
        assert not any(type(m).__name__ == "Conv1D" for m in ours.modules())


def test_the_models_tokenizer_encodes_the_text_without_its_bos_and_decodes_it_back(upload, tmp_path):
    from transformers import AutoTokenizer

    _, directory = upload
    spec = spec_of(directory)
    data = load_data(spec.data, 0, tmp_path / "cache", model_dir=directory)
    assert data.vocab_size == VOCAB and data.tokenizer is not None
    theirs = AutoTokenizer.from_pretrained(directory)
    piece = TEXT[:2000]
    ids = data.tokenizer.encode(piece)
    assert ids.tolist() == theirs(piece, add_special_tokens=False)["input_ids"]
    assert data.tokenizer.decode(ids) == piece
    assert np.array_equal(np.asarray(data.train[: len(ids) - 5]), ids[:-5])  # no BOS at the text's start
    again = load_data(spec.data, 0, tmp_path / "cache", model_dir=directory)  # from the cache
    assert np.array_equal(np.asarray(again.val), np.asarray(data.val))
    with pytest.raises(ValueError, match="more than its 100"):
        Tokenizer("bpe", bpe=(directory / "tokenizer.json").read_text(), vocab_size=100)


def test_a_run_from_the_upload_logs_it_and_lowers_the_loss(upload, tmp_path):
    _, directory = upload
    sink = ListSink()
    result = run_job(RunRequest(spec_of(directory, steps=10), tmp_path / "run", sink=sink, model_dir=directory))
    assert result is not None and result.status == "succeeded"
    assert any(f"starting from model {directory.name} (" in line for _, line in sink.logs)
    losses = [values["val_loss"] for _, values in sink.records if "val_loss" in values]
    assert losses[-1] < losses[0] - 0.3, losses
    # A resume loads the run's own checkpoint, not the upload's weights.
    again = ListSink()
    resumed = run_job(RunRequest(spec_of(directory, steps=12), tmp_path / "run", sink=again, model_dir=directory))
    assert resumed is not None and resumed.status == "succeeded"
    assert any("resumed from" in line for _, line in again.logs)
    assert not any("starting from model" in line for _, line in again.logs)
    assert again.records[0][1]["loss"] < losses[0]


def test_weights_that_do_not_match_are_refused(upload, tmp_path):
    from safetensors.torch import load_file, save_file

    _, directory = upload
    spec = spec_of(directory)
    broken = tmp_path / directory.name
    broken.mkdir()
    tensors = load_file(str(directory / "model.safetensors"))
    tensors["extra.weight"] = torch.zeros(2)
    save_file(tensors, str(broken / "model.safetensors"))
    with pytest.raises(ValueError, match=r"unexpected extra\.weight"):
        build_model(ModelConfig.of(spec.model, vocab_size=VOCAB), broken)
    del tensors["extra.weight"]
    first = next(name for name in tensors if "layers.0" in name or ".h.0." in name)
    del tensors[first]
    save_file(tensors, str(broken / "model.safetensors"))
    with pytest.raises(ValueError, match=f"missing {re.escape(first)}"):
        build_model(ModelConfig.of(spec.model, vocab_size=VOCAB), broken)
