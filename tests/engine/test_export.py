"""Exported weights: a checkpoint converted to safetensors (as the API converts it) reloads to the
same logits, and the example of docs/engine.md runs as written."""

import re
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from app.services.export import EXPORT_KEY, export_config, to_safetensors
from contract.export import CONFIG_FILE, EXPORT_FILE
from contract.spec import JobSpec
from muonforge.transfer import export_metadata, write_export_config
from worker.engine.checkpoints import latest_checkpoint, load_checkpoint
from worker.engine.config import ModelConfig
from worker.engine.export import load_safetensors
from worker.engine.models import build_model
from worker.engine.request import RunRequest
from worker.engine.run import run_job

ROOT = Path(__file__).resolve().parents[2]


HF_LLAMA = {"model_type": "llama", "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2}
HF_LLAMA |= {"num_attention_heads": 2, "num_key_value_heads": 1, "tie_word_embeddings": True}


def spec(arch: str, data: dict) -> dict:
    model = {"arch": arch, "n_layer": 2, "d_model": 16, "seq_len": 16} | ({"n_head": 2} if arch != "mlp" else {})
    if arch == "hf":
        model = {"arch": arch, "seq_len": 16, "hf": {"config": HF_LLAMA}}
    return JobSpec.model_validate(
        {
            "model": model | ({"n_experts": 3, "top_k": 2} if arch == "moe" else {}),
            "data": data,
            "train": {"steps": 3, "batch_size": 4, "eval_every": 3, "checkpoint_every": 3},
            "telemetry": {"sample_tokens": 0},
        }
    ).model_dump()


def checkpoint_model(path: Path) -> torch.nn.Module:
    """The model as the checkpoint holds it, built without the export's code."""
    payload = load_checkpoint(path)
    model = build_model(ModelConfig(**payload["config"]["model"]))
    model.load_state_dict(payload["model"])
    return model.eval()


def logits(model: torch.nn.Module, vocab: int, seq_len: int) -> torch.Tensor:
    tokens = torch.randint(vocab, (2, seq_len), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return model(tokens)


@pytest.mark.parametrize("arch", ["gpt", "moe", "mlp", "hf"])
def test_the_exported_safetensors_reload_to_the_same_logits(tmp_path, arch):
    run_job(RunRequest(spec(arch, {"builtin": "synthetic"}), tmp_path / "run"))
    checkpoint = latest_checkpoint(tmp_path / "run" / "checkpoints")
    exported = to_safetensors(checkpoint, tmp_path / "exports")
    model, config = load_safetensors(exported)
    assert config == export_config(load_checkpoint(checkpoint)) and config["tokenizer"] is None
    assert config["arch"] == arch and config["vocab_size"] == 64
    expected = logits(checkpoint_model(checkpoint), 64, 16)
    assert torch.allclose(logits(model, 64, 16), expected, rtol=0, atol=1e-6)
    with safe_open(str(exported), framework="pt") as f:
        assert f.metadata()["format"] == "pt" and EXPORT_KEY in f.metadata()
        assert export_metadata(exported) == f.metadata()  # the client's reader, which needs no torch
    tensors = load_file(str(exported))
    assert tensors.keys() == checkpoint_model(checkpoint).state_dict().keys()
    if arch != "mlp":  # the head tied to the embedding: two names, two tensors of the same values
        head, table = ("net.lm_head", "net.model.embed_tokens") if arch == "hf" else ("lm_head", "wte")
        assert torch.equal(tensors[f"{head}.weight"], tensors[f"{table}.weight"])


def docs_example() -> str:
    """The Python example under "Exported weights" in docs/engine.md."""
    text = (ROOT / "docs" / "engine.md").read_text()
    section = text[text.index("## Exported weights") :]
    return re.search(r"```python\n(.*?)```", section, re.S)[1]


def test_the_docs_example_loads_an_export_and_writes_text(tmp_path, monkeypatch, capsys):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("def main(argv):\n    return len(argv)\n" * 200)
    run_job(RunRequest(spec("gpt", {"path": str(corpus)}), tmp_path / "run"))
    exported = to_safetensors(latest_checkpoint(tmp_path / "run" / "checkpoints"), tmp_path / "export")
    write_export_config(exported.replace(tmp_path / "export" / EXPORT_FILE))
    assert sorted(p.name for p in (tmp_path / "export").iterdir()) == sorted([CONFIG_FILE, EXPORT_FILE])
    monkeypatch.chdir(tmp_path)
    exec(compile(docs_example(), "docs/engine.md", "exec"), {})
    written = capsys.readouterr().out
    assert written.startswith("def main(") and len(written) > len("def main(") + 50
