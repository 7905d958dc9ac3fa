"""`posttrain generate`: completions for a JSONL file of prompts (`prompt` text or chat `messages`) as JSON lines, to a
file or to standard output (`--output -`, the default).

Text prompts are rendered as the model was trained to be prompted (the prompt format its export records:
`posttrain.models.prompt_format`; raw text for a checkpoint that records none); `--chat` / `--no-chat` and
`--system-prompt` override it.

With `--tools` or `--environment` each sample is a multi-turn conversation (`posttrain.agent`): the output
line then holds the whole trajectory (messages, tool calls and results, turns, the token ids after the prompt
with their `loss_mask`: 1 where sampled, 0 where appended) and `text` is the last assistant message.
The model is sharded over every device (of every process: on several hosts every process runs the same sampler
on the global mesh and gets every completion, and process 0 writes the file)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
from pathlib import Path

from posttrain.cli.agent_args import add_agent_arguments, check_agent, make_agent
from posttrain.cli.model_arg import add_model_argument, add_prompt_style_arguments, fitted_budget, model_folder


class InputError(ValueError):
    """A prompts file that cannot be used as given (the message names the file and line)."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_argument(p)
    p.add_argument("--prompts", required=True,
                   help="JSONL input: one object per line with `prompt` or `messages` (`-`: read standard input)")
    p.add_argument("--output", default="-", help="JSONL output: one line per completion (`-`, the default: standard "
                                                 "output)")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--n", type=int, default=1, help="samples per prompt")
    p.add_argument("--seed", type=int, default=0)
    add_prompt_style_arguments(p, default_chat=False)  # a `messages` prompt always goes through the template
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--max-slots", type=int, default=32, help="sequences decoded at once (at most)")
    p.add_argument("--max-len", type=int, default=None, help="KV cache length (default: fitted to the prompts)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_agent_arguments(p)


def read_prompts(path: str | Path) -> list[dict]:
    """Parsed lines of a prompts file, or of standard input for `-` (blank lines skipped); errors name the file
    (`<stdin>`) and line number."""
    if str(path) == "-":
        return _parse_lines(sys.stdin, "<stdin>")
    path = Path(path)
    if not path.is_file():
        raise InputError(f"prompts file {path} does not exist")
    with path.open(encoding="utf-8") as f:
        return _parse_lines(f, path)


def _parse_lines(lines, path) -> list[dict]:
    """The records of JSONL `lines` from `path` (named in errors), each with its `_line`."""
    from posttrain.data.sources import json_error_column

    records = []
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise InputError(f"{path}, line {lineno}: not valid JSON ({e.msg}, column {json_error_column(line, e)})"
                             ) from None
        if not isinstance(rec, dict):
            raise InputError(f"{path}, line {lineno}: expected a JSON object, got {type(rec).__name__}")
        if "messages" in rec:
            msgs = rec["messages"]
            if not isinstance(msgs, list) or not all(isinstance(m, dict) and "role" in m and "content" in m
                                                     for m in msgs):
                raise InputError(f"{path}, line {lineno}: `messages` must be a list of {{role, content}} objects")
        elif "prompt" in rec:
            if not isinstance(rec["prompt"], str):
                raise InputError(f"{path}, line {lineno}: `prompt` must be a string")
        else:
            raise InputError(f"{path}, line {lineno}: has neither a `prompt` (text) nor a `messages` (chat) field")
        rec["_line"] = lineno
        records.append(rec)
    if not records:
        raise InputError(f"prompts file {path} has no prompts")
    return records


def encode_records(records: list[dict], tokenizer, folder, style, source: str, agent=None):
    """`(records with the prompt under "prompt", their encoded PromptSet)`: text or chat messages, images for a
    vision-language checkpoint, or an agent's first messages (`posttrain.rollout.prompts`); errors name the line."""
    # lazy: image decoding and the vision spec load only for prompts that carry images
    from posttrain.data.vlm import VisionSpec, has_images
    from posttrain.rollout.prompts import encode_prompts

    records = [{**{k: v for k, v in r.items() if k != "messages"}, "prompt": r.get("messages", r.get("prompt"))}
               for r in records]
    images = agent is None and any(has_images(r, ("prompt",)) for r in records)
    vision = VisionSpec.from_checkpoint(folder, tokenizer) if images and Path(folder).is_dir() else None
    prompts = encode_prompts(records, tokenizer, style, agent=agent, vision=vision,
                             where=lambda i: f"{source}, line {records[i]['_line']}")
    return records, prompts


def write_output(path: str, completions, rollout=None) -> str:
    """One JSON line per completion (with its trajectory when `rollout`, the multi-turn driver, is given) to the file
    `path`, or to standard output for `-`; returns where they went."""
    if path == "-":
        _write_rows(sys.stdout, completions, rollout)
        sys.stdout.flush()
        return "standard output"
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w", encoding="utf-8") as f:
        _write_rows(f, completions, rollout)
    return str(out)


def _write_rows(f, completions, rollout) -> None:
    for c in completions:
        row = {"prompt_index": c.prompt_index, "sample_index": c.sample_index, "text": c.text,
               "token_ids": c.token_ids, "logprobs": c.logprobs, "finish_reason": c.finish_reason}
        if rollout is not None:
            traj = rollout.finished(c)
            row |= traj.summary() | {"text": traj.final_text, "loss_mask": c.mask}
        f.write(json.dumps(row, ensure_ascii=False) + "\n")


def run(args) -> int:
    def fail(msg: str) -> int:
        print(f"error: {msg}", file=sys.stderr)
        return 1

    from posttrain.agent.rollout import AgentRollout
    from posttrain import distributed
    from posttrain.sampling import Sampler, SamplingParams

    source = "<stdin>" if args.prompts == "-" else args.prompts
    try:
        params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                                top_p=args.top_p, min_p=args.min_p, n=args.n, seed=args.seed)
        records = read_prompts(args.prompts)
        checked = check_agent(args)
    except ValueError as e:
        return fail(str(e))

    from posttrain.models import tokenizer as tok_lib
    from posttrain.models import from_pretrained
    from posttrain.models.prompt_format import prompt_style

    try:
        folder = model_folder(args.model)
        tokenizer = tok_lib.load(folder)
        model = from_pretrained(folder, dtype=args.dtype, mesh=distributed.devices_mesh())
        style = prompt_style(folder, args.chat, args.system_prompt, default_chat=False)  # flags, else the export's
        agent = make_agent(checked, tokenizer, system_prompt=style.system_prompt)
        records, encoded = encode_records(records, tokenizer, folder, style, source, agent)
        prompts, images = encoded.ids, encoded.images
        slots = min(args.max_slots, 1 << (len(prompts) * params.n - 1).bit_length())  # no idle slots on small runs
        sampler = Sampler(model, tokenizer, max_slots=slots, max_len=args.max_len)
        params = dataclasses.replace(params, max_new_tokens=fitted_budget(sampler, prompts, params.max_new_tokens,
                                                                          "generate"))
    except (ValueError, FileNotFoundError) as e:
        return fail(str(e))
    try:
        rollout = None if agent is None else AgentRollout(agent, records, prompts)
        kwargs = dict(progress=not args.no_progress and distributed.is_primary(),
                      **({} if rollout is None else {"on_turn_end": rollout}))
        completions = sampler.generate(prompts, params, images=images, **kwargs)
    except ValueError as e:
        m = re.match(r"prompt (\d+) ", str(e))  # the sampler names prompts by index: name the line too
        where = f"{source}, line {records[int(m.group(1))]['_line']}: " if m else ""
        return fail(where + str(e))
    finally:
        if agent is not None:
            agent.close()
    distributed.finish()  # multi-host: every process has every completion; process 0 writes them
    if not distributed.is_primary():
        return 0
    out = write_output(args.output, completions, rollout)
    stats = sampler.last_stats
    print(f"wrote {len(completions)} completions to {out} "
          f"({stats.get('generated_tokens', 0)} tokens, {stats.get('seconds', 0.0):.1f}s)", file=sys.stderr)
    return 0
