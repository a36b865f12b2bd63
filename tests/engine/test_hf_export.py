"""format=hf: a checkpoint's model as transformers' own. Every family of arch hf and the engine's gpt
load with transformers' AutoModelForCausalLM alone to the engine's logits, the tokenizer files give
the engine's ids, moe and mlp are refused, and the client unpacks plain files only."""

from __future__ import annotations

import dataclasses
import io
import json
import re
import tarfile
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer as HFTokenizer
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from app.errors import ValidationFailed
from app.services.export import to_hf_archive, write_hf
from app.services.hf_export import CAUSAL_LM
from contract.export import CONFIG_FILE, EXPORT_FILE, GENERATION_FILE, TOKENIZER_FILES
from contract.hf import FAMILIES, normalized, positions
from contract.spec import JobSpec
from muonforge.transfer import extract_export
from tests.engine.test_export import HF_LLAMA, ROOT, checkpoint_model, logits, spec
from worker.engine.checkpoints import latest_checkpoint, load_checkpoint
from worker.engine.config import ModelConfig
from worker.engine.data import PYSOURCE_CHARS
from worker.engine.models import LanguageModel, build_model
from worker.engine.request import RunRequest
from worker.engine.run import run_job
from worker.engine.tokenizer import Tokenizer

SIZES = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4}
GQA = {"num_key_value_heads": 2}
CONFIGS = {  # arch hf: a config of each family, with what sets it apart
    "llama-gqa": {"model_type": "llama", **SIZES, **GQA},
    "llama-tied-biases": {"model_type": "llama", **SIZES, "tie_word_embeddings": True, "attention_bias": True},
    "mistral-sliding-window": {"model_type": "mistral", **SIZES, **GQA, "sliding_window": 4},
    "qwen2-qkv-bias": {"model_type": "qwen2", **SIZES, **GQA},
    "qwen3-qk-norm": {"model_type": "qwen3", **SIZES, **GQA},
    "gemma-unit-offset-norms": {"model_type": "gemma", **SIZES, **GQA},
    "gemma3-qk-norm-sliding": {"model_type": "gemma3_text", **SIZES, **GQA, "sliding_window": 4},
    "gpt2-tied": {"model_type": "gpt2", "n_embd": 16, "n_layer": 2, "n_head": 2},
    "gpt2-untied": {"model_type": "gpt2", "n_embd": 16, "n_layer": 2, "n_head": 2, "tie_word_embeddings": False},
}
SEQ_LEN, VOCAB = 16, 64
TEXTS = [
    "plain ASCII: def main(argv):\n\treturn 0\n",
    "multi-byte: héllo wörld, 日本語, Ελληνικά, 🎉🐍",
    "  two  spaces , .",
]


def model_config(arch: str, hf: dict | None = None, vocab: int = VOCAB, seq_len: int = SEQ_LEN) -> ModelConfig:
    if hf is not None:
        hf = normalized(hf | {positions(hf): seq_len})
    extra = {"n_experts": 3, "top_k": 2} if arch == "moe" else {}
    return ModelConfig(arch, 2, 2, 16, seq_len, vocab, hf=hf, **extra)


def random_model(cfg: ModelConfig) -> LanguageModel:
    """The model of ``cfg`` with every parameter drawn at random, biases and norm gains included."""
    model = build_model(cfg)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=generator) * 0.3)
    return model.eval()


def payload(model: LanguageModel, tokenizer: Tokenizer | dict | None = None) -> dict:
    """A checkpoint's payload as the engine writes it: the model's config, tensors and tokenizer."""
    return {
        "config": {"model": dataclasses.asdict(model.cfg)},
        "model": model.state_dict(),
        "tokenizer": tokenizer.to_dict() if isinstance(tokenizer, Tokenizer) else tokenizer,
    }


def from_pretrained(directory: Path) -> torch.nn.Module:
    """The directory loaded by transformers alone, every tensor used and none missing."""
    loaded, info = AutoModelForCausalLM.from_pretrained(directory, output_loading_info=True)
    assert {k: v for k, v in info.items() if v} == {}, info
    assert not loaded.training
    return loaded


def hf_logits(model: torch.nn.Module, vocab: int = VOCAB) -> torch.Tensor:
    return logits(lambda tokens: model(input_ids=tokens).logits, vocab, SEQ_LEN)


def test_the_families_are_transformers_causal_lms():
    assert CAUSAL_LM == {family: MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[family] for family in FAMILIES}


@pytest.mark.parametrize("name", CONFIGS)
def test_every_family_loads_in_transformers_to_the_same_logits(tmp_path, name):
    model = random_model(model_config("hf", CONFIGS[name]))
    files = write_hf(payload(model), tmp_path)
    assert [f.name for f in files] == [CONFIG_FILE, GENERATION_FILE, EXPORT_FILE]  # no tokenizer: synthetic ids
    config = json.loads((tmp_path / CONFIG_FILE).read_text())
    assert config["architectures"] == [CAUSAL_LM[CONFIGS[name]["model_type"]]] and config["vocab_size"] == VOCAB
    loaded = from_pretrained(tmp_path)
    assert torch.allclose(hf_logits(loaded), logits(model, VOCAB, SEQ_LEN), rtol=0, atol=1e-5)


def test_a_gpt2s_layers_go_back_to_conv1d(tmp_path):
    from safetensors.torch import load_file

    model = random_model(model_config("hf", CONFIGS["gpt2-tied"]))
    write_hf(payload(model), tmp_path)
    tensors = load_file(tmp_path / EXPORT_FILE)
    attention = model.net.transformer.h[0].attn.c_attn
    qkv = [attention.q.weight, attention.k.weight, attention.v.weight]
    assert torch.equal(tensors["transformer.h.0.attn.c_attn.weight"], torch.cat(qkv).T)  # [in, 3C]
    biases = [attention.q.bias, attention.k.bias, attention.v.bias]
    assert torch.equal(tensors["transformer.h.0.attn.c_attn.bias"], torch.cat(biases))
    assert torch.equal(tensors["transformer.h.0.mlp.c_fc.weight"], model.net.transformer.h[0].mlp.c_fc.weight.T)
    assert "lm_head.weight" not in tensors  # tied: transformers ties it to wte


def test_the_engines_gpt_is_a_gpt2_with_zero_biases(tmp_path):
    model = random_model(model_config("gpt"))
    write_hf(payload(model), tmp_path)
    config = json.loads((tmp_path / CONFIG_FILE).read_text())
    assert config["architectures"] == ["GPT2LMHeadModel"] and config["activation_function"] == "gelu"
    assert (config["n_positions"], config["n_inner"], config["layer_norm_epsilon"]) == (SEQ_LEN, 64, 1e-5)
    loaded = from_pretrained(tmp_path)
    biases = [p for name, p in loaded.named_parameters() if name.endswith("bias") and ".ln_" not in name]
    assert len(biases) == 2 * 4 and all(not b.any() for b in biases)  # c_attn, c_proj, c_fc, c_proj per layer
    assert torch.allclose(hf_logits(loaded), logits(model, VOCAB, SEQ_LEN), rtol=0, atol=1e-5)
    # generation_config.json: no end-of-text token, so greedy decoding is the engine's argmax, token by token
    prompt = torch.tensor([[1, 2, 3]])
    ids = prompt
    with torch.no_grad():
        for _ in range(5):
            ids = torch.cat([ids, model(ids)[:, -1:].argmax(-1)], dim=1)
        generated = loaded.generate(prompt, max_new_tokens=5, do_sample=False)
    assert torch.equal(generated, ids)


@pytest.mark.parametrize("arch", ["moe", "mlp"])
def test_moe_and_mlp_are_refused_naming_format_safetensors(tmp_path, arch):
    checkpoint = tmp_path / "step.pt"
    torch.save(payload(random_model(model_config(arch))), checkpoint)
    with pytest.raises(ValidationFailed) as refused:
        to_hf_archive(checkpoint, tmp_path / "exports")
    assert refused.value.param == "format"
    message = f"arch {arch} has no transformers equivalent: export its weights with format=safetensors"
    assert refused.value.message == message
    assert not (tmp_path / "exports").exists()  # refused before anything is written


def tokenizer_directory(tmp_path: Path, tokenizer: Tokenizer | dict, seq_len: int = SEQ_LEN) -> Path:
    vocab = tokenizer["vocab_size"] if isinstance(tokenizer, dict) else tokenizer.vocab_size
    model = random_model(model_config("gpt", vocab=vocab, seq_len=seq_len))
    tmp_path.mkdir(exist_ok=True)
    files = write_hf(payload(model, tokenizer), tmp_path)
    assert [f.name for f in files] == sorted([CONFIG_FILE, GENERATION_FILE, EXPORT_FILE, *TOKENIZER_FILES])
    return tmp_path


def assert_same_ids(directory: Path, ours: Tokenizer, texts: list[str]) -> None:
    """tokenizers (tokenizer.json) and transformers (AutoTokenizer) both encode each text to the
    engine's ids and decode them back to the text."""
    fast = HFTokenizer.from_file(str(directory / "tokenizer.json"))
    auto = AutoTokenizer.from_pretrained(directory)
    for text in texts:
        ids = ours.encode(text).tolist()
        assert fast.encode(text).ids == ids and auto(text)["input_ids"] == ids, text
        assert fast.decode(ids) == text and auto.decode(ids) == text == ours.decode(ids)


def test_the_docs_example_generates_text_with_transformers_alone(tmp_path, monkeypatch, capsys):
    text = (ROOT / "docs" / "engine.md").read_text()
    section = text[text.index("### As a transformers model") :]
    example = re.search(r"```python\n(.*?)```", section, re.S)[1]
    corpus = "def main(argv):\n    return len(argv)\n"
    tokenizer_directory(tmp_path / "DIR", Tokenizer.fit("char", corpus), seq_len=64)  # the prompt and 40 tokens
    monkeypatch.chdir(tmp_path)
    exec(compile(example, "docs/engine.md", "exec"), {})
    written = capsys.readouterr().out
    assert written.startswith("def main(") and len(written) == len("def main(") + 40 + 1  # and print's newline
    assert AutoTokenizer.from_pretrained(tmp_path / "DIR")("def").keys() == {"input_ids", "attention_mask"}


def test_the_byte_tokenizer_gives_every_utf8_byte_its_value(tmp_path):
    ours = Tokenizer("byte")
    directory = tokenizer_directory(tmp_path, ours)
    # every character of the basic plane, and one of each 4-byte lead: text with every byte UTF-8 uses
    basic = "".join(chr(c) for c in range(0x10000) if not 0xD800 <= c < 0xE000)
    astral = "".join(map(chr, (0x10000, 0x40000, 0x80000, 0xC0000, 0x10FFFF)))
    assert set((basic + astral).encode()) == set(range(256)) - {0xC0, 0xC1, *range(0xF5, 0x100)}
    assert_same_ids(directory, ours, [*TEXTS, basic + astral, "\x00\r\n"])
    fast = HFTokenizer.from_file(str(directory / "tokenizer.json"))
    assert sorted(fast.get_vocab().values()) == list(range(256))
    for invalid in ([*"日本".encode()][:-1], [0xFF, 0x41], [0xC0, 0x80, 0x41]):  # decoded with U+FFFD, as the engine's
        assert fast.decode(invalid) == ours.decode(invalid)


def test_the_char_tokenizer_gives_each_character_its_id(tmp_path):
    corpus = "".join(TEXTS) * 3
    ours = Tokenizer.fit("char", corpus)
    directory = tokenizer_directory(tmp_path / "corpus", ours)
    assert_same_ids(directory, ours, [*TEXTS, ours.chars, corpus])
    fast = HFTokenizer.from_file(str(directory / "tokenizer.json"))
    assert fast.encode("a€b").ids == ours.encode("ab").tolist()  # € is not in the corpus: it has no id
    pysource = Tokenizer("char", PYSOURCE_CHARS)  # the builtin pysource text's alphabet: ASCII, controls included
    assert_same_ids(tokenizer_directory(tmp_path / "pysource", pysource), pysource, [PYSOURCE_CHARS, TEXTS[0]])


def test_a_trained_bpe_is_written_as_it_is(tmp_path):
    from tokenizers import decoders, models, pre_tokenizers, trainers

    fast = HFTokenizer(models.BPE())
    fast.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    fast.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"], initial_alphabet=alphabet)
    fast.train_from_iterator(TEXTS * 20, trainer=trainer)
    directory = tokenizer_directory(tmp_path, {"kind": "bpe", "chars": None, "bpe": fast.to_str(), "vocab_size": 320})
    auto = AutoTokenizer.from_pretrained(directory)
    for text in TEXTS:
        ids = fast.encode(text).ids
        assert auto(text)["input_ids"] == ids and auto.decode(ids) == text
    assert len(ids) < len(text)  # merges learned and kept


def test_a_models_own_tokenizer_is_written_without_the_special_tokens_it_would_add(tmp_path):
    from tokenizers import models, processors

    fast = HFTokenizer(models.BPE(vocab={"<s>": 0, "a": 1, "b": 2}, merges=[]))  # an uploaded llama's adds a BOS
    fast.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    assert fast.encode("ab").ids == [0, 1, 2]
    directory = tokenizer_directory(tmp_path, {"kind": "bpe", "chars": None, "bpe": fast.to_str(), "vocab_size": 3})
    assert AutoTokenizer.from_pretrained(directory)("ab")["input_ids"] == [1, 2]  # as the engine encodes it
    assert Tokenizer("bpe", bpe=fast.to_str(), vocab_size=3).encode("ab").tolist() == [1, 2]


@pytest.mark.parametrize(
    "arch, config, data",
    [
        ("gpt", None, "char"),
        ("hf", HF_LLAMA | {"num_attention_heads": 4, "num_key_value_heads": 2}, "byte"),  # GQA: 2 heads a group
        ("hf", CONFIGS["gpt2-tied"], "synthetic"),
    ],
)
def test_a_trained_checkpoint_unpacks_to_a_model_and_tokenizer_transformers_load(tmp_path, arch, config, data):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("def main(argv):\n    return len(argv)  # é, 日本\n" * 200)
    job = spec(arch, {"builtin": "synthetic"} if data == "synthetic" else {"path": str(corpus), "tokenizer": data})
    if config:
        job["model"] = {"arch": "hf", "seq_len": SEQ_LEN, "hf": {"config": config}}
        job = JobSpec.model_validate(job).model_dump()
    run_job(RunRequest(job, tmp_path / "run"))
    checkpoint = latest_checkpoint(tmp_path / "run" / "checkpoints")
    archive = to_hf_archive(checkpoint, tmp_path / "exports")
    with tarfile.open(archive) as tar:
        members = tar.getmembers()
    names = sorted([CONFIG_FILE, GENERATION_FILE, EXPORT_FILE, *(TOKENIZER_FILES if data != "synthetic" else ())])
    assert [m.name for m in members] == names and all(m.isfile() for m in members)
    written = extract_export(archive, tmp_path / "model")
    assert sorted(p.name for p in written) == names
    expected = checkpoint_model(checkpoint)
    vocab = expected.cfg.vocab_size
    loaded = from_pretrained(tmp_path / "model")
    assert torch.allclose(hf_logits(loaded, vocab), logits(expected, vocab, SEQ_LEN), rtol=0, atol=1e-5)
    tokenizer = load_checkpoint(checkpoint)["tokenizer"]
    if tokenizer:
        assert_same_ids(tmp_path / "model", Tokenizer(**tokenizer), [corpus.read_text()[:500]])


def tar_with(member: tarfile.TarInfo, data: bytes = b"x") -> Path:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        ok = tarfile.TarInfo("config.json")
        ok.size = 2
        tar.addfile(ok, io.BytesIO(b"{}"))
        if member.isfile():
            member.size = len(data)
        tar.addfile(member, io.BytesIO(data) if member.isfile() else None)
    return buffer.getvalue()


def unsafe(name: str, kind: bytes = tarfile.REGTYPE, link: str = "") -> tarfile.TarInfo:
    member = tarfile.TarInfo(name)
    member.type, member.linkname = kind, link
    return member


@pytest.mark.parametrize(
    "member",
    [
        unsafe("../escaped"),
        unsafe("/etc/escaped"),
        unsafe("sub/config.json"),
        unsafe(".hidden"),
        unsafe("link", tarfile.SYMTYPE, "/etc/passwd"),
        unsafe("hard", tarfile.LNKTYPE, "config.json"),
        unsafe("folder", tarfile.DIRTYPE),
        unsafe("fifo", tarfile.FIFOTYPE),
    ],
    ids=lambda m: m.name,
)
def test_the_client_unpacks_plain_files_with_safe_names_only(tmp_path, member):
    archive = tmp_path / "export.tar"
    archive.write_bytes(tar_with(member))
    with pytest.raises(ValueError, match="not a plain file with a safe name"):
        extract_export(archive, tmp_path / "out")
    assert not (tmp_path / "out").exists() and sorted(p.name for p in tmp_path.iterdir()) == ["export.tar"]
