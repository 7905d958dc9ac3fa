"""Hugging Face checkpoints in and out: `from_pretrained` (local folder, hub id or .gguf) and `save_pretrained`.

Loading streams: the model is first built abstractly (shapes only), then each of our parameters is
read tensor by tensor from the safetensors files, converted to our layout, and placed straight into its
target sharding; at most one parameter (one weight across all layers) is on the host at a time, so a
checkpoint is never held twice in host memory. With a mesh, each parameter is built shard by shard
(`jax.make_array_from_callback`): a process reads from safetensors only the slices its own devices hold
(on a multi-host mesh, each host reads its part of every weight); a shard whose slice is not one
contiguous block of the HF tensor (and GGUF tensors, which dequantize whole) is cut from the whole tensor.
When saving, the weights are gathered from every process and process 0 writes the files.

Layout: HF linear weights are [out, in]; ours are [*in, *out] with heads split out
(q: [embed, heads, head_dim]; o: [heads, head_dim, embed]) and per-layer weights stacked on a leading axis.
Mixture-of-experts weights: `posttrain.models.moe_names` (per-expert and fused layouts in, per-expert out); in a
model with both dense and expert layers, each layer reads and writes only the MLP it uses.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from pathlib import Path

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh
from safetensors import safe_open
from safetensors.numpy import save_file

from posttrain import distributed
from posttrain.models import gguf_io, moe_names, prompt_format, vision_names
from posttrain.models.config import ModelConfig
from posttrain.models.layers import dtype_of
from posttrain.models.transformer import Transformer

SHARD_BYTES = 2 * 1024**3  # write sharded safetensors above 2 GB


class CheckpointError(ValueError):
    """A checkpoint folder that is missing, incomplete, or whose tensors do not fit the config."""


# ---------------------------------------------------------------------- names and layouts
def _hf_name(path: tuple, layer: int | None) -> tuple[str, int]:
    """HF tensor name for one of our parameter paths, and its layout code: the number of input axes of a
    linear kernel, -1 for a bias (flattened over heads), 0 for a tensor stored as it is."""
    parts = [str(p) for p in path]
    leaf = parts[-1]
    if parts[0] in vision_names.VISION_ROOTS:
        return vision_names.hf_name(parts, layer)
    if parts[0] == "lm_head":
        return "lm_head.weight", 1
    if parts[0] == "embed_tokens":
        return "model.embed_tokens.weight", 0
    if parts[0] == "norm":
        return "model.norm.weight", 0
    assert parts[0] == "layers", path
    if parts[1] == "moe":  # HF's `mlp` of a sparse layer
        parts[1] = "mlp"
        if parts[2] == "experts":
            return moe_names.hf_key(layer, leaf), moe_names.EXPERTS
    module = ".".join(parts[1:-1])
    suffix = "weight" if leaf in ("kernel", "weight") else "bias"
    n_in = 2 if parts[-2] == "o_proj" else 1
    return f"model.layers.{layer}.{module}.{suffix}", {"kernel": n_in, "bias": -1}.get(leaf, 0)


def _stored(cfg: ModelConfig, path: tuple, layer: int | None) -> bool:
    """Whether layer `layer` holds this parameter: a sparse layer has no dense MLP, a dense one no experts."""
    if layer is None or str(path[0]) != "layers" or str(path[1]) not in ("mlp", "moe"):
        return True
    return cfg.moe_layers[layer] == (str(path[1]) == "moe")


def to_ours(hf: np.ndarray, shape: tuple[int, ...], n_in: int) -> np.ndarray:
    """An HF tensor in our layout of `shape` (layout code `n_in`: see `_hf_name`)."""
    if n_in == vision_names.CONV:  # conv weight [out, *in] -> [*in, out]
        return np.ascontiguousarray(np.moveaxis(hf, 0, -1)).reshape(shape)
    if n_in > 0:  # linear kernel: [out, in] -> [*in, *out]
        return np.ascontiguousarray(hf.T).reshape(shape)
    return hf.reshape(shape)


def _hf_shape(shape: tuple[int, ...], n_in: int) -> tuple[int, ...]:
    if n_in == vision_names.CONV:
        return (shape[-1], *shape[:-1])
    if n_in > 0:
        return (math.prod(shape[n_in:]), math.prod(shape[:n_in]))
    if n_in < 0:  # biases split by heads
        return (math.prod(shape),)
    return tuple(shape)


def _to_hf(ours: np.ndarray, n_in: int) -> np.ndarray:
    if n_in == vision_names.CONV:
        return np.ascontiguousarray(np.moveaxis(ours, -1, 0))
    if n_in > 0:
        return np.ascontiguousarray(ours.reshape(math.prod(ours.shape[:n_in]), -1).T)
    return ours.reshape(-1) if n_in < 0 else ours


def _param_entries(state: nnx.State):
    """(path, variable) for every parameter of a model state, skipping LoRA adapters."""
    for path, var in nnx.to_flat_state(state):
        if isinstance(var, nnx.LoRAParam):
            continue
        yield tuple(path), var


def linear_weights(model) -> dict[str, tuple[nnx.Variable, int | None, int]]:
    """Every linear kernel of `model` that its checkpoint stores, by HF tensor name (`model.layers.3.mlp.up_proj.weight`
    and the like): (its variable, the layer's index in a stacked one or None, the layout code for `to_ours`). A PEFT
    adapter's change of a weight lands there (`posttrain.models.adapters.merge_adapter`)."""
    out = {}
    for path_, var in _param_entries(nnx.state(model)):
        if str(path_[-1]) != "kernel":
            continue
        for i in (range(var.get_value().shape[0]) if vision_names.is_stacked(path_) else [None]):
            if _stored(model.cfg, path_, i):
                name, n_in = _hf_name(path_, i)
                if n_in in (1, 2):
                    out[name] = (var, i, n_in)
    return out


# ---------------------------------------------------------------------- reading
def resolve_path(path: str | os.PathLike) -> Path:
    """A local checkpoint folder or GGUF file, or a hub id downloaded with huggingface_hub (clear error when
    offline)."""
    p = Path(path).expanduser()
    if p.exists():
        if not p.is_dir() and p.suffix != ".gguf":
            raise CheckpointError(f"{p} is a file; expected a Hugging Face checkpoint folder (config.json + "
                                  "*.safetensors) or a .gguf file")
        return p
    text = str(path)
    looks_like_hub_id = text.count("/") == 1 and not text.startswith((".", "/", "~"))
    if not looks_like_hub_id:
        raise CheckpointError(f"checkpoint folder {text!r} does not exist")
    try:
        from huggingface_hub import snapshot_download  # lazy: only a hub id needs huggingface_hub

        local = snapshot_download(text, allow_patterns=["*.json", "*.safetensors", "tokenizer*", "*.model", "*.jinja"])
    except Exception as e:  # offline, unknown repo, gated model...
        raise CheckpointError(
            f"{text!r} is not a local folder and could not be fetched from the Hugging Face hub "
            f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); download it first and pass the folder"
        ) from None
    return Path(local)


def _safe_open(f: Path):
    """`safetensors.safe_open(f)`; a damaged or truncated file is a CheckpointError naming it."""
    try:
        return safe_open(f, framework="numpy")
    except Exception as e:  # noqa: BLE001 - SafetensorError, OSError: re-raised naming the file
        raise CheckpointError(f"{f}: cannot read this safetensors file, it is damaged or incomplete "
                              f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None


class _TensorIndex:
    """Maps tensor names to the safetensors file holding them; opens files lazily (memory-mapped)."""

    def __init__(self, folder: Path):
        self._open = lambda f, framework: _safe_open(f)
        index = folder / "model.safetensors.index.json"
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
            self.files = {name: folder / f for name, f in weight_map.items()}
        else:
            files = sorted(folder.glob("*.safetensors"))
            if not files:
                raise CheckpointError(f"{folder}: no *.safetensors files (only safetensors checkpoints are supported)")
            self.files = {}
            for f in files:
                with _safe_open(f) as h:
                    for name in h.keys():
                        self.files[name] = f
        # Text-model prefix: "model." normally, another one inside multimodal wrappers (e.g. Gemma 3).
        embed = [n for n in self.files if n.endswith("embed_tokens.weight")]
        self.prefix = embed[0][: -len("embed_tokens.weight")] if embed else "model."
        self._handles: dict[Path, object] = {}

    def _resolve(self, name: str) -> str | None:
        for cand in (name, self.prefix + name.removeprefix("model."), *vision_names.aliases(name),
                     *moe_names.aliases(name)):
            if cand in self.files:
                return cand
        return None

    def __contains__(self, name: str) -> bool:
        return self._resolve(name) is not None

    def get(self, name: str) -> np.ndarray:
        real = self._resolve(name)
        if real is None:
            raise KeyError(name)
        return self._handle(real).get_tensor(real)

    def shape(self, name: str) -> tuple[int, ...]:
        real = self._resolve(name)
        if real is None:
            raise KeyError(name)
        return tuple(self._handle(real).get_slice(real).get_shape())

    def get_block(self, name: str, index: tuple[slice, ...]) -> np.ndarray:
        """tensor[index] (slices with step 1), read without reading the rest of the tensor."""
        real = self._resolve(name)
        if real is None:
            raise KeyError(name)
        return self._handle(real).get_slice(real)[index]

    def _handle(self, real: str):
        f = self.files[real]
        if f not in self._handles:
            self._handles[f] = self._open(f, framework="numpy")
        return self._handles[f]

    def file_of(self, name: str) -> str:
        real = self._resolve(name)
        return str(self.files[real]) if real else "?"


def count_checkpoint_params(path: str | os.PathLike) -> tuple[int, set[str]]:
    """Number of parameters and the tensor dtypes of a checkpoint, read from safetensors headers only."""
    index = _TensorIndex(resolve_path(path))
    total, dtypes = 0, set()
    for f in sorted(set(index.files.values())):
        with _safe_open(f) as h:
            for name in h.keys():
                sl = h.get_slice(name)
                total += math.prod(sl.get_shape())
                dtypes.add(str(sl.get_dtype()))
    return total, dtypes


def load_config(path: str | os.PathLike, **overrides) -> tuple[Path, ModelConfig]:
    folder = resolve_path(path)
    cfg_file = folder / "config.json"
    if not cfg_file.exists():
        raise CheckpointError(f"{folder}: no config.json (not a Hugging Face checkpoint folder)")
    cfg = ModelConfig.from_file(cfg_file, **overrides)
    if cfg.vision is not None and cfg.vision.processor_files is None:
        cfg = cfg.replace(vision=dataclasses.replace(cfg.vision, processor_files=_processor_files(folder)))
    return folder, cfg


#: Processor files of a vision-language checkpoint that export copies (the tokenizer's files are the tokenizer's)
PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json")


def _processor_files(folder: Path) -> dict[str, dict]:
    out = {}
    for fname in PROCESSOR_FILES:
        f = folder / fname
        if f.is_file():
            try:
                out[fname] = json.loads(f.read_text())
            except json.JSONDecodeError as e:
                raise CheckpointError(f"{f}: not valid JSON (line {e.lineno}): {e.msg}") from None
    return out


def from_pretrained(path: str | os.PathLike, *, dtype: str = "float32", mesh: Mesh | None = None,
                    compute_dtype: str | None = None, **config_overrides) -> Transformer:
    """Loads a HF checkpoint (config.json + safetensors) or a GGUF file (or a folder holding one) into our
    Transformer, sharded over `mesh` if given.

    `dtype` is the parameter dtype; `compute_dtype` defaults to it. Other keyword arguments override
    `ModelConfig` fields (e.g. `scan_layers=False`, `remat="full"`).
    """
    numerics = dict(param_dtype=dtype, compute_dtype=compute_dtype or dtype, **config_overrides)
    if gguf_io.is_gguf_path(path):  # llama.cpp file: dequantized tensor by tensor, same loop below
        index = gguf_io.GGUFCheckpoint(path)
        folder = index.path
        cfg = ModelConfig.from_hf(index.hf_config(), source=str(folder), **numerics)
    else:
        folder, cfg = load_config(path, **numerics)
        index = _TensorIndex(folder)
    abstract = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    pdtype = dtype_of(cfg.param_dtype)
    for path_, var in _param_entries(state):
        shape = tuple(var.get_value().shape)
        stacked = vision_names.is_stacked(path_)
        per_shape = shape[1:] if stacked else shape
        names: list[tuple[str, int] | None] = []  # per layer: (HF name, layout), None = not stored (tied head)
        for i in (range(shape[0]) if stacked else [None]):
            if not _stored(cfg, path_, i):  # the other MLP of a layer (zeros)
                names.append(None)
                continue
            name, n_in = _hf_name(path_, i)
            if n_in == moe_names.EXPERTS:
                problem = moe_names.check(index, name, per_shape)
                if problem:
                    raise CheckpointError(f"{folder}: {problem}")
                names.append((name, n_in))
                continue
            if path_[0] == "lm_head" and name not in index and cfg.tie_word_embeddings:
                names.append(None)
                continue
            if name not in index:
                raise CheckpointError(f"{folder}: tensor {name!r} is missing from the checkpoint")
            if hasattr(index, "shape"):  # from the header; GGUF tensors are checked when read
                _check_shape(index, name, index.shape(name), per_shape, n_in)
            names.append((name, n_in))
        sharding = distributed.sharding_for_axes(var, shape, mesh)
        whole: dict[str, np.ndarray] = {}  # tensors read whole (GGUF, non-contiguous blocks): read once
        full = tuple(slice(0, d) for d in shape)
        if sharding is None:  # a plain transfer: jnp.asarray would compile one program per shape
            var.set_value(jax.device_put(_read_param(index, names, per_shape, stacked, full, pdtype, whole)))
            continue
        blocks: dict[tuple, np.ndarray] = {}  # replicated shards ask for the same block: read it once

        def block(idx, names=names, shape=shape, per_shape=per_shape, stacked=stacked, blocks=blocks, whole=whole):
            idx = tuple(slice(*sl.indices(d)[:2]) for sl, d in zip(idx, shape))
            key = tuple((sl.start, sl.stop) for sl in idx)
            if key not in blocks:
                blocks[key] = _read_param(index, names, per_shape, stacked, idx, pdtype, whole)
            return blocks[key]

        var.set_value(jax.make_array_from_callback(shape, sharding, block))
        del blocks, whole
    model = nnx.merge(graphdef, state)
    model.mesh = mesh
    return model


def _flat_range(index: tuple[slice, ...], dims: tuple[int, ...]) -> tuple[int, int] | None:
    """[lo, hi) of the row-major flattening of `dims` that block `index` occupies, or None if the block is not
    one contiguous range there."""
    size = math.prod(sl.stop - sl.start for sl in index)
    if size == 0:
        return None
    lo = int(np.ravel_multi_index([sl.start for sl in index], dims)) if dims else 0
    hi = int(np.ravel_multi_index([sl.stop - 1 for sl in index], dims)) + 1 if dims else 1
    return (lo, hi) if hi - lo == size else None


def _check_shape(index, name: str, got, per_shape: tuple[int, ...], n_in: int) -> None:
    want = _hf_shape(per_shape, n_in)
    if tuple(got) != want:
        raise CheckpointError(f"{index.file_of(name)}: tensor {name!r} has shape {tuple(got)}, expected {want} "
                              "for this config")


def _read_layer_block(index, name: str, n_in: int, per_shape: tuple[int, ...], idx: tuple[slice, ...],
                      whole: dict[str, np.ndarray]) -> np.ndarray:
    """Our-layout block `idx` of one HF tensor, reading only the HF rows/columns it covers when it can."""
    out_shape = tuple(sl.stop - sl.start for sl in idx)
    if n_in == moe_names.EXPERTS:
        return moe_names.read_block(index, name, per_shape, idx)
    if hasattr(index, "get_block"):
        if n_in == 0:  # stored as it is
            return index.get_block(name, idx)
        if n_in < 0:  # a bias flattened over heads
            r = _flat_range(idx, per_shape)
            if r is not None:
                return index.get_block(name, (slice(*r),)).reshape(out_shape)
        elif n_in != vision_names.CONV:  # a linear kernel: HF [out, in] -> ours [*in, *out]
            rin = _flat_range(idx[:n_in], per_shape[:n_in])
            rout = _flat_range(idx[n_in:], per_shape[n_in:])
            if rin is not None and rout is not None:
                hf = index.get_block(name, (slice(*rout), slice(*rin)))
                return np.ascontiguousarray(hf.T).reshape(out_shape)
    if name not in whole:  # not one block of the HF tensor: cut from the whole one
        t = index.get(name)
        _check_shape(index, name, t.shape, per_shape, n_in)
        whole[name] = to_ours(t, per_shape, n_in)
    return whole[name][idx]


def _read_param(index, names, per_shape, stacked: bool, idx: tuple[slice, ...], dtype, whole) -> np.ndarray:
    """Block `idx` of one of our parameters (all layers for a stacked one), in `dtype`."""
    out = np.zeros(tuple(sl.stop - sl.start for sl in idx), dtype=dtype)
    if stacked:
        for k, i in enumerate(range(idx[0].start, idx[0].stop)):
            if names[i] is not None:
                out[k] = _read_layer_block(index, *names[i], per_shape, idx[1:], whole).astype(dtype)
    elif names[0] is not None:
        out[...] = _read_layer_block(index, *names[0], per_shape, idx, whole).astype(dtype)
    return out


# ---------------------------------------------------------------------- writing
def save_pretrained(model: Transformer, out_dir: str | os.PathLike, tokenizer=None, *,
                    dtype: str | None = None, shard_bytes: int = SHARD_BYTES, prompt_style=None) -> Path:
    """Writes config.json (+ generation_config.json) and model.safetensors (sharded above 2 GB) for `transformers`.

    prompt_style: how the model was trained to be prompted (`posttrain.models.prompt_format.PromptStyle`), recorded in
    config.json's `posttrain` block, the default of the commands that prompt it; None records nothing.

    LoRA adapters must be merged first (`posttrain.models.lora.merge`); unmerged adapters are an error.
    In a multi-host run every process calls it (the weights are gathered from all of them, one at a time) and
    process 0 writes the files.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg: ModelConfig = model.cfg
    dtype = dtype or cfg.param_dtype
    state = nnx.state(model)
    if any(isinstance(v, nnx.LoRAParam) for _, v in nnx.to_flat_state(state)):
        raise ValueError("model has LoRA adapters: merge them first with posttrain.models.lora.merge(model)")
    np_dtype = np.dtype(dtype_of(dtype))
    tensors: list[tuple[str, np.ndarray]] = []
    for path_, var in _param_entries(state):
        value = np.asarray(distributed.to_host(var.get_value())).astype(np_dtype)
        if vision_names.is_stacked(path_):
            for i in range(value.shape[0]):
                if not _stored(cfg, path_, i):
                    continue
                name, n_in = _hf_name(path_, i)
                if n_in == moe_names.EXPERTS:
                    tensors.extend(moe_names.export(name, value[i], cfg.model_type))
                else:
                    tensors.append((moe_names.export_name(name, cfg.model_type), _to_hf(value[i], n_in)))
        else:
            name, n_in = _hf_name(path_, None)
            tensors.append((name, _to_hf(value, n_in)))
    if cfg.vision is not None:  # transformers' names for Gemma3ForConditionalGeneration
        tensors = [(vision_names.export_name(n), t) for n, t in tensors]
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name, t in tensors:
        if size and size + t.nbytes > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += t.nbytes
    if not distributed.is_primary():
        return out
    meta = {"format": "pt"}
    umask = os.umask(0)
    os.umask(umask)

    def write(shard: dict, path: Path) -> None:
        save_file(shard, str(path), metadata=meta)
        os.chmod(path, 0o666 & ~umask)  # safetensors writes through a private temporary file (mode 0600)

    if len(shards) == 1:
        write(shards[0], out / "model.safetensors")
    else:
        weight_map = {}
        for k, shard in enumerate(shards):
            fname = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
            write(shard, out / fname)
            weight_map.update({n: fname for n in shard})
        total = sum(t.nbytes for _, t in tensors)
        (out / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
        )
    hf = cfg.replace(param_dtype=dtype).to_hf()
    if prompt_style is not None:
        hf.update(prompt_format.config_block(prompt_style))
    (out / "config.json").write_text(json.dumps(hf, indent=2))
    gen = {"bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id, "pad_token_id": cfg.pad_token_id}
    (out / "generation_config.json").write_text(json.dumps({k: v for k, v in gen.items() if v is not None}, indent=2))
    if tokenizer is not None:
        getattr(tokenizer, "save_pretrained")(str(out))
    if cfg.vision is not None:  # the image processor's files, as read beside the source checkpoint
        for fname, content in (cfg.vision.processor_files or {}).items():
            (out / fname).write_text(json.dumps(content, indent=2) + "\n")
    return out
