"""The synchronous RL loop (GRPO family): rollout -> rewards -> advantages -> policy update, on one host.

Per step: take B prompts, sample G completions each with the engine on the current weights in place,
score the rewards, compute group advantages, optionally drop zero-signal groups (DAPO dynamic sampling,
re-sampling fresh prompts up to a cap), build the batch (old log-probs are the sampler's, which were
computed by the very weights being updated; `old_logprobs=recompute` re-scores them with the training
forward), add reference log-probs when beta > 0 (the base model with LoRA adapters off, or a frozen
copy for full fine-tuning), then run `ppo_epochs` x `minibatches` optimizer steps.

Resume is exact: prompts are drawn from a per-epoch permutation fixed by (seed, epoch), the cursor
into it is checkpointed with the trainer state, and sampling seeds derive from (seed, step).
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Any

import numpy as np

from posttrain.rl.config import RLConfig


class PromptStream:
    """Deterministic prompt order: epoch e is permutation(seed, e) of the records; `cursor` counts prompts taken."""

    def __init__(self, n: int, seed: int, shuffle: bool, cursor: int = 0):
        self.n, self.seed, self.shuffle, self.cursor = n, seed, shuffle, cursor
        self._perm_epoch, self._perm = -1, None

    def _order(self, epoch: int) -> np.ndarray:
        if epoch != self._perm_epoch:
            self._perm = (np.random.default_rng([self.seed, epoch]).permutation(self.n) if self.shuffle
                          else np.arange(self.n))
            self._perm_epoch = epoch
        return self._perm

    def take(self, k: int) -> list[int]:
        out = []
        for _ in range(k):
            epoch, pos = divmod(self.cursor, self.n)
            out.append(int(self._order(epoch)[pos]))
            self.cursor += 1
        return out

    @property
    def epoch(self) -> int:
        return self.cursor // self.n


@dataclasses.dataclass
class RLResult:
    output_dir: Path
    steps: int
    history: list[dict[str, float]]
    evals: list[dict[str, Any]]
    hf_dir: Path | None


def load_rl_config(path: str | Path | None, overrides=()) -> RLConfig:
    from posttrain.config import load_config

    return load_config(RLConfig, path, list(overrides))


def _reward_runner(cfg: RLConfig, preset: dict):
    from posttrain.rewards.length import overlong_penalty
    from posttrain.rewards.runner import RewardRunner, RewardSpec

    specs = [dataclasses.replace(RewardSpec.coerce(r.name), weight=r.weight, kwargs=dict(r.kwargs))
             for r in cfg.rewards.functions]
    if preset.get("overlong_penalty") and not any(r.name == "overlong_penalty" for r in cfg.rewards.functions):
        budget = cfg.rollout.max_new_tokens
        cache = max(1, int(round(preset.get("overlong_cache_fraction", 0.2) * budget)))
        specs.append(RewardSpec(name="overlong_penalty", fn=overlong_penalty(budget, cache), weight=1.0))
    return RewardRunner(specs, timeout_s=cfg.rewards.timeout_s, failure_value=cfg.rewards.failure_value,
                        num_workers=cfg.rewards.num_workers, max_failed_calls=cfg.rewards.max_failed_steps)


def _encode_all(tok, records, cfg: RLConfig, where: str) -> list[list[int]]:
    from posttrain.rl.rollout import encode_prompt

    out = []
    for i, r in enumerate(records):
        ids = encode_prompt(tok, r["prompt"], chat=cfg.data.chat, system_prompt=cfg.data.system_prompt)
        if not ids:
            raise ValueError(f"{where}: record {i} has an empty prompt")
        if len(ids) > cfg.data.max_prompt_tokens:
            raise ValueError(f"{where}: record {i} prompt has {len(ids)} tokens, more than "
                             f"data.max_prompt_tokens={cfg.data.max_prompt_tokens}")
        out.append(ids)
    return out


def _mesh(cfg: RLConfig):
    import jax

    from posttrain import distributed

    if len(jax.devices()) == 1:
        return None
    m = cfg.mesh
    return distributed.make_mesh(data=m.data, fsdp=m.fsdp, tensor=m.tensor)


def run_rl(cfg: RLConfig, *, stop_after: int | None = None) -> RLResult:
    """Runs (or resumes) an RL job; `stop_after` ends the loop early, as a crash would (for resume tests)."""
    from posttrain import tokenizer as tok_lib
    from posttrain.algorithms import dapo
    from posttrain.algorithms.registry import ADVANTAGES, get, loss_kwargs
    from posttrain.config import save_config
    from posttrain.data import read_prompts
    from posttrain.models import lora as lora_lib
    from posttrain.models.hf_io import save_pretrained
    from posttrain.rl.batch import build_rl_batch, completion_logprobs
    from posttrain.rl.evaluate import evaluate
    from posttrain.rl.loss import make_rl_loss
    from posttrain.rl.rollout import Rollouts, generate_rollouts
    from posttrain.sampling import Sampler, SamplingParams
    from posttrain.training.checkpoint import Checkpointer
    from posttrain.training.errors import TrainingDivergedError
    from posttrain.training.metrics import MetricsLogger
    from posttrain.training.optim import make_optimizer
    from posttrain.training.sft import build_model
    from posttrain.training.trainer import Trainer

    if not cfg.data.train:
        from posttrain.config import ConfigError

        raise ConfigError("data.train: no prompt set given (set data.train=FILE)")
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_config(cfg, out / "config.yaml")
    preset = cfg.algorithm.resolved()
    g, b = cfg.rollout.group_size, cfg.rollout.batch_prompts
    advantage_fn = get(ADVANTAGES, preset["advantage"])
    if preset["advantage"] == "rloo" and g < 2:
        raise ValueError("rollout.group_size must be >= 2 for RLOO")
    kw = loss_kwargs(preset)
    if kw.get("max_tokens") is None:
        kw["max_tokens"] = cfg.rollout.max_new_tokens
    beta = float(kw.get("beta") or 0.0)
    kw["beta"] = beta
    if beta == 0.0:
        kw.pop("kl_estimator", None)

    # rewards first: a data set without a field a reward needs fails before any model is loaded
    runner = _reward_runner(cfg, preset)
    records = read_prompts(cfg.data.train, prompt_field=cfg.data.prompt_field)
    runner.check_records(records)
    eval_records = None
    if cfg.data.eval:
        eval_records = read_prompts(cfg.data.eval, prompt_field=cfg.data.prompt_field)
        if cfg.data.eval_limit:
            eval_records = eval_records[: cfg.data.eval_limit]
        runner.check_records(eval_records)

    mesh = _mesh(cfg)
    model, folder = build_model(cfg, mesh)
    tok = tok_lib.load(folder)
    prompt_ids = _encode_all(tok, records, cfg, cfg.data.train)
    eval_ids = _encode_all(tok, eval_records, cfg, cfg.data.eval) if eval_records else None

    updates_per_step = cfg.algorithm.ppo_epochs * cfg.algorithm.minibatches
    tx, schedule = make_optimizer(cfg.optim, cfg.trainer.max_steps * updates_per_step)
    trainer = Trainer(model, tx, grad_accum=cfg.trainer.grad_accum, mesh=mesh, schedule=schedule,
                      seed=cfg.trainer.seed, logprob_chunk_size=cfg.trainer.loss_chunk_size or None)
    loss_fn = make_rl_loss(kw, chunk_size=cfg.trainer.loss_chunk_size or None)
    ref_fn = None
    if beta > 0:
        if trainer.has_lora:  # the base model with adapters off: no second copy of the weights
            ref_fn = lambda batch: np.asarray(trainer.token_logprobs(batch, adapters=False))  # noqa: E731
        else:
            ref_model, _ = build_model(dataclasses.replace(cfg, lora=dataclasses.replace(cfg.lora, enabled=False)), mesh)
            ref_trainer = Trainer(ref_model, tx, mesh=mesh, logprob_chunk_size=cfg.trainer.loss_chunk_size or None)
            ref_fn = lambda batch: np.asarray(ref_trainer.token_logprobs(batch))  # noqa: E731

    ckpt = Checkpointer(out / "checkpoints", keep=cfg.trainer.keep_checkpoints,
                        async_save=cfg.trainer.async_checkpointing)
    stream = PromptStream(len(records), cfg.data.seed, cfg.data.shuffle)
    start = 0
    meta = ckpt.restore_latest(trainer) if cfg.trainer.resume else None
    if meta is not None:
        stream.cursor = int(meta["data_state"]["prompt_cursor"])
        start = int(meta["metadata"].get("rl_step", trainer.step_count // updates_per_step))
    sampler = Sampler(trainer.model(), tok, max_slots=cfg.rollout.max_slots or b * g)
    logger = MetricsLogger(out, total_steps=cfg.trainer.max_steps, start_step=start,
                           progress=cfg.trainer.progress, description="rl")
    samples_file = open(out / "samples.jsonl", "a", encoding="utf-8")
    history: list[dict[str, float]] = []
    evals: list[dict[str, Any]] = []
    params = dict(max_new_tokens=cfg.rollout.max_new_tokens, temperature=cfg.rollout.temperature,
                  top_p=cfg.rollout.top_p, top_k=cfg.rollout.top_k, n=g, stop_token_ids=cfg.rollout.stop_token_ids)

    def run_eval(step: int) -> None:
        if eval_records is None:
            return
        sampler.model = trainer.model()
        t0 = time.perf_counter()
        e = evaluate(sampler, eval_records, eval_ids, runner, correctness=cfg.rewards.correctness,
                     max_new_tokens=cfg.rollout.max_new_tokens, k=cfg.eval.k, n_samples=cfg.eval.n_samples,
                     temperature=cfg.eval.temperature, seed=cfg.trainer.seed + 7919 * step)
        greedy = e.pop("_greedy")
        e["eval/seconds"] = time.perf_counter() - t0
        logger.log(step, e)
        evals.append({"step": step, **e})
        for i in range(min(cfg.eval.log_samples, len(greedy))):
            samples_file.write(json.dumps({"step": step, "kind": "eval", "prompt": greedy.prompts_text[i],
                                           "completion": greedy.texts[i], "reward": float(greedy.rewards[i])}) + "\n")
        samples_file.flush()
        logger.message(f"step {step}: held-out accuracy {e['eval/accuracy']:.3f}, reward {e['eval/reward_mean']:.3f}")

    def save(step: int) -> None:
        if ckpt.latest_step() != trainer.step_count:
            ckpt.save(trainer, data_state={"prompt_cursor": stream.cursor}, metadata={"rl_step": step})

    if cfg.eval.at_start and start == 0:
        run_eval(0)
    step = start
    try:
        while step < cfg.trainer.max_steps:
            if stop_after is not None and step >= stop_after:
                break
            t0 = time.perf_counter()
            sampler.model = trainer.model()
            parts: list[Rollouts] = []
            kept_groups, rounds, sampled_groups = 0, 0, 0
            first = None
            while kept_groups < b:
                idx = stream.take(b)
                sp = SamplingParams(seed=(cfg.trainer.seed * 1_000_003 + step * 101 + rounds) % 2**32, **params)
                r = generate_rollouts(sampler, records, idx, [prompt_ids[i] for i in idx], sp, runner)
                first = first or r
                sampled_groups += r.num_groups
                if preset.get("dynamic_sampling"):
                    keep = dapo.groups_with_signal(r.rewards, g)
                    r = r.select_groups(keep)
                if len(r):
                    parts.append(r)
                    kept_groups += r.num_groups
                rounds += 1
                if not preset.get("dynamic_sampling") or rounds > cfg.algorithm.max_resample_rounds:
                    break
            rollout_s = time.perf_counter() - t0
            if not parts:  # every group had equal rewards: nothing to learn from this step
                parts = [first]
            ro = Rollouts.concat(parts)
            if ro.num_groups > b:
                ro = ro.select_groups(np.arange(ro.num_groups) < b)
            lengths = ro.completion_lengths()
            adv = np.asarray(advantage_fn(ro.rewards, g))
            weights = dapo.overlong_mask(ro.finish_reasons) if preset.get("overlong_filtering") else None
            batch = build_rl_batch(ro, adv, seq_weights=weights, pad_id=tok.pad_token_id or 0)
            t1 = time.perf_counter()
            if cfg.algorithm.old_logprobs == "recompute":
                batch["old_logp"] = completion_logprobs(trainer.token_logprobs(batch), batch)
            if ref_fn is not None:
                batch["ref_logp"] = completion_logprobs(ref_fn(batch), batch)
            n = len(ro)
            mb = cfg.algorithm.minibatches
            if n % mb or (n // mb) % cfg.trainer.grad_accum:
                raise ValueError(f"{n} rollouts do not split into algorithm.minibatches={mb} x "
                                 f"trainer.grad_accum={cfg.trainer.grad_accum}")
            rng = np.random.default_rng([cfg.trainer.seed, step])
            step_metrics: list[dict[str, float]] = []
            for _ in range(cfg.algorithm.ppo_epochs):
                order = rng.permutation(n) if mb > 1 else np.arange(n)
                for part in np.split(order, mb):
                    step_metrics.append(trainer.step({k: v[part] for k, v in batch.items()}, loss_fn))
            train_s = time.perf_counter() - t1
            step += 1
            m = {k: float(np.mean([s[k] for s in step_metrics])) for k in step_metrics[0]}
            m.update({
                "reward/mean": float(ro.rewards.mean()),
                "reward/std": float(ro.rewards.std()),
                "completion/length_mean": float(lengths.mean()),
                "completion/length_max": float(lengths.max()),
                "completion/truncated_fraction": float(np.mean([f == "length" for f in ro.finish_reasons])),
                "time/rollout_s": rollout_s,
                "time/train_s": train_s,
                "throughput/tokens_per_s": float(lengths.sum()) / max(rollout_s + train_s, 1e-9),
                "groups/kept": float(ro.num_groups),
                "groups/sampled": float(sampled_groups),
            })
            for name, vals in ro.per_reward.items():
                m[f"reward/{name}"] = float(vals.mean())
            if cfg.rewards.correctness in ro.per_reward:
                m["accuracy"] = float((ro.per_reward[cfg.rewards.correctness] >= 1.0).mean())
            for k2, v in ro.reward_stats.items():
                if k2.endswith(("failures", "timeouts")):
                    m[k2] = float(v)
            if not np.isfinite(m["loss"]):
                raise TrainingDivergedError.at(step, m["loss"], m.get("grad_norm"), ckpt)
            history.append({"step": step, **m})
            if step % cfg.trainer.log_every == 0 or step == cfg.trainer.max_steps:
                logger.log(step, m)
                samples_file.write(json.dumps({"step": step, "kind": "train", "prompt": ro.prompts_text[0],
                                               "completion": ro.texts[0], "reward": float(ro.rewards[0])}) + "\n")
            logger.advance(step)
            if cfg.eval.every and step % cfg.eval.every == 0 and step < cfg.trainer.max_steps:
                run_eval(step)
            if cfg.trainer.save_every and step % cfg.trainer.save_every == 0:
                save(step)
        finished = step >= cfg.trainer.max_steps
        if finished:
            run_eval(step)
            save(step)
    finally:
        logger.close()
        samples_file.close()
        runner.close()
        ckpt.wait()
    hf_dir = None
    if finished and cfg.export_hf:
        final = trainer.model()
        if trainer.has_lora:
            final = lora_lib.merge(final)
        hf_dir = save_pretrained(final, out / "hf", tokenizer=tok, dtype=cfg.export_dtype)
    ckpt.close()
    return RLResult(out, step, history, evals, hf_dir)
