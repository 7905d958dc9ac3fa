"""The checkpoints a server answers for: each a `Policy` (`posttrain.rollout.policy`: the model spec resolved once,
the tokenizer, the prompt encoder with the model's prompt format and vision spec, the sampler), and what the API
needs of it beyond that: conversations with tools.

`ServedModel.open(spec)` is `Policy.open(spec)` for any spec the CLI takes (`tiny:`, `pypi:`, GGUF, an HF folder, a
run's output folder, a PEFT LoRA adapter folder), prompted as the checkpoint was trained (the prompt format its export
records, `posttrain.models.prompt_format`; the server's `--chat/--no-chat` and `--system-prompt` override it, the
chat template otherwise). A conversation without tools goes through the policy's encoder, as `chat`, `generate` and
`eval` prompt the model: the chat template with the trained system prompt when it has none, images for a
vision-language model; a model trained on raw prompts gets the last user message's text alone (as `posttrain chat`
prompts it). A conversation with tools, earlier tool calls or tool results, chat-template arguments or no generation
prompt goes through the tools' template support (`posttrain.tools.chat`): a template that renders `tools=`, assistant
`tool_calls` and `tool` messages gets them as they are; for one that does not, the tools become a system-prompt
section, earlier calls Hermes text and results user turns, exactly as RL rollouts and tool-use SFT render them.
"""

from __future__ import annotations

import base64
import binascii
import json

from posttrain.data.errors import DataError
from posttrain.models.prompt_format import PromptStyle
from posttrain.rollout.policy import Policy
from posttrain.serve.errors import APIError
from posttrain.tools.chat import TemplateToolSupport, normalize_tool_calls, to_template_messages

__all__ = ["ServedModel"]

RAW = PromptStyle(chat=False)


class ServedModel:
    """One served checkpoint: its `policy` (model, tokenizer, sampler, prompt encoder) and the chat rendering."""

    def __init__(self, policy: Policy):
        self.policy = policy
        self._support: dict[str, TemplateToolSupport] = {}

    @classmethod
    def open(cls, spec: str, *, dtype: str = "float32", chat: bool | None = None,
             system_prompt: str | None = None) -> ServedModel:
        """The checkpoint `spec` names; `chat`, `system_prompt`: the prompt style's flags (None: the model's)."""
        return cls(Policy.open(spec, dtype=dtype, chat=chat, system_prompt=system_prompt, default_chat=True))

    @property
    def model(self):
        return self.policy.model

    @property
    def tokenizer(self):
        return self.policy.tokenizer

    @property
    def sampler(self):
        return self.policy.sampler

    @property
    def style(self) -> PromptStyle:
        return self.policy.style

    @property
    def max_len(self) -> int:
        return self.model.cfg.max_position_embeddings

    # ------------------------------------------------------------------ text
    def encode_text(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """A text prompt's ids as `generate` encodes raw text (the tokenizer's special tokens added)."""
        if not add_special_tokens:
            return self.tokenizer.encode(text, add_special_tokens=False)
        return self._encode({"prompt": text}, RAW)

    def _encode(self, record: dict, style: PromptStyle | None = None, images: bool = False):
        try:
            prompt = self.policy.encode([record], style=style, where=lambda i: "messages")[0]
        except DataError as e:  # the prompt encoder's errors name the place already
            raise APIError(400, str(e), param="messages" if isinstance(record["prompt"], list) else "prompt") from None
        return (prompt.ids, list(prompt.images)) if images else prompt.ids

    # ------------------------------------------------------------------ chat
    def render_chat(self, messages: list, tools: list | None = None, *, add_generation_prompt: bool = True,
                    template_kwargs: dict | None = None) -> tuple[list[int], list]:
        """(prompt ids, pixel arrays) of a conversation (pydantic `ChatMessage`s or plain dicts in OpenAI's form);
        an `APIError` (400) when it cannot be rendered."""
        msgs, images = _plain_messages(messages)
        schemas = [t if isinstance(t, dict) else t.model_dump(exclude_none=True) for t in tools or []]
        if images and self.policy.encoder.vision is None:
            raise APIError(400, "this model is text-only: it cannot take image parts", param="messages")
        tool_talk = schemas or any(m.get("tool_calls") or m["role"] == "tool" for m in msgs)
        if not (tool_talk or template_kwargs or not add_generation_prompt):
            if images or self.style.chat:
                return self._encode({"prompt": msgs}, images=True)
            return self._encode({"prompt": _last_user_text(msgs)}), []
        if images:
            raise APIError(400, "tools, tool messages or template arguments together with images are not supported "
                                "by this server", param="messages")
        if self.style.system_prompt and not any(m["role"] == "system" for m in msgs):
            msgs = [{"role": "system", "content": self.style.system_prompt}, *msgs]
        support = self._tool_support(schemas, dict(template_kwargs or {}))
        try:
            rendered = to_template_messages(msgs, schemas, support)
            ids = self.tokenizer.apply_chat_template(rendered, add_generation_prompt=add_generation_prompt,
                                                     tools=schemas if support.renders_tools else None,
                                                     **dict(template_kwargs or {}))
        except Exception as e:  # noqa: BLE001 - a template that cannot render these messages: the client's input
            raise APIError(400, f"the chat template cannot render these messages: {type(e).__name__}: "
                                f"{' '.join(str(e).split())[:300]}", param="messages") from None
        return list(ids), []

    def _tool_support(self, schemas: list[dict], kwargs: dict) -> TemplateToolSupport:
        key = json.dumps([schemas, kwargs], sort_keys=True, default=str)
        support = self._support.get(key)
        if support is None:
            if len(self._support) > 64:
                self._support.clear()
            support = self._support[key] = TemplateToolSupport.probe(self.tokenizer, schemas, **kwargs)
        return support


def _last_user_text(msgs: list[dict]) -> str:
    """A raw-trained model's prompt: the last user message's text, as the model was trained to read it."""
    users = [m for m in msgs if m["role"] == "user"]
    if not users:
        raise APIError(400, "this model was trained on raw prompts: the conversation needs a user message, whose "
                            "text is the prompt", param="messages")
    return users[-1]["content"] or ""


def _plain_messages(messages: list) -> tuple[list[dict], bool]:
    """OpenAI messages as the template renders them: `developer` as `system`, calls normalized (arguments as
    objects), image parts as `{"type": "image", "image": bytes}`; and whether any message holds an image."""
    out, images = [], False
    for j, m in enumerate(messages):
        m = m if isinstance(m, dict) else m.model_dump(exclude_none=True)
        role = "system" if m["role"] == "developer" else m["role"]
        msg = {"role": role, "content": m.get("content")}
        if isinstance(msg["content"], list):
            parts = [_part(p, j, k) for k, p in enumerate(msg["content"])]
            images = images or any(p["type"] == "image" for p in parts)
            msg["content"] = parts if any(p["type"] == "image" for p in parts) else \
                "".join(p["text"] for p in parts)
        if m.get("tool_calls"):
            try:
                msg["tool_calls"] = normalize_tool_calls(m["tool_calls"], f"messages.{j}")
            except ValueError as e:
                raise APIError(400, str(e), param=f"messages.{j}.tool_calls") from None
        for key in ("name", "tool_call_id"):
            if m.get(key) is not None:
                msg[key] = m[key]
        out.append(msg)
    return out, images


def _part(p: dict, j: int, k: int) -> dict:
    if p["type"] == "text":
        return {"type": "text", "text": p["text"]}
    url = p["image_url"]["url"]
    where = f"messages.{j}.content.{k}.image_url.url"
    if not url.startswith("data:") or ";base64," not in url:
        raise APIError(400, "image parts must be data: URLs (data:image/png;base64,...): this server fetches no "
                            "URLs", param=where)
    try:
        data = base64.b64decode(url.split(";base64,", 1)[1], validate=True)
    except (binascii.Error, ValueError):
        raise APIError(400, "the image's data: URL is not valid base64", param=where) from None
    return {"type": "image", "image": data}
