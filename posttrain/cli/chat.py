"""`posttrain chat MODEL`: a multi-turn conversation with a model through its chat template, or raw prompts for a
model trained on raw prompts.

Each user turn is read from the terminal (`> ` prompt; `/reset` starts over, `/exit` or end of input leaves) or,
when stdin is not a terminal, one turn per non-empty line of stdin (`echo "What is 2+3?" | posttrain chat MODEL`).
The reply is printed to stdout. With `--tools` the model may call tools within a turn (the same multi-turn rollout
as `posttrain rl` and `eval`: calls parsed in `--tool-format`, run under the tool limits); calls and results are
printed to stderr. `--image FILE` (repeatable) attaches images to the first user turn (a vision-language
checkpoint). A model is prompted as it was trained to be (the prompt format its export records,
`posttrain.models.prompt_format`; the chat template for a checkpoint that records none): a model trained on raw
prompts (`posttrain demo`'s) gets each line as its raw prompt, answered on its own, as `generate` and `eval` prompt
it; `--chat` / `--no-chat` and `--system-prompt` override it. The conversation is
`posttrain.rollout.chat.Conversation` over a `Policy`.
"""

from __future__ import annotations

import argparse
import sys

from posttrain.cli.agent_args import add_agent_arguments, options
from posttrain.cli.model_arg import add_model_argument, add_prompt_style_arguments


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


def _show(new: list[dict]) -> None:
    """The reply on stdout; tool calls and results (every message before the last) on stderr."""
    for m in new[:-1]:
        print(f"[{m['role']}] {m['content']}", file=sys.stderr, flush=True)
    print(new[-1]["content"] if new else "", flush=True)


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def conversation(args):
    """The `Conversation` the flags ask for, and its agent (None without tools); a bad tool reference fails before
    the model loads."""
    from posttrain.rollout.chat import Conversation
    from posttrain.rollout.config import AgentOptions
    from posttrain.rollout.policy import Policy
    from posttrain.sampling import SamplingParams

    agent_options = options(AgentOptions, args)
    checked = agent_options.check_agent()
    policy = Policy.open(args.model, dtype=args.dtype, max_slots=1, chat=args.chat, system_prompt=args.system_prompt,
                         default_chat=True)  # the flags, else the export's prompt format, else the chat template
    agent = agent_options.make_agent(checked, policy.tokenizer, system_prompt=policy.style.system_prompt)
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                            n=1, seed=args.seed)
    return Conversation(policy, params, style=policy.style, images=args.image, agent=agent), agent


def _banner(args, chat) -> str:
    """The first line on stderr: the model, its tools, how it is prompted, the commands."""
    system = chat.style.system_prompt
    how = ("raw prompts: each line is answered on its own" if chat.raw
           else "chat template" + (f", system prompt {system!r}" if system else ""))
    return (f"posttrain chat: {args.model} ({'tools: ' + args.tools if args.tools else 'no tools'}); {how}; "
            "/reset starts over, /exit leaves")


def _turn(chat, line: str) -> None:
    """One user line: a command, or a turn answered (a turn that fails, e.g. past the context, is said and skipped)."""
    if line.strip() == "/reset":
        chat.reset()
        _say("reset: a new conversation starts")
        return
    try:
        _show(chat.reply(line))
    except ValueError as e:  # this turn only (e.g. the conversation outgrew the context): say it, go on
        _say(f"error: turn {chat.turn + 1}: {e}" + ("" if chat.raw else " (/reset starts over)"))


def run(args) -> int:
    chat, agent = conversation(args)
    _say(_banner(args, chat))
    try:
        for line in user_turns():
            if line.strip() == "/exit":
                break
            _turn(chat, line)
    finally:
        if agent is not None:
            agent.close()
    return 0
