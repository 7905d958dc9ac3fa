"""The preference-tuning run (DPO family): `posttrain dpo CONFIG.yaml`, on the shared run skeleton.

config -> pairs (encoded, truncated, counted; errors before any model loads) -> model (+LoRA/QLoRA) ->
reference (the LoRA base with adapters off, or a frozen model; optionally scored once up front and
cached in OUTPUT_DIR/reference_logps.npz) -> `Run.fit` with the family's loss -> HF export.
Multi-host: every process builds the same global batches of pairs and feeds its own rows of each (after the
host-side preparation that reads the whole batch, ORPO's NLL weights); the reference log-probs are scored on
the global mesh and written by process 0.
Losses and presets: `posttrain.algorithms.preference`. Data formats: `posttrain.data.preference`.

Metrics (TRL's names): loss, rewards/chosen, rewards/rejected, rewards/margins, rewards/accuracies,
logps/chosen, logps/rejected, logps/accuracies (policy log-prob of chosen > rejected), pairs (a mixture of
experts adds moe/*: `posttrain.models.moe_loss`); on the eval split the same under eval/.
"""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path
from typing import Any, Callable, Literal

import numpy as np

from posttrain import distributed
from posttrain.algorithms.preference import (ReferenceSource, make_preference_loss, make_preset,
                                             nll_weights)
from posttrain.config import ConfigError, load_config
from posttrain.data.preference import PreferenceFormat, build_preference_dataset, encode_pairs, stack_pairs
from posttrain.data.sources import DataError, read_records, source_name
from posttrain.models.moe_loss import RouterLoss
from posttrain.training.config import (DataSplits, LoraConfig, ModelSection, OptimConfig, RunConfig,
                                       TrainerConfig)
from posttrain.training.run import Run
from posttrain.training.trainer import reduce_metrics

__all__ = ["DPOConfig", "PreferenceData", "PreferenceAlgorithm", "DPOResult", "DPORun", "load_dpo_config",
           "resolve_reference", "run_dpo"]

LossName = Literal["sigmoid", "ipo", "hinge", "robust", "cdpo", "simpo", "orpo"]


@dataclasses.dataclass
class PreferenceData(DataSplits):
    """Preference pairs: the splits (`DataSplits`), record format, length and batching.

    batch_size: pairs per optimizer step (each pair is two rows, chosen and rejected).
    truncation: a pair longer than seq_len: keep_start (cut the response's end), keep_end (cut the prompt's
      start), drop.
    """

    format: PreferenceFormat = dataclasses.field(default_factory=PreferenceFormat)
    truncation: Literal["keep_start", "keep_end", "drop"] = "keep_start"


@dataclasses.dataclass
class PreferenceAlgorithm:
    """The loss (a preset of `posttrain.algorithms.preference.PRESETS`) and its reference.

    loss: the preference loss: sigmoid (DPO), ipo, hinge, robust, cdpo, simpo (reference-free) or orpo
      (reference-free, with an NLL term).
    reference_path: the checkpoint of the frozen reference (default: model.path).
    beta, label_smoothing, gamma: None = the preset's default (sigmoid/ipo/hinge/robust/cdpo/orpo β=0.1,
      simpo β=2.0 γ=1.0, robust/cdpo ε=0.1); setting one the loss does not take is an error.
    reference: auto = the LoRA base with adapters off when training LoRA, else a frozen copy of
      `reference_path` (default: model.path); base; model.
    precompute_reference: score every pair with the reference once before training (cached with the run)
      and free it: no reference forward per step.
    nll_on_prompt: ORPO's NLL over prompt and response (as TRL) instead of the response only (the paper).
    """

    loss: LossName = "sigmoid"
    beta: float | None = None
    label_smoothing: float | None = None
    gamma: float | None = None
    reference: Literal["auto", "base", "model"] = "auto"
    reference_path: str | None = None
    precompute_reference: bool = False
    nll_on_prompt: bool = False

    def resolved(self):
        """The typed preset with this section's settings (a ConfigError names what does not apply)."""
        try:
            return make_preset(self.loss, beta=self.beta, label_smoothing=self.label_smoothing, gamma=self.gamma)
        except ValueError as e:
            raise ConfigError(str(e)) from None


@dataclasses.dataclass
class DPOConfig(RunConfig):
    """Preference tuning run: everything `posttrain dpo CONFIG.yaml` needs (the shared sections: `RunConfig`).

    data: the preference pairs (`PreferenceData`).
    algorithm: the loss and its reference (`PreferenceAlgorithm`).
    eval_at_start: evaluate the eval split before training (logged as step 0: the baseline).
    """

    output_dir: str = "outputs/dpo"
    optim: OptimConfig = dataclasses.field(default_factory=lambda: OptimConfig(lr=5e-6))
    data: PreferenceData = dataclasses.field(default_factory=PreferenceData)
    algorithm: PreferenceAlgorithm = dataclasses.field(default_factory=PreferenceAlgorithm)
    eval_at_start: bool = True


@dataclasses.dataclass
class DPOResult:
    output_dir: Path
    losses: list[tuple[int, float]]
    final_step: int
    start_step: int
    eval_metrics: dict[str, float]
    initial_eval: dict[str, float]
    hf_dir: Path | None
    stats: dict[str, Any]
    reference: str
    trainer: Any = None


def load_dpo_config(path, overrides=()) -> DPOConfig:
    return load_config(DPOConfig, path, list(overrides))


def _read_pairs(source, split, tok, d: PreferenceData):
    name = source_name(source, split)
    records = read_records(source, split)
    if not records:
        raise DataError(f"preference data '{name}' is empty")
    return encode_pairs(records, tok, d.format, seq_len=d.seq_len, truncation=d.truncation, source=name)


def resolve_reference(a: PreferenceAlgorithm, spec, has_lora: bool) -> ReferenceSource:
    """The one place the config's choice (`algorithm.reference`: auto/base/model) becomes a `ReferenceSource`:
    none for a reference-free loss; the LoRA base with adapters off for `base`, or for `auto` when training
    LoRA without a `reference_path`; otherwise a frozen model (`reference_path`, default model.path)."""
    if not spec.needs_reference:
        return ReferenceSource.NONE
    if a.reference == "base" and not has_lora:
        raise ConfigError("algorithm.reference=base needs lora.enabled=true (the base is the model with adapters off)")
    if a.reference == "base" or (a.reference == "auto" and has_lora and not a.reference_path):
        return ReferenceSource.BASE
    return ReferenceSource.MODEL


def _batches(arrays: dict, batch_pairs: int):
    n = arrays["input_ids"].shape[0]
    for s in range(0, n, batch_pairs):
        yield stack_pairs([{k: v[i] for k, v in arrays.items()} for i in range(s, min(n, s + batch_pairs))],
                          batch_pairs)


def _fingerprint(arrays: dict, model: ModelSection, a: PreferenceAlgorithm, lora: LoraConfig) -> str:
    """What the cached reference log-probs depend on: the pairs, the reference and the model's dtypes/LoRA."""
    h = hashlib.sha256()
    for k in ("input_ids", "loss_mask"):
        h.update(arrays[k].tobytes())
    h.update(repr((model.path, a.reference_path, a.reference, model.param_dtype,
                   model.compute_dtype, lora.enabled, lora.quantize, lora.block_size)).encode())
    return h.hexdigest()[:16]


def cached_reference(cache: Path, fingerprint: str):
    """The cached reference log-probs [P, 2] when `cache` holds them for this fingerprint, else None."""
    if not cache.exists():
        return None
    with np.load(cache) as z:
        return np.asarray(z["ref_logps"]) if str(z["fingerprint"]) == fingerprint else None


def precompute_reference(trainer, name: str, pairs, batch_pairs: int, cache: Path | None, fingerprint: str = "",
                         rows: list[int] | None = None):
    """Reference sequence log-probs of every pair [P, 2], scored with the frozen model `name` ("base": the
    LoRA model with adapters off) and written atomically to `cache` with the data/model fingerprint.
    Multi-host: every process calls it, feeding its `rows` of each batch; all get every pair's; process 0 writes."""
    out = []
    for b in _batches(pairs.arrays, batch_pairs):
        mine = b if rows is None else {k: v[rows] for k, v in b.items()}
        lp = np.asarray(distributed.to_host(trainer.frozen_token_logprobs(name, mine)))
        out.append((lp * b["loss_mask"][:, 1:]).sum(-1).reshape(-1, 2))
    ref = np.concatenate(out)[: len(pairs)].astype(np.float32)
    if cache is not None and distributed.is_primary():
        tmp = cache.with_name(cache.name + ".tmp.npz")
        np.savez(tmp, ref_logps=ref, fingerprint=np.asarray(fingerprint))
        tmp.replace(cache)
    return ref


def _agreed(refs: list):
    """The cached reference log-probs every process uses: process 0's verdict on each cache decides (a process
    must not skip a scoring collective that the others run); a cache process 0 read must be readable here."""
    if not distributed.is_multiprocess():
        return refs
    have = distributed.broadcast_json([r is not None for r in refs])
    if any(h and r is None for h, r in zip(have, refs)):
        raise ConfigError("output_dir: process 0 reads the cached reference log-probs there but this process "
                          "cannot; a multi-host run's output_dir must be on a file system every host sees")
    return [r if h else None for h, r in zip(have, refs)]


def _check_config(tc: TrainerConfig, d: PreferenceData, a: PreferenceAlgorithm):
    """The loss preset; a ConfigError for settings that cannot run (before anything is loaded)."""
    if not d.train:
        raise ConfigError("data.train is required (a .jsonl/.json/.parquet file of preference pairs)")
    if d.batch_size % tc.grad_accum:
        raise ConfigError(f"data.batch_size={d.batch_size} (pairs) must be divisible by "
                          f"trainer.grad_accum={tc.grad_accum}")
    spec = a.resolved()
    if a.nll_on_prompt and not spec.chosen_nll:
        raise ConfigError(f"algorithm.nll_on_prompt applies to loss 'orpo' only (loss is '{a.loss}')")
    return spec


class DPORun:
    """The steps of one preference-tuning run on the shared skeleton `run` (see the module docstring):
    data, then the trainer and its reference and loss, then the fit with held-out evaluation."""

    def __init__(self, cfg: DPOConfig, spec, run):
        self.cfg, self.spec, self.run = cfg, spec, run
        self.trainer = None
        self.reference = ReferenceSource.NONE
        self.initial_eval: dict[str, float] = {}

    def read_data(self) -> None:
        """Tokenizer and encoded pairs: a bad data set fails before any model is loaded."""
        d = self.cfg.data
        self.tok = self.run.tokenizer()
        self.train_pairs = _read_pairs(d.train, d.train_split, self.tok, d)
        self.eval_pairs = _read_pairs(d.eval, d.eval_split, self.tok, d) if d.eval else None

    def build(self) -> None:
        """The trainer (LoRA decides where the reference comes from), its reference, the loss, the batches."""
        cfg, d, tc = self.cfg, self.cfg.data, self.cfg.trainer
        self.trainer = self.run.build_trainer(process_local_batches=True)
        self.rows = self.run.batch_rows(2 * d.batch_size)  # multi-host: this process's rows of every batch
        self.reference = resolve_reference(cfg.algorithm, self.spec, self.trainer.has_lora)
        extra, eval_extra = self.attach_reference()
        self.trainer.loss_fn = make_preference_loss(self.spec, reference=self.reference,
                                                    chunk_size=tc.loss_chunk_size or None,
                                                    nll_on_prompt=cfg.algorithm.nll_on_prompt,
                                                    router=RouterLoss(**dataclasses.asdict(cfg.moe)))
        self.train_ds = build_preference_dataset(self.train_pairs, self.tok, seq_len=d.seq_len,
                                                 batch_pairs=d.batch_size, seed=d.seed, shuffle=d.shuffle,
                                                 num_epochs=None, extra=extra)
        self.eval_batches = []
        if self.eval_pairs is not None and tc.eval_every > 0:
            arrays = {**self.eval_pairs.arrays, **(eval_extra or {})}
            for b in _batches(arrays, d.batch_size):
                self.eval_batches.append(b)
                if len(self.eval_batches) >= tc.eval_batches:
                    break

    def attach_reference(self) -> tuple[dict | None, dict | None]:
        """Makes `self.reference` available to the loss: a frozen model loaded beside the trainer, or (with
        `precompute_reference`) every pair scored once and cached with the run (a resume reads the cache and
        never loads the reference), then precomputed. Returns the train/eval pairs' extra arrays."""
        a, run, trainer = self.cfg.algorithm, self.run, self.trainer
        ref = self.reference
        if not a.precompute_reference or ref is ReferenceSource.NONE:
            if ref is ReferenceSource.MODEL:
                trainer.add_frozen(ref.frozen_name, run.frozen_model(a.reference_path))
            return None, None
        jobs = [(self.train_pairs, run.out / "reference_logps.npz")]
        if self.eval_pairs is not None:
            jobs.append((self.eval_pairs, run.out / "reference_logps_eval.npz"))
        fps = [_fingerprint(p.arrays, self.cfg.model, a, self.cfg.lora) for p, _ in jobs]
        refs = _agreed([cached_reference(path, fp) for (_, path), fp in zip(jobs, fps)])
        if any(r is None for r in refs):
            if ref is ReferenceSource.MODEL:
                trainer.add_frozen(ref.frozen_name, run.frozen_model(a.reference_path))
            refs = [r if r is not None else precompute_reference(trainer, ref.frozen_name, p, self.cfg.data.batch_size,
                                                                 path, fp, self.rows)
                    for r, (p, path), fp in zip(refs, jobs, fps)]
            if ref is ReferenceSource.MODEL:  # no longer needed: free its memory
                trainer.remove_frozen(ref.frozen_name)
        self.reference = ReferenceSource.PRECOMPUTED
        return {"ref_logps": refs[0]}, ({"ref_logps": refs[1]} if self.eval_pairs is not None else None)

    def prepare(self, batch: dict) -> dict:
        """A global batch as the loss reads it: flat precomputed reference log-probs, ORPO's NLL row weights
        (over the whole batch); then this process's rows of it (multi-host)."""
        if "ref_logps" in batch:
            batch = dict(batch, ref_logps=np.asarray(batch["ref_logps"]).reshape(-1))
        if self.spec.chosen_nll:
            batch = dict(batch, nll_weight=nll_weights(batch, nll_on_prompt=self.cfg.algorithm.nll_on_prompt))
        return self.run.local_rows(batch, self.rows)

    def evaluate(self) -> dict[str, float]:
        """Loss and metrics over the held-out batches (eval/...); the first, before any step, is kept."""
        tot = {"loss": 0.0, "weight": 0.0}
        sums: dict[str, Any] = {}
        for b in self.eval_batches:
            ls, w, m = self.trainer.eval_sums(self.prepare(b))
            tot["loss"] += ls
            tot["weight"] += w
            for k, v in m.items():  # a (numerator, denominator) pair sums elementwise
                prev = sums.get(k)
                sums[k] = v if prev is None else (tuple(x + y for x, y in zip(prev, v)) if isinstance(v, tuple)
                                                  else prev + v)
        out = {"eval/loss": tot["loss"] / max(tot["weight"], 1e-12)}
        out.update({f"eval/{k}": float(v) for k, v in reduce_metrics(sums).items()})
        if not self.initial_eval and self.trainer.step_count == 0:
            self.initial_eval.update(out)
        return out

    def announce(self) -> None:
        d, s, spec, trainer, start = self.cfg.data, self.train_pairs.stats, self.spec, self.trainer, self.run.start_step
        settings = ", ".join(f"{f.name}={getattr(spec, f.name)}" for f in dataclasses.fields(spec))
        self.run.say(f"dpo: {self.run.folder} | loss {spec.name} ({settings})"
                     f" | reference: {self.reference} | {trainer.num_trainable:,} trained parameters"
                     f"{' (LoRA)' if trainer.has_lora else ''} | {s['num_pairs']} pairs ({s['truncated_pairs']} "
                     f"truncated, {s['dropped_pairs']} dropped) of <= {d.seq_len} tokens | steps "
                     f"{start}->{self.cfg.trainer.max_steps}" + (f" | resumed from step {start}" if start else ""))

    def fit(self, stop_after: int | None, batch_hook: Callable[[int, dict], dict] | None):
        """Restores the newest checkpoint (weights and data position), opens the logs, trains."""
        it = iter(self.train_ds)
        self.run.restore(it)
        self.run.open_logger()
        self.announce()

        def hook(step: int, batch: dict) -> dict:
            batch = self.prepare(batch)
            return batch_hook(step, batch) if batch_hook is not None else batch

        return self.run.fit(it, evaluate=self.evaluate if self.eval_batches else None, stop_after=stop_after,
                            batch_hook=hook, seq_len=self.cfg.data.seq_len, evaluate_at_start=self.cfg.eval_at_start)

    def export(self) -> Path | None:
        """The HF export of a finished run (LoRA merged); None when stopped early."""
        self.run.logger.close()
        return self.run.export_hf(prompt_style=self.train_pairs.prompt_style) if self.run.finished else None


def run_dpo(cfg: DPOConfig, *, stop_after: int | None = None, batch_hook: Callable[[int, dict], dict] | None = None,
            log: Callable[[str], None] | None = None) -> DPOResult:
    """Runs (or resumes) preference tuning as `cfg` says (see the module docstring)."""
    spec = _check_config(cfg.trainer, cfg.data, cfg.algorithm)
    with Run(cfg, "dpo", log=log) as run:
        dpo = DPORun(cfg, spec, run)
        dpo.read_data()
        dpo.build()
        fit = dpo.fit(stop_after, batch_hook)
        hf_dir = dpo.export()
    return DPOResult(output_dir=run.out, losses=fit.losses, final_step=dpo.trainer.step_count,
                     start_step=run.start_step, eval_metrics=fit.last_eval, initial_eval=dpo.initial_eval,
                     hf_dir=hf_dir, stats=dict(dpo.train_pairs.stats), reference=dpo.reference, trainer=dpo.trainer)
