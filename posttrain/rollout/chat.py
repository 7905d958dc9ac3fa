"""A multi-turn conversation with a model (`Conversation`: what `posttrain chat` talks to).

Each user turn is added to the messages, the whole conversation is rendered again (the chat template, the system
prompt, the images of the first user turn for a vision-language checkpoint, an agent's tools) and the policy samples
the reply; with an agent the model may call tools within a turn (the multi-turn rollout of `posttrain rl` and
`eval`), and the reply is then every message after the user's: tool calls, their results and the answer. A model
trained on raw prompts (a raw `style`, no tools, no images: `posttrain demo`'s) gets each turn's text as its raw
prompt, answered on its own, as `generate` and `eval` prompt it. The reply is cut to the room the model's context
leaves; a turn that cannot be answered at all (a conversation longer than the context) raises ValueError and leaves
the conversation as it was. This is inference: no training data is made here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from posttrain.agent.rollout import Agent
from posttrain.rollout.policy import Policy
from posttrain.rollout.prompts import Prompt, PromptStyle
from posttrain.sampling import SamplingParams

__all__ = ["Conversation"]


class Conversation:
    """One conversation with `policy`: its `messages` (the user's view: no tools section), sampled with `params`;
    `style`: how it is prompted (default: the chat template with `system_prompt`); `images` (files) go with the
    first user turn; `agent`: tools or an environment within a turn."""

    def __init__(self, policy: Policy, params: SamplingParams, *, style: PromptStyle | None = None,
                 system_prompt: str | None = None, images: Sequence[str] = (), agent: Agent | None = None):
        self.policy, self.params, self.agent = policy, params, agent
        self.style = style or PromptStyle(chat=True, system_prompt=system_prompt)
        self.images = list(images)
        self.raw = not self.style.chat and agent is None and not self.images
        self.messages: list[dict] = []
        self.turn = 0

    def reset(self) -> None:
        """Starts over (the images go with the next first turn again)."""
        self.messages, self.turn = [], 0

    def _user_message(self, text: str) -> dict:
        if self.turn == 0 and self.images:
            return {"role": "user", "content": [*({"type": "image", "path": p} for p in self.images),
                                                {"type": "text", "text": text}]}
        return {"role": "user", "content": text}

    def prompt(self) -> Prompt:
        """The conversation so far as one prompt (`Policy.encode`: the chat template, images, tools), or in a raw
        style the last user turn's text alone."""
        record = {"prompt": self.messages[-1]["content"] if self.raw else self.messages}
        style = self.style if self.raw else PromptStyle(chat=True, system_prompt=self.style.system_prompt)
        return self.policy.encode([record], agent=self.agent, style=style, where=lambda i: f"turn {self.turn + 1}")[0]

    def reply(self, text: str) -> list[dict]:
        """Adds the user's turn, samples, and returns the new messages (the assistant's, and tool results); see the
        module docstring for what a turn the context cannot hold does."""
        before = len(self.messages)
        try:
            return self._reply(text)
        except ValueError:
            del self.messages[before:]
            raise

    def _reply(self, text: str) -> list[dict]:
        self.messages.append(self._user_message(text))
        prompt = self.prompt()
        if len(prompt.ids) >= self.policy.context:
            raise ValueError(f"the {'line' if self.raw else 'conversation'} has {len(prompt.ids)} tokens; the model's "
                             f"context holds {self.policy.context}")
        params = dataclasses.replace(self.params, max_new_tokens=self.policy.budget_for([prompt.ids],
                                                                                       self.params.max_new_tokens))
        out = self.policy.sample([prompt], params, agent=self.agent)
        if out.trajectories is None:
            new = [{"role": "assistant", "content": out[0].text}]
        else:
            first = self.agent.appender.prompt_messages(self.agent.first_messages(prompt.record))
            new = out.trajectories[0].messages[len(first):]
            out.close()
        self.messages.extend(new)
        self.turn += 1
        return new
