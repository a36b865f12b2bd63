"""Run by tests/engine/test_memory_estimate.py in a process of its own: train the JobSpec given as
JSON on the command line for its steps and print the growth of the peak resident memory, in
bytes, over what the process held before (Linux: /proc/self/clear_refs resets the peak)."""

from __future__ import annotations

import copy
import gc
import json
import sys
import tempfile
from pathlib import Path

import torch

from contract.hf import FAMILIES
from worker.engine.request import RunRequest
from worker.engine.run import run_job


def status_bytes(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def main() -> None:
    torch.set_num_threads(1)
    spec = json.loads(sys.argv[1])
    with tempfile.TemporaryDirectory() as tmp:
        warm = copy.deepcopy(spec)  # imports, kernels and allocator arenas first, on a tiny run
        warm["train"].update(steps=2, batch_size=1)
        if spec["model"]["arch"] == "hf":
            family = spec["model"]["hf"]["config"]["model_type"]
            names = FAMILIES[family].names
            sizes = {names[w]: n for w, n in (("width", 8), ("ffn", 8), ("layers", 1), ("heads", 1))}
            warm["model"] = {"arch": "hf", "seq_len": 8, "hf": {"config": {"model_type": family, **sizes}}}
        else:
            warm["model"].update(n_layer=1, n_head=1, d_model=8, seq_len=8)
        run_job(RunRequest(warm, Path(tmp) / "warm"))
        gc.collect()
        before = status_bytes("VmRSS")
        Path("/proc/self/clear_refs").write_text("5")
        run_job(RunRequest(spec, Path(tmp) / "run"))
        print(json.dumps({"peak_growth": status_bytes("VmHWM") - before}))


if __name__ == "__main__":
    main()
