"""HF names and layouts of mixture-of-experts weights (Qwen3-MoE, Mixtral, Qwen2-MoE), read and written.

Ours (per layer): router `moe.gate` [D, E]; experts `moe.experts.{gate,up,down}_proj` stacked over experts, gate/up
[E, D, F] and down [E, F, D]; Qwen2-MoE's `moe.shared_expert.*` and `moe.shared_expert_gate` [D, 1]. In HF names
`moe` is `mlp` (`model.layers.N.mlp.gate.weight`, ...), Mixtral's `block_sparse_moe`.

Expert weights come in the two layouts transformers 5.23 reads:
- per expert, as `save_pretrained` writes them and hub checkpoints hold them: `mlp.experts.{e}.gate_proj.weight`
  [F, D], `up_proj` [F, D], `down_proj` [D, F]; Mixtral `block_sparse_moe.experts.{e}.w1` (gate), `w3` (up), `w2`
  (down);
- fused, the modules' own parameters (transformers merges the per-expert tensors into them on load):
  `mlp.experts.gate_up_proj` [E, 2F, D] (gate rows first) and `mlp.experts.down_proj` [E, D, F].
Export writes the per-expert layout under the family's names, which is what `save_pretrained` writes.

An expert weight is one of our parameters per layer but several HF tensors, so it has its own layout code
(`EXPERTS`), and `hf_io` hands its reads and writes to this module.
"""

from __future__ import annotations

import numpy as np

EXPERTS = 2000  # layout code of a stacked expert weight (`posttrain.models.hf_io._hf_name`)
_MIXTRAL = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}


def hf_key(layer: int, kind: str) -> str:
    """Our name for one layer's stacked expert weight `kind` (gate_proj | up_proj | down_proj)."""
    return f"model.layers.{layer}.mlp.experts.{kind}"


def _split(key: str) -> tuple[str, str]:
    base, _, kind = key.rpartition(".")
    return base, kind  # "model.layers.N.mlp.experts", "gate_proj"


def aliases(name: str) -> list[str]:
    """Mixtral's spelling (`block_sparse_moe`) of a name under a layer's `mlp`."""
    return [name.replace(".mlp.", ".block_sparse_moe.", 1)] if ".mlp." in name else []


def _per_expert(index, key: str, e: int) -> str | None:
    base, kind = _split(key)
    for cand in (f"{base}.{e}.{kind}.weight", f"{base}.{e}.{_MIXTRAL[kind]}.weight"):
        if cand in index:
            return cand
    return None


def _fused(index, key: str) -> tuple[str, int] | None:
    """(fused tensor name, which F-block of its rows: 0 gate, 1 up; -1 for down) if the checkpoint is fused."""
    base, kind = _split(key)
    name = f"{base}.down_proj" if kind == "down_proj" else f"{base}.gate_up_proj"
    if name not in index:
        return None
    return name, {"gate_proj": 0, "up_proj": 1, "down_proj": -1}[kind]


def check(index, key: str, per_shape: tuple[int, ...]) -> str | None:
    """What is wrong with one layer's expert weight in a checkpoint (None: present with the expected shapes)."""
    e, a, b = per_shape  # ours [E, in, out]
    fused = _fused(index, key)
    if fused is not None:
        name, part = fused
        want = (e, b, a) if part < 0 else (e, 2 * b, a)
        got = tuple(index.shape(name))
        return None if got == want else f"tensor {name!r} has shape {got}, expected {want} for this config"
    for i in range(e):
        name = _per_expert(index, key, i)
        if name is None:
            return f"expert weight {key!r} is missing from the checkpoint (expert {i}, neither per expert nor fused)"
        if tuple(index.shape(name)) != (b, a):
            return f"tensor {name!r} has shape {tuple(index.shape(name))}, expected {(b, a)} for this config"
    return None


def read_block(index, key: str, per_shape: tuple[int, ...], idx: tuple[slice, ...]) -> np.ndarray:
    """Block `idx` (over [E, in, out]) of one layer's stacked expert weight in our layout."""
    experts, ins, outs = idx
    fused = _fused(index, key)
    if fused is not None:
        name, part = fused
        if part > 0:  # up: the second F rows of gate_up
            f = per_shape[2]
            outs = slice(outs.start + f, outs.stop + f)
        return np.ascontiguousarray(index.get_block(name, (experts, outs, ins)).transpose(0, 2, 1))
    rows = [index.get_block(_per_expert(index, key, e), (outs, ins)).T for e in range(experts.start, experts.stop)]
    return np.ascontiguousarray(np.stack(rows))


def export(key: str, value: np.ndarray, model_type: str) -> list[tuple[str, np.ndarray]]:
    """Per-expert HF tensors (name, [out, in]) of one layer's stacked expert weight `value` [E, in, out]."""
    base, kind = _split(key)
    if model_type == "mixtral":
        base, kind = base.replace(".mlp.", ".block_sparse_moe."), _MIXTRAL[kind]
    return [(f"{base}.{e}.{kind}.weight", np.ascontiguousarray(value[e].T)) for e in range(value.shape[0])]


def export_name(name: str, model_type: str) -> str:
    """The family's name of a router or shared-expert tensor (Mixtral: `block_sparse_moe`)."""
    return aliases(name)[0] if model_type == "mixtral" and ".mlp." in name else name
