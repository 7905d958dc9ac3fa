"""Turning one record into token ids plus a loss mask (chat messages, prompt/completion, plain text).

Shift convention (used everywhere in posttrain): `loss_mask[i] == 1` means token
`input_ids[i]` is a *target*, i.e. it is predicted from positions `< i`. The
loss is computed on predicting `input_ids[1:]` from `input_ids[:-1]` with
weights `loss_mask[1:]`; `loss_mask[0]` is therefore always 0.
"""

from __future__ import annotations

import dataclasses
import json
import weakref
from pathlib import Path
from typing import Any, Literal, Sequence

import numpy as np

from posttrain.data.sources import DataError
from posttrain.tools.chat import TemplateToolSupport, normalize_tool_calls, to_template_messages
from posttrain.data.vlm import VisionSpec, expand_image_tokens, prepare_vlm_record
from posttrain.models.prompt_format import PromptStyle, trained_style

__all__ = ["DataFormatConfig", "Example", "encode_record", "encode_records", "resolve_format",
           "chat_assistant_mask", "records_prompt_style"]


@dataclasses.dataclass
class DataFormatConfig:
    """How records are read into examples.

    format: "messages" (a chat list of {"role", "content"} under `messages_field`),
      "prompt_completion" (`prompt_field` + `completion_field`; the prompt may be a
      string or a list of chat messages), "text" (`text_field`), or "auto"
      (detected per record in that order of preference).
    messages_field: the field of a "messages" record holding its chat list (only the assistant turns get loss).
    prompt_field: the field of a "prompt_completion" record holding the prompt (no loss on it): a string, or a
      list of chat messages rendered with the chat template.
    completion_field: the field holding the completion (the loss): a string (an assistant message when the
      prompt is a message list), or a list of chat messages after a message-list prompt.
    text_field: the field of a "text" record holding the plain text, all of it trained on.
    tools_field: the optional field of a "messages" record holding the JSON schemas of the tools the
      conversation may call (a list, or a JSON string of one), as TRL's `tools` column. Assistant turns may
      carry OpenAI-style `tool_calls` (content empty) and results come as `tool` messages; they are rendered
      with the template's tool support, or as `posttrain.tools.chat` describes for templates without it.
    train_on_prompt: also put loss on non-assistant / prompt tokens.
    add_eos: append the EOS token to plain-string completions and texts (chat
      renderings end turns as the template says and get nothing appended).
    """

    format: Literal["auto", "messages", "prompt_completion", "text"] = "auto"
    messages_field: str = "messages"
    prompt_field: str = "prompt"
    completion_field: str = "completion"
    text_field: str = "text"
    tools_field: str = "tools"
    train_on_prompt: bool = False
    add_eos: bool = True


@dataclasses.dataclass
class Example:
    """One tokenised example.

    input_ids: int32[L]. loss_mask: float32[L]; loss_mask[i] = 1 means input_ids[i]
    is a target predicted from input_ids[:i] (loss on input_ids[1:] given
    input_ids[:-1], weighted by loss_mask[1:]; loss_mask[0] is always 0).
    """

    input_ids: np.ndarray
    loss_mask: np.ndarray
    images: tuple = ()  # the record's images (`posttrain.data.vlm.ImageRef`), in the order of their tokens
    image_end: int = 0  # one past the last image token: a cut before it would split an image

    def __post_init__(self):
        self.input_ids = np.asarray(self.input_ids, dtype=np.int32)
        self.loss_mask = np.asarray(self.loss_mask, dtype=np.float32)
        if self.input_ids.ndim != 1 or self.input_ids.shape != self.loss_mask.shape:
            raise ValueError(f"input_ids {self.input_ids.shape} and loss_mask {self.loss_mask.shape} "
                             "must be 1-D arrays of the same length")

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])


def _where(index: int | None, source: str | None) -> str:
    parts = []
    if source:
        parts.append(str(source))
    if index is not None:
        parts.append(f"record {index + 1}")  # 1-based, like line numbers
    return ": ".join(parts) if parts else "record"


def resolve_format(record: dict, cfg: DataFormatConfig, *, index: int | None = None,
                   source: str | None = None) -> str:
    """The concrete format of `record` ("auto" resolved from the fields present)."""
    if cfg.format != "auto":
        return cfg.format
    if cfg.messages_field in record:
        return "messages"
    if cfg.prompt_field in record and cfg.completion_field in record:
        return "prompt_completion"
    if cfg.text_field in record:
        return "text"
    raise DataError(
        f"{_where(index, source)}: cannot detect the data format: expected a field "
        f"'{cfg.messages_field}' (messages), '{cfg.prompt_field}'+'{cfg.completion_field}' "
        f"(prompt_completion) or '{cfg.text_field}' (text); fields present: {sorted(record)}")


def _field(record: dict, field: str, fmt: str, index: int | None, source: str | None) -> Any:
    if field not in record:
        raise DataError(f"{_where(index, source)}: missing field '{field}' (format '{fmt}'); "
                        f"fields present: {sorted(record)}")
    return record[field]


def check_messages(messages: Any, field: str, where: str, *, or_string: bool = False) -> list[dict]:
    """`messages` when it is a non-empty list of {role, content} objects whose assistant `tool_calls` are well
    formed (`posttrain.tools.chat.normalize_tool_calls`); else a DataError naming `where` (file and line) and the
    field. or_string: the field may also be a string (said in the message)."""
    if not isinstance(messages, list) or not messages:
        found = "an empty list" if isinstance(messages, list) else type(messages).__name__
        raise DataError(f"{where}: field '{field}' must be a non-empty list of messages"
                        f"{' or a string' if or_string else ''}, found {found}")
    for j, m in enumerate(messages):
        calls = isinstance(m, dict) and m.get("role") == "assistant" and m.get("tool_calls")
        if not isinstance(m, dict) or "role" not in m or ("content" not in m and not calls):
            raise DataError(f"{where}: field '{field}' message {j} must be an object with 'role' and 'content', "
                            f"found {m!r}")
        if calls:
            try:
                normalize_tool_calls(calls, f"{where}: message {j}")
            except ValueError as e:
                raise DataError(str(e)) from None
    return messages


def _check_messages(messages: Any, field: str, index: int | None, source: str | None) -> list[dict]:
    return check_messages(messages, field, _where(index, source))


def _common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _common_suffix_len(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[len(a) - 1 - i] == b[len(b) - 1 - i]:
        i += 1
    return i


def _turn_end_from_content(tokenizer, messages: Sequence[dict], j: int, full: list[int],
                           prefix: list[int], **template_kwargs) -> int | None:
    """End of turn j in `full` for a template that renders turn j differently when it is the last message
    (Qwen3 shows an answer's reasoning only after the last user turn): the end of its content in `full`
    (where a rendering with one character appended to that content stops agreeing with `full`, counted
    from the back) plus the turn's closing tokens (what follows the content when it is rendered last)."""
    content = messages[j].get("content")
    if not isinstance(content, str):
        return None
    mark = "~" if content.endswith("#") else "#"
    probe = dict(messages[j], content=content + mark)
    full_probe = tokenizer.apply_chat_template([*messages[:j], probe, *messages[j + 1:]],
                                               add_generation_prompt=False, tokenize=True, **template_kwargs)
    prefix_probe = tokenizer.apply_chat_template([*messages[:j], probe], add_generation_prompt=False,
                                                 tokenize=True, **template_kwargs)
    closing = _common_suffix_len(prefix, prefix_probe)
    return len(full) - _common_suffix_len(full, full_probe) + closing


def chat_assistant_mask(tokenizer, messages: Sequence[dict], *,
                        train_roles: Sequence[str] = ("assistant",),
                        trainable: Sequence[bool] | None = None,
                        **template_kwargs) -> tuple[list[int], list[float]]:
    """Render `messages` with the chat template; mask = 1 on tokens of trainable turns.

    A message is trainable when its role is in `train_roles` (and, if given,
    `trainable[j]` is true). Spans are found template-agnostically: turn j covers
    the tokens between the common prefix of the full rendering with
    render(messages[:j], add_generation_prompt=True) (so the assistant header is
    not a target) and the common prefix with render(messages[:j+1]). Where render(messages[:j+1]) is not a
    prefix of the full rendering (the template renders a last turn differently), a trained turn ends where
    its content ends in the full rendering, plus its closing tokens. `template_kwargs` go to every rendering
    (e.g. `tools=`).
    """
    full = tokenizer.apply_chat_template(messages, add_generation_prompt=False, tokenize=True, **template_kwargs)
    mask = [0.0] * len(full)
    prev_end = 0
    for j, msg in enumerate(messages):
        train = msg["role"] in train_roles and (trainable is None or trainable[j])
        try:
            prefix = tokenizer.apply_chat_template(messages[: j + 1], add_generation_prompt=False, tokenize=True,
                                                   **template_kwargs)
        except Exception:  # noqa: BLE001 - e.g. Llama 3.1 with tools refuses a system turn alone: not a target
            if train:
                raise
            continue
        end = _common_prefix_len(full, prefix)
        if j == len(messages) - 1:
            end = len(full)
        elif train and end < len(prefix):
            end = max(end, _turn_end_from_content(tokenizer, messages, j, full, prefix, **template_kwargs) or end)
        if train:
            start = prev_end
            if j > 0:
                try:
                    header = tokenizer.apply_chat_template(
                        messages[:j], add_generation_prompt=True, tokenize=True, **template_kwargs)
                    start = max(prev_end, min(end, _common_prefix_len(full, header)))
                except Exception:  # noqa: BLE001 - templates that refuse this prefix: no header skip
                    start = prev_end
            for t in range(start, end):
                mask[t] = 1.0
        prev_end = max(prev_end, end)
    return list(full), mask


_SUPPORT: "weakref.WeakKeyDictionary[Any, dict[str, TemplateToolSupport]]" = weakref.WeakKeyDictionary()


def _tool_schemas(tools: Any, where: str) -> list[dict]:
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError as e:
            raise DataError(f"{where}: field 'tools' is not JSON ({e.msg})") from None
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise DataError(f"{where}: field 'tools' must be a list of JSON schemas, found {type(tools).__name__}")
    return tools


def _encode_messages(tokenizer, messages: list[dict], tools: Any, where: str) -> tuple[list[int], list[float]]:
    """Assistant-masked ids of a conversation; tool calls, tool results and tool schemas rendered with the
    template's tool support or rewritten for what it lacks (`posttrain.tools.chat`)."""
    schemas = _tool_schemas(tools, where) if tools is not None else []
    if not schemas and not any(m.get("tool_calls") or m["role"] == "tool" for m in messages):
        return chat_assistant_mask(tokenizer, messages)
    known = _SUPPORT.setdefault(tokenizer, {})  # what each tokenizer's template renders, per tool set
    key = json.dumps(schemas, sort_keys=True)
    if key not in known:
        known[key] = TemplateToolSupport.probe(tokenizer, schemas)
    support = known[key]
    try:
        messages = [dict(m, tool_calls=normalize_tool_calls(m["tool_calls"], f"{where}: message {j}"))
                    if m.get("tool_calls") else m for j, m in enumerate(messages)]
    except ValueError as e:
        raise DataError(str(e)) from None
    kwargs = {"tools": schemas} if support.renders_tools else {}
    return chat_assistant_mask(tokenizer, to_template_messages(messages, schemas, support), **kwargs)


def encode_record(record: dict, tokenizer, cfg: DataFormatConfig | None = None, *,
                  index: int | None = None, source: str | None = None, vision: VisionSpec | None = None,
                  base_dir: str | None = None) -> Example:
    """Tokenise one record into an `Example` according to `cfg` (see module doc for the mask).

    Records with images (TRL's VLM format, `posttrain.data.vlm`) need `vision`, the model's `VisionSpec`
    (None: a text-only model, and such a record is an error); relative image paths start at `base_dir`.
    """
    cfg = cfg or DataFormatConfig()
    fmt = resolve_format(record, cfg, index=index, source=source)
    fields = {"messages": (cfg.messages_field,), "prompt_completion": (cfg.prompt_field, cfg.completion_field)}
    record, images = prepare_vlm_record(record, vision, where=_where(index, source), base_dir=base_dir,
                                        fields=fields.get(fmt, ()))
    eos = tokenizer.eos_token_id

    if fmt == "messages":
        messages = _check_messages(_field(record, cfg.messages_field, fmt, index, source),
                                   cfg.messages_field, index, source)
        ids, mask = _encode_messages(tokenizer, messages, record.get(cfg.tools_field), _where(index, source))
        if cfg.train_on_prompt:
            mask = [1.0] * len(ids)

    elif fmt == "prompt_completion":
        prompt = _field(record, cfg.prompt_field, fmt, index, source)
        completion = _field(record, cfg.completion_field, fmt, index, source)
        if isinstance(prompt, list):
            prompt_msgs = _check_messages(prompt, cfg.prompt_field, index, source)
            if isinstance(completion, str):
                completion_msgs = [{"role": "assistant", "content": completion}]
            else:
                completion_msgs = _check_messages(completion, cfg.completion_field, index, source)
            messages = prompt_msgs + completion_msgs
            trainable = [False] * len(prompt_msgs) + [True] * len(completion_msgs)
            ids, mask = chat_assistant_mask(tokenizer, messages, trainable=trainable)
            if cfg.train_on_prompt:
                mask = [1.0] * len(ids)
        elif isinstance(prompt, str):
            if not isinstance(completion, str):
                raise DataError(f"{_where(index, source)}: field '{cfg.completion_field}' must be a string "
                                f"when '{cfg.prompt_field}' is a string, found {type(completion).__name__}")
            p_ids = tokenizer.encode(prompt, add_special_tokens=True)
            c_ids = tokenizer.encode(completion, add_special_tokens=False)
            if cfg.add_eos and eos is not None:
                c_ids = c_ids + [eos]
            ids = p_ids + c_ids
            mask = [1.0 if cfg.train_on_prompt else 0.0] * len(p_ids) + [1.0] * len(c_ids)
        else:
            raise DataError(f"{_where(index, source)}: field '{cfg.prompt_field}' must be a string or a "
                            f"list of messages, found {type(prompt).__name__}")

    elif fmt == "text":
        text = _field(record, cfg.text_field, fmt, index, source)
        if not isinstance(text, str):
            raise DataError(f"{_where(index, source)}: field '{cfg.text_field}' must be a string, "
                            f"found {type(text).__name__}")
        ids = tokenizer.encode(text, add_special_tokens=True)
        if cfg.add_eos and eos is not None and (not ids or ids[-1] != eos):
            ids = ids + [eos]
        mask = [1.0] * len(ids)
    else:
        raise DataError(f"unknown data format {fmt!r}")

    if not ids:
        raise DataError(f"{_where(index, source)}: encodes to zero tokens")
    mask = list(mask)
    mask[0] = 0.0  # nothing predicts the first token
    if vision is None:
        return Example(np.asarray(ids, np.int32), np.asarray(mask, np.float32))
    ids, mask = expand_image_tokens(ids, mask, vision, len(images), where=_where(index, source))
    end = int(np.flatnonzero(ids == vision.eoi_id)[-1]) + 1 if images else 0
    return Example(ids, mask, images=tuple(images), image_end=end)


def encode_records(records: Sequence[dict], tokenizer, cfg: DataFormatConfig | None = None, *,
                   source: str | None = None, vision: VisionSpec | None = None) -> list[Example]:
    """`encode_record` over a list (errors name the record index and `source`; relative image paths start
    at the data file's folder)."""
    where = getattr(records, "where", None)  # records read from a file know their line
    src = getattr(records, "source", None) or source
    base = str(Path(src).parent) if src and Path(src).is_file() else None
    kw = {"vision": vision, "base_dir": base}
    if where is not None and getattr(records, "lines", None) is not None:
        return [encode_record(r, tokenizer, cfg, source=where(i), **kw) for i, r in enumerate(records)]
    return [encode_record(r, tokenizer, cfg, index=i, source=source, **kw) for i, r in enumerate(records)]


def records_prompt_style(records: Sequence[dict], cfg: DataFormatConfig | None = None) -> PromptStyle:
    """How SFT `records` prompt the model they train (`posttrain.models.prompt_format.trained_style`): through the
    chat template for `messages` and message-list prompts, raw text for text prompts and plain texts."""
    cfg = cfg or DataFormatConfig()

    def prompt(record: dict):
        try:
            fmt = resolve_format(record, cfg)
        except DataError:
            return None
        field = {"messages": cfg.messages_field, "prompt_completion": cfg.prompt_field}.get(fmt)
        return record.get(field) if field else None

    return trained_style(prompt(r) for r in records)
