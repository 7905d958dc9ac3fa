"""LoRA adapters served over one base (`posttrain serve BASE --lora NAME=RUN`): each adapter is a model that
shares the base's weight arrays (nothing copied) and adds its own adapters, read from a LoRA run's output folder
(its `config.yaml` says the rank, alpha, target; its newest checkpoint holds the trained adapters). A request
picks one by its `model` field; each adapter is its own engine lane (slots and cache of its own), the programs
compiled once for all adapters of one shape.
"""

from __future__ import annotations

from pathlib import Path

from flax import nnx

from posttrain.config import ConfigError, from_dict, yaml_load
from posttrain.models import lora as lora_lib
from posttrain.models.weights import load_flat_weights
from posttrain.sampling import Sampler
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
        raise ConfigError(f"--lora {path}: not a run folder (no config.yaml); give the output folder of a LoRA run")
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
    """The base with a run's adapters attached, sharing the base's arrays."""
    lora, _, flat = read_adapter(path)
    graphdef, state = nnx.split(base.model)
    model = nnx.merge(graphdef, state)  # new modules over the same arrays
    target = lora_target(model, lora)
    lora_lib.attach(model, rank=lora.rank, alpha=lora.alpha, target=target, seed=0, init=lora.init)
    if lora.quantize:
        lora_lib.quantize_base(model, target=target, qtype=lora.quantize, block_size=lora.block_size)
    try:
        load_flat_weights(model, flat)
    except ValueError as e:
        raise ConfigError(f"--lora {path}: its adapters do not fit the served model ({e}); was it trained on "
                          "another base?") from None
    sampler = Sampler(model, base.tokenizer, program_cache=base.sampler.program_cache)
    return ServedModel(base.folder, base.tokenizer, model, sampler, base.vision, base.style)
