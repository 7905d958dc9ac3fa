"""vLLM's token endpoints, at the server's root: POST /tokenize, POST /detokenize, GET /tokenizer_info.

lm-eval's `local-completions` probes /tokenizer_info (it needs `eos_token`) and /tokenize, and then tokenizes with
the server's own tokenizer (no `tokenizer=` argument needed); RL clients (verifiers) count tokens with them.
"""

from __future__ import annotations

from posttrain.serve.context import ServerState
from posttrain.serve.errors import APIError
from posttrain.serve.protocol import DetokenizeRequest, TokenizeRequest

__all__ = ["detokenize", "tokenize", "tokenizer_info"]


def tokenize(state: ServerState, req: TokenizeRequest) -> dict:
    _, model = state.model(req.model)
    if req.messages is not None:
        ids, _ = model.render_chat(req.messages, add_generation_prompt=req.add_generation_prompt)
    else:
        ids = model.encode_text(req.prompt, add_special_tokens=req.add_special_tokens)
    out = {"count": len(ids), "max_model_len": state.max_len(), "tokens": ids}
    if req.return_token_strs:
        out["token_strs"] = model.tokenizer.hf.convert_ids_to_tokens(ids)
    return out


def detokenize(state: ServerState, req: DetokenizeRequest) -> dict:
    _, model = state.model(req.model)
    bad = [t for t in req.tokens if t >= len(model.tokenizer)]
    if bad:
        raise APIError(400, f"token id {bad[0]} is outside the vocabulary [0, {len(model.tokenizer)})", param="tokens")
    return {"prompt": model.tokenizer.decode(req.tokens, skip_special_tokens=False)}


def tokenizer_info(state: ServerState) -> dict:
    """The tokenizer's settings as vLLM gives them: its special tokens, chat template, class and lengths."""
    model = state.models[state.base]
    hf = model.tokenizer.hf
    return {"tokenizer_class": type(hf).__name__, "eos_token": hf.eos_token, "bos_token": hf.bos_token,
            "pad_token": hf.pad_token, "unk_token": hf.unk_token, "chat_template": model.tokenizer.chat_template,
            "model_max_length": state.max_len(), "vocab_size": len(model.tokenizer),
            "eos_token_ids": list(model.tokenizer.eos_token_ids)}
