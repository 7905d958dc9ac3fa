"""The checkpoints a server answers for: a base model opened once, and its tokenizer's two jobs, text prompts and
chat conversations (chat template, tools, images) to token ids.

`ServedModel.open(spec)` resolves any model spec the CLI takes (`tiny:`, `pypi:`, GGUF, an HF folder, a run's
output folder: `posttrain.models.spec`) and builds the `Sampler` the engine runs. How a conversation becomes a prompt
follows the model's prompt format (`posttrain.models.prompt_format`: what it was trained with, recorded in its
export, unless the server's flags say otherwise): through the chat template (with the trained system prompt when the
conversation has none), or, for a model trained on raw prompts, the last user message's text alone (as `posttrain
chat` prompts it; tools and images always take the template). Chat rendering goes through the tools' template support
(`posttrain.tools.chat`): a template that renders `tools=`, assistant `tool_calls` and `tool` messages gets them as
they are; for one that does not, the tools become a system-prompt section, earlier calls Hermes text and results
user turns, exactly as RL rollouts and tool-use SFT render them. Image parts (`data:` URLs) go through the
vision-language prompt encoder (`posttrain.data.vlm`).
"""

from __future__ import annotations

import base64
import binascii
import json
from pathlib import Path

from posttrain import distributed
from posttrain.data.errors import DataError
from posttrain.data.vlm import VisionSpec, encode_image_prompt
from posttrain.models import from_pretrained
from posttrain.models import tokenizer as tok_lib
from posttrain.models.prompt_format import PromptStyle, prompt_style
from posttrain.models.spec import resolve_checkpoint
from posttrain.sampling import Sampler
from posttrain.serve.errors import APIError
from posttrain.tools.chat import TemplateToolSupport, normalize_tool_calls, to_template_messages

__all__ = ["ServedModel"]


class ServedModel:
    """One checkpoint: its folder, tokenizer, model, sampler, vision spec (None for a text-only model) and the prompt
    style conversations are rendered with."""

    def __init__(self, folder: Path, tokenizer, model, sampler: Sampler, vision: VisionSpec | None = None,
                 style: PromptStyle = PromptStyle()):
        self.folder, self.tokenizer, self.model, self.sampler, self.vision = folder, tokenizer, model, sampler, vision
        self.style = style
        self._support: dict[str, TemplateToolSupport] = {}

    @classmethod
    def open(cls, spec: str, *, dtype: str = "float32", chat: bool | None = None,
             system_prompt: str | None = None) -> ServedModel:
        """The checkpoint `spec` names; `chat`, `system_prompt`: the prompt style's flags (None: the model's)."""
        folder = resolve_checkpoint(spec)
        tokenizer = tok_lib.load(folder)
        model = from_pretrained(folder, dtype=dtype, mesh=distributed.devices_mesh())
        vision = VisionSpec.from_checkpoint(folder, tokenizer) if folder.is_dir() and model.cfg.vision else None
        style = prompt_style(folder if folder.is_dir() else None, chat, system_prompt, default_chat=True)
        return cls(folder, tokenizer, model, Sampler(model, tokenizer), vision, style)

    @property
    def max_len(self) -> int:
        return self.model.cfg.max_position_embeddings

    # ------------------------------------------------------------------ text
    def encode_text(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    # ------------------------------------------------------------------ chat
    def render_chat(self, messages: list, tools: list | None = None, *, add_generation_prompt: bool = True,
                    template_kwargs: dict | None = None) -> tuple[list[int], list]:
        """(prompt ids, pixel arrays) of a conversation (pydantic `ChatMessage`s or plain dicts in OpenAI's form);
        an `APIError` (400) when it cannot be rendered."""
        msgs, images = _plain_messages(messages)
        schemas = [t if isinstance(t, dict) else t.model_dump(exclude_none=True) for t in tools or []]
        kwargs = dict(template_kwargs or {})
        if not self.style.chat and not schemas and not images:
            return self._raw_prompt(msgs), []
        if self.style.system_prompt and not any(m["role"] == "system" for m in msgs):
            msgs = [{"role": "system", "content": self.style.system_prompt}, *msgs]
        if images:
            if self.vision is None:
                raise APIError(400, "this model is text-only: it cannot take image parts", param="messages")
            if schemas:
                raise APIError(400, "tools together with images are not supported by this server", param="tools")
            try:
                ids, pixels = encode_image_prompt(msgs, self.tokenizer, self.vision, "messages")
            except DataError as e:
                raise APIError(400, str(e), param="messages") from None
            return ids, list(pixels)
        support = self._tool_support(schemas, kwargs)
        try:
            rendered = to_template_messages(msgs, schemas, support)
            ids = self.tokenizer.apply_chat_template(rendered, add_generation_prompt=add_generation_prompt,
                                                     tools=schemas if support.renders_tools else None, **kwargs)
        except Exception as e:  # noqa: BLE001 - a template that cannot render these messages: the client's input
            raise APIError(400, f"the chat template cannot render these messages: {type(e).__name__}: "
                                f"{' '.join(str(e).split())[:300]}", param="messages") from None
        return list(ids), []

    def _raw_prompt(self, msgs: list[dict]) -> list[int]:
        """A raw-trained model's prompt: the last user message's text, as the model was trained to read it."""
        users = [m for m in msgs if m["role"] == "user"]
        if not users:
            raise APIError(400, "this model was trained on raw prompts: the conversation needs a user message, whose "
                                "text is the prompt", param="messages")
        return self.encode_text(users[-1]["content"] or "")

    def _tool_support(self, schemas: list[dict], kwargs: dict) -> TemplateToolSupport:
        key = json.dumps([schemas, kwargs], sort_keys=True, default=str)
        support = self._support.get(key)
        if support is None:
            if len(self._support) > 64:
                self._support.clear()
            support = self._support[key] = TemplateToolSupport.probe(self.tokenizer, schemas, **kwargs)
        return support


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
