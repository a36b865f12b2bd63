"""Route a model's parameters to Muon or AdamW by the role they play, not by their rank."""

from __future__ import annotations

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


def split_params(model: nn.Module, output_head: nn.Module | None = None) -> list[dict[str, Any]]:
    """Param groups for :class:`optim.Muon`: hidden matrices to Muon, the rest to AdamW.

    Roles, in order of precedence:
    1. a module's own ``muon_param_roles()`` -> {param name: "muon" | "experts" | "adamw"}
       (how an MoE layer marks its [E, out, in] expert weights);
    2. embeddings, norms and the output head -> AdamW. The head is ``output_head`` if given,
       else a Linear whose weight is tied to an embedding or whose out_features equals an
       embedding's vocabulary, else the last Linear registered;
    3. weights of Linear and conv layers -> Muon; biases and anything else -> AdamW.
    Tied parameters are routed once. Asserts every parameter lands in exactly one group.
    """
    head = output_head if output_head is not None else _find_output_head(model)
    roles: dict[Tensor, str] = {}
    for module in model.modules():
        declared = module.muon_param_roles() if isinstance(module, DeclaresRoles) else {}
        for name, p in module.named_parameters(recurse=False):
            role = declared.get(name) or _role(module, name, head)
            if role not in ROLES:
                raise ValueError(f"unknown role {role!r} for parameter {name!r} of {type(module).__name__}")
            previous = roles.get(p)
            roles[p] = "adamw" if "adamw" in (previous, role) else role  # a tie to an embedding keeps AdamW
    groups: list[dict[str, Any]] = [
        {"params": [p for p, r in roles.items() if r == "muon"], "use_muon": True},
        {"params": [p for p, r in roles.items() if r == "experts"], "use_muon": True, "experts": True},
        {"params": [p for p, r in roles.items() if r == "adamw"], "use_muon": False},
    ]
    groups = [g for g in groups if g["params"]]
    routed = [id(p) for g in groups for p in g["params"]]
    if len(routed) != len(set(routed)) or set(routed) != {id(p) for p in model.parameters()}:
        raise AssertionError("every parameter must land in exactly one group")
    return groups


def _role(module: nn.Module, name: str, head: nn.Module | None) -> str:
    if module is head or isinstance(module, _ADAMW_MODULES):
        return "adamw"
    if isinstance(module, _MATRIX_MODULES) and name == "weight":
        return "muon"
    return "adamw"


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
