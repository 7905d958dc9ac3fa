"""The Tinker wire formats, read and written with the SDK's own modules (never a copy of its schema).

- `forward_backward` bodies are protobuf (`tinker.proto.tinker_public_pb2.ForwardBackwardRequest`, zstd-compressed
  when the client says `Content-Encoding: zstd`): `read_forward_backward` turns one into a `FwdBwdRequest` of
  `TokenRow`s, checking every datum (text chunks only, token ids in the vocabulary, each loss input a dense 1-D
  tensor of the input's length in the dtype the loss needs, the loss and its config known); a bad one is a
  `BadInput` naming the field (`data[2].loss_fn_inputs.advantages: ...`).
- Results of `forward_backward` and of sampling are protobuf too (`ForwardBackwardOutput`, `SampleResponse`):
  `forward_backward_output` and `sample_response` write them.
- Every other body is JSON, validated with the SDK's pydantic request types (`parse`): an unknown or ill-typed field
  is a `BadInput` naming it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

import numpy as np
import pydantic

from posttrain.algorithms.token_losses import LOSSES
from posttrain.training.tenants import TokenRow

__all__ = ["BadInput", "FwdBwdRequest", "SampledSequence", "forward_backward_output", "parse",
           "read_forward_backward", "sample_response"]

T = TypeVar("T")


class BadInput(ValueError):
    """A request the server cannot run as given; the message names the field (a user error for the client).
    `model_id` and `seq_id`: the operation's place in its model's order, when the request got that far; `status`:
    the HTTP status of a request answered at once (404: an unknown session, 410: a finished one)."""

    def __init__(self, message: str, model_id: str | None = None, seq_id: int | None = None, status: int = 400):
        super().__init__(message)
        self.model_id, self.seq_id, self.status = model_id, seq_id, status


def _pb():
    from tinker.proto import tinker_public_pb2  # lazy: the SDK loads only when a server speaks the Tinker API

    return tinker_public_pb2


def parse(model: type[T], body: Any) -> T:
    """`body` (JSON) as the SDK's request type `model`; a `BadInput` naming the first bad field otherwise."""
    if not isinstance(body, dict):
        raise BadInput(f"the request body must be a JSON object, got {type(body).__name__}")
    try:
        return model.model_validate(body)
    except pydantic.ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(x) for x in first.get("loc", ())) or "body"
        raise BadInput(f"{where}: {first.get('msg', 'invalid')} ({model.__name__})") from None


@dataclasses.dataclass(frozen=True)
class FwdBwdRequest:
    """A decoded `forward_backward` (or `forward`) request."""

    model_id: str
    seq_id: int
    loss: str
    config: tuple[tuple[str, float], ...]
    forward_only: bool
    rows: list[TokenRow]


def _decompress(body: bytes, encoding: str | None) -> bytes:
    if not encoding or encoding == "identity":
        return body
    if encoding != "zstd":
        raise BadInput(f"Content-Encoding {encoding!r} is not supported (zstd or none)")
    import zstandard  # lazy: a dependency of the tinker SDK, needed only for compressed bodies

    try:
        return zstandard.ZstdDecompressor().decompressobj().decompress(body)
    except zstandard.ZstdError as e:
        raise BadInput(f"the body is not valid zstd ({e})") from None


def _config(msg, loss: str) -> tuple[tuple[str, float], ...]:
    """The loss's settings from `loss_fn_config_v2` (preferred) or the legacy float map; unknown keys are errors."""
    accepted = dict(LOSSES[loss].config)
    given: dict[str, float] = {k: float(v) for k, v in msg.loss_fn_config.items()}
    for k, v in msg.loss_fn_config_v2.items():
        if v.WhichOneof("value") != "number":
            raise BadInput(f"loss_fn_config.{k}: must be a number for loss {loss!r}")
        given[k] = float(v.number)
    unknown = sorted(set(given) - set(accepted))
    if unknown:
        raise BadInput(f"loss_fn_config.{unknown[0]}: not a setting of loss {loss!r} "
                       f"(accepted: {', '.join(accepted) or 'none'})")
    return tuple(sorted({**accepted, **given}.items()))


_DTYPES = {"int": (np.int64, np.int32), "float": (np.float32,)}


def _tensor(t, where: str, kind: str, n: int) -> np.ndarray:
    pb = _pb()
    np_dtype = {pb.DTYPE_FLOAT32: np.float32, pb.DTYPE_INT64: np.int64, pb.DTYPE_INT32: np.int32}.get(t.dtype)
    if np_dtype is None or np_dtype not in _DTYPES[kind]:
        name = pb.DType.Name(t.dtype) if t.dtype in pb.DType.values() else str(t.dtype)
        want = "int64" if kind == "int" else "float32"
        raise BadInput(f"{where}: dtype {name.removeprefix('DTYPE_').lower()}, expected {want}")
    if t.WhichOneof("encoding") != "dense":
        raise BadInput(f"{where}: sparse tensors are not supported; send a dense 1-D tensor")
    values = np.frombuffer(t.dense, dtype=np_dtype)
    shape = list(t.shape) or [values.size]
    if len(shape) != 1 or shape[0] != n or values.size != n:
        raise BadInput(f"{where}: shape {shape}, expected [{n}] (one value per input token)")
    return values


def _datum(d, i: int, loss: str, vocab: int) -> TokenRow:
    ids = []
    for j, chunk in enumerate(d.model_input):
        kind = chunk.WhichOneof("chunk")
        if kind != "encoded_text":
            raise BadInput(f"data[{i}].model_input.chunks[{j}]: {kind} chunks are not supported (text tokens only)")
        ids.append(np.frombuffer(chunk.encoded_text.tokens, dtype=np.int32))
    ids = np.concatenate(ids) if ids else np.zeros(0, np.int32)
    n = ids.size
    if n == 0:
        raise BadInput(f"data[{i}].model_input: empty")
    if ids.min() < 0 or ids.max() >= vocab:
        raise BadInput(f"data[{i}].model_input: token ids outside the vocabulary [0, {vocab})")
    spec = LOSSES[loss]
    names = set(d.loss_fn_inputs)
    accepted = {"target_tokens", *spec.required, *spec.optional_ones}
    missing = sorted({"target_tokens", *spec.required} - names)
    if missing:
        raise BadInput(f"data[{i}].loss_fn_inputs.{missing[0]}: required by loss {loss!r}")
    if names - accepted:
        raise BadInput(f"data[{i}].loss_fn_inputs.{min(names - accepted)}: not an input of loss {loss!r} "
                       f"(accepted: {', '.join(sorted(accepted))})")
    where = f"data[{i}].loss_fn_inputs"
    targets = _tensor(d.loss_fn_inputs["target_tokens"], f"{where}.target_tokens", "int", n)
    if targets.min() < 0 or targets.max() >= vocab:
        raise BadInput(f"{where}.target_tokens: token ids outside the vocabulary [0, {vocab})")
    floats = {k: _tensor(d.loss_fn_inputs[k], f"{where}.{k}", "float", n) for k in sorted(names - {"target_tokens"})}
    for k, v in floats.items():
        if not np.isfinite(v).all():
            raise BadInput(f"{where}.{k}: holds NaN or infinite values")
    return TokenRow(ids.astype(np.int32), targets.astype(np.int32), floats)


def read_forward_backward(body: bytes, encoding: str | None, vocab: int, max_len: int) -> FwdBwdRequest:
    """A `forward_backward` protobuf body, decoded and checked (module docstring)."""
    msg = _pb().ForwardBackwardRequest()
    try:
        msg.ParseFromString(_decompress(body, encoding))
    except BadInput:
        raise
    except Exception as e:  # noqa: BLE001 - protobuf's DecodeError and friends: the body is not the message
        raise BadInput(f"the body is not a ForwardBackwardRequest protobuf ({type(e).__name__})") from None
    try:
        return _checked(msg, vocab, max_len)
    except BadInput as e:
        raise BadInput(str(e), msg.model_id, int(msg.seq_id)) from None


def _checked(msg, vocab: int, max_len: int) -> FwdBwdRequest:
    if msg.loss_fn not in LOSSES:
        raise BadInput(f"loss_fn: {msg.loss_fn!r} is not supported (supported: {', '.join(LOSSES)})")
    config = _config(msg, msg.loss_fn)
    if not msg.data:
        raise BadInput("data: empty (forward_backward needs at least one datum)")
    rows = [_datum(d, i, msg.loss_fn, vocab) for i, d in enumerate(msg.data)]
    longest = max(len(r.input_ids) for r in rows)
    if longest > max_len:
        raise BadInput(f"data: a datum of {longest} tokens is longer than the model's context ({max_len})")
    return FwdBwdRequest(msg.model_id, int(msg.seq_id), msg.loss_fn, config, bool(msg.forward_only), rows)


def forward_backward_output(logprobs: list[np.ndarray], loss_sum: float) -> bytes:
    """A `ForwardBackwardOutput` protobuf: one `logprobs` tensor per datum (float32) and `loss:sum`."""
    pb = _pb()
    arrays = [np.asarray(x, np.float32) for x in logprobs]
    offsets = np.concatenate([[0], np.cumsum([a.nbytes for a in arrays])]).astype(np.int64)
    field = pb.BatchedTensor(data=b"".join(a.tobytes() for a in arrays), offsets=offsets.tobytes(),
                             dtype=pb.DTYPE_FLOAT32)
    record = pb.ArrayRecord(type_tag="ArrayRecord", num_datums=len(arrays))
    record.fields["logprobs"].CopyFrom(field)
    out = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord", loss_fn_outputs=[record])
    out.metrics["loss:sum"] = float(loss_sum)
    return out.SerializeToString()


@dataclasses.dataclass(frozen=True)
class SampledSequence:
    tokens: list[int]
    logprobs: list[float]
    stop: bool  # True: ended on a stop token or string; False: on its token budget


def sample_response(sequences: list[SampledSequence], prompt_logprobs: np.ndarray | None) -> bytes:
    """A `SampleResponse` protobuf (prompt log-probs NaN where not computed, e.g. the first token)."""
    pb = _pb()
    out = pb.SampleResponse()
    for s in sequences:
        out.sequences.add(stop_reason=pb.STOP_REASON_STOP if s.stop else pb.STOP_REASON_LENGTH,
                          tokens=np.asarray(s.tokens, np.int32).tobytes(),
                          logprobs=np.asarray(s.logprobs, np.float32).tobytes())
    if prompt_logprobs is not None:
        out.prompt_logprobs = np.asarray(prompt_logprobs, np.float32).tobytes()
    return out.SerializeToString()
