"""RL set-up as data: `build_rl(cfg) -> RLParts`, every piece of one run built once, in order, as a frozen record.

The order: the run skeleton (`posttrain.training.run.Run`: run lock, output folder + config.yaml, mesh); the reward
runner, the agent's tools and environment, then the prompt records checked against the rewards (all before any model
loads: `posttrain.rl.rewarding`, `posttrain.rl.prompts`); the trainer and tokenizer; the agent and the encoded prompts
(the checkpoint's `PromptEncoder`); the learner (`posttrain.rl.learner`); the dispatcher; last, the latest checkpoint
restored when resuming (`posttrain.rl.checkpoints`: `start_step`) and the logs opened; the sampling parameters and
the batch builder (`posttrain.rl.batch.GroupAdvantages`). Each piece is built next to what it builds, from the
config sections it reads; this module only orders them. A failure part way closes what was built (the run lock
released). The loop (`posttrain.rl.loop`) runs the named steps of `posttrain.rl.steps` over these parts, which they
do not change (what changes as the run goes is the loop's `RLState`); the rollout sources (`posttrain.rl.sources`,
`posttrain.rl.fleet`) get only the pieces they use.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from typing import Any

from posttrain.agent.failures import EnvErrorWatch, env_watch
from posttrain.agent.rollout import Agent
from posttrain.agent.setup import build_agent
from posttrain.algorithms.registry import ADVANTAGES, GRPOFamily, get
from posttrain.config import ConfigError
from posttrain.models.kernels import check_compute_dtype
from posttrain.rewards.runner import RewardRunner
from posttrain.rl import checkpoints
from posttrain.rl.batch import GroupAdvantages, RLBatch
from posttrain.rl.config import RLConfig
from posttrain.rl.dispatcher import Dispatcher
from posttrain.rl.learner import Learner, build_learner, check_routing_replay
from posttrain.rl.ledger import ROW_FILES
from posttrain.rl.prompts import (
    RLPrompts,
    batch_columns,
    check_image_prompts,
    encode_prompt_set,
    read_records,
)
from posttrain.rl.rewarding import agent_parts, reward_runner, rollout_sampling_params
from posttrain.rl.verifiers_source import open_verifiers
from posttrain.rollout.prompts import PromptEncoder, PromptStyle
from posttrain.rollout.rollouts import Rollouts
from posttrain.rollout.verifiers_env import VerifiersEnvironment, is_verifiers
from posttrain.sampling import ProgramCache, SamplingParams
from posttrain.training.run import Run

__all__ = ["RLParts", "build_rl"]


@dataclasses.dataclass(frozen=True)
class RLParts:
    """The built pieces of one RL run (module docstring). `run`: the shared skeleton (output folder, the trainer
    `run.trainer`, checkpoints, logs, profiler); `prepare(rollouts) -> (batch, metrics)`: the step's batch builder
    (`GroupAdvantages`; on-policy distillation supplies its own); `programs`: compiled sampler programs shared with
    the caller's policies (the demo's); `start_step`: the step the run starts from (the restored checkpoint's, or 0); `verifiers`: the verifiers environment
    (`rollout.environment=verifiers:...`) whose dataset gave the prompts and whose rollouts and rubric the source
    runs (`posttrain.rl.verifiers_source`)."""

    cfg: RLConfig
    run: Run
    preset: GRPOFamily
    runner: RewardRunner
    prompts: RLPrompts
    tok: Any
    learner: Learner
    dispatcher: Dispatcher
    agent: Agent | None
    env_watch: EnvErrorWatch | None
    sampling: SamplingParams
    prepare: Callable[[Rollouts], tuple[RLBatch, dict[str, float]]]
    programs: ProgramCache | None = None
    start_step: int = 0
    verifiers: VerifiersEnvironment | None = None


def build_rl(cfg: RLConfig, program_cache: ProgramCache | None = None) -> RLParts:
    """Every piece of the RL run `cfg` (module docstring); on an error, what was built is closed."""
    data, rollout, lc = cfg.data, cfg.rollout, cfg.learner
    if not data.train and not is_verifiers(rollout.environment):
        raise ConfigError("data.train: no prompt set given (set data.train=FILE)")
    with contextlib.ExitStack() as undo:
        run = Run(cfg, "rl")  # the run lock, the output folder + config.yaml, the mesh
        undo.callback(run.close)
        venv = open_verifiers(rollout, cfg.rewards, data, cfg.fleet) if is_verifiers(rollout.environment) else None
        if venv is not None:  # its dataset gives the prompts, its rubric the rewards
            undo.callback(venv.close)
        runner = reward_runner(cfg.rewards, rollout, cfg.algorithm) if venv is None else RewardRunner([])
        undo.callback(runner.close)
        tools = agent_parts(rollout, cfg.fleet, data)  # tools and environment, then the prompts: before any model
        records, eval_records, found = read_records(data, runner, environment=bool(rollout.environment)) \
            if venv is None else (venv.records("train"), None, data)
        image_prompts = check_image_prompts(rollout, data, records, eval_records)
        if rollout.compute_dtype:  # the sampler's own (the trainer's is checked with its model)
            check_compute_dtype(rollout.compute_dtype, "rollout.compute_dtype", cfg.model.kernels)
        trainer = run.build_trainer(updates=cfg.trainer.max_steps * lc.ppo_epochs * lc.minibatches)
        check_routing_replay(lc, trainer.model().cfg)
        tok = run.tokenizer()
        agent = None
        if tools is not None:
            agent = build_agent(rollout, tok, system_prompt=data.system_prompt, prompt_field=found.prompt_field,
                                parts=tools)
            undo.callback(agent.close)
        # a vision-language checkpoint's image settings are read from its folder
        encoder = PromptEncoder(tok, PromptStyle(chat=data.chat or venv is not None, system_prompt=data.system_prompt),
                                run.model_folder())
        train = encode_prompt_set(encoder, records, data, agent)
        held_out = encode_prompt_set(encoder, eval_records, data, agent) if eval_records else None
        learner = build_learner(lc, cfg.algorithm, run, cfg.trainer, cfg.moe, image_prompts=image_prompts,
                                completion_budget=rollout.completion_budget, prompts=train)
        dispatcher = Dispatcher.of(len(records), data, rollout, cfg.fleet, cfg.curation)
        start = checkpoints.restore(run, dispatcher)  # when resuming: the latest checkpoint (trainer, dispatcher)
        run.open_logger(start, description="rl", row_files=ROW_FILES)  # rows of steps after it are dropped
        prepare = GroupAdvantages(get(ADVANTAGES, cfg.algorithm.advantage), cfg.algorithm.overlong_filtering, train,
                                  tok.pad_token_id or 0, batch_columns(train, rollout.completion_budget))
        parts = RLParts(cfg=cfg, run=run, preset=cfg.algorithm, runner=runner, tok=tok,
                        prompts=RLPrompts(train, held_out, found), learner=learner, dispatcher=dispatcher, agent=agent,
                        env_watch=env_watch(agent, rollout.max_env_error_fraction, run.say) if venv is None else
                        EnvErrorWatch(venv.name, rollout.max_env_error_fraction, lambda x: run.say(f"warning: {x}")),
                        sampling=rollout_sampling_params(rollout, cfg.trainer.seed), prepare=prepare,
                        programs=program_cache, start_step=start, verifiers=venv)
        undo.pop_all()
    return parts
