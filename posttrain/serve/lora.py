"""LoRA adapters served over one base (`posttrain serve BASE --lora NAME=PATH`), chosen by a request's `model`; each is
its own engine lane (slots and cache of its own) over a model that shares the base's arrays:

- a LoRA run's output folder (its `config.yaml` says the rank, alpha and target; its newest checkpoint holds the
  trained adapters): the adapters are attached as LoRA parameters, so nothing of the base is copied, and the
  programs compile once for every adapter of one shape;
- a PEFT adapter folder (`adapter_config.json` + `adapter_model.safetensors`): merged into the weights it adapts
  (`posttrain.models.adapters.merge_adapter`, as `Policy.open` does), so only those weights are copied and the
  base's compiled programs serve it.
"""

from __future__ import annotations

from pathlib import Path

import jax
from flax import nnx

from posttrain.config import ConfigError, from_dict, yaml_load
from posttrain.models import lora as lora_lib
from posttrain.models.adapters import is_adapter, merge_adapter
from posttrain.models.weights import load_flat_weights
from posttrain.rollout.policy import Policy
from posttrain.serve.models import ServedModel
from posttrain.training.checkpoint import read_trained_params
from posttrain.training.config import LoraConfig
from posttrain.training.run import lora_target

__all__ = ["open_adapter"]


def read_adapter(path: str | Path) -> tuple[LoraConfig, int, dict]:
    """(the run's LoRA settings, checkpoint step, adapter arrays) of a LoRA run's output folder."""
    folder = Path(path)
    cfg_path = folder / "config.yaml"
    if not cfg_path.is_file():
        raise ConfigError(f"--lora {path}: neither a LoRA run's output folder (no config.yaml) nor a PEFT adapter "
                          "folder (no adapter_config.json)")
    data = yaml_load(cfg_path.read_text(), source=str(cfg_path)) or {}
    lora = from_dict(LoraConfig, data.get("lora") or {}, prefix="lora")
    if not lora.enabled:
        raise ConfigError(f"--lora {path}: the run trained every weight (lora.enabled is false); serve its hf/ "
                          "export as a model instead")
    try:
        step, flat = read_trained_params(folder / "checkpoints")
    except FileNotFoundError as e:
        raise ConfigError(f"--lora {path}: {e}") from None
    return lora, step, flat


def open_adapter(base: ServedModel, path: str | Path) -> ServedModel:
    """The base with an adapter (a LoRA run's folder or a PEFT adapter folder), sharing the base's arrays."""
    graphdef, state = nnx.split(base.model)
    # new modules and variables over the same arrays (merging `state` itself would reuse the base's variables: an
    # adapter merged into them would change the base)
    model = nnx.merge(graphdef, jax.tree.map(lambda x: x, state))
    if is_adapter(Path(path)):
        merge_adapter(model, path)
    else:
        _attach_run_adapters(model, path)
    policy = base.policy
    return ServedModel(Policy(model, policy.tokenizer, folder=policy.encoder.folder, style=policy.style,
                              program_cache=policy.sampler.program_cache))


def _attach_run_adapters(model, path: str | Path) -> None:
    lora, _, flat = read_adapter(path)
    target = lora_target(model, lora)
    lora_lib.attach(model, rank=lora.rank, alpha=lora.alpha, target=target, seed=0, init=lora.init)
    if lora.quantize:
        lora_lib.quantize_base(model, target=target, qtype=lora.quantize, block_size=lora.block_size)
    try:
        load_flat_weights(model, flat)
    except ValueError as e:
        raise ConfigError(f"--lora {path}: its adapters do not fit the served model ({e}); was it trained on "
                          "another base?") from None
