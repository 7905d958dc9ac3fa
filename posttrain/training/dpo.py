"""The preference-tuning run (DPO family): `posttrain dpo CONFIG.yaml`, on the shared run skeleton.

config -> pairs (encoded, truncated, counted; errors before any model loads) -> model (+LoRA/QLoRA) ->
reference (the LoRA base with adapters off, or a frozen model; optionally scored once up front and
cached in OUTPUT_DIR/reference_logps.npz) -> `Run.fit` with the family's loss -> HF export.
Losses and presets: `posttrain.algorithms.preference`. Data formats: `posttrain.data.preference`.

Metrics (TRL's names): loss, rewards/chosen, rewards/rejected, rewards/margins, rewards/accuracies,
logps/chosen, logps/rejected, logps/accuracies (policy log-prob of chosen > rejected), pairs; on the
eval split the same under eval/.
"""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path
from typing import Any, Callable, Literal

from posttrain.data.preference import PreferenceFormat
from posttrain.training.config import DataSplits, OptimConfig, RunConfig

__all__ = ["DPOConfig", "PreferenceData", "PreferenceAlgorithm", "DPOResult", "load_dpo_config", "run_dpo"]

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
        from posttrain.algorithms.preference import make_preset
        from posttrain.config import ConfigError

        try:
            return make_preset(self.loss, beta=self.beta, label_smoothing=self.label_smoothing, gamma=self.gamma)
        except ValueError as e:
            raise ConfigError(str(e)) from None


@dataclasses.dataclass
class DPOConfig(RunConfig):
    """Preference tuning run: everything `posttrain dpo CONFIG.yaml` needs (the shared sections: `RunConfig`)."""

    output_dir: str = "outputs/dpo"
    optim: OptimConfig = dataclasses.field(default_factory=lambda: OptimConfig(lr=5e-6))
    data: PreferenceData = dataclasses.field(default_factory=PreferenceData)
    algorithm: PreferenceAlgorithm = dataclasses.field(default_factory=PreferenceAlgorithm)
    eval_at_start: bool = True  # evaluate the eval split before training (logged as step 0: the baseline)


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
    from posttrain.config import load_config

    return load_config(DPOConfig, path, list(overrides))


def _read_pairs(source, split, tok, cfg: DPOConfig):
    from posttrain.data.preference import encode_pairs
    from posttrain.data.sources import DataError, read_records, source_name

    name = source_name(source, split)
    records = read_records(source, split)
    if not records:
        raise DataError(f"preference data '{name}' is empty")
    d = cfg.data
    return encode_pairs(records, tok, d.format, seq_len=d.seq_len, truncation=d.truncation, source=name)


def _reference_source(cfg: DPOConfig, spec, has_lora: bool) -> str:
    from posttrain.config import ConfigError

    if not spec.needs_reference:
        return "none"
    ref = cfg.algorithm.reference
    if ref == "base" and not has_lora:
        raise ConfigError("algorithm.reference=base needs lora.enabled=true (the base is the model with adapters off)")
    if ref == "base" or (ref == "auto" and has_lora and not cfg.algorithm.reference_path):
        return "base"
    return "reference"


def _batches(arrays: dict, batch_pairs: int):
    from posttrain.data.preference import stack_pairs

    n = arrays["input_ids"].shape[0]
    for s in range(0, n, batch_pairs):
        yield stack_pairs([{k: v[i] for k, v in arrays.items()} for i in range(s, min(n, s + batch_pairs))],
                          batch_pairs)


def _fingerprint(arrays: dict, cfg: DPOConfig) -> str:
    h = hashlib.sha256()
    for k in ("input_ids", "loss_mask"):
        h.update(arrays[k].tobytes())
    h.update(repr((cfg.model.path, cfg.algorithm.reference_path, cfg.algorithm.reference, cfg.model.param_dtype,
                   cfg.model.compute_dtype, cfg.lora.enabled, cfg.lora.quantize, cfg.lora.block_size)).encode())
    return h.hexdigest()[:16]


def cached_reference(cache: Path, fingerprint: str):
    """The cached reference log-probs [P, 2] when `cache` holds them for this fingerprint, else None."""
    import numpy as np

    if not cache.exists():
        return None
    with np.load(cache) as z:
        return np.asarray(z["ref_logps"]) if str(z["fingerprint"]) == fingerprint else None


def precompute_reference(trainer, name: str, pairs, batch_pairs: int, cache: Path | None, fingerprint: str = ""):
    """Reference sequence log-probs of every pair [P, 2], scored with the frozen model `name` ("base": the
    LoRA model with adapters off) and written atomically to `cache` with the data/model fingerprint."""
    import numpy as np

    out = []
    for b in _batches(pairs.arrays, batch_pairs):
        lp = np.asarray(trainer.frozen_token_logprobs(name, b))
        out.append((lp * b["loss_mask"][:, 1:]).sum(-1).reshape(-1, 2))
    ref = np.concatenate(out)[: len(pairs)].astype(np.float32)
    if cache is not None:
        tmp = cache.with_name(cache.name + ".tmp.npz")
        np.savez(tmp, ref_logps=ref, fingerprint=np.asarray(fingerprint))
        tmp.replace(cache)
    return ref


def run_dpo(cfg: DPOConfig, *, stop_after: int | None = None, batch_hook: Callable[[int, dict], dict] | None = None,
            log: Callable[[str], None] | None = None) -> DPOResult:
    """Runs (or resumes) preference tuning as `cfg` says (see the module docstring)."""
    import numpy as np

    from posttrain.algorithms.preference import make_preference_loss, nll_weights
    from posttrain.config import ConfigError
    from posttrain.data.preference import build_preference_dataset
    from posttrain.training.run import Run
    from posttrain.training.trainer import reduce_metrics

    tc, d, a = cfg.trainer, cfg.data, cfg.algorithm
    if not d.train:
        raise ConfigError("data.train is required (a .jsonl/.json/.parquet file of preference pairs)")
    if d.batch_size % tc.grad_accum:
        raise ConfigError(f"data.batch_size={d.batch_size} (pairs) must be divisible by "
                          f"trainer.grad_accum={tc.grad_accum}")
    spec = a.resolved()
    if a.nll_on_prompt and not spec.chosen_nll:
        raise ConfigError(f"algorithm.nll_on_prompt applies to loss 'orpo' only (loss is '{a.loss}')")

    with Run(cfg, "dpo", log=log, multi_host=False) as run:
        tok = run.tokenizer()
        # Data first: a bad data set fails before any model is loaded.
        train_pairs = _read_pairs(d.train, d.train_split, tok, cfg)
        eval_pairs = _read_pairs(d.eval, d.eval_split, tok, cfg) if d.eval else None
        chunk = tc.loss_chunk_size or None
        # the trainer first (LoRA decides where the reference comes from), then the loss
        trainer = run.build_trainer()
        reference = _reference_source(cfg, spec, trainer.has_lora)
        extra = eval_extra = None
        if reference != "none" and a.precompute_reference:
            # scored once and cached with the run: a resume reads the cache and never loads the reference
            jobs = [(train_pairs, run.out / "reference_logps.npz")]
            if eval_pairs is not None:
                jobs.append((eval_pairs, run.out / "reference_logps_eval.npz"))
            fps = [_fingerprint(p.arrays, cfg) for p, _ in jobs]
            refs = [cached_reference(path, fp) for (_, path), fp in zip(jobs, fps)]
            if any(r is None for r in refs):
                if reference == "reference":
                    trainer.add_frozen("reference", run.frozen_model(a.reference_path))
                refs = [r if r is not None else precompute_reference(trainer, reference, p, d.batch_size, path, fp)
                        for r, (p, path), fp in zip(refs, jobs, fps)]
                if reference == "reference":  # no longer needed: free its memory
                    trainer.remove_frozen("reference")
            extra = {"ref_logps": refs[0]}
            eval_extra = {"ref_logps": refs[1]} if eval_pairs is not None else None
            reference = "precomputed"
        elif reference == "reference":
            trainer.add_frozen("reference", run.frozen_model(a.reference_path))
        loss_fn = make_preference_loss(spec, reference=reference, chunk_size=chunk, nll_on_prompt=a.nll_on_prompt)
        trainer.loss_fn = loss_fn
        train_ds = build_preference_dataset(train_pairs, tok, seq_len=d.seq_len, batch_pairs=d.batch_size,
                                            seed=d.seed, shuffle=d.shuffle, num_epochs=None, extra=extra)
        eval_batches = []
        if eval_pairs is not None and tc.eval_every > 0:
            arrays = {**eval_pairs.arrays, **(eval_extra or {})}
            for b in _batches(arrays, d.batch_size):
                eval_batches.append(b)
                if len(eval_batches) >= tc.eval_batches:
                    break

        def prepare(batch: dict) -> dict:
            if "ref_logps" in batch:
                batch = dict(batch, ref_logps=np.asarray(batch["ref_logps"]).reshape(-1))
            if spec.chosen_nll:
                batch = dict(batch, nll_weight=nll_weights(batch, nll_on_prompt=a.nll_on_prompt))
            return batch

        def evaluate() -> dict[str, float]:
            tot = {"loss": 0.0, "weight": 0.0}
            sums: dict[str, Any] = {}
            for b in eval_batches:
                ls, w, m = trainer.eval_sums(prepare(b))
                tot["loss"] += ls
                tot["weight"] += w
                for k, v in m.items():  # a (numerator, denominator) pair sums elementwise
                    prev = sums.get(k)
                    sums[k] = v if prev is None else (tuple(x + y for x, y in zip(prev, v)) if isinstance(v, tuple)
                                                      else prev + v)
            out = {"eval/loss": tot["loss"] / max(tot["weight"], 1e-12)}
            out.update({f"eval/{k}": float(v) for k, v in reduce_metrics(sums).items()})
            return out

        it = iter(train_ds)
        run.restore(it)
        start = run.start_step
        run.open_logger()
        s = train_pairs.stats
        settings = ", ".join(f"{f.name}={getattr(spec, f.name)}" for f in dataclasses.fields(spec))
        run.say(f"dpo: {run.folder} | loss {spec.name} ({settings})"
                f" | reference: {reference} | {trainer.num_trainable:,} trained parameters"
                f"{' (LoRA)' if trainer.has_lora else ''} | {s['num_pairs']} pairs ({s['truncated_pairs']} truncated, "
                f"{s['dropped_pairs']} dropped) of <= {d.seq_len} tokens | steps {start}->{tc.max_steps}"
                + (f" | resumed from step {start}" if start else ""))

        def hook(step: int, batch: dict) -> dict:
            batch = prepare(batch)
            return batch_hook(step, batch) if batch_hook is not None else batch

        initial: dict[str, float] = {}

        def evaluate_logged() -> dict[str, float]:
            out = evaluate()
            if not initial and trainer.step_count == 0:
                initial.update(out)
            return out

        fit = run.fit(it, evaluate=evaluate_logged if eval_batches else None, stop_after=stop_after, batch_hook=hook,
                      seq_len=d.seq_len, evaluate_at_start=cfg.eval_at_start)
        run.logger.close()
        hf_dir = run.export_hf() if run.finished else None
    return DPOResult(output_dir=run.out, losses=fit.losses, final_step=trainer.step_count, start_step=start,
                     eval_metrics=fit.last_eval, initial_eval=initial, hf_dir=hf_dir, stats=dict(train_pairs.stats),
                     reference=reference,
                     trainer=trainer)
