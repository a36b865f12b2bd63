"""bench/finetune.py's study at a tiny size: the 2x2 table, and fine-tunes that start from the
pretrained weights."""

import math
from pathlib import Path

import pytest
import yaml

from bench import finetune
from contract.spec import JobSpec
from worker.engine.checkpoints import load_checkpoint
from worker.engine.config import job_config
from worker.engine.data import load_data
from worker.engine.trainer import Trainer

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "finetune-study"
TINY_MODEL = {
    "arch": "hf",
    "seq_len": 32,
    "hf": {
        "config": {
            "model_type": "llama",
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
        }
    },
}
STUDY = finetune.Study(seeds=(0,), pretrain_steps=6, finetune_steps=3, scales=(1 / 3,), model=TINY_MODEL, batch_size=4)


class NullSink:
    def metrics(self, report):
        pass

    def checkpoint(self, step, path, nbytes, metrics):
        pass

    def log(self, level, message):
        pass

    def sample(self, step, prompt, text):
        pass


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    """(the study's results, its work directory)."""
    work = tmp_path_factory.mktemp("finetune")
    return finetune.run_study(STUDY, work, log=lambda line: None), work


def instruct_loss(work, pretrain: str | None) -> float:
    """The fine-tune data's validation loss of ``pretrain``'s final weights (None: an untrained model)."""
    spec = STUDY.spec(finetune.FINETUNE_DATA, finetune.scaled_optimizer("adamw", 1 / 3), STUDY.finetune_steps, 0)
    job = job_config(spec)
    trainer = Trainer(job, load_data(job.data, 0, work / "fresh-data"), None, NullSink())
    if pretrain is not None:
        path = finetune.final_checkpoint(work / f"pretrain-{pretrain}-s0")
        trainer.model.load_state_dict(load_checkpoint(path)["model"])
    return float(trainer.evaluate())


def test_the_table_has_four_cells_of_finite_losses(study):
    results, _ = study
    assert set(results["table"]) == {"adamw->adamw", "adamw->muon", "muon->adamw", "muon->muon"}
    for cell in results["table"].values():
        assert all(math.isfinite(cell[k]["mean"]) and cell[k]["n"] == 1 for k in ("step0", "final", "gain"))
    assert all(math.isfinite(s["mean"]) for s in results["pretrain"].values())
    assert set(results["muon_advantage"]) == set(finetune.OPTIMIZERS)
    assert all(math.isfinite(s["mean"]) for s in results["muon_advantage"].values())
    phases = [(r["phase"], r["pretrain"], r["finetune"]) for r in results["runs"]]
    assert len(phases) == 6 and phases[:2] == [("pretrain", "adamw", None), ("pretrain", "muon", None)]
    assert "pretrain \\ fine-tune" in finetune.format_table(results)


def test_a_finetune_starts_from_its_pretrained_weights(study):
    results, work = study
    untrained = instruct_loss(work, None)
    for pretrain in finetune.OPTIMIZERS:
        loaded = instruct_loss(work, pretrain)
        firsts = {r["first"] for r in results["runs"] if r["phase"] == "finetune" and r["pretrain"] == pretrain}
        assert len(firsts) == 1  # both fine-tunes of one pretrain start from the same weights
        assert firsts.pop() == pytest.approx(loaded, rel=1e-6, abs=1e-6)
        assert abs(loaded - untrained) > 1e-3


def test_a_finetune_lr_is_a_scale_of_the_pretraining_lrs():
    assert finetune.scaled_optimizer("muon", 0.5) == {"name": "muon", "lr": 0.01, "adamw_lr": 1.5e-3}
    assert finetune.scaled_optimizer("adamw", 1.0) == finetune.PRETRAIN_OPTIMIZER["adamw"]


def training(spec: dict) -> dict:
    """What of a spec shapes the training: model, data, optimizer and train (how many checkpoints
    the service keeps left out)."""
    train = {k: v for k, v in spec["train"].items() if k != "keep_checkpoints"}
    return {"model": spec["model"], "data": spec["data"], "optimizer": spec["optimizer"], "train": train}


@pytest.mark.parametrize("phase", ["pretrain", "finetune"])
@pytest.mark.parametrize("optimizer", finetune.OPTIMIZERS)
def test_the_examples_train_as_the_study_does(phase, optimizer):
    path = EXAMPLES / f"{phase}-{optimizer}.yaml"
    example = JobSpec.model_validate(yaml.safe_load(path.read_text())).model_dump(mode="json")
    study = finetune.Study(seeds=(0,))
    if phase == "pretrain":
        ours = study.spec(finetune.PRETRAIN_DATA, finetune.PRETRAIN_OPTIMIZER[optimizer], study.pretrain_steps, 0)
        assert example["init_from"] is None
    else:
        ratio = example["optimizer"]["lr"] / finetune.PRETRAIN_OPTIMIZER[optimizer]["lr"]
        section = finetune.scaled_optimizer(optimizer, min(finetune.SCALES, key=lambda s: abs(s - ratio)))
        lrs = {k: example["optimizer"][k] for k in ("lr", "adamw_lr") if k in section}
        assert lrs == pytest.approx({k: section[k] for k in lrs}, rel=1e-3)  # the study's lrs, to 4 digits
        ours = study.spec(finetune.FINETUNE_DATA, section | lrs, study.finetune_steps, 0)
        assert example["init_from"]["job_id"] and not example["init_from"]["optimizer_state"]
    assert training(example) == training(ours)
