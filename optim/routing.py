"""Route a model's parameters to Muon or AdamW by the role they play, not by their rank."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from torch import Tensor, nn

ROLES = ("muon", "experts", "adamw")


@runtime_checkable
class DeclaresRoles(Protocol):
    """A module that names the role of its own parameters (an MoE layer's expert weights)."""

    def muon_param_roles(self) -> dict[str, str]: ...


# Modules whose weights are gains or lookup tables, never hidden linear maps.
_ADAMW_MODULES = (
    nn.Embedding,
    nn.EmbeddingBag,
    nn.LayerNorm,
    nn.GroupNorm,
    nn.RMSNorm,
    nn.modules.batchnorm._NormBase,
)
_MATRIX_MODULES = (nn.Linear, nn.Bilinear, nn.modules.conv._ConvNd)

# Why a parameter lands where it does, one per rule of :func:`routes`.
DECLARED = "declared by its module"  # muon_param_roles(): an MoE layer's expert weights
HEAD = "output head"
TABLE = "embedding or norm"
MATRIX = "hidden matrix"  # the weight of a Linear or conv layer
VECTOR = "bias or vector"  # 1-D: biases, gains, a layer's own vectors
UNRECOGNIZED = "matrix of an unrecognized module"  # > 1-D, neither a Linear/conv weight nor declared
REASONS = (DECLARED, HEAD, TABLE, MATRIX, VECTOR, UNRECOGNIZED)


@dataclass(frozen=True)
class Route:
    """Where one parameter goes: its name (the first, for a tied one), shape, group, and why."""

    name: str
    shape: tuple[int, ...]
    group: str  # one of ROLES
    reason: str  # one of REASONS


def routes(model: nn.Module, output_head: nn.Module | None = None) -> list[Route]:
    """Every parameter of ``model`` with its group and the rule that put it there.

    Rules, in order of precedence:
    1. a module's own ``muon_param_roles()`` -> {param name: "muon" | "experts" | "adamw"}
       (how an MoE layer marks its [E, out, in] expert weights);
    2. embeddings, norms (torch's, and any module whose class name ends in "Norm": transformers'
       LlamaRMSNorm and the like) and the output head -> AdamW. The head is ``output_head`` if given,
       else a Linear whose weight is tied to an embedding or whose out_features equals an
       embedding's vocabulary, else the last Linear registered;
    3. weights of Linear and conv layers -> Muon; 1-D parameters (biases, gains) -> AdamW;
    4. any other parameter of more than one dimension -> AdamW: a matrix whose role Muon cannot
       tell (a custom module's own weight, a table held as a bare parameter) is never
       orthogonalized on a guess. Its reason is ``UNRECOGNIZED``, and the engine logs a warning.
    A tied parameter is routed once, under its first name; a tie to an embedding keeps AdamW.
    """
    head = output_head if output_head is not None else _find_output_head(model)
    found: dict[Tensor, Route] = {}
    for prefix, module in model.named_modules():
        declared = module.muon_param_roles() if isinstance(module, DeclaresRoles) else {}
        for name, p in module.named_parameters(recurse=False):
            group, reason = (declared[name], DECLARED) if name in declared else _role(module, name, p, head)
            if group not in ROLES:
                raise ValueError(f"unknown role {group!r} for parameter {name!r} of {type(module).__name__}")
            first = found.get(p)
            if first is not None and first.group == "adamw":  # a tie to an embedding keeps AdamW
                continue
            if first is not None and group != "adamw":
                continue
            found[p] = Route(first.name if first else f"{prefix}.{name}".lstrip("."), tuple(p.shape), group, reason)
    return list(found.values())


def split_params(model: nn.Module, output_head: nn.Module | None = None) -> list[dict[str, Any]]:
    """Param groups for :class:`optim.Muon` by :func:`routes`: hidden matrices to Muon, expert
    weights to Muon per expert, the rest to AdamW. Asserts every parameter lands in exactly one group."""
    by_name = dict(model.named_parameters())
    table = routes(model, output_head)
    groups: list[dict[str, Any]] = [
        {"params": [by_name[r.name] for r in table if r.group == "muon"], "use_muon": True},
        {"params": [by_name[r.name] for r in table if r.group == "experts"], "use_muon": True, "experts": True},
        {"params": [by_name[r.name] for r in table if r.group == "adamw"], "use_muon": False},
    ]
    groups = [g for g in groups if g["params"]]
    routed = [id(p) for g in groups for p in g["params"]]
    if len(routed) != len(set(routed)) or set(routed) != {id(p) for p in model.parameters()}:
        raise AssertionError("every parameter must land in exactly one group")
    return groups


def _role(module: nn.Module, name: str, p: Tensor, head: nn.Module | None) -> tuple[str, str]:
    if module is head:
        return "adamw", HEAD
    if isinstance(module, _ADAMW_MODULES) or type(module).__name__.endswith("Norm"):
        return "adamw", TABLE
    if isinstance(module, _MATRIX_MODULES) and name == "weight":
        return "muon", MATRIX
    return "adamw", VECTOR if p.ndim < 2 else UNRECOGNIZED


def _find_output_head(model: nn.Module) -> nn.Module | None:
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    embeddings = [m for m in model.modules() if isinstance(m, (nn.Embedding, nn.EmbeddingBag))]
    tables = {e.weight for e in embeddings}
    vocab = {e.num_embeddings for e in embeddings}
    for lin in linears:
        if lin.weight in tables:
            return lin
    for lin in reversed(linears):
        if lin.out_features in vocab:
            return lin
    return linears[-1] if linears else None


def split_by_heads(groups: list[dict[str, Any]], blocks: Mapping[Tensor, Sequence[int]]) -> list[dict[str, Any]]:
    """``groups`` with every Muon parameter of ``blocks`` moved into a group of its own heights
    (``"row_blocks"``, the other options kept): its row blocks, a head each, are orthogonalized
    one by one (:class:`optim.Muon`). Parameters of one geometry share a group."""
    out: list[dict[str, Any]] = []
    split: dict[tuple[int, tuple[int, ...]], dict[str, Any]] = {}
    for group in groups:
        kept = []
        for p in group["params"]:
            heights = blocks.get(p)
            if heights is None or not group.get("use_muon", True) or group.get("experts", False):
                kept.append(p)
                continue
            key = (id(group), tuple(heights))
            if key not in split:
                split[key] = {**group, "params": [], "row_blocks": tuple(heights)}
            split[key]["params"].append(p)
        if kept:
            out.append({**group, "params": kept})
    return out + list(split.values())


def fused_qkv_blocks(n_head: int, head_dim: int, n_kv_head: int | None = None) -> tuple[int, ...]:
    """Per-head row blocks of a fused W_qkv [(n_head + 2 n_kv_head) * d, in] ([Q heads | K heads |
    V heads]): every query and key head on its own, the values whole."""
    kv = n_head if n_kv_head is None else n_kv_head
    return (head_dim,) * (n_head + kv) + (kv * head_dim,)
