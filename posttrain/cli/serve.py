"""`posttrain serve MODEL`: an OpenAI-compatible HTTP server (completions, chat with tools and images, streaming,
token endpoints, Prometheus metrics) on posttrain's own sampler, every client's requests batched together; with
`--tinker`, the Tinker training API under /api/v1 as well (the `tinker` SDK trains LoRA adapters over MODEL).
SIGTERM (or Ctrl-C) finishes the requests in flight, then exits."""

from __future__ import annotations

import argparse
import os

from posttrain.cli.model_arg import add_model_argument, add_prompt_style_arguments


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_argument(p, positional=True)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    p.add_argument("--port", type=int, default=8000, help="port (0: any free port; the start-up line says which)")
    p.add_argument("--api-key", default=os.environ.get("POSTTRAIN_API_KEY"),
                   help="require `Authorization: Bearer KEY` (default: $POSTTRAIN_API_KEY; none: open)")
    p.add_argument("--served-model-name", default=None, help="the model name clients use (default: MODEL as given)")
    p.add_argument("--lora", action="append", default=[], metavar="NAME=PATH",
                   help="serve an adapter over the base as model NAME: a LoRA run's output folder or a PEFT adapter "
                        "folder (repeatable)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="context of every request, prompt and completion (default: the model's)")
    p.add_argument("--max-slots", type=int, default=16, help="sequences decoded at once (per model)")
    p.add_argument("--max-queue", type=int, default=256, help="sequences waiting for a slot before 429s")
    p.add_argument("--segment-steps", type=int, default=16,
                   help="decode steps between looks at the queue (smaller: tokens stream out sooner)")
    p.add_argument("--tool-format", default="hermes", choices=["hermes", "llama3", "mistral"],
                   help="how the model writes tool calls (read into message.tool_calls)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    add_prompt_style_arguments(p, default_chat=True)
    p.add_argument("--no-warmup", action="store_true", help="do not compile the common programs before listening")
    p.add_argument("--tinker", action="store_true",
                   help="serve the Tinker training API under /api/v1 too (the `tinker` SDK: pip install -e '.[tinker]'; "
                        "its api_key must start with tml-)")
    p.add_argument("--tinker-checkpoints", default="tinker-checkpoints", metavar="DIR",
                   help="folder of the Tinker API's tinker:// checkpoints (save_state, save_weights_for_sampler)")


def run(args) -> int:
    from posttrain.config import ConfigError
    from posttrain.serve import ServeConfig, serve

    loras = []
    for item in args.lora:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise ConfigError(f"--lora {item!r}: expected NAME=PATH (a LoRA run's output folder or a PEFT "
                              "adapter folder)")
        loras.append((name, path))
    try:
        config = ServeConfig(model=args.model, served_model_name=args.served_model_name, host=args.host,
                             port=args.port, api_key=args.api_key or None, loras=tuple(loras),
                             max_model_len=args.max_model_len, max_slots=args.max_slots, max_queue=args.max_queue,
                             segment_steps=args.segment_steps, dtype=args.dtype, tool_format=args.tool_format,
                             warmup=not args.no_warmup, chat=args.chat, system_prompt=args.system_prompt,
                             tinker=args.tinker, tinker_checkpoints=args.tinker_checkpoints)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    return serve(config)
