"""A model's config and weights, checked against each other without loading a tensor.

An upload's (app.services.models) and a staged directory's (app.services.staged_models) alike. The
config must name a decoder family of contract.hf without remote code; the safetensors headers (read
alone) must hold exactly the tensors, with their shapes, of the model the config builds
(transformers on the meta device: no memory, no weights).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from app.services.model_archive import CONFIG, INDEX, SHARD, WEIGHTS, refused
from contract.hf import FAMILIES, Shape, normalized

JSON_LIMIT = 16 << 20  # bytes of config.json or the index read into memory
HEADER_LIMIT = 100_000_000  # the safetensors format's own bound on a header
# Sizes the config's model names for its training, not its shapes: left out of contract.hf's check.
NOT_SHAPES = ("vocab_size", "dtype", "torch_dtype", "attn_implementation", "_attn_implementation")
SHOWN = 5  # mismatched tensors named in a refusal


# -- the config -----------------------------------------------------------------------------------
def _read_json(path: Path, what: str) -> Any:
    if path.stat().st_size > JSON_LIMIT:
        raise refused(f"{what} is larger than {JSON_LIMIT:,} bytes")
    try:
        return json.loads(path.read_bytes())
    except (ValueError, UnicodeDecodeError) as exc:
        raise refused(f"{what} is not JSON ({exc})") from None


def check_config(path: Path, where: str = "the archive") -> dict[str, Any]:
    """config.json, checked: a decoder family of contract.hf, no code to load, valid sizes.
    ``where`` names what holds it in a refusal (an upload's archive, a staged directory)."""
    if not path.is_file():
        raise refused(f"{where} has no {CONFIG}")
    config = _read_json(path, CONFIG)
    if not isinstance(config, dict):
        raise refused(f"{CONFIG} is not a JSON object")
    for key in ("auto_map", "trust_remote_code"):
        if key in config:
            raise refused(f"{CONFIG} sets {key}: no code is loaded from a model")
    model_type = config.get("model_type")
    if model_type not in FAMILIES:
        raise refused(
            f"{CONFIG}'s model_type {model_type!r} is not a decoder family this service trains: "
            f"one of {', '.join(sorted(FAMILIES))}"
        )
    if "quantization_config" in config:
        raise refused(f"{CONFIG} sets quantization_config: quantized models are not taken")
    vocab = config.get("vocab_size")
    if not isinstance(vocab, int) or isinstance(vocab, bool) or vocab < 1:
        raise refused(f"{CONFIG}'s vocab_size must be a whole number >= 1 (got {vocab!r})")
    try:
        normalized({k: v for k, v in config.items() if k not in NOT_SHAPES})
    except ValueError as exc:
        raise refused(f"{CONFIG}: {exc}") from None
    return config


# -- the weights ----------------------------------------------------------------------------------
Tensors = dict[str, tuple[int, ...]]


def check_weights(directory: Path, files: list[str], config: dict[str, Any], where: str = "the archive") -> int:
    """The weights' tensors against those the config builds; the model's parameter count.
    ``where`` names what holds the files in a refusal (an upload's archive, a staged directory)."""
    found = weight_tensors(directory, files, where)
    layers = Shape.of(normalized({k: v for k, v in config.items() if k not in NOT_SHAPES})).layers
    if layers > len(found):  # every layer has tensors of its own: the build below is bounded by the file
        raise refused(f"the weights hold {len(found):,} tensors, fewer than the config's {layers:,} layers")
    expected, tied, parameters = expected_tensors(config)
    tied_names = {name for group in tied for name in group}
    missing = [n for n in expected if n not in found and n not in tied_names]
    missing += [sorted(group)[0] for group in tied if not group & found.keys()]
    unexpected = [n for n in found if n not in expected]
    mismatched = [
        f"{n} is {list(found[n])} in the weights, {list(shape)} by the config"
        for n, shape in expected.items()
        if n in found and found[n] != shape
    ]
    problems = []
    if mismatched:
        problems.append(
            "; ".join(mismatched[:SHOWN]) + (f" (and {len(mismatched) - SHOWN} more)" * (len(mismatched) > SHOWN))
        )
    for label, names in (("missing", missing), ("not in the model", unexpected)):
        if names:
            problems.append(
                f"{label}: "
                + ", ".join(sorted(names)[:SHOWN])
                + (f" (and {len(names) - SHOWN} more)" * (len(names) > SHOWN))
            )
    if problems:
        raise refused(f"the weights do not match {CONFIG}: " + "; ".join(problems))
    return parameters


def weight_tensors(directory: Path, files: list[str], where: str = "the archive") -> Tensors:
    """Every tensor's name and shape, from the safetensors headers (one file, or the index's shards)."""
    shards = sorted(f for f in files if SHARD.fullmatch(f))
    if WEIGHTS in files:
        if shards or INDEX in files:
            raise refused(f"{where} has both {WEIGHTS} and sharded weights: one or the other")
        return read_header(directory / WEIGHTS, WEIGHTS)
    if not shards:
        if INDEX in files:
            raise refused(f"{INDEX} names shards that {where} lacks")
        raise refused(f"{where} has no weights: {WEIGHTS}, or model-NNNNN-of-NNNNN.safetensors shards")
    if INDEX not in files:
        raise refused(f"sharded weights need {INDEX}")
    totals = {int(SHARD.fullmatch(s)[2]) for s in shards}  # type: ignore[index]
    numbers = sorted(int(SHARD.fullmatch(s)[1]) for s in shards)  # type: ignore[index]
    if len(totals) != 1 or numbers != list(range(1, totals.pop() + 1)):
        raise refused(f"the shards {', '.join(shards)} are not a complete set")
    index = _read_json(directory / INDEX, INDEX)
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise refused(f"{INDEX} has no weight_map of tensor names to shard files")
    if set(weight_map.values()) != set(shards):
        raise refused(
            f"{INDEX} names the shards {', '.join(sorted(set(weight_map.values())))}, {where} holds {', '.join(shards)}"
        )
    found: Tensors = {}
    for shard in shards:
        for name, shape in read_header(directory / shard, shard).items():
            if name in found:
                raise refused(f"tensor {name} is in two shards")
            if weight_map.get(name) != shard:
                raise refused(f"tensor {name} is in {shard}, {INDEX} says {weight_map.get(name)!r}")
            found[name] = shape
    if absent := sorted(set(weight_map) - found.keys()):
        raise refused(f"{INDEX} names tensors that no shard holds: {', '.join(absent[:SHOWN])}")
    return found


def read_header(path: Path, what: str) -> Tensors:
    """A safetensors file's tensors (name and shape) from its header alone: 8 bytes of header
    length (little-endian), then the JSON header; each tensor's bytes must lie in the file."""
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(8)
        length = int.from_bytes(head, "little") if len(head) == 8 else -1
        if length < 2 or length > HEADER_LIMIT or 8 + length > size:
            raise refused(f"{what} is not a safetensors file (no valid header)")
        raw = f.read(length)
    try:
        header = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise refused(f"{what} is not a safetensors file (its header is not JSON)") from None
    if not isinstance(header, dict):
        raise refused(f"{what} is not a safetensors file (its header is not an object)")
    data = size - 8 - length
    tensors: Tensors = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        shape = entry.get("shape") if isinstance(entry, dict) else None
        offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
        if (
            not isinstance(shape, list)
            or not all(isinstance(n, int) and n >= 0 for n in shape)
            or not isinstance(entry.get("dtype"), str)
            or not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(isinstance(n, int) for n in offsets)
            or not 0 <= offsets[0] <= offsets[1] <= data
        ):
            raise refused(f"{what}: tensor {name!r} has an invalid header entry")
        tensors[name] = tuple(shape)
    return tensors


def expected_tensors(config: dict[str, Any]) -> tuple[Tensors, list[set[str]], int]:
    """The tensors (names and shapes) of the model the config builds, the groups of names that
    share one tensor (a tied lm_head: the weights may hold any one of them), and its parameters.

    transformers builds the model on the meta device: no memory is allocated and nothing is
    initialized. torch and transformers are imported here, when a model is uploaded or first staged.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = {k: v for k, v in config.items() if k != "model_type"}
    try:
        hf_config = AutoConfig.for_model(config["model_type"], **fields)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(hf_config)
    except Exception as exc:  # transformers' own checks of the config, whatever they raise
        raise refused(f"{CONFIG} does not build a {config['model_type']} model: {exc}") from None
    names: dict[int, list[str]] = {}
    expected: Tensors = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        names.setdefault(id(tensor), []).append(name)
        expected[name] = tuple(tensor.shape)
    tied = [set(group) for group in names.values() if len(group) > 1]
    return expected, tied, sum(p.numel() for p in model.parameters())
