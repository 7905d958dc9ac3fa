"""What an RL run holds besides its loop: data, rewards, model, trainer, learner, dispatcher, checkpoints, logs.

`RLRun(cfg)` does every set-up step once on the shared run skeleton (`posttrain.training.run.Run`) (rewards are checked against the data before any model
loads); the loop (`posttrain.rl.loop`) then only calls named steps on it: `resume`, `prepare`,
`after_step` (logs, held-out evaluation, checkpoint), `finish` (final evaluation, checkpoint, HF export).

Files in `output_dir`: `config.yaml`, `metrics.jsonl`, `tensorboard/`, `samples.jsonl` and `trained.jsonl`
(`posttrain.rl.ledger`), `checkpoints/<step>/` (trainer state + the dispatcher's state with its buffered
rollouts), `hf/`. On resume, records after the restored step are dropped from the JSONL files: those
steps run again. The rollout metrics are `posttrain.rl.metrics`'; the held-out evaluator `posttrain.eval`'s.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import nnx

from posttrain import distributed
from posttrain.agent.failures import EnvErrorWatch, EnvironmentFailedError
from posttrain.agent.rollout import Agent
from posttrain.agent.setup import agent_enabled, build_agent, load_agent_parts
from posttrain.algorithms import dapo
from posttrain.algorithms.policy import ISLevel
from posttrain.algorithms.registry import ADVANTAGES, get, loss_kwargs
from posttrain.config import ConfigError
from posttrain.data import read_prompts
from posttrain.data.vlm import VisionSpec, has_images
from posttrain.eval.images import ImagePromptSampler
from posttrain.eval.evaluate import evaluate
from posttrain.rl import metrics
from posttrain.rl.batch import RLBatch, build_rl_batch
from posttrain.rl.config import LearnerConfig, PromptData, RLConfig
from posttrain.rl.dispatcher import Dispatcher
from posttrain.rl.ledger import ROW_FILES, Ledger
from posttrain.rl.learner import FrozenScorer, Learner, TrainerScorer
from posttrain.rl.loss import make_rl_loss
from posttrain.rl.packing import attention_span
from posttrain.rl.rewarding import reward_runner, rollout_sampling_params
from posttrain.rollout.prompts import PromptSet, PromptStyle, encode_prompts
from posttrain.rollout.rollouts import Rollouts
from posttrain.sampling import ProgramCache, Sampler
from posttrain.training.run import Run

__all__ = ["RLRun", "RLResult"]


@dataclasses.dataclass
class RLResult:
    output_dir: Path
    steps: int
    history: list[dict[str, float]]
    evals: list[dict[str, Any]]
    hf_dir: Path | None


def _encode_all(tok, records, data: PromptData, agent: Agent | None = None, vision=None) -> PromptSet:
    """Every record's prompt (`posttrain.rollout.prompts`: chat template or text; with an `agent`, its first
    messages rendered with the tools; image prompts with their pixels, expanded for `vision`). A prompt longer than
    `data.max_prompt_tokens` is a config error naming its file and line."""
    prompts = encode_prompts(records, tok, PromptStyle(chat=data.chat, system_prompt=data.system_prompt),
                             agent=agent, vision=vision)
    for p in prompts:
        if len(p.ids) > data.max_prompt_tokens:
            raise ConfigError(f"{p.where}: the prompt has {len(p.ids)} tokens, more than "
                              f"data.max_prompt_tokens={data.max_prompt_tokens}")
    return prompts


def _check_image_prompts(cfg: RLConfig, records, eval_records) -> bool:
    """Whether the train or held-out prompts have images; image prompts with the fleet, packed batches or
    multi-turn rollouts are a one-line config error (not supported yet)."""
    if not any(has_images(r, ("prompt",)) for recs in (records, eval_records or []) for r in recs):
        return False
    for on, key in ((cfg.fleet.enabled, "fleet.workers"), (cfg.learner.pack, "learner.pack"),
                    (cfg.learner.share_prompts is True, "learner.share_prompts"),
                    (agent_enabled(cfg.rollout), "rollout.tools")):
        if on:
            raise ConfigError(f"{key}: not supported with image prompts ({cfg.data.train} has images); "
                              "image prompts train in-process on padded batches, single-turn")
    return True


def policy_loss_kwargs(preset: dict, learner: LearnerConfig, max_new_tokens: int) -> dict:
    """The policy loss's keyword arguments: the algorithm preset's, the length normaliser (default: the
    generation budget) and the learner's off-policy correction."""
    kw = loss_kwargs(preset)
    if kw.get("max_tokens") is None:
        kw["max_tokens"] = max_new_tokens
    kw["beta"] = float(kw.get("beta") or 0.0)
    if kw["beta"] == 0.0:
        kw.pop("kl_estimator", None)
    kw.update(is_level=ISLevel.of(learner.is_level), is_cap=learner.is_cap)
    return kw


class RLRun:
    """The set-up of one RL run and the named steps the loop calls (see the module docstring)."""

    def __init__(self, cfg: RLConfig, program_cache: ProgramCache | None = None):
        if not cfg.data.train:
            raise ConfigError("data.train: no prompt set given (set data.train=FILE)")
        self.cfg = cfg
        # the shared skeleton: run lock, output folder + config.yaml, mesh; later trainer, checkpoints, logs
        self.run = Run(cfg, "rl")
        self.out = self.run.out
        self.runner = None
        self.ledger: Ledger | None = None
        self.history: list[dict[str, float]] = []
        self.evals: list[dict[str, Any]] = []
        self._sampler = None
        self._programs = program_cache  # compiled sampler programs shared with the caller's samplers (the demo's)
        self.agent: Agent | None = None
        self.env_watch: EnvErrorWatch | None = None
        try:
            self._setup(cfg)
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ set-up: named builders, in order
    def _setup(self, cfg: RLConfig) -> None:
        self._build_algorithm(cfg)
        self._read_data(cfg)  # rewards first: a field a reward needs is checked before any model loads
        self._build_trainer(cfg)
        self._build_learner(cfg)
        self._build_dispatcher(cfg)
        self.sampling_params = rollout_sampling_params(cfg.rollout, cfg.trainer.seed)

    def _build_algorithm(self, cfg: RLConfig) -> None:
        """The algorithm preset: advantage estimator, dynamic sampling and the policy loss's settings."""
        self.preset = preset = cfg.algorithm.resolved()
        self.advantage_fn = get(ADVANTAGES, preset.advantage)
        if preset.advantage == "rloo" and cfg.rollout.group_size < 2:
            raise ValueError("rollout.group_size must be >= 2 for RLOO")
        self.dynamic_sampling = preset.dynamic_sampling
        self.max_drops_per_step = cfg.learner.max_resample_rounds * cfg.rollout.batch_prompts
        self.loss_kwargs = policy_loss_kwargs(preset, cfg.learner, cfg.rollout.completion_budget)

    def _read_data(self, cfg: RLConfig) -> None:
        """The reward runner, then the train (and held-out) prompts, checked against the rewards. The prompt
        field: `data.prompt_field`; when the records lack the default `prompt`, the first of question, problem,
        messages they have (as `posttrain eval`); with an environment, none at all (its `reset` makes the
        conversation). `prompt_data` is the data section with the field found (what the fleet's agents use)."""
        self.runner = reward_runner(cfg.rewards, cfg.rollout, self.preset)
        self._agent_parts = self._check_agent(cfg)
        env = bool(cfg.rollout.environment)
        self.records = read_prompts(cfg.data.train, prompt_field=cfg.data.prompt_field,
                                    fallback=cfg.data.prompt_field == "prompt", optional=env)
        field = self.records.prompt_field
        self.prompt_data = dataclasses.replace(cfg.data, prompt_field=field or cfg.data.prompt_field)
        self.runner.check_records(self.records)
        self.eval_records = None
        if cfg.data.eval:
            self.eval_records = read_prompts(cfg.data.eval, prompt_field=field, optional=env)
            if cfg.data.eval_limit:
                self.eval_records = self.eval_records[: cfg.data.eval_limit]
            self.runner.check_records(self.eval_records)
        self.image_prompts = _check_image_prompts(cfg, self.records, self.eval_records)

    def _build_trainer(self, cfg: RLConfig) -> None:
        """The trainer (its schedule counts every optimizer step), the tokenizer and the prompts' token ids."""
        lc = cfg.learner
        self.trainer = self.run.build_trainer(updates=cfg.trainer.max_steps * lc.ppo_epochs * lc.minibatches)
        self.tok = self.run.tokenizer()
        if self._agent_parts is not None:
            self.agent = build_agent(cfg.rollout, self.tok, system_prompt=cfg.data.system_prompt,
                                     prompt_field=self.prompt_data.prompt_field, parts=self._agent_parts)
            if self.agent.environment is not None:
                self.env_watch = EnvErrorWatch(self.agent.environment.cls.__name__,
                                               cfg.rollout.max_env_error_fraction,
                                               warn=lambda line: self.run.say(f"warning: {line}"))
        vision = VisionSpec.from_checkpoint(self.run.model_folder(), self.tok) if self.image_prompts else None
        self.prompts = _encode_all(self.tok, self.records, cfg.data, self.agent, vision)
        self.prompt_ids, self.prompt_images = self.prompts.ids, self.prompts.images
        self.eval_prompts = _encode_all(self.tok, self.eval_records, cfg.data, self.agent, vision) \
            if self.eval_records else None
        self.eval_ids = self.eval_prompts.ids if self.eval_prompts is not None else None
        self.eval_images = self.eval_prompts.images if self.eval_prompts is not None else None

    @staticmethod
    def _check_agent(cfg: RLConfig):
        """The tools and environment of multi-turn rollouts (None: single-turn), checked before the model loads."""
        if not agent_enabled(cfg.rollout):
            return None
        if distributed.is_multiprocess() and not (cfg.fleet.enabled and not cfg.data.eval):
            raise ConfigError("rollout.tools: a multi-process trainer runs multi-turn rollouts only on the fleet "
                              "(fleet.workers) and without data.eval (sampling in-process, every process would run "
                              "the tools and could read different results)")
        return load_agent_parts(cfg.rollout)

    def _build_learner(self, cfg: RLConfig) -> None:
        """The learner: the policy loss, its epochs and minibatches, and the reference scorer when beta > 0."""
        lc, kw, trainer = cfg.learner, self.loss_kwargs, self.trainer
        share = lc.share_prompts if lc.share_prompts is not None else not self.image_prompts
        chunk = cfg.trainer.loss_chunk_size or None
        ref_fn = None
        if kw["beta"] > 0:
            if trainer.has_lora:  # the base model with adapters off: no second copy of the weights
                ref_fn = TrainerScorer(trainer, adapters=False)
            else:
                ref_fn = FrozenScorer(self.run.frozen_model(), trainer, chunk)
        self.learner = Learner(trainer, make_rl_loss(kw, chunk_size=chunk), ppo_epochs=lc.ppo_epochs,
                               minibatches=lc.minibatches, seed=cfg.trainer.seed,
                               recompute_old=lc.old_logprobs == "recompute",
                               correct_off_policy=kw["is_level"].corrects, ref_fn=ref_fn,
                               pack=lc.pack or share, attn_span=attention_span(trainer.model().cfg) if share else None)

    def _build_dispatcher(self, cfg: RLConfig) -> None:
        """The dispatcher of prompt groups: the data stream, staleness bound, leases and curation."""
        fc, cc = cfg.fleet, cfg.curation
        self.dispatcher = Dispatcher(len(self.records), seed=cfg.data.seed, shuffle=cfg.data.shuffle,
                                     batch_groups=cfg.rollout.batch_prompts,
                                     max_staleness=fc.max_staleness if fc.enabled else 0,
                                     lease_timeout_s=fc.lease_timeout_s, curation_window=cc.window,
                                     skip_always_solved=cc.skip_always_solved, skip_never_solved=cc.skip_never_solved)

    @property
    def ckpt(self):
        return self.run.ckpt

    @property
    def logger(self):
        return self.run.logger

    # ------------------------------------------------------------------ pieces the sources use
    def local_sampler(self) -> Sampler:
        """The sampler on the trainer's devices (in-process rollouts and held-out evaluation), built once over
        its own copy of the trained weights (`Sampler.load_weights` refreshes them)."""
        if self._sampler is None:
            t = self.trainer
            model = nnx.merge(t.graphdef, jax.tree.map(lambda x: x.copy(), t.params), t.rest)
            b, g = self.cfg.rollout.batch_prompts, self.cfg.rollout.group_size
            self._sampler = Sampler(model, self.tok, max_slots=self.cfg.rollout.max_slots or b * g,
                                    program_cache=self._programs)
        return self._sampler

    def lease_items(self, lease) -> tuple[dict[int, dict], list[int], list[list[int]]]:
        """(records, record indices, prompt token ids) of a lease: what `generate_rollouts` takes."""
        return ({r: self.records[r] for r in lease.records}, list(lease.records),
                [self.prompt_ids[r] for r in lease.records])

    def lease_images(self, lease) -> list[list[np.ndarray]] | None:
        """The images of a lease's prompts (`generate_rollouts`'s `images`), None for text prompts."""
        return None if self.prompt_images is None else [self.prompt_images[r] for r in lease.records]

    def pass_rates(self, ro: Rollouts) -> dict[int, float]:
        """uid -> fraction of the group's samples that are correct (for curation)."""
        return metrics.pass_rates(ro, self.cfg.rewards.correctness)

    # ------------------------------------------------------------------ the loop's named steps
    def resume(self) -> int:
        """Restores the latest checkpoint (trainer, dispatcher) when resuming; opens the logs; returns the step."""
        start = 0
        meta = self.run.restore()  # the newest checkpoint that restores (when trainer.resume)
        if meta is not None:
            self.dispatcher.load_state_dict(meta["data_state"]["dispatcher"])
            start = int(meta["metadata"]["rl_step"])
        self.run.start_step = start
        # rows of steps after the checkpoint are dropped: those steps run again
        self.run.open_logger(start, description="rl", row_files=ROW_FILES)
        self.ledger = Ledger(self.out, primary=distributed.is_primary())
        return start

    def prepare(self, ro: Rollouts) -> RLBatch:
        """The training batch of a step's rollouts: group advantages, loss masks (DAPO overlong filtering),
        the sampler's log-probs as behaviour log-probs (the learner adds proximal and reference ones)."""
        adv = np.asarray(self.advantage_fn(ro.rewards, ro.group_size))
        weights = dapo.overlong_mask(ro.finish_reasons) if self.preset.overlong_filtering else None
        images = None if self.prompt_images is None else [self.prompt_images[r] for r in ro.record_index]
        return build_rl_batch(ro, adv, seq_weights=weights, pad_id=self.tok.pad_token_id or 0, images=images)

    def check_environment(self, step: int, ro: Rollouts) -> None:
        """A step's environment failures: a warning line for each new kind; when more than
        `rollout.max_env_error_fraction` of its trajectories failed, they go to trajectories.jsonl and the run
        stops (`EnvironmentFailedError`: one `error:` line naming the environment class and the first error)."""
        if self.env_watch is None or not ro.trajectories:
            return
        try:
            self.env_watch.check(step, ro.trajectories)
        except EnvironmentFailedError:
            self.ledger.record_trajectories(step, "train", ro, self.cfg.eval.log_samples)
            raise

    def rollout_metrics(self, ro: Rollouts) -> dict[str, float]:
        return metrics.rollout_metrics(ro, self.cfg.rewards.correctness)

    def save(self, step: int) -> None:
        self.run.save(data_state={"dispatcher": self.dispatcher.state_dict()}, metadata={"rl_step": step})

    def evaluate(self, step: int) -> None:
        """Held-out greedy accuracy (and pass@k) with the trainer's current weights (`posttrain.eval`)."""
        if self.eval_records is None:
            return
        cfg = self.cfg
        sampler = self.local_sampler()
        if sampler.version != step:
            sampler.load_weights(self.trainer.params, step)
        t0 = time.perf_counter()
        if self.eval_images is not None:  # image prompts: each prompt's images go to its prefill
            sampler = ImagePromptSampler(sampler, self.eval_images)
        e = evaluate(sampler, self.eval_records, self.eval_ids, self.runner, correctness=cfg.rewards.correctness,
                     max_new_tokens=cfg.rollout.max_new_tokens, k=cfg.eval.k, n_samples=cfg.eval.n_samples,
                     temperature=cfg.eval.temperature, seed=cfg.trainer.seed + 7919 * step, agent=self.agent)
        greedy = e.pop("_greedy")
        e.pop("_sampled")
        e["eval/seconds"] = time.perf_counter() - t0
        self.logger.log(step, e)
        self.evals.append({"step": step, **e})
        self.ledger.record_samples(step, "eval", greedy, cfg.eval.log_samples)
        self.logger.message(f"step {step}: held-out accuracy {e['eval/accuracy']:.3f}, reward {e['eval/reward_mean']:.3f}")

    def after_step(self, step: int, m: dict[str, float], ro: Rollouts, trained_uids: list[int]) -> None:
        """Ledger, metrics, samples, periodic evaluation and checkpoint of a finished step."""
        cfg = self.cfg
        self.run.check_finite(step, m, grad_norm=False, log=False)
        self.ledger.record_trained(step, ro, trained_uids)
        self.history.append({"step": step, **m})
        if step % cfg.trainer.log_every == 0 or step == cfg.trainer.max_steps:
            self.logger.log(step, m)
            self.ledger.record_samples(step, "train", ro, 1)
            self.ledger.record_trajectories(step, "train", ro, cfg.eval.log_samples)
        self.logger.advance(step)
        if cfg.eval.every and step % cfg.eval.every == 0 and step < cfg.trainer.max_steps:
            self.evaluate(step)
        if cfg.trainer.save_every and step % cfg.trainer.save_every == 0:
            self.save(step)

    def finish(self, step: int) -> Path | None:
        """Final evaluation and checkpoint; the HF export (LoRA merged)."""
        self.evaluate(step)
        self.save(step)
        self.ckpt.wait()
        return self.run.export_hf(quiet=True)

    def close(self) -> None:
        try:
            if self.ledger is not None:
                self.ledger.close()
            if self.runner is not None:
                self.runner.close()
            if self.agent is not None:
                self.agent.close()
        finally:
            self.run.close()  # logs; waits for a pending save (bounded: never a hang); releases the run lock
