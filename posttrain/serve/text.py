"""Tokens to text for responses: incremental detokenization, stop strings, and log-probs in OpenAI's two layouts.

`TextStream` turns a sequence's tokens into text as they arrive: it decodes a short window of recent tokens
(the earlier ones give the tokenizer its context), holds back an incomplete UTF-8 character ("\\ufffd" at the end)
and any tail that could be the start of a stop string, and cuts the text at the first stop string (which is left
out, as OpenAI does). Streamed and non-streamed answers are both built by it, so their texts are equal.
"""

from __future__ import annotations

import dataclasses

__all__ = ["TextStream", "chat_logprobs", "completion_logprobs", "token_text"]


class TextStream:
    """The text of one sequence's tokens, given a few at a time (`add`), then `finish`."""

    def __init__(self, tokenizer, stops: list[str] = (), skip_special_tokens: bool = True):
        self.tok, self.stops, self.skip = tokenizer, list(stops), skip_special_tokens
        self.ids: list[int] = []
        self.prefix = self.read = 0  # decode window: ids[prefix:] for context, text of ids[read:] is new
        self.before = ""  # decode(ids[prefix:read])
        self.text = ""  # everything decoded so far (stop strings not yet cut)
        self.sent = 0  # characters of `text` given out
        self.stopped = False

    def _decode(self, ids) -> str:
        return self.tok.decode(ids, skip_special_tokens=self.skip)

    def add(self, token: int) -> str:
        """Adds one token; returns the text that is final now (possibly empty). After a stop string matched,
        `stopped` is True and nothing more is returned."""
        if self.stopped:
            return ""
        self.ids.append(int(token))
        now = self._decode(self.ids[self.prefix:])
        if now.endswith("\ufffd") or len(now) <= len(self.before):
            return ""  # an incomplete character, or a token without text (a special token)
        self.text += now[len(self.before):]
        self.prefix, self.read = self.read, len(self.ids)
        self.before = self._decode(self.ids[self.prefix: self.read])  # alone, as the next window starts with it
        return self._release(final=False)

    def finish(self) -> str:
        """The text held back (an incomplete character at the end is decoded as it is)."""
        if not self.stopped and self.read < len(self.ids):
            self.text += self._decode(self.ids[self.prefix:])[len(self.before):]
            self.read = len(self.ids)
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        cut = min((i for i in (self.text.find(s, self.sent) for s in self.stops) if i >= 0),
                  default=-1)
        if cut >= 0:
            self.stopped = True
            self.text = self.text[:cut]
            end = cut
        elif final or not self.stops:
            end = len(self.text)
        else:  # hold back a tail that could begin a stop string
            hold = max((k for s in self.stops for k in range(1, len(s)) if self.text.endswith(s[:k])), default=0)
            end = len(self.text) - hold
        out, self.sent = self.text[self.sent: end], max(self.sent, end)
        return out


def token_text(tokenizer, token_id: int, as_ids: bool = False) -> str:
    """How a token is named in log-probs: its own text (special tokens included), or "token_id:N"."""
    return f"token_id:{token_id}" if as_ids else tokenizer.decode([int(token_id)], skip_special_tokens=False)


@dataclasses.dataclass
class TokenLogprob:
    """One position: the token, its log-prob (None for a prompt's first token) and its top (id, log-prob)
    pairs (None when not asked, or for a prompt's first token)."""

    token: int
    logprob: float | None
    top: list[tuple[int, float]] | None


def _merged_top(t: TokenLogprob, k: int) -> list[tuple[int, float]]:
    """The first k pairs of a position's top list, with the chosen token's own log-prob (the same number as
    `logprob`, wherever it ranks) added when it is not among them; sorted, most likely first."""
    top = [(i, v) for i, v in (t.top or [])[:k] if i != t.token]
    if t.logprob is not None:
        top.append((t.token, t.logprob))
    return sorted(top, key=lambda p: -p[1])


def completion_logprobs(tokenizer, positions: list[TokenLogprob], k: int, text_start: int = 0,
                        as_ids: bool = False) -> dict:
    """The legacy completions layout: tokens, token_logprobs, top_logprobs (dicts, up to k+1 entries: the
    chosen token is always there) and text_offset (characters from the start of the choice's text)."""
    tokens, offsets, lps, tops = [], [], [], []
    at = text_start
    for t in positions:
        s = token_text(tokenizer, t.token, as_ids)
        tokens.append(s)
        offsets.append(at)
        at += len(tokenizer.decode([t.token], skip_special_tokens=True))
        lps.append(t.logprob)
        tops.append(None if t.logprob is None else
                    {token_text(tokenizer, i, as_ids): v for i, v in _merged_top(t, k)})
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(tokenizer, positions: list[TokenLogprob], k: int, as_ids: bool = False) -> dict:
    """The chat layout: {"content": [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]} with k
    top entries per position (most likely first)."""
    def entry(i: int, v: float) -> dict:
        s = token_text(tokenizer, i, as_ids)
        return {"token": s, "logprob": v, "bytes": list(s.encode("utf-8"))}

    content = []
    for t in positions:
        top = [(i, v) for i, v in (t.top or [])[:k]]
        if any(i == t.token for i, _ in top):  # one number per token: the chosen one's own
            top = sorted([(i, t.logprob if i == t.token else v) for i, v in top], key=lambda p: -p[1])
        content.append({**entry(t.token, t.logprob), "top_logprobs": [entry(i, v) for i, v in top]})
    return {"content": content}
