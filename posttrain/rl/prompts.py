"""An RL run's prompt sets (`RLPrompts`): the train and held-out records, read and checked against the rewards before
any model loads (`read_records`, `check_image_prompts`), then encoded once (`encode_prompt_set`, with the
checkpoint's `PromptEncoder`), the batch columns the longest of them fixes (`batch_columns`), and how they prompt
the policy, written with its export (`trained_prompt_style`)."""

from __future__ import annotations

import dataclasses

from posttrain.agent.rollout import Agent
from posttrain.agent.setup import agent_enabled
from posttrain.config import ConfigError
from posttrain.data import read_prompts
from posttrain.data.vlm import has_images
from posttrain.models.prompt_format import trained_style
from posttrain.rewards.runner import RewardRunner
from posttrain.rl.config import PromptData, RolloutConfig
from posttrain.rollout.layout import bucket_length
from posttrain.rollout.prompts import PromptEncoder, PromptSet, PromptStyle

__all__ = ["RLPrompts", "batch_columns", "check_image_prompts", "encode_prompt_set", "read_records",
           "trained_prompt_style"]


@dataclasses.dataclass(frozen=True)
class RLPrompts:
    """The run's prompts: `train` (every record encoded; `Prompt.index` is the record's index, what the dispatcher's
    leases name), `eval` (held-out, or None) and `data`, the data section with the prompt field the records were
    read with (what a fleet worker's agent uses)."""

    train: PromptSet
    eval: PromptSet | None
    data: PromptData


def read_records(data: PromptData, runner: RewardRunner, *, environment: bool = False):
    """(train records, held-out records or None, the data section with the prompt field found), checked against the
    rewards. The prompt field: `data.prompt_field`; when the records lack the default `prompt`, the first of
    question, problem, messages they have (as `posttrain eval`); with an `environment`, none at all (its `reset`
    makes the conversation)."""
    records = read_prompts(data.train, prompt_field=data.prompt_field, fallback=data.prompt_field == "prompt",
                           optional=environment)
    field = records.prompt_field
    found = dataclasses.replace(data, prompt_field=field or data.prompt_field)
    runner.check_records(records)
    eval_records = None
    if data.eval:
        eval_records = read_prompts(data.eval, prompt_field=field, optional=environment)
        if data.eval_limit:
            eval_records = eval_records[: data.eval_limit]
        runner.check_records(eval_records)
    return records, eval_records, found


def check_image_prompts(rollout: RolloutConfig, data: PromptData, records, eval_records) -> bool:
    """Whether the train or held-out prompts have images (they travel with their prompts: in-process, on the
    fleet, in packed and shared-prompt rows); image prompts with multi-turn rollouts are a one-line config error:
    the agent renders its first messages and appended turns as text (no image expansion, no pixels for the
    sampler's extend program)."""
    if not any(has_images(r, ("prompt",)) for recs in (records, eval_records or []) for r in recs):
        return False
    if agent_enabled(rollout):
        raise ConfigError(f"rollout.tools: not supported with image prompts ({data.train} has images); "
                          "image prompts are single-turn")
    return True


def encode_prompt_set(encoder: PromptEncoder, records, data: PromptData, agent: Agent | None = None) -> PromptSet:
    """Every record's prompt (`PromptEncoder`: chat template or text; with an `agent`, its first messages rendered
    with the tools; image prompts with their pixels, expanded for the checkpoint's vision spec). A prompt longer
    than `data.max_prompt_tokens` is a config error naming its file and line."""
    prompts = encoder.encode(records, agent=agent)
    for p in prompts:
        if len(p.ids) > data.max_prompt_tokens:
            raise ConfigError(f"{p.where}: the prompt has {len(p.ids)} tokens, more than "
                              f"data.max_prompt_tokens={data.max_prompt_tokens}")
    return prompts


def batch_columns(prompts: PromptSet, completion_budget: int) -> tuple[int, int]:
    """(P, C): the prompt and completion columns every batch of the run is padded to (the longest train prompt,
    and the tokens after a prompt at most), so the train step and the scoring compile once (issue 40)."""
    return (bucket_length(max((len(x) for x in prompts.ids), default=1)), bucket_length(completion_budget))


def trained_prompt_style(prompts: RLPrompts, agent: Agent | None = None) -> PromptStyle:
    """How the run prompts its policy, written with its export (`posttrain.models.prompt_format`): the chat
    template with tools or an environment (the agent renders its first messages), else the training prompts' own
    (message lists and `data.chat` through the template, text otherwise; `data.system_prompt`)."""
    data = prompts.data
    if agent is not None:
        return PromptStyle(chat=True, system_prompt=data.system_prompt)
    return trained_style((r.get("prompt") for r in prompts.train.records), chat=data.chat,
                         system_prompt=data.system_prompt)
