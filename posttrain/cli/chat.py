"""`posttrain chat MODEL`: a multi-turn conversation with a model through its chat template, or raw prompts for a
model trained on raw prompts.

Each user turn is read from the terminal (`> ` prompt; `/reset` starts over, `/exit` or end of input leaves) or,
when stdin is not a terminal, one turn per non-empty line of stdin (`echo "What is 2+3?" | posttrain chat MODEL`).
The reply is printed to stdout. With `--tools` the model may call tools within a turn (the same multi-turn rollout
as `posttrain rl` and `eval`: calls parsed in `--tool-format`, run under the tool limits); calls and results are
printed to stderr. `--image FILE` (repeatable) attaches images to the first user turn (a vision-language
checkpoint). The conversation is rendered from its messages at each turn (inference: no training data is made
here). A model is prompted as it was trained to be (the prompt format its export records,
`posttrain.models.prompt_format`; the chat template for a checkpoint that records none): a model trained on raw prompts
(`posttrain demo`'s) gets each line as its raw prompt, answered on its own, as `generate` and `eval` prompt it;
`--chat` / `--no-chat` and `--system-prompt` override it.
"""

from __future__ import annotations

import argparse
import sys

from posttrain.cli.agent_args import add_agent_arguments, check_agent, make_agent
from posttrain.cli.model_arg import add_model_argument, add_prompt_style_arguments, load_model


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_argument(p, positional=True)
    add_prompt_style_arguments(p, default_chat=True)
    p.add_argument("--image", action="append", default=[], metavar="FILE",
                   help="an image for the first user turn (repeatable; vision-language models)")
    p.add_argument("--max-new-tokens", type=int, default=512, help="tokens per reply at most")
    p.add_argument("--temperature", type=float, default=0.7, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    add_agent_arguments(p)


def user_turns(stream=None):
    """The user's turns: lines typed at the terminal (with a prompt) or the non-empty lines of piped stdin."""
    stream = stream or sys.stdin
    if stream.isatty():
        while True:
            try:
                line = input("> ")
            except EOFError:
                return
            if line.strip():
                yield line
        return
    for line in stream:
        if line.strip():
            yield line.rstrip("\n")


class Chat:
    """One conversation: its messages (the user's view: no tools section), the sampler, the optional agent, and the
    prompt style (`style`, default: the chat template with `args.system_prompt`). A raw style (no tools, no images)
    prompts with the last user turn's text alone: a model trained on raw prompts knows no conversation."""

    def __init__(self, folder, tokenizer, model, args, agent=None, style=None):
        from posttrain.rollout.prompts import PromptStyle
        from posttrain.sampling import Sampler, SamplingParams

        self.folder, self.tok, self.agent = folder, tokenizer, agent
        self.style = style or PromptStyle(chat=True, system_prompt=args.system_prompt)
        self.images = list(args.image)
        self.raw = not self.style.chat and agent is None and not self.images
        self.params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                                     top_p=args.top_p, n=1, seed=args.seed)
        self.sampler = Sampler(model, tokenizer, max_slots=1)
        self.messages: list[dict] = []
        self.turn = 0

    def reset(self) -> None:
        self.messages, self.turn = [], 0

    def _user_message(self, text: str) -> dict:
        if self.turn == 0 and self.images:
            return {"role": "user", "content": [*({"type": "image", "path": p} for p in self.images),
                                                {"type": "text", "text": text}]}
        return {"role": "user", "content": text}

    def _encode(self):
        """The conversation as one prompt (`posttrain.rollout.prompts`: the chat template, images, tools)."""
        from posttrain.data.vlm import VisionSpec
        from posttrain.rollout.prompts import PromptStyle, encode_prompts

        vision = VisionSpec.from_checkpoint(self.folder, self.tok) if self.images and self.folder.is_dir() else None
        record = {"prompt": self.messages[-1]["content"] if self.raw else self.messages}
        style = self.style if self.raw else PromptStyle(chat=True, system_prompt=self.style.system_prompt)
        return record, encode_prompts([record], self.tok, style, agent=self.agent, vision=vision,
                                      where=lambda i: f"turn {self.turn + 1}")[0]

    def reply(self, text: str) -> list[dict]:
        """Adds the user's turn, generates, and returns the new messages (the assistant's, and tool results). The
        reply is cut to the room the model's context leaves; a turn that cannot be answered (a conversation longer
        than the context) raises ValueError and leaves the conversation as it was."""
        before = len(self.messages)
        try:
            return self._reply(text)
        except ValueError:
            del self.messages[before:]
            raise

    def _reply(self, text: str) -> list[dict]:
        import dataclasses

        from posttrain.agent.rollout import AgentRollout

        self.messages.append(self._user_message(text))
        record, prompt = self._encode()
        images = [prompt.images] if prompt.images else None
        if len(prompt.ids) >= self.sampler.context:
            raise ValueError(f"the {'line' if self.raw else 'conversation'} has {len(prompt.ids)} tokens; the model's "
                             f"context holds {self.sampler.context}")
        params = dataclasses.replace(self.params, max_new_tokens=self.sampler.budget_for([prompt.ids],
                                                                                        self.params.max_new_tokens))
        if self.agent is None:
            c = self.sampler.generate([prompt.ids], params, images=images)[0]
            new = [{"role": "assistant", "content": c.text}]
        else:
            rollout = AgentRollout(self.agent, [record], [prompt.ids])
            c = self.sampler.generate([prompt.ids], params, images=images, on_turn_end=rollout)[0]
            first = self.agent.appender.prompt_messages(self.agent.first_messages(record))
            new = rollout.finished(c).messages[len(first):]
        self.messages.extend(new)
        self.turn += 1
        return new


def _show(new: list[dict]) -> None:
    """The reply on stdout; tool calls and results (every message before the last) on stderr."""
    for m in new[:-1]:
        print(f"[{m['role']}] {m['content']}", file=sys.stderr, flush=True)
    print(new[-1]["content"] if new else "", flush=True)


def _banner(args, chat: Chat) -> str:
    """The first line on stderr: the model, its tools, how it is prompted, the commands."""
    system = chat.style.system_prompt
    how = ("raw prompts: each line is answered on its own" if chat.raw
           else "chat template" + (f", system prompt {system!r}" if system else ""))
    return (f"posttrain chat: {args.model} ({'tools: ' + args.tools if args.tools else 'no tools'}); {how}; "
            "/reset starts over, /exit leaves")


def run(args) -> int:
    from posttrain.models.prompt_format import prompt_style

    checked = check_agent(args)  # a bad tool reference fails before the model loads
    folder, tokenizer, model = load_model(args.model, args.dtype)
    style = prompt_style(folder, args.chat, args.system_prompt, default_chat=True)  # flags, else the export's
    agent = make_agent(checked, tokenizer, system_prompt=style.system_prompt)
    chat = Chat(folder, tokenizer, model, args, agent, style)
    print(_banner(args, chat), file=sys.stderr, flush=True)
    try:
        for line in user_turns():
            if line.strip() == "/exit":
                break
            if line.strip() == "/reset":
                chat.reset()
                print("reset: a new conversation starts", file=sys.stderr, flush=True)
                continue
            try:
                _show(chat.reply(line))
            except ValueError as e:  # this turn only (e.g. the conversation outgrew the context): say it, go on
                hint = "" if chat.raw else " (/reset starts over)"
                print(f"error: turn {chat.turn + 1}: {e}{hint}", file=sys.stderr, flush=True)
    finally:
        if agent is not None:
            agent.close()
    return 0
