"""GGUF checkpoints (llama.cpp's format) in: the HF config and HF-layout float32 tensors read from one `.gguf` file.

`hf_io.from_pretrained` uses this module when given a `.gguf` file (or a folder holding exactly one):
`GGUFCheckpoint(path).hf_config()` gives the config.json dict that `ModelConfig.from_hf` reads, and
`GGUFCheckpoint.get(hf_name)` reads one tensor, dequantized with the `gguf` package (memory-mapped,
one tensor at a time) and undoing llama.cpp's conventions: rows of Llama q/k projections permuted
for its rotary layout, Gemma RMSNorm weights stored as `w + 1`.

Supported architectures: llama, qwen2, gemma3 (text). Supported tensor types: F32, F16, BF16 and every
type whose dequantization the `gguf` package implements (Q4_0..Q8_0, the K-quants, IQ types...).
"""

from __future__ import annotations

import os
import re
import struct
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from posttrain.models.config import UnsupportedModelError

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "gemma3")
_MAGIC = b"GGUF"


class GGUFError(ValueError):
    """A GGUF file that is missing, truncated or corrupt, or that uses something not supported."""


class _Tensor(NamedTuple):
    name: str
    shape: tuple[int, ...]  # HF order ([out, in] for linear weights)
    qtype: Any  # gguf.GGMLQuantizationType
    raw: np.ndarray  # the bytes in the file (memory-mapped)


def is_gguf_path(path: str | os.PathLike) -> bool:
    """True for a `.gguf` file, or a folder holding a `.gguf` file and no config.json."""
    p = Path(path).expanduser()
    if p.suffix == ".gguf":
        return True
    return p.is_dir() and not (p / "config.json").exists() and any(p.glob("*.gguf"))


def find_gguf(path: str | os.PathLike) -> Path:
    """The `.gguf` file named by `path`: the file itself, or the only `.gguf` in a folder."""
    p = Path(path).expanduser()
    if p.is_dir():
        files = sorted(p.glob("*.gguf"))
        if len(files) != 1:
            raise GGUFError(f"{p}: expected exactly one .gguf file in the folder, found {len(files)}")
        return files[0]
    if not p.is_file():
        raise GGUFError(f"{p}: GGUF file does not exist")
    return p


def _supported_types() -> set[str]:
    """Plain float types, and the quantized types the pinned `gguf` package has a numpy dequantizer for."""
    from gguf import quants  # lazy: only GGUF files need the gguf package

    return {"F32", "F16", "BF16"} | {t.name for t in quants._type_traits}


# HF tensor name (after "model.layers.{i}.") -> GGUF tensor name (after "blk.{i}.")
_LAYER_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
}
_LAYER_NAMES_PLAIN = {"post_attention_layernorm": "ffn_norm"}  # llama, qwen2: the pre-MLP norm
_LAYER_NAMES_GEMMA = {
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}
_GLOBAL_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)\.(weight|bias)$")


class _Blob:
    """Sequential little-endian reader over a memory-mapped file, failing cleanly past its end."""

    def __init__(self, data: np.ndarray, path: Path):
        self.data, self.path, self.pos = data, path, 0

    def take(self, n: int) -> np.ndarray:
        if self.pos + n > len(self.data):
            raise GGUFError(f"{self.path}: truncated GGUF file: its header runs past the end of the file "
                            f"({len(self.data):,} bytes)")
        out = self.data[self.pos:self.pos + n]
        self.pos += n
        return out

    def scalar(self, fmt: str):
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)).tobytes())[0]

    def string(self) -> str:
        return self.take(self.scalar("<Q")).tobytes().decode("utf-8", errors="replace")

    def value(self, vtype: int):
        import gguf  # lazy: only GGUF files need the gguf package

        t = gguf.GGUFValueType(vtype)
        if t == gguf.GGUFValueType.STRING:
            return self.string()
        if t == gguf.GGUFValueType.ARRAY:
            etype, count = self.scalar("<I"), self.scalar("<Q")
            if etype in _SCALARS:  # numeric arrays (scores, token types) in one read
                fmt = _SCALARS[etype]
                return np.frombuffer(self.take(count * struct.calcsize(fmt)).tobytes(), dtype=np.dtype(fmt)).tolist()
            return [self.value(etype) for _ in range(count)]
        return self.scalar(_SCALARS[vtype])


_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}


class GGUFCheckpoint:
    """One GGUF file opened for reading (memory-mapped): metadata, HF config and HF-layout tensors.

    The header is parsed here with the `gguf` package's type codes (its `GGUFReader` walks a 262k-token
    vocabulary element by element, ~30 s on Gemma 3); tensors are dequantized with `gguf.quants`.
    """

    def __init__(self, path: str | os.PathLike):
        import gguf  # lazy: only GGUF files need the gguf package

        self.path = find_gguf(path)
        size = self.path.stat().st_size
        if size < 24:  # magic, version and two counts
            raise GGUFError(f"{self.path}: truncated GGUF file ({size} bytes, shorter than a GGUF header)")
        data = np.memmap(self.path, mode="r", dtype=np.uint8)
        blob = _Blob(data, self.path)
        magic = blob.take(4).tobytes()
        if magic != _MAGIC:
            raise GGUFError(f"{self.path}: not a GGUF file (starts with {magic!r}, expected {_MAGIC!r})")
        version = blob.scalar("<I")
        if version not in (2, 3):
            raise GGUFError(f"{self.path}: GGUF version {version} is not supported (2 or 3)")
        n_tensors, n_kv = blob.scalar("<Q"), blob.scalar("<Q")
        try:
            self.metadata: dict[str, Any] = {}
            for _ in range(n_kv):
                key = blob.string()
                self.metadata[key] = blob.value(blob.scalar("<I"))
            infos = []
            for _ in range(n_tensors):
                name = blob.string()
                dims = [blob.scalar("<Q") for _ in range(blob.scalar("<I"))]
                infos.append((name, dims, blob.scalar("<I"), blob.scalar("<Q")))
        except (ValueError, struct.error) as e:
            if isinstance(e, GGUFError):
                raise
            raise GGUFError(f"{self.path}: corrupt GGUF header ({type(e).__name__}: {e})") from None
        align = int(self.metadata.get("general.alignment", gguf.GGUF_DEFAULT_ALIGNMENT))
        data_start = (blob.pos + align - 1) // align * align

        self.architecture = str(self.metadata.get("general.architecture"))
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(
                f"{self.path}: GGUF architecture {self.architecture!r} is not supported; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        supported = _supported_types()
        self.tensors: dict[str, _Tensor] = {}
        for name, dims, type_code, offset in infos:
            try:
                qtype = gguf.GGMLQuantizationType(type_code)
            except ValueError:
                qtype = None
            if qtype is None or qtype.name not in supported:
                type_name = qtype.name if qtype is not None else f"type code {type_code}"
                raise GGUFError(
                    f"{self.path}: tensor {name!r} has quantization type {type_name}, which is not supported "
                    f"(supported: {', '.join(sorted(supported))})"
                )
            block, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
            n_bytes = int(np.prod(dims)) // block * block_bytes
            start = data_start + offset
            if start + n_bytes > len(data):
                raise GGUFError(f"{self.path}: truncated GGUF file: tensor {name!r} ends at byte "
                                f"{start + n_bytes:,}, the file has {len(data):,}")
            raw = data[start:start + n_bytes]
            self.tensors[name] = _Tensor(name, tuple(int(d) for d in reversed(dims)), qtype, raw)
        if "rope_freqs.weight" in self.tensors:
            raise UnsupportedModelError(f"{self.path}: per-frequency RoPE scaling (tensor 'rope_freqs.weight', "
                                        "Llama 3.1 style) is not supported")
        self._hf_names = self._name_map()

    # ------------------------------------------------------------------ metadata
    def field(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def arch_field(self, key: str, default: Any = None) -> Any:
        return self.field(f"{self.architecture}.{key}", default)

    def hf_config(self) -> dict[str, Any]:
        """The Hugging Face config.json dict this file describes."""
        a = self.arch_field
        hidden, heads = int(a("embedding_length")), int(a("attention.head_count"))
        n_vocab = a("vocab_size") or len(self.field("tokenizer.ggml.tokens", ()))
        model_type = {"gemma3": "gemma3_text"}.get(self.architecture, self.architecture)
        hf: dict[str, Any] = {
            "model_type": model_type,
            "vocab_size": int(n_vocab),
            "hidden_size": hidden,
            "intermediate_size": int(a("feed_forward_length")),
            "num_hidden_layers": int(a("block_count")),
            "num_attention_heads": heads,
            "num_key_value_heads": int(a("attention.head_count_kv", heads)),
            "head_dim": int(a("attention.key_length", hidden // heads)),
            "rms_norm_eps": float(a("attention.layer_norm_rms_epsilon", 1e-6)),
            "max_position_embeddings": int(a("context_length", 4096)),
            "rope_theta": float(a("rope.freq_base", 1_000_000.0 if model_type == "gemma3_text" else 10000.0)),
            "tie_word_embeddings": "output.weight" not in self.tensors,
            "bos_token_id": self.field("tokenizer.ggml.bos_token_id"),
            "eos_token_id": self.field("tokenizer.ggml.eos_token_id"),
            "pad_token_id": self.field("tokenizer.ggml.padding_token_id"),
        }
        scaling = a("rope.scaling.type")
        if scaling not in (None, "none"):
            if scaling != "linear":
                raise UnsupportedModelError(f"{self.path}: RoPE scaling {scaling!r} is not supported")
            hf["rope_scaling"] = {"rope_type": "linear", "factor": float(a("rope.scaling.factor"))}
        if model_type == "llama":
            hf["attention_bias"] = "blk.0.attn_q.bias" in self.tensors
        if model_type == "gemma3_text":
            hf["sliding_window"] = int(a("attention.sliding_window", 512))
            hf["query_pre_attn_scalar"] = hf["head_dim"]
        return hf

    # ------------------------------------------------------------------ tensors
    def _name_map(self) -> dict[str, str]:
        extra = _LAYER_NAMES_GEMMA if self.architecture == "gemma3" else _LAYER_NAMES_PLAIN
        per_layer = {**_LAYER_NAMES, **extra}
        out = {}
        for hf_name, g in _GLOBAL_NAMES.items():
            if g in self.tensors:
                out[hf_name] = g
        n_layers = int(self.arch_field("block_count"))
        for i in range(n_layers):
            for hf_mod, g_mod in per_layer.items():
                for suffix in ("weight", "bias"):
                    g = f"blk.{i}.{g_mod}.{suffix}"
                    if g in self.tensors:
                        out[f"model.layers.{i}.{hf_mod}.{suffix}"] = g
        return out

    def __contains__(self, hf_name: str) -> bool:
        return hf_name in self._hf_names

    def file_of(self, hf_name: str) -> str:
        return f"{self.path} [{self._hf_names.get(hf_name, '?')}]"

    def get(self, hf_name: str) -> np.ndarray:
        """One tensor in HF layout ([out, in] for linear weights), dequantized to float32."""
        from gguf import quants  # lazy: only GGUF files need the gguf package

        t = self.tensors[self._hf_names[hf_name]]
        raw = t.raw
        if t.qtype.name in ("F32", "F16"):
            raw = raw.view(np.float32 if t.qtype.name == "F32" else np.float16)
        w = np.asarray(quants.dequantize(raw, t.qtype), dtype=np.float32).reshape(t.shape)
        m = _LAYER_RE.match(hf_name)
        module = m.group(2) if m else ""
        if self.architecture == "llama" and module in ("self_attn.q_proj", "self_attn.k_proj"):
            n = int(self.arch_field("attention.head_count"))
            if module == "self_attn.k_proj":
                n = int(self.arch_field("attention.head_count_kv", n))
            w = _unpermute_rows(w, n)
        if self.architecture == "gemma3" and hf_name.endswith("norm.weight"):
            w = w - 1.0
        return w


def _unpermute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's row order of a Llama q/k projection (rotary pairs interleaved per head)."""
    rows = w.shape[0]
    head_dim = rows // n_head
    return w.reshape(n_head, head_dim // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
