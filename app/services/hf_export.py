"""A checkpoint's model as transformers' own: its config, its tensors' names and layouts, its tokenizer.

``GET …/checkpoints/{step}?format=hf`` (app/services/export.py writes the files) gives a directory
that ``AutoModelForCausalLM.from_pretrained`` and ``AutoTokenizer.from_pretrained`` load with no
code of ours, to the same logits. arch hf is already a transformers model: our ``net.`` prefix goes,
and GPT-2's layers go back to its Conv1D layout ([in, out] weights, q, k and v fused in ``c_attn``).
arch gpt is a GPT-2 without biases: GPT2LMHeadModel with zero biases, the exact (erf) GELU and no
dropout. moe and mlp have no transformers equivalent. The tokenizer files give the ids of the
engine's byte, char or bpe tokenizer for any text (docs/engine.md, "Exported weights").

torch and tokenizers are imported when an export is asked for, not when the API starts.
"""

from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING, Any

from app.errors import ValidationFailed
from contract.export import TOKENIZER_FILES

if TYPE_CHECKING:
    from torch import Tensor

# The transformers class of each family contract.hf offers (its config.json's ``architectures``).
CAUSAL_LM = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma": "GemmaForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "gpt2": "GPT2LMHeadModel",
}
CONV1D = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")  # GPT-2's Conv1D layers: weight [in, out]
GPT_BLOCK = {  # a block's tensor in our gpt -> in a GPT-2 block
    "ln_1.weight": "ln_1.weight",
    "ln_1.bias": "ln_1.bias",
    "attn.qkv.weight": "attn.c_attn.weight",
    "attn.proj.weight": "attn.c_proj.weight",
    "ln_2.weight": "ln_2.weight",
    "ln_2.bias": "ln_2.bias",
    "ffn.up.weight": "mlp.c_fc.weight",
    "ffn.down.weight": "mlp.c_proj.weight",
}
GPT_TOP = {"wte.weight", "wpe.weight", "ln_f.weight", "ln_f.bias"}  # under ``transformer.`` in GPT-2
# The engine's tokenizers mark no begin or end of text: generation stops at the length asked for.
NO_SPECIAL_TOKENS = {"bos_token_id": None, "eos_token_id": None, "pad_token_id": None}


def check_exportable(model: dict[str, Any]) -> None:
    """ValidationFailed (param ``format``) for an arch that has no transformers equivalent."""
    if model["arch"] not in ("hf", "gpt"):
        raise ValidationFailed(
            f"arch {model['arch']} has no transformers equivalent: export its weights with format=safetensors",
            param="format",
        )


def hf_config(model: dict[str, Any], dtype: str) -> dict[str, Any]:
    """config.json of the transformers model of ``model`` (a checkpoint's model config), its
    tensors of ``dtype`` (``float32``); bos, eos and pad are null."""
    check_exportable(model)
    if model["arch"] == "hf":
        hf = model["hf"]
        return {
            **hf,
            "architectures": [CAUSAL_LM[hf["model_type"]]],
            "vocab_size": model["vocab_size"],
            "dtype": dtype,
            **NO_SPECIAL_TOKENS,
        }
    d = model["d_model"]
    return {
        "architectures": [CAUSAL_LM["gpt2"]],
        "model_type": "gpt2",
        "vocab_size": model["vocab_size"],
        "n_positions": model["seq_len"],
        "n_embd": d,
        "n_layer": model["n_layer"],
        "n_head": model["n_head"],
        "n_inner": model["mlp_ratio"] * d,
        "activation_function": "gelu",  # torch's exact erf GELU ("gelu_new" is the tanh approximation)
        "layer_norm_epsilon": 1e-5,  # nn.LayerNorm's
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
        "scale_attn_weights": True,  # q.k / sqrt(head_dim)
        "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False,
        "tie_word_embeddings": True,
        "dtype": dtype,
        **NO_SPECIAL_TOKENS,
    }


def generation_config() -> dict[str, Any]:
    """generation_config.json: no special tokens."""
    return dict(NO_SPECIAL_TOKENS)


def hf_tensors(model: dict[str, Any], state: dict[str, Tensor]) -> dict[str, Tensor]:
    """The checkpoint's tensors (``state``, the engine's names) under transformers' names and layouts.

    A tied output head is left out, as transformers saves it (the model ties it to the embedding).
    """
    check_exportable(model)
    if model["arch"] == "gpt":
        return _gpt_as_gpt2(state)
    out = {name.removeprefix("net."): tensor for name, tensor in state.items()}
    if model["hf"]["model_type"] == "gpt2":
        out = _conv1d_layout(out)
    if model["hf"]["tie_word_embeddings"]:
        del out["lm_head.weight"]
    return out


def _conv1d_layout(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """GPT-2's tensors as the engine trains them (nn.Linear, c_attn as q, k, v) in Conv1D layout."""
    import torch

    out: dict[str, Tensor] = {}
    for name, tensor in state.items():
        layer = re.fullmatch(r"(transformer\.h\.\d+\.attn\.c_attn)\.([qkv])\.(weight|bias)", name)
        if layer:
            fused, part, kind = layer.groups()
            if part == "q":  # [C, in] each: c_attn.weight = [q; k; v].T [in, 3C], its bias [3C]
                parts = [state[f"{fused}.{p}.{kind}"] for p in "qkv"]
                out[f"{fused}.{kind}"] = torch.cat(parts, dim=0).T if kind == "weight" else torch.cat(parts)
        elif name.endswith(".weight") and name.removesuffix(".weight").endswith(CONV1D):
            out[name] = tensor.T
        else:
            out[name] = tensor
    return out


def _gpt_as_gpt2(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """Our gpt's tensors as GPT2LMHeadModel's: Conv1D weights transposed, zero biases added."""
    import torch

    out: dict[str, Tensor] = {}
    for name, tensor in state.items():
        if name == "lm_head.weight":  # tied to wte
            continue
        if name in GPT_TOP:
            out[f"transformer.{name}"] = tensor
            continue
        block = re.fullmatch(r"blocks\.(\d+)\.(.+)", name)
        if not block or block[2] not in GPT_BLOCK:
            raise ValueError(f"{name}: not a tensor of arch gpt")
        target = f"transformer.h.{block[1]}.{GPT_BLOCK[block[2]]}"
        if target.removesuffix(".weight").endswith(CONV1D):  # nn.Linear [out, in] -> Conv1D [in, out], bias 0
            out[target] = tensor.T
            out[target.removesuffix("weight") + "bias"] = torch.zeros(tensor.shape[0], dtype=tensor.dtype)
        else:
            out[target] = tensor
    return out


def byte_alphabet() -> list[str]:
    """GPT-2's byte-to-unicode table: the printable character that stands for byte b, at index b."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    code = {b: b for b in printable} | {b: 256 + i for i, b in enumerate(others)}
    return [chr(code[b]) for b in range(256)]


def tokenizer_files(tokenizer: dict[str, Any] | None, seq_len: int) -> dict[str, str]:
    """tokenizer.json and tokenizer_config.json of the engine's tokenizer, by file name; none for
        the synthetic task's token ids.

        byte: a byte-level BPE without merges over GPT-2's byte alphabet in byte order, so text's ids
        are its UTF-8 bytes, and decoding joins the bytes (an invalid sequence decodes to U+FFFD, as the
        engine's). char: a BPE without merges (no pre-tokenizer) whose vocabulary is the tokenizer's
        characters, each at its id, decoded by joining them; a character outside it has no id and is
        left out (the engine's tokenizer refuses the text). bpe: the BPE's own JSON (learned, or an
    uploaded model's) without its post-processor: the engine adds no BOS or EOS to a text, nor does
    the exported tokenizer.
    """
    if tokenizer is None:
        return {}
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    if tokenizer["kind"] == "bpe":  # a tokenizers model already; the engine encodes without special tokens
        built = Tokenizer.from_str(json.dumps(json.loads(tokenizer["bpe"]) | {"post_processor": None}))
    elif tokenizer["kind"] == "byte":
        built = Tokenizer(models.BPE(vocab={c: b for b, c in enumerate(byte_alphabet())}, merges=[]))
        built.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        built.decoder = decoders.ByteLevel()
    elif tokenizer["kind"] == "char":
        built = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(tokenizer["chars"])}, merges=[]))
        built.decoder = decoders.Fuse()
    else:
        raise ValueError(f"no transformers tokenizer for the engine's {tokenizer['kind']!r} tokenizer")
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "clean_up_tokenization_spaces": False,  # decoding gives the text back as it was
        "model_max_length": seq_len,
        "model_input_names": ["input_ids", "attention_mask"],  # no token_type_ids: GPT-2 would embed them
    }
    return dict(zip(TOKENIZER_FILES, (built.to_str(), json.dumps(config, indent=2) + "\n"), strict=True))
