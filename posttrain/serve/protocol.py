"""The request bodies the server reads, as pydantic models: OpenAI's completions and chat completions, and vLLM's
token endpoints and extensions (`return_token_ids`, `return_tokens_as_token_ids`, `top_k`, `min_p`,
`chat_template_kwargs`).

Types are strict (a string is not a number), ranges are checked here, and a field the server does not implement
with a value that would change the answer (`presence_penalty` other than 0, `logit_bias`, `best_of` > n, a
`response_format` other than text, ...) is refused by name rather than ignored. Other unknown fields are
accepted and ignored, as OpenAI-compatible servers do (clients send their own extensions).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = ["ChatMessage", "ChatRequest", "CompletionRequest", "DetokenizeRequest", "MAX_LOGPROBS", "MAX_N",
           "SamplingFields", "TokenizeRequest"]

#: top log-probs a request may ask for (OpenAI's limit; the engine computes this many when any slot asks)
MAX_LOGPROBS = 20
#: choices per request at most
MAX_N = 16

TokenId = Annotated[int, Field(ge=0)]
Stop = str | list[str] | None


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")


class StreamOptions(_Body):
    """Options of a streamed answer.

    include_usage: end the stream with a chunk holding `usage` (and no choices); the chunks before carry
      `"usage": null`.
    """

    include_usage: bool = False


class SamplingFields(_Body):
    """What completions and chat share: the model, sampling parameters, streaming, vLLM's token extensions.

    model: the served name of the model (`--served-model-name`, or a `--lora` name); absent: the base model.
    temperature: 0 = greedy (default 1); the filters apply in the order temperature, top-k, top-p, min-p.
    top_p: nucleus sampling: the smallest set of most likely tokens whose mass reaches top_p (1 = off).
    top_k: keep the k most likely tokens (0 or -1 = off; vLLM's extension).
    min_p: keep tokens at least min_p times as likely as the most likely one (0 = off; vLLM's extension).
    n: choices per prompt (their own samples of one prompt: sample i draws from keys of (seed, i)).
    stop: up to 4 strings; the text ends before the first one found (it is left out), finish_reason "stop".
    seed: the same request with the same seed gives the same tokens (absent: a fresh seed per request).
    stream: answer with server-sent events, `data: [DONE]` last.
    stream_options: see below.
    user: accepted and ignored.
    presence_penalty, frequency_penalty, repetition_penalty: only their neutral values (0, 0, 1); others are a 400.
    logit_bias: not supported (a 400 when given).
    return_token_ids: vLLM's extension: the prompt's token ids (`prompt_token_ids`) and each choice's (`token_ids`).
    return_tokens_as_token_ids: name tokens in log-probs as "token_id:N" rather than by their text.
    ignore_eos: vLLM's extension: generate `max_tokens` whatever end-of-sequence tokens come (benchmarks).
    """

    model: str | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=-1)] | None = None
    min_p: Annotated[float, Field(ge=0.0, lt=1.0)] | None = None
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1
    stop: Stop = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    return_token_ids: bool = False
    return_tokens_as_token_ids: bool = False
    ignore_eos: bool = False

    @model_validator(mode="after")
    def _unsupported(self):
        for name, off in (("presence_penalty", 0.0), ("frequency_penalty", 0.0), ("repetition_penalty", 1.0)):
            value = getattr(self, name)
            if value is not None and value != off:
                raise ValueError(f"{name}={value} is not supported by this server (only {off})")
        if self.logit_bias:
            raise ValueError("logit_bias is not supported by this server")
        if isinstance(self.stop, list) and len(self.stop) > 4 or any(s == "" for s in self.stop_list()):
            raise ValueError("stop: at most 4 non-empty strings")
        return self

    def stop_list(self) -> list[str]:
        return [] if self.stop is None else [self.stop] if isinstance(self.stop, str) else list(self.stop)


class CompletionRequest(SamplingFields):
    """POST /v1/completions.

    prompt: a string, a list of strings, a list of token ids or a list of token-id lists (each its own choices).
    max_tokens: tokens to generate per choice (default 16); 0 only with `echo` (the prompt is scored, nothing is
      generated).
    echo: put the prompt before each choice's text (and, with `logprobs`, the prompt's scored tokens before its
      log-probs: the first with `null`).
    logprobs: 0-20: each token's log-prob, and the `logprobs` most likely tokens at each position (the chosen one
      always among them).
    best_of: only equal to n.
    suffix: not supported (a 400 when given).
    """

    prompt: str | list[str] | list[TokenId] | list[list[TokenId]]
    max_tokens: Annotated[int, Field(ge=0)] | None = 16
    echo: bool = False
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    best_of: int | None = None
    suffix: str | None = None

    @model_validator(mode="after")
    def _completion_checks(self):
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of is not supported by this server (only best_of = n)")
        if self.suffix:
            raise ValueError("suffix is not supported by this server")
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens=0 needs echo=true (scoring the prompt)")
        if isinstance(self.prompt, list) and not self.prompt:
            raise ValueError("prompt: an empty list")
        return self


class ImageURL(_Body):
    """An image part's image.

    url: a `data:` URL (`data:image/png;base64,...`); this server fetches no other URL.
    detail: accepted and ignored.
    """

    url: str
    detail: str | None = None


class ContentPart(_Body):
    """A part of a message's content: `{"type": "text", "text": ...}` or `{"type": "image_url", "image_url":
    {"url": "data:image/png;base64,..."}}` (a vision-language model).

    type: "text" or "image_url".
    text: the text of a text part.
    image_url: the image of an image part.
    """

    type: Literal["text", "image_url"]
    text: str | None = None
    image_url: ImageURL | None = None

    @model_validator(mode="after")
    def _filled(self):
        if self.type == "text" and self.text is None:
            raise ValueError("a text part needs 'text'")
        if self.type == "image_url" and self.image_url is None:
            raise ValueError("an image_url part needs 'image_url'")
        return self


class FunctionCall(_Body):
    """The function a call names.

    name: the function's name.
    arguments: its arguments, as JSON text (or an object).
    """

    name: str
    arguments: str | dict[str, Any]


class ToolCall(_Body):
    """A call an assistant message made (as a reply's `message.tool_calls` holds them).

    id: the call's id (a tool message's `tool_call_id` answers it).
    type: "function".
    function: the function and its arguments.
    """

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Body):
    """One message of a conversation, rendered with the model's chat template.

    role: system, developer (as system), user, assistant or tool.
    content: a string, or a list of parts (text; images for a vision-language model); may be null on an assistant
      message with tool calls.
    name: the tool's name on a tool message (templates that use it).
    tool_calls: the calls an assistant message made.
    tool_call_id: on a tool message, the call it answers.
    """

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    @model_validator(mode="after")
    def _content(self):
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"a {self.role} message needs 'content'")
        return self


class FunctionDef(_Body):
    """A function the model may call.

    name: its name.
    description: what it does.
    parameters: its arguments as a JSON schema.
    """

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None


class Tool(_Body):
    """A tool of a chat request.

    type: "function".
    function: the function.
    """

    type: Literal["function"]
    function: FunctionDef


class ResponseFormat(_Body):
    """type: only "text"."""

    type: str


class ChatRequest(SamplingFields):
    """POST /v1/chat/completions.

    messages: the conversation (at least one message).
    max_tokens, max_completion_tokens: tokens to generate per choice (the latter wins); default: what the context
      leaves after the prompt.
    logprobs: each token's log-prob in `choices[i].logprobs.content`.
    top_logprobs: 0-20 most likely tokens at each position (needs `logprobs`).
    tools: functions the model may call; its calls are read from its text in the server's `--tool-format`.
    tool_choice: "auto" (default with tools) or "none" (the tools are shown to the model, its text is not read for
      calls).
    parallel_tool_calls: accepted (every call in the reply is returned).
    response_format: only {"type": "text"}.
    chat_template_kwargs: extra arguments for the chat template (e.g. {"enable_thinking": false}).
    add_generation_prompt: end the rendering with the assistant's header (default true).
    """

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["auto", "none"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True

    @model_validator(mode="after")
    def _chat_checks(self):
        if isinstance(self.tool_choice, dict):
            raise ValueError("tool_choice: only 'auto' and 'none' are supported by this server")
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs=true")
        if self.response_format is not None and self.response_format.type != "text":
            raise ValueError(f"response_format {self.response_format.type!r} is not supported by this server "
                             "(only 'text')")
        return self

    def completion_budget(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class TokenizeRequest(_Body):
    """POST /tokenize (vLLM's): a `prompt` string, or chat `messages` through the chat template.

    model: as in completions.
    prompt: text to tokenize.
    messages: a conversation to render and tokenize (instead of `prompt`).
    add_special_tokens: add the tokenizer's special tokens to `prompt` (default true).
    add_generation_prompt: with `messages`, end with the assistant's header (default true).
    return_token_strs: also return each token's string (`token_strs`).
    """

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of 'prompt' and 'messages'")
        return self


class DetokenizeRequest(_Body):
    """POST /detokenize (vLLM's).

    model: as in completions.
    tokens: the token ids to turn into text (special tokens kept).
    """

    model: str | None = None
    tokens: list[TokenId]
