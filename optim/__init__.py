"""muonforge's optimizer core: Muon, NorMuon, MuonClip/QK-Clip and the Newton–Schulz family (torch only)."""

from .adamw import adamw_update
from .batches import as_matrices, matrix_shape
from .coefficients import KELLER, POLAR_EXPRESS, resolve_coefficients, scalar_map, singular_value_band
from .distributed import assign_owners, ns_flops
from .hyperparams import update_scale
from .muon import Muon
from .newton_schulz import choose_method, orthogonalize
from .normuon import normalize_batch, normalize_reference
from .precision import auto_dtype
from .qk_clip import (
    MuonClip,
    QKClipSource,
    QKClipTarget,
    fused_qkv_targets,
    mla_targets,
    qk_clip,
    qk_clip_sources,
    separate_qk_targets,
)
from .routing import Route, fused_qkv_blocks, routes, split_by_heads, split_params
from .scratch import Scratch
from .stats import StepStats

__all__ = [
    "KELLER",
    "POLAR_EXPRESS",
    "Muon",
    "MuonClip",
    "QKClipSource",
    "QKClipTarget",
    "Route",
    "Scratch",
    "StepStats",
    "adamw_update",
    "as_matrices",
    "assign_owners",
    "auto_dtype",
    "choose_method",
    "fused_qkv_blocks",
    "fused_qkv_targets",
    "matrix_shape",
    "mla_targets",
    "normalize_batch",
    "normalize_reference",
    "ns_flops",
    "orthogonalize",
    "qk_clip",
    "qk_clip_sources",
    "resolve_coefficients",
    "routes",
    "scalar_map",
    "separate_qk_targets",
    "singular_value_band",
    "split_by_heads",
    "split_params",
    "update_scale",
]
