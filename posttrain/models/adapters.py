"""LoRA adapter folders in PEFT's format (`adapter_config.json` + `adapter_model.safetensors`, as `peft`'s
`save_pretrained` writes them): which base model one adapts (`adapter_base`, resolved by `posttrain.models.spec`
like any spec) and its weights merged into that base (`merge_adapter`: W += s * B A per adapted linear layer,
s = lora_alpha / r, or lora_alpha / sqrt(r) with `use_rslora`; PEFT's own merge), so that sampling and scoring then
cost what the base model's do.
"""

from __future__ import annotations

import json
import math
import re
from collections import defaultdict
from pathlib import Path

import jax
import numpy as np
from safetensors.numpy import load_file

from posttrain import distributed
from posttrain.models.hf_io import CheckpointError, linear_weights, to_ours

__all__ = ["ADAPTER_CONFIG", "adapter_base", "has_tokenizer", "is_adapter", "merge_adapter"]

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
#: a PEFT tensor name: the base module, A or B (an adapter name may sit between: `lora_A.default.weight`)
_PEFT_NAME = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<ab>[AB])(?:\.[^.]+)?\.weight$")


def is_adapter(folder: Path) -> bool:
    """Whether `folder` is a LoRA adapter folder (PEFT's `adapter_config.json`, no model `config.json`)."""
    return folder.is_dir() and (folder / ADAPTER_CONFIG).is_file() and not (folder / "config.json").exists()


def adapter_base(folder: Path) -> str:
    """The model spec an adapter folder adapts (its `base_model_name_or_path`: a path relative to the current
    folder, else to the adapter's, or any other spec)."""
    base = _adapter_settings(folder).get("base_model_name_or_path")
    if not base:
        raise CheckpointError(f"{folder / ADAPTER_CONFIG}: no base_model_name_or_path: the adapter does not say "
                              "which model it adapts")
    relative = folder / str(base)
    return str(relative) if not Path(str(base)).exists() and relative.exists() else str(base)


def has_tokenizer(folder: Path) -> bool:
    """Whether an adapter folder carries its own tokenizer files."""
    return any((folder / f).is_file() for f in _TOKENIZER_FILES)


def _adapter_settings(folder: Path) -> dict:
    path = folder / ADAPTER_CONFIG
    try:
        settings = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: cannot read the adapter config: {e}") from None
    if str(settings.get("peft_type", "LORA")).upper() != "LORA":
        raise CheckpointError(f"{path}: peft_type {settings.get('peft_type')!r}; only LORA adapters are supported")
    unsupported = [k for k in ("fan_in_fan_out", "alpha_pattern", "modules_to_save", "use_dora") if settings.get(k)]
    if settings.get("bias", "none") != "none":
        unsupported.append("bias")
    if unsupported:
        raise CheckpointError(f"{path}: {unsupported} set: not supported (plain LoRA adapters only)")
    return settings


def _adapter_pairs(folder: Path) -> dict[str, dict[str, np.ndarray]]:
    """module name -> {"A": [r, in], "B": [out, r]} of the adapter's weights."""
    path = folder / ADAPTER_WEIGHTS
    if not path.is_file():
        raise CheckpointError(f"{folder}: no {ADAPTER_WEIGHTS} beside {ADAPTER_CONFIG}")
    pairs: dict[str, dict[str, np.ndarray]] = defaultdict(dict)
    for name, tensor in load_file(str(path)).items():
        m = _PEFT_NAME.match(name)
        if m is None:
            raise CheckpointError(f"{path}: tensor {name!r} is not a LoRA A or B weight (plain LoRA adapters only)")
        pairs[m.group("module")][m.group("ab")] = tensor.astype(np.float32)
    broken = sorted(k for k, v in pairs.items() if set(v) != {"A", "B"})
    if broken:
        raise CheckpointError(f"{path}: {broken[0]!r} has an A or B weight without the other")
    return dict(pairs)


def merge_adapter(model, folder: str | Path) -> list[str]:
    """Adds the PEFT LoRA adapter in `folder` to `model`'s weights in place (module docstring); returns the adapted
    HF weight names. An adapter for a layer the model does not have is a `CheckpointError`."""
    folder = Path(folder)
    settings = _adapter_settings(folder)
    alpha, rslora = float(settings.get("lora_alpha", 8)), bool(settings.get("use_rslora", False))
    targets = linear_weights(model)
    pairs = _adapter_pairs(folder)
    by_var: dict[int, list] = defaultdict(list)
    for module, ab in sorted(pairs.items()):
        name = module + ".weight"
        if name not in targets:
            raise CheckpointError(f"{folder}: the adapter changes {module!r}, which is not a linear layer of the base "
                                  f"{model.cfg.model_type} model")
        r = ab["A"].shape[0]
        scale = alpha / (math.sqrt(r) if rslora else r)
        var, layer, n_in = targets[name]
        by_var[id(var)].append((var, layer, n_in, scale * (ab["B"] @ ab["A"])))
    for changes in by_var.values():
        var = changes[0][0]
        old = var.get_value()
        value = np.array(distributed.to_host(old), np.float32)
        for _, layer, n_in, delta in changes:
            part = value if layer is None else value[layer]
            part += to_ours(delta, part.shape, n_in)
        var.set_value(jax.device_put(value.astype(old.dtype), old.sharding))
    return sorted(m + ".weight" for m in pairs)
