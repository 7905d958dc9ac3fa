"""LLM-as-judge reward (`judge`): a model reads the question, the completion and the reference answer, and its
verdict is the reward, scaled to [0, 1].

    rewards:
      functions:
        - name: judge
          kwargs: {url: http://127.0.0.1:8000/v1, model: my-judge, score: verdict}

Settings (`JudgeConfig`): where the judge is (`url` of an OpenAI-compatible server, its served `model` name and
`api_key_env`; or, without `url`, `model` a local checkpoint: any model spec, which the run opens as a `Policy` and
serves in-process, `posttrain.serve.local.serve_judges`, before the judge's first request), what it is asked (`template`: one user message with `{question}`, `{answer}` (the completion) and
`{reference}` (the record's `reference_field`)), how its reply is read (`score`: `number`, `verdict` or a regex
with one group; `min`/`max` scale a number to [0, 1]) and how it is called (`max_new_tokens`, `timeout_s` per
request, `concurrency` requests at once). The judge is our own code calling a model under its own time limits, so
it runs in the run's process, on threads of its own (`starts_early`: the reward runner hands it each completion as
soon as the sampler finishes it, and collects the answers when the batch is scored; `posttrain.rewards.runner`).

Outcomes per completion: a parsed score; 0 for a reply that cannot be parsed (counted in
`reward/judge/parse_failures`); 0 without asking for a "master key" (`master_key`, counted in
`reward/judge/skipped`); or, when the request itself failed (connection refused, time-out, an HTTP error), no
value: the runner gives it `rewards.failure_value` and counts it in `reward/judge/failures`, so a judge that is
down stops the run after `rewards.max_failed_steps` scoring calls like any failing reward.

Defences (Zhao et al. 2025, "One Token to Fool LLM-as-a-Judge", arXiv:2507.08794: judges give false positives to
non-word symbols and bare reasoning openers). A completion scores 0 without being sent when, after removing role
and formatting tokens (`<|...|>` and `<...>` tags, `[INST]`-style markers, a leading `assistant`/`user`/`system`
role name, markdown markup `*`, `_`, `#`, `>`, backquotes), nothing but punctuation is left, or what is left
(lower-cased, trailing punctuation removed) is one of `OPENERS`.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import math
import os
import re
import string
import threading
from pathlib import Path

from posttrain.rewards.scored import Scored

__all__ = ["DEFAULT_TEMPLATE", "OPENERS", "Judge", "JudgeConfig", "judge", "master_key", "parse_score"]

DEFAULT_TEMPLATE = """You are grading an answer to a question against the reference answer.

Question:
{question}

Reference answer:
{reference}

Answer to grade:
{answer}

Does the answer to grade reach the same final result as the reference answer? Reply with one word: yes or no."""

#: Bare openers that score 0 without asking the judge: the paper's master keys ("Thought process:", "Let's solve
#: this problem step by step.", "Solution", 解, かいせつ, Respuesta) and their common kin, compared lower-cased with
#: trailing punctuation removed.
OPENERS = frozenset({
    "solution", "the solution", "answer", "the answer", "final answer", "the final answer", "the answer is",
    "final answer is", "the final answer is", "my answer", "response", "result", "thought process", "thoughts",
    "thinking", "reasoning", "explanation", "analysis", "step 1", "step-by-step solution", "let's think",
    "let's think step by step", "let me think", "let me think step by step", "let's solve this",
    "let's solve this step by step", "let's solve this problem step by step", "let's solve the problem step by step",
    "let's break this down", "let's work through this step by step", "sure", "sure, here is the solution",
    "解", "解答", "答案", "答", "解析", "かいせつ", "解説", "解答例", "respuesta", "solución", "réponse", "solution :",
    "lösung", "antwort", "ответ", "решение",
})

_TAGS = re.compile(r"<\|[^|>]*\|>|</?[A-Za-z_][\w:-]*>|\[/?(?:INST|SYS|TOOL_CALLS|AVAILABLE_TOOLS)\]|<<SYS>>|<</SYS>>")
_ROLE = re.compile(r"^\s*(?:assistant|user|system|model|bot|ai)\s*(?::|\n|$)", re.IGNORECASE)
_MARKUP = re.compile(r"[*_#>`~|]+")
_PUNCT = re.compile(r"[\s\W]+$", re.UNICODE)
_NUMBER = r"[-+]?\d+(?:\.\d+)?"
_FIELDS = ("question", "answer", "reference")
_POSITIVE = frozenset({"yes", "correct", "right", "true", "pass", "passed", "accept", "accepted", "valid",
                       "equivalent"})
_NEGATIVE = frozenset({"no", "incorrect", "wrong", "false", "fail", "failed", "reject", "rejected", "invalid",
                       "different"})
_VERDICT = re.compile(r"\b(not\s+)?(" + "|".join(sorted(_POSITIVE | _NEGATIVE, key=len, reverse=True)) + r")\b",
                      re.IGNORECASE)


def master_key(completion: str) -> bool:
    """Whether `completion` is empty, only role or formatting tokens and punctuation, or a bare opener (`OPENERS`):
    the answers that score 0 without asking the judge (module docstring)."""
    text = _TAGS.sub(" ", completion or "")
    text = _ROLE.sub("", text, count=1)
    text = _MARKUP.sub(" ", text)
    text = " ".join(text.split())
    if not any(ch.isalnum() for ch in text):
        return True
    core = _PUNCT.sub("", text).strip().lower().replace("’", "'")
    return core in OPENERS


def _verdict(text: str) -> float | None:
    """1.0 or 0.0 from the last verdict word of `text` (`not` before a positive word makes it negative)."""
    found = _VERDICT.findall(text)
    if not found:
        return None
    negated, word = found[-1]
    positive = word.lower() in _POSITIVE
    return 1.0 if positive and not negated else 0.0


def _number(text: str) -> float | None:
    """The last number of `text`; of `N/M` (a score out of M), N."""
    found = list(re.finditer(rf"({_NUMBER})(\s*/\s*{_NUMBER})?", text))
    if not found:
        return None
    value = float(found[-1].group(1))
    return value if math.isfinite(value) else None


@dataclasses.dataclass(frozen=True)
class JudgeConfig:
    """The judge's settings (`rewards.functions[i].kwargs` of the `judge` reward).

    url: an OpenAI-compatible base URL ending in /v1 (`posttrain serve`, vLLM, a hosted API); None: `model` is a
      local checkpoint the run serves itself (`local`).
    model: the served model's name at `url` (None: the first model `GET /v1/models` lists); without `url`, a model
      spec (`tiny:`, an HF folder, a run's output folder, `pypi:`, GGUF: what `posttrain eval --model` takes).
    api_key_env: the environment variable holding the API key (None: no key is sent).
    template: the judge's one user message, or a file holding it: `{question}`, `{answer}` (the completion),
      `{reference}` (the record's `reference_field`); write `{{` and `}}` for literal braces.
    score: how the reply is read: `verdict` (the last of yes/correct/true/pass... = 1, no/incorrect/false/fail... =
      0; "not correct" = 0), `number` (the last number; of "7/10", 7; scaled by min/max), or a regex with one group
      (its last match; the group a number, scaled, or a verdict word).
    min, max: a number's range: (x - min) / (max - min), clipped to [0, 1].
    max_new_tokens: tokens the judge may write.
    timeout_s: seconds per request (connection and reply).
    concurrency: requests at once.
    reference_field: the record field `{reference}` reads.
    temperature: the judge's sampling temperature.
    """

    url: str | None = None
    model: str | None = None
    api_key_env: str | None = None
    template: str = DEFAULT_TEMPLATE
    score: str = "verdict"
    min: float = 0.0
    max: float = 1.0
    max_new_tokens: int = 256
    timeout_s: float = 60.0
    concurrency: int = 8
    reference_field: str = "answer"
    temperature: float = 0.0

    def __post_init__(self):
        if not self.url and not self.model:
            raise ValueError("judge: kwargs.url or kwargs.model is required: an OpenAI-compatible base URL ending in "
                             "/v1 (e.g. http://127.0.0.1:8000/v1 of `posttrain serve`), or a local model spec")
        if self.url and (not re.match(r"^https?://", self.url) or not self.url.rstrip("/").endswith("/v1")):
            raise ValueError(f"judge: kwargs.url must be an http(s) base URL ending in /v1, found {self.url!r}")
        if self.api_key_env is not None and not os.environ.get(self.api_key_env):
            raise ValueError(f"judge: kwargs.api_key_env names {self.api_key_env!r}, which is not set")
        if not self.max > self.min:
            raise ValueError(f"judge: kwargs.max ({self.max}) must be greater than kwargs.min ({self.min})")
        if self.score not in ("number", "verdict"):
            try:
                groups = re.compile(self.score).groups
            except re.error as e:
                raise ValueError(f"judge: kwargs.score must be number, verdict or a regex with one group; "
                                 f"{self.score!r} is not a regex ({e})") from None
            if groups != 1:
                raise ValueError(f"judge: kwargs.score regex {self.score!r} must have exactly one group, has {groups}")
        for key in ("max_new_tokens", "concurrency"):
            if int(getattr(self, key)) < 1:
                raise ValueError(f"judge: kwargs.{key} must be >= 1, found {getattr(self, key)}")
        if not self.timeout_s > 0:
            raise ValueError(f"judge: kwargs.timeout_s must be > 0, found {self.timeout_s}")
        object.__setattr__(self, "template", _load_template(self.template))

    @property
    def local(self) -> bool:
        """Whether `model` is a local checkpoint the run serves (no `url`)."""
        return not self.url

    @property
    def uses_reference(self) -> bool:
        return "reference" in _placeholders(self.template)

    def render(self, question: str, answer: str, reference=None) -> str:
        """The judge's message for one completion."""
        return self.template.format(question=question, answer=answer, reference="" if reference is None else reference)

    def scale(self, value: float) -> float:
        return min(1.0, max(0.0, (value - self.min) / (self.max - self.min)))

    def read(self, reply: str) -> float | None:
        """The score in [0, 1] of the judge's `reply`, or None when it cannot be read (`parse_score`)."""
        return parse_score(reply, self)


def _placeholders(template: str) -> set[str]:
    return {field for _, field, _, _ in string.Formatter().parse(template) if field is not None}


def _load_template(template: str) -> str:
    """`template`, or the text of the file it names; its placeholders checked."""
    if "{" not in template and "\n" not in template and len(template) < 4096 and Path(template).is_file():
        template = Path(template).read_text()
    try:
        fields = _placeholders(template)
    except ValueError as e:
        raise ValueError(f"judge: kwargs.template is not a valid template ({e}); write {{{{ and }}}} for literal "
                         "braces") from None
    unknown = sorted(f for f in fields if f not in _FIELDS)
    if unknown:
        raise ValueError(f"judge: kwargs.template has placeholder(s) {unknown}; accepted: {{question}}, {{answer}}, "
                         "{reference} (write {{ and }} for literal braces)")
    if "answer" not in fields:
        raise ValueError("judge: kwargs.template must contain {answer} (the completion to grade)")
    return template


def parse_score(reply: str, cfg: JudgeConfig) -> float | None:
    """The judge's `reply` read as `cfg.score` says (see `JudgeConfig`), in [0, 1]; None when it cannot be read."""
    if cfg.score == "verdict":
        return _verdict(reply)
    if cfg.score == "number":
        value = _number(reply)
        return None if value is None else cfg.scale(value)
    matches = list(re.finditer(cfg.score, reply))
    if not matches or matches[-1].group(1) is None:
        return None
    group = matches[-1].group(1).strip()
    if re.fullmatch(_NUMBER, group):
        return cfg.scale(float(group))
    return _verdict(group) if _VERDICT.fullmatch(group) else None


class JudgeUnavailable(RuntimeError):
    """A request to the judge failed (refused, timed out, an HTTP error or a reply without a message)."""


class _Client:
    """The judge's HTTP client: one chat completion per request (httpx; one connection pool, thread-safe)."""

    def __init__(self, cfg: JudgeConfig):
        import httpx  # lazy: reward workers that never judge do not import it

        self.cfg = cfg
        headers = {"Authorization": f"Bearer {os.environ[cfg.api_key_env]}"} if cfg.api_key_env else {}
        limits = httpx.Limits(max_connections=cfg.concurrency, max_keepalive_connections=cfg.concurrency)
        self.http = httpx.Client(base_url=cfg.url.rstrip("/") + "/", headers=headers, limits=limits,
                                 timeout=httpx.Timeout(cfg.timeout_s))
        self.model = cfg.model
        self.error_type = httpx.HTTPError
        self._lock = threading.Lock()

    def served_model(self) -> str:
        """`model`, or the first model the server lists (asked once)."""
        with self._lock:
            if self.model is None:
                body = self._json("GET", "models")
                try:
                    self.model = str(body["data"][0]["id"])
                except (KeyError, IndexError, TypeError):
                    raise JudgeUnavailable(f"{self.cfg.url}/models lists no model; set kwargs.model") from None
            return self.model

    def _json(self, method: str, path: str, body: dict | None = None) -> dict:
        try:
            r = self.http.request(method, path, json=body)
        except self.error_type as e:
            raise JudgeUnavailable(f"{self.cfg.url}/{path}: {type(e).__name__}: {e}") from None
        if r.status_code != 200:
            raise JudgeUnavailable(f"{self.cfg.url}/{path}: HTTP {r.status_code}: {' '.join(r.text.split())[:200]}")
        try:
            return r.json()
        except ValueError:
            raise JudgeUnavailable(f"{self.cfg.url}/{path}: the reply is not JSON: {r.text[:100]!r}") from None

    def ask(self, message: str) -> str:
        """The judge's reply to one user `message`."""
        body = {"model": self.served_model(), "messages": [{"role": "user", "content": message}],
                "max_tokens": self.cfg.max_new_tokens, "temperature": self.cfg.temperature}
        out = self._json("POST", "chat/completions", body)
        try:
            content = out["choices"][0]["message"]["content"]
        except (KeyError, IndexError, TypeError):
            raise JudgeUnavailable(f"{self.cfg.url}/chat/completions: no choices[0].message in the reply") from None
        return "" if content is None else str(content)

    def close(self) -> None:
        self.http.close()


class Judge:
    """The `judge` reward: `(prompts, completions, **fields) -> Scored` (module docstring). `submit` asks about one
    completion and `collect` gathers such answers: the runner's early path (`starts_early`) submits each completion
    as soon as it is sampled, so the judge's requests overlap the decoding of the others."""

    starts_early = True  # the runner asks it in the run's process, per completion (`submit`), as they are sampled

    def __init__(self, cfg: JudgeConfig):
        self.cfg = cfg
        self.spec = cfg.model if cfg.local else None  # a local checkpoint, served by the run (`serve_at`)
        self.required_fields = (cfg.reference_field,) if cfg.uses_reference else ()
        self._client: _Client | None = None  # made at the first request (in the process that asks)
        self._pool: cf.ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    def serve_at(self, url: str, name: str) -> None:
        """A local judge's checkpoint is served at `url` (a base URL ending in /v1) as `name`: its requests go there."""
        with self._lock:
            self.cfg = dataclasses.replace(self.cfg, url=url, model=name)

    def time_limit_s(self, n: int) -> float:
        """A call on `n` completions: its requests, `concurrency` at a time, each within `timeout_s`, plus slack."""
        return self.cfg.timeout_s * max(1, math.ceil(n / self.cfg.concurrency)) + 5.0

    def submit(self, prompt, completion, **fields) -> cf.Future:
        """A Future of one completion's outcome: `("score", x)`, `("skipped", 0.0)` (a master key, not sent),
        `("parse_failure", 0.0)` or `("failed", one line)`; it never fails."""
        if master_key(str(completion)):
            out: cf.Future = cf.Future()
            out.set_result(("skipped", 0.0))
            return out
        with self._lock:
            if self.cfg.local:
                out = cf.Future()
                out.set_result(("failed", f"the local judge {self.spec!r} is not served (posttrain rl and eval serve "
                                          "it; elsewhere call serve_judges first)"))
                return out
            if self._pool is None:
                self._client = _Client(self.cfg)
                self._pool = cf.ThreadPoolExecutor(max_workers=self.cfg.concurrency, thread_name_prefix="judge")
        message = self.cfg.render(str(prompt), str(completion), fields.get(self.cfg.reference_field))
        return self._pool.submit(self._ask, message)

    def _ask(self, message: str) -> tuple[str, float | str]:
        try:
            score = self.cfg.read(self._client.ask(message))
        except JudgeUnavailable as e:
            return "failed", str(e)
        except Exception as e:  # noqa: BLE001 - an answer we cannot read is a failed request, never a crash
            return "failed", f"{type(e).__name__}: {e}"
        return ("parse_failure", 0.0) if score is None else ("score", score)

    def collect(self, futures: list[cf.Future], timeout_s: float | None = None) -> Scored:
        """The outcomes of `futures` (one per completion, in order) as one `Scored`; requests still unanswered
        after `timeout_s` (default: `time_limit_s` of their number, less slack) are failures."""
        timeout_s = self.time_limit_s(len(futures)) - 2.0 if timeout_s is None else timeout_s
        done, late = cf.wait(futures, timeout=max(0.0, timeout_s))
        values: list[float | None] = []
        counts = {"skipped": 0, "parse_failures": 0}
        errors = [f"no answer within {self.cfg.timeout_s:g}s"] if late else []
        for f in futures:
            if f not in done:
                f.cancel()  # still queued: never sent; one in flight ends at its own time-out
                values.append(None)
                continue
            kind, value = f.result()
            counts["skipped"] += kind == "skipped"
            counts["parse_failures"] += kind == "parse_failure"
            errors += [value] if kind == "failed" else []
            values.append(None if kind == "failed" else float(value))
        error = None
        if errors:
            error = f"{sum(v is None for v in values)} request(s) to the judge failed; first: {errors[0]}"
        return Scored(values, counts, error)

    def __call__(self, prompts, completions, **fields) -> Scored:
        rows = [{k: v[i] for k, v in fields.items()} for i in range(len(completions))]
        return self.collect([self.submit(p, c, **row) for p, c, row in zip(prompts, completions, rows)])

    def __repr__(self) -> str:
        where = f"local={self.spec!r}, " if self.spec is not None else ""
        return f"Judge({where}url={self.cfg.url!r}, model={self.cfg.model!r}, score={self.cfg.score!r})"


def judge(**kwargs) -> Judge:
    """Factory of the `judge` reward from its kwargs (`JudgeConfig`'s fields; any other key is an error naming
    the accepted ones)."""
    accepted = [f.name for f in dataclasses.fields(JudgeConfig)]
    unknown = sorted(set(kwargs) - set(accepted))
    if unknown:
        raise ValueError(f"judge: unknown kwargs {unknown}; accepted: {', '.join(accepted)}")
    return Judge(JudgeConfig(**kwargs))


judge.is_reward_factory = True
