"""RL set-up as data: `build_rl(cfg) -> RLParts`, every piece of one run built once, in order, as a frozen record.

The order: the run skeleton (`posttrain.training.run.Run`: run lock, output folder + config.yaml, mesh); the typed
algorithm preset (the config's `algorithm` section); the reward runner, then the prompt records checked against the
rewards, and the agent's tools and environment (all before any model loads); the trainer and tokenizer; the agent and
the encoded prompts (`posttrain.rollout.prompts`); the learner; the dispatcher; the sampling parameters and the batch
builder. A failure part way closes what was built (the run lock released). The loop (`posttrain.rl.loop`) runs the
named steps of `posttrain.rl.steps` over these parts; the rollout sources (`posttrain.rl.sources`,
`posttrain.rl.fleet`) get only the pieces they use.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np

from posttrain import distributed
from posttrain.agent.failures import EnvErrorWatch
from posttrain.agent.rollout import Agent
from posttrain.agent.setup import agent_enabled, build_agent, load_agent_parts
from posttrain.algorithms import dapo
from posttrain.algorithms.policy import ISLevel
from posttrain.algorithms.registry import ADVANTAGES, GRPOFamily, get, loss_kwargs
from posttrain.config import ConfigError
from posttrain.data import read_prompts
from posttrain.data.vlm import VisionSpec, has_images
from posttrain.models.moe_loss import RouterLoss
from posttrain.rewards.runner import RewardRunner
from posttrain.rl.batch import RLBatch, bucket_length, build_rl_batch
from posttrain.rl.config import LearnerConfig, PromptData, RLConfig, RolloutConfig
from posttrain.rl.dispatcher import Dispatcher
from posttrain.rl.learner import FrozenScorer, Learner, TrainerScorer
from posttrain.rl.loss import make_rl_loss
from posttrain.rl.packing import attention_span
from posttrain.rl.rewarding import reward_runner, rollout_sampling_params
from posttrain.models.prompt_format import trained_style
from posttrain.rollout.prompts import PromptSet, PromptStyle, encode_prompts
from posttrain.rollout.rollouts import Rollouts
from posttrain.sampling import ProgramCache, SamplingParams
from posttrain.training.run import Run
from posttrain.training.trainer import Trainer

__all__ = ["GroupAdvantages", "RLParts", "RLPrompts", "build_rl", "policy_loss_kwargs"]


@dataclasses.dataclass(frozen=True)
class RLPrompts:
    """The run's prompts: `train` (every record encoded; `Prompt.index` is the record's index, what the dispatcher's
    leases name), `eval` (held-out, or None) and `data`, the data section with the prompt field the records were
    read with (what a fleet worker's agent uses)."""

    train: PromptSet
    eval: PromptSet | None
    data: PromptData


@dataclasses.dataclass(frozen=True)
class GroupAdvantages:
    """The GRPO family's batch builder: a step's rollouts -> (the training batch, extra metrics: none). Group
    advantages (the preset's estimator), loss masks (DAPO's overlong filtering), the prompts' images, and the
    sampler's log-probs as behaviour log-probs (the learner adds the proximal and reference ones)."""

    advantage: Callable[..., Any]
    overlong_filtering: bool
    prompts: PromptSet
    pad_id: int
    columns: tuple[int, int] = (0, 0)  # (P, C) at least: `batch_columns`

    def __call__(self, ro: Rollouts) -> tuple[RLBatch, dict[str, float]]:
        adv = np.asarray(self.advantage(ro.rewards, ro.group_size))
        weights = dapo.overlong_mask(ro.finish_reasons) if self.overlong_filtering else None
        images = [p.images for p in self.prompts.select(ro.record_index)] if self.prompts.has_images else None
        return build_rl_batch(ro, adv, seq_weights=weights, pad_id=self.pad_id, images=images,
                              at_least=self.columns), {}


def batch_columns(prompts: PromptSet, completion_budget: int) -> tuple[int, int]:
    """(P, C): the prompt and completion columns every batch of the run is padded to (the longest train prompt,
    and the tokens after a prompt at most), so the train step and the scoring compile once (issue 40)."""
    return (bucket_length(max((len(x) for x in prompts.ids), default=1)), bucket_length(completion_budget))


@dataclasses.dataclass(frozen=True)
class RLParts:
    """The built pieces of one RL run (module docstring). `run`: the shared skeleton (output folder, trainer,
    checkpoints, logs, profiler); `prepare(rollouts) -> (batch, metrics)`: the step's batch builder
    (`GroupAdvantages`; on-policy distillation supplies its own); `programs`: compiled sampler programs shared with
    the caller's samplers (the demo's)."""

    cfg: RLConfig
    run: Run
    preset: GRPOFamily
    runner: RewardRunner
    prompts: RLPrompts
    tok: Any
    trainer: Trainer
    learner: Learner
    dispatcher: Dispatcher
    agent: Agent | None
    env_watch: EnvErrorWatch | None
    sampling: SamplingParams
    prepare: Callable[[Rollouts], tuple[RLBatch, dict[str, float]]]
    programs: ProgramCache | None = None


def build_rl(cfg: RLConfig, program_cache: ProgramCache | None = None) -> RLParts:
    """Every piece of the RL run `cfg` (module docstring); on an error, what was built is closed."""
    if not cfg.data.train:
        raise ConfigError("data.train: no prompt set given (set data.train=FILE)")
    with contextlib.ExitStack() as undo:
        run = Run(cfg, "rl")  # the run lock, the output folder + config.yaml, the mesh
        undo.callback(run.close)
        preset = algorithm_preset(cfg)
        runner = reward_runner(cfg.rewards, cfg.rollout, preset)
        undo.callback(runner.close)
        agent_parts = check_agent(cfg)  # tools and environment, then the prompts: all before any model loads
        records, eval_records, data = read_records(cfg, runner)
        image_prompts = _check_image_prompts(cfg, records, eval_records)
        lc = cfg.learner
        trainer = run.build_trainer(updates=cfg.trainer.max_steps * lc.ppo_epochs * lc.minibatches)
        check_routing_replay(lc, trainer.model().cfg)
        tok = run.tokenizer()
        agent = None
        if agent_parts is not None:
            agent = build_agent(cfg.rollout, tok, system_prompt=cfg.data.system_prompt,
                                prompt_field=data.prompt_field, parts=agent_parts)
            undo.callback(agent.close)
        vision = VisionSpec.from_checkpoint(run.model_folder(), tok) if image_prompts else None
        train = _encode_all(tok, records, cfg.data, agent, vision)
        held_out = _encode_all(tok, eval_records, cfg.data, agent, vision) if eval_records else None
        parts = RLParts(
            cfg=cfg, run=run, preset=preset, runner=runner, prompts=RLPrompts(train, held_out, data), tok=tok,
            trainer=trainer, learner=build_learner(cfg, preset, run, image_prompts, train),
            dispatcher=build_dispatcher(cfg, len(records)), agent=agent,
            env_watch=env_watch(cfg.rollout, agent, run.say),
            sampling=rollout_sampling_params(cfg.rollout, cfg.trainer.seed),
            prepare=GroupAdvantages(get(ADVANTAGES, preset.advantage), preset.overlong_filtering, train,
                                    tok.pad_token_id or 0, batch_columns(train, cfg.rollout.completion_budget)),
            programs=program_cache)
        undo.pop_all()
    return parts


# ---------------------------------------------------------------------- the builders, in build_rl's order
def algorithm_preset(cfg: RLConfig) -> GRPOFamily:
    """The typed preset of the `algorithm` section, checked against the rollout section."""
    if cfg.algorithm.advantage == "rloo" and cfg.rollout.group_size < 2:
        raise ValueError("rollout.group_size must be >= 2 for RLOO")
    return cfg.algorithm


def check_agent(cfg: RLConfig):
    """The tools and environment of multi-turn rollouts (None: single-turn), checked before the model loads."""
    if not agent_enabled(cfg.rollout):
        return None
    if distributed.is_multiprocess() and not (cfg.fleet.enabled and not cfg.data.eval):
        raise ConfigError("rollout.tools: a multi-process trainer runs multi-turn rollouts only on the fleet "
                          "(fleet.workers) and without data.eval (sampling in-process, every process would run "
                          "the tools and could read different results)")
    return load_agent_parts(cfg.rollout)


def read_records(cfg: RLConfig, runner: RewardRunner):
    """(train records, held-out records or None, the data section with the prompt field found), checked against the
    rewards. The prompt field: `data.prompt_field`; when the records lack the default `prompt`, the first of
    question, problem, messages they have (as `posttrain eval`); with an environment, none at all (its `reset`
    makes the conversation)."""
    env = bool(cfg.rollout.environment)
    records = read_prompts(cfg.data.train, prompt_field=cfg.data.prompt_field,
                           fallback=cfg.data.prompt_field == "prompt", optional=env)
    field = records.prompt_field
    data = dataclasses.replace(cfg.data, prompt_field=field or cfg.data.prompt_field)
    runner.check_records(records)
    eval_records = None
    if cfg.data.eval:
        eval_records = read_prompts(cfg.data.eval, prompt_field=field, optional=env)
        if cfg.data.eval_limit:
            eval_records = eval_records[: cfg.data.eval_limit]
        runner.check_records(eval_records)
    return records, eval_records, data


def _check_image_prompts(cfg: RLConfig, records, eval_records) -> bool:
    """Whether the train or held-out prompts have images (they travel with their prompts: in-process, on the
    fleet, in packed and shared-prompt rows); image prompts with multi-turn rollouts are a one-line config error:
    the agent renders its first messages and appended turns as text (no image expansion, no pixels for the
    sampler's extend program)."""
    if not any(has_images(r, ("prompt",)) for recs in (records, eval_records or []) for r in recs):
        return False
    if agent_enabled(cfg.rollout):
        raise ConfigError(f"rollout.tools: not supported with image prompts ({cfg.data.train} has images); "
                          "image prompts are single-turn")
    return True


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


def trained_prompt_style(prompts: RLPrompts, agent: Agent | None = None) -> PromptStyle:
    """How the run prompts its policy, written with its export (`posttrain.models.prompt_format`): the chat
    template with tools or an environment (the agent renders its first messages), else the training prompts' own
    (message lists and `data.chat` through the template, text otherwise; `data.system_prompt`)."""
    data = prompts.data
    if agent is not None:
        return PromptStyle(chat=True, system_prompt=data.system_prompt)
    return trained_style((r.get("prompt") for r in prompts.train.records), chat=data.chat,
                         system_prompt=data.system_prompt)


def policy_loss_kwargs(preset: GRPOFamily, learner: LearnerConfig, max_new_tokens: int) -> dict:
    """The policy loss's keyword arguments: the algorithm preset's, the length normaliser (default: the
    generation budget) and the learner's off-policy correction."""
    kw = loss_kwargs(preset)
    kw["max_tokens"] = max_new_tokens if preset.max_tokens is None else preset.max_tokens
    kw["beta"] = float(preset.beta)
    if kw["beta"] == 0.0:
        kw.pop("kl_estimator")
    kw.update(is_level=ISLevel.of(learner.is_level), is_cap=learner.is_cap)
    return kw


def check_routing_replay(learner: LearnerConfig, model_cfg) -> None:
    """`learner.routing_replay` needs a mixture of experts (a one-line config error on a dense model). With it on,
    the sources record the experts the sampler routed to (`record_experts`), the batch carries them
    (`RLBatch.routed_experts`) and the learner's policy passes replay them (`posttrain.rl.learner`)."""
    if learner.routing_replay and not model_cfg.is_moe:
        raise ConfigError(f"learner.routing_replay: needs a mixture-of-experts model; this {model_cfg.model_type} "
                          "model has no experts (set learner.routing_replay=false)")


def build_learner(cfg: RLConfig, preset: GRPOFamily, run: Run, image_prompts: bool, prompts: PromptSet) -> Learner:
    """The learner: the policy loss, its epochs and minibatches, and the reference scorer when beta > 0 (which
    routes with its own router: a batch's recorded experts, `learner.routing_replay`, are the policy's only);
    packed rows sized once by the shortest of the train `prompts`."""
    lc, trainer = cfg.learner, run.trainer
    kw = policy_loss_kwargs(preset, lc, cfg.rollout.completion_budget)
    share = lc.share_prompts if lc.share_prompts is not None else not image_prompts
    chunk = cfg.trainer.loss_chunk_size or None
    ref_fn = None
    if kw["beta"] > 0:
        if trainer.has_lora:  # the base model with adapters off: no second copy of the weights
            ref_fn = TrainerScorer(trainer, adapters=False)
        else:
            ref_fn = FrozenScorer(run.frozen_model(), trainer, chunk)
    router = RouterLoss(**dataclasses.asdict(cfg.moe))  # a mixture of experts' router terms (none when dense)
    return Learner(trainer, make_rl_loss(kw, chunk_size=chunk, router=router), ppo_epochs=lc.ppo_epochs, minibatches=lc.minibatches,
                   seed=cfg.trainer.seed, recompute_old=lc.old_logprobs == "recompute",
                   correct_off_policy=kw["is_level"].corrects, ref_fn=ref_fn, pack=lc.pack or share,
                   attn_span=attention_span(trainer.model().cfg) if share else None,
                   prompt_min=min((len(x) for x in prompts.ids), default=1))


def build_dispatcher(cfg: RLConfig, num_records: int) -> Dispatcher:
    """The dispatcher of prompt groups: the data stream, staleness bound, leases and curation."""
    fc, cc = cfg.fleet, cfg.curation
    return Dispatcher(num_records, seed=cfg.data.seed, shuffle=cfg.data.shuffle, batch_groups=cfg.rollout.batch_prompts,
                      max_staleness=fc.max_staleness if fc.enabled else 0, lease_timeout_s=fc.lease_timeout_s,
                      curation_window=cc.window, skip_always_solved=cc.skip_always_solved,
                      skip_never_solved=cc.skip_never_solved)


def env_watch(rollout: RolloutConfig, agent: Agent | None, say: Callable[[str], None]) -> EnvErrorWatch | None:
    """The watch over an environment's failures (None without an environment)."""
    if agent is None or agent.environment is None:
        return None
    return EnvErrorWatch(agent.environment.name, rollout.max_env_error_fraction,
                         warn=lambda line: say(f"warning: {line}"))
