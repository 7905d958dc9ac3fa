"""The Tinker API's state and operations over one served base model: sessions, training clients (LoRA tenants),
sampling sessions, and the futures that carry every result.

- Sessions (`create_session`, heartbeats, `finish`): a client's scope. Finishing one drops its training clients and
  sampling sessions (their memory goes; their saved checkpoints stay on disk); a session not heard from for
  `session_ttl_s` (10 minutes; the SDK beats every 10 s) is finished when the next session starts.
- Training clients: `create_model` makes a `Tenant` (`posttrain.training.tenants`) over the base named by its
  served name, id `SESSION:train:N` (the SDK derives the same id itself when it creates a client from a
  checkpoint). Its operations (`forward_backward`, `forward`, `optim_step`, `save_weights`,
  `save_weights_for_sampler`, `load_weights`) run on the training worker in `seq_id` order (`OrderedOps`).
- Sampling sessions, id `SESSION:sample:N`: the base (`base_model`), a saved checkpoint (`model_path`), or a
  training client's adapters at the moment `save_weights_for_sampler` ran without a name (what
  `save_weights_and_get_sampling_client` does; a training client keeps its `keep_snapshots` newest ones).
  `asample` requests go to the server's serving engine (`sampling`: the base's lane, or a lane of the session's
  own over its adapters while it lives).
- Every operation answers a request id at once; its result or error (`{"error", "category"}`) is fetched through
  `retrieve_future`. A request the server cannot run (an unknown model id, a bad tensor, an unsupported loss or
  option) settles as a user error whose message names the field.
"""

from __future__ import annotations

import dataclasses
import secrets
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from posttrain.serve.tinker.futures import Futures, Reply
from posttrain.serve.tinker.ops import OrderedOps
from posttrain.serve.tinker.requests import check_sample
from posttrain.serve.tinker.sampling import EngineSampling, SampleJob, Weights
from posttrain.serve.tinker.store import CheckpointStore
from posttrain.serve.tinker.wire import BadInput, forward_backward_output, parse, read_forward_backward
from posttrain.training.tenant_checkpoints import load_tenant, save_tenant
from posttrain.training.tenants import AdamSettings, LoraSpec, Tenant, TenantPool, TokenBatch, random_seed

__all__ = ["TinkerService"]


@dataclasses.dataclass
class _Session:
    id: str
    last_seen: float
    models: list[str] = dataclasses.field(default_factory=list)
    samplers: list[str] = dataclasses.field(default_factory=list)
    finished: bool = False


@dataclasses.dataclass
class _Model:
    id: str
    session: str
    tenant: Tenant | None = None


@dataclasses.dataclass
class _Sampler:
    weights: Weights
    model_path: str | None = None
    clients: int = 0
    owner: str | None = None  # the training client whose adapters it snapshot (None: base or checkpoint)


def _types():
    from tinker import types  # lazy: the SDK loads only when a server speaks the Tinker API

    return types


class TinkerService:
    """The Tinker API over `sampling.pool`'s base (module docstring).

    sampling: the sampling sessions on the server's engine (its `pool`: the base the training clients adapt).
    names: the names a client may ask for as `base_model` (the first is the served name); folder: the base's
    checkpoint folder (handed to clients as the tokenizer id, so `get_tokenizer()` loads it without a hub);
    checkpoints: where `tinker://` checkpoints are written.
    """

    def __init__(self, sampling: EngineSampling, *, names: tuple[str, ...], folder: str | Path,
                 checkpoints: str | Path, session_ttl_s: float = 600.0, keep_snapshots: int = 8):
        self.sampling, self.pool, self.names = sampling, sampling.pool, tuple(names)
        self.folder = str(Path(folder).absolute())
        self.session_ttl_s, self.keep_snapshots = session_ttl_s, keep_snapshots
        self.store = CheckpointStore(checkpoints)
        self.futures = Futures()
        self.ops = OrderedOps(self.futures)
        self.sessions: dict[str, _Session] = {}
        self.models: dict[str, _Model] = {}
        self.samplers: dict[str, _Sampler] = {}
        self._created: dict[str, str] = {}  # model id -> the request id that creates it (retries get it again)
        self._lock = threading.Lock()

    @property
    def name(self) -> str:
        return self.names[0]

    @property
    def vocab(self) -> int:
        return int(self.pool.cfg.vocab_size)

    @classmethod
    def open(cls, engine, lane: str, policy, *, names: tuple[str, ...], checkpoints: str | Path) -> TinkerService:
        """The service over the base `policy` (a `Policy` served in `lane` of the serving `engine`, an
        `AsyncEngine`): its training clients adapt the policy's model (its arrays shared, never trained)."""
        folder = policy.encoder.folder
        if folder is None:
            raise ValueError("the Tinker API needs the served model's checkpoint folder (its tokenizer for clients)")
        sampling = EngineSampling(engine, lane, policy, TenantPool(policy.model))
        return cls(sampling, names=names, folder=folder, checkpoints=checkpoints)

    def close(self) -> None:
        """Stops the training worker (operations queued still run first); the engine is the server's."""
        self.ops.stop()

    # ------------------------------------------------------------------ sessions
    def create_session(self, body: Any) -> dict:
        parse(_types().CreateSessionRequest, body)
        self._expire()
        sid = f"session-{secrets.token_hex(6)}"
        with self._lock:
            self.sessions[sid] = _Session(sid, time.monotonic())
        return {"type": "create_session", "session_id": sid}

    def _expire(self) -> None:
        """Finishes the sessions not heard from for `session_ttl_s` (the SDK beats every 10 s: their client is
        gone), so a crashed client's adapters do not stay in memory."""
        now = time.monotonic()
        for s in [s for s in list(self.sessions.values()) if not s.finished and now - s.last_seen > self.session_ttl_s]:
            self.finish(s.id)

    def session(self, sid: str, field: str = "session_id") -> _Session:
        s = self.sessions.get(sid)
        if s is None:
            raise BadInput(f"{field}: unknown session {sid!r}", status=404)
        if s.finished:
            raise BadInput(f"{field}: session {sid!r} has finished", status=410)
        s.last_seen = time.monotonic()
        return s

    def finish(self, sid: str) -> None:
        """Ends session `sid`: its training clients and sampling sessions are dropped (checkpoints stay)."""
        s = self.sessions.get(sid)
        if s is None or s.finished:
            self.session(sid)  # the error for an unknown or finished session
        with self._lock:
            s.finished = True
            for mid in s.models:
                self.models.pop(mid, None)
                self.ops.close(mid)
            closed = [self.samplers.pop(key) for key in s.samplers if key in self.samplers]
        for entry in closed:
            self.sampling.close(entry.weights)

    # ------------------------------------------------------------------ training clients
    def _base(self, name: str | None, field: str) -> None:
        if name is not None and name not in self.names:
            raise BadInput(f"{field}: this server serves {self.name!r}, not {name!r}")

    def create_model(self, body: Any) -> str:
        """Queues the creation of a LoRA training client; returns the request id."""
        try:
            req = parse(_types().CreateModelRequest, body)
            self.session(req.session_id)
            self._base(req.base_model, "base_model")
            spec = self._spec(req.lora_config, req.optimizer_config)
        except BadInput as e:
            return self.failed(f"create_model: {e}")
        return self._register(req.session_id, req.model_seq_id, 1,
                              lambda mid: self.ops.submit_now("create_model", lambda: self._create(mid, spec)))

    def _register(self, sid: str, seq: int, first_seq: int, submit: Callable[[str], str]) -> str:
        """The training client `seq` of session `sid`, registered once (its order starting at `first_seq`) with its
        creation queued by `submit(model_id)`; a repeated request gets the first one's request id."""
        mid = f"{sid}:train:{seq}"
        with self._lock:
            if mid not in self._created:
                self.models[mid] = _Model(mid, sid)
                self.sessions[sid].models.append(mid)
                self.ops.open(mid, first_seq=first_seq)
                self._created[mid] = submit(mid)
            return self._created[mid]

    def _spec(self, lora, optimizer) -> LoraSpec:
        if lora is None:
            raise BadInput("lora_config: required (this server trains LoRA adapters over the served model)")
        if getattr(optimizer, "type", "adamw") != "adamw":
            raise BadInput(f"optimizer_config.type: {optimizer.type!r} is not supported (adamw)")
        if lora.rank < 1:
            raise BadInput(f"lora_config.rank: {lora.rank} must be >= 1")
        if not (lora.train_attn or lora.train_mlp or lora.train_unembed):
            raise BadInput("lora_config: at least one of train_attn, train_mlp, train_unembed must be true")
        return LoraSpec(rank=lora.rank, train_attn=lora.train_attn, train_mlp=lora.train_mlp,
                        train_unembed=lora.train_unembed, seed=random_seed() if lora.seed is None else lora.seed)

    def _create(self, mid: str, spec: LoraSpec, saved=None) -> Reply:
        model = self.models.get(mid)
        if model is None:
            raise BadInput(f"model {mid!r} was dropped (its session finished)")
        try:
            if saved is None:
                model.tenant = self.pool.new(spec)
            else:
                model.tenant = self.pool.restore(spec, saved["params"], saved.get("opt_state"),
                                                 int(saved["meta"].get("steps", 0)))
        except ValueError:
            self._drop(mid)
            raise
        return Reply(json={"model_id": mid, "type": "create_model"})

    def _drop(self, mid: str) -> None:
        with self._lock:
            self.models.pop(mid, None)
            self.ops.close(mid)

    def get_info(self, body: Any) -> dict:
        req = parse(_types().GetInfoRequest, body)
        tenant = self._tenant(req.model_id, "model_id")
        return {"type": "get_info", "model_id": req.model_id, "model_name": self.name, "is_lora": True,
                "lora_rank": tenant.spec.rank, "optimizer_config": {"type": "adamw"},
                "model_data": {"arch": self.pool.cfg.model_type, "model_name": self.name,
                               "tokenizer_id": self.folder}}

    def _tenant(self, mid: str, field: str = "model_id") -> Tenant:
        model = self.models.get(mid)
        if model is None or model.tenant is None:
            raise BadInput(f"{field}: unknown model {mid!r}")
        return model.tenant

    # ------------------------------------------------------------------ ordered operations
    def failed(self, message: str) -> str:
        """A request id whose future is already settled with the user error `message`."""
        rid = self.futures.new()
        self.futures.fail(rid, message)
        return rid

    def _ordered(self, mid: str | None, seq: int | None, what: str, run) -> str:
        if mid is None or seq is None:
            return self.failed(f"{what}: model_id and seq_id are required")
        return self.ops.submit(mid, seq, what, run)

    def _rejected(self, what: str, e: BadInput, mid: str | None, seq: int | None) -> str:
        """A bad request still takes its turn in its model's order (so the next ones run), then fails."""
        if mid is not None and seq is not None and mid in self.models:
            return self.ops.submit(mid, seq, what, lambda: Reply.error(f"{what}: {e}"))
        return self.failed(f"{what}: {e}")

    def forward_backward(self, body: bytes, encoding: str | None) -> str:
        try:
            req = read_forward_backward(body, encoding, self.vocab, self.pool.max_len)
        except BadInput as e:
            return self._rejected("forward_backward", e, e.model_id, e.seq_id)
        what = "forward" if req.forward_only else "forward_backward"
        names = sorted({k for r in req.rows for k in r.inputs} | ({"weights"} if req.loss == "cross_entropy" else set()))

        def run() -> Reply:
            batch = TokenBatch.pack(req.rows, names, self.pool.max_len)
            logp, loss = self.pool.forward_backward(self._tenant(req.model_id), batch, req.loss, req.config,
                                                    forward_only=req.forward_only)
            return Reply(proto=forward_backward_output(logp, loss))

        return self._ordered(req.model_id, req.seq_id, what, run)

    def optim_step(self, body: Any) -> str:
        try:
            req = parse(_types().OptimStepRequest, body)
            adam = _adam(req.optim_params)
        except BadInput as e:
            return self._rejected("optim_step", e, _get(body, "model_id"), _get(body, "seq_id"))

        def run() -> Reply:
            metrics = self.pool.optim_step(self._tenant(req.model_id), adam)
            return Reply(json={"metrics": {f"optim/{k}": v for k, v in metrics.items()}})

        return self._ordered(req.model_id, req.seq_id, "optim_step", run)

    def save_weights(self, body: Any) -> str:
        try:
            req = parse(_types().SaveWeightsRequest, body)
            path, folder = self.store.new(req.model_id, "weights", req.path, f"state-{secrets.token_hex(4)}")
        except BadInput as e:
            return self._rejected("save_weights", e, _get(body, "model_id"), _get(body, "seq_id"))

        def run() -> Reply:
            meta = {"base_model": self.name, "user_metadata": req.user_metadata or {}}
            save_tenant(folder, self._tenant(req.model_id), meta, optimizer=True, overwrite=req.overwrite)
            return Reply(json={"path": path, "type": "save_weights"})

        return self._ordered(req.model_id, req.seq_id, "save_weights", run)

    def save_weights_for_sampler(self, body: Any) -> str:
        try:
            req = parse(_types().SaveWeightsForSamplerRequest, body)
            if req.path is None and req.sampling_session_seq_id is None:
                raise BadInput("path: give a name, or sampling_session_seq_id for a sampling session")
            target = None if req.path is None else self.store.new(req.model_id, "sampler_weights", req.path, "")
        except BadInput as e:
            return self._rejected("save_weights_for_sampler", e, _get(body, "model_id"), _get(body, "seq_id"))

        def run() -> Reply:
            tenant = self._tenant(req.model_id)
            if target is None:
                sid = self._sampler_id(req.model_id.split(":train:")[0], req.sampling_session_seq_id)
                self._add_sampler(sid, _Sampler(self.sampling.open(sid, tenant.spec, tenant.params),
                                                owner=req.model_id))
                return Reply(json={"sampling_session_id": sid, "type": "save_weights_for_sampler"})
            save_tenant(target[1], tenant, {"base_model": self.name, "user_metadata": req.user_metadata or {}},
                        optimizer=False, overwrite=True)
            return Reply(json={"path": target[0], "type": "save_weights_for_sampler"})

        return self._ordered(req.model_id, req.seq_id, "save_weights_for_sampler", run)

    def load_weights(self, body: Any) -> str:
        """`load_weights`: into an existing client (legacy: model_id + seq_id), or creating one from a checkpoint
        (session_id + model_seq_id: the new client's operation 0)."""
        try:
            req = parse(_types().LoadWeightsRequest, body)
            _, folder = self.store.folder(req.path)
            if req.session_id is not None:
                return self._create_from(req, folder)
        except BadInput as e:
            return self._rejected("load_weights", e, _get(body, "model_id"), _get(body, "seq_id"))

        def run() -> Reply:
            tenant = self._tenant(req.model_id)
            saved = load_tenant(folder, optimizer=req.optimizer)
            _same_structure(LoraSpec.from_json(saved["meta"]["lora"]), tenant.spec)
            fresh = self.pool.restore(tenant.spec, saved["params"], saved["opt_state"], tenant.steps)
            tenant.params, tenant.grads = fresh.params, fresh.grads
            if req.optimizer:
                tenant.opt_state = fresh.opt_state
            return Reply(json={"path": req.path, "model_id": req.model_id, "type": "load_weights"})

        return self._ordered(req.model_id, req.seq_id, "load_weights", run)

    def _create_from(self, req, folder: Path) -> str:
        self.session(req.session_id)
        self._base(req.base_model, "base_model")
        if req.optimizer_config is not None and getattr(req.optimizer_config, "type", "adamw") != "adamw":
            raise BadInput(f"optimizer_config.type: {req.optimizer_config.type!r} is not supported (adamw)")

        def run(mid: str) -> Reply:
            saved = load_tenant(folder, optimizer=req.optimizer)
            self._base(saved["meta"].get("base_model"), "path")
            self._create(mid, LoraSpec.from_json(saved["meta"]["lora"]), saved)
            return Reply(json={"path": req.path, "model_id": mid, "type": "load_weights"})

        return self._register(req.session_id, req.model_seq_id, 0,
                              lambda mid: self.ops.submit(mid, 0, "load_weights", lambda: run(mid)))

    # ------------------------------------------------------------------ sampling sessions
    def _sampler_id(self, sid: str, seq: int) -> str:
        return f"{sid}:sample:{seq}"

    def _add_sampler(self, key: str, entry: _Sampler) -> None:
        """Registers a sampling session; a training client keeps its `keep_snapshots` newest snapshots (an RL loop
        takes one a step and never samples an old one again: their adapters' memory goes)."""
        with self._lock:
            self.samplers[key] = entry
            dropped = []
            if entry.owner is not None:
                mine = [k for k, e in self.samplers.items() if e.owner == entry.owner]
                dropped = [self.samplers.pop(old) for old in mine[:-self.keep_snapshots]]
            session = self.sessions.get(key.split(":sample:")[0])
            if session is not None:
                session.samplers.append(key)
        for old in dropped:
            self.sampling.close(old.weights)

    def create_sampling_session(self, body: Any) -> dict:
        """A sampling session over the base (`base_model`) or a saved checkpoint (`model_path`); runs in a worker
        thread of the event loop (reading a checkpoint takes a moment)."""
        req = parse(_types().CreateSamplingSessionRequest, body)
        self.session(req.session_id)
        key = self._sampler_id(req.session_id, req.sampling_session_seq_id)
        if key in self.samplers:
            return {"type": "create_sampling_session", "sampling_session_id": key}
        if req.model_path is None:
            if req.base_model is None:
                raise BadInput("base_model: give base_model or model_path")
            self._base(req.base_model, "base_model")
            entry = _Sampler(self.sampling.open(key))
        else:
            _, folder = self.store.folder(req.model_path, "model_path")
            saved = load_tenant(folder)
            self._base(saved["meta"].get("base_model"), "model_path")
            spec = LoraSpec.from_json(saved["meta"]["lora"])
            entry = _Sampler(self.sampling.open(key, spec, self.pool.restore(spec, saved["params"]).params),
                             req.model_path)
        self._add_sampler(key, entry)
        return {"type": "create_sampling_session", "sampling_session_id": key}

    def sampler(self, key: str) -> dict:
        entry = self._sampler_entry(key, "sampler_id")
        return {"sampler_id": key, "base_model": self.name, "model_path": entry.model_path}

    def join_sampling_session(self, body: Any) -> dict:
        req = parse(_types().JoinSamplingSessionRequest, body)
        entry = self._sampler_entry(req.sampling_session_id, "sampling_session_id")
        with self._lock:
            entry.clients += 1
            return {"type": "join_sampling_session", "client_counter": entry.clients}

    def _sampler_entry(self, key: str | None, field: str) -> _Sampler:
        entry = self.samplers.get(key) if key is not None else None
        if entry is None:
            raise BadInput(f"{field}: unknown sampling session {key!r}")
        return entry

    def asample(self, body: Any) -> dict:
        """Queues a sampling request; returns its request id and one sequence id per sample."""
        rid = self.futures.new()
        n = _get(body, "num_samples")
        ids = [f"{rid}:{i}" for i in range(n if isinstance(n, int) and 0 < n <= 1024 else 0)]
        try:
            job = self._sample_job(body, lambda reply: self.futures.resolve(rid, reply))
        except BadInput as e:
            self.futures.fail(rid, f"sample: {e}")
            return {"request_id": rid, "sample_sequence_ids": ids}
        self.sampling.submit(job)
        return {"request_id": rid, "sample_sequence_ids": ids}

    def _sample_job(self, body: Any, reply) -> SampleJob:
        req = parse(_types().SampleRequest, body)
        entry = self._sampler_entry(req.sampling_session_id, "sampling_session_id")
        return check_sample(req, entry.weights, reply, vocab=self.vocab, max_len=self.sampling.max_len)

    # ------------------------------------------------------------------ results
    async def retrieve(self, body: Any, poll_s: float) -> Reply | None:
        req = parse(_types().FutureRetrieveRequest, body)
        if not self.futures.known(req.request_id):
            raise BadInput(f"request_id: unknown request {req.request_id!r}", status=404)
        return await self.futures.wait(req.request_id, poll_s)

    def capabilities(self) -> dict:
        return {"supported_models": [{"model_name": self.name, "max_context_length": self.pool.max_len,
                                      "trainable": True, "sampleable": True}]}


def _get(body: Any, key: str):
    return body.get(key) if isinstance(body, dict) else None


def _adam(params) -> AdamSettings:
    """The optimizer step's settings (AdamW only), each checked."""
    if getattr(params, "type", None) not in (None, "adamw") or not hasattr(params, "beta1"):
        raise BadInput(f"optim_params.type: {getattr(params, 'type', '?')!r} is not supported (AdamParams only)")
    checks = {"learning_rate": params.learning_rate >= 0, "beta1": 0 <= params.beta1 < 1,
              "beta2": 0 <= params.beta2 < 1, "eps": params.eps > 0, "weight_decay": params.weight_decay >= 0,
              "grad_clip_norm": params.grad_clip_norm >= 0}
    for name, ok in checks.items():
        if not ok:
            raise BadInput(f"adam_params.{name}: {getattr(params, name)!r} is out of range")
    return AdamSettings(**{name: float(getattr(params, name)) for name in checks})


def _same_structure(saved: LoraSpec, live: LoraSpec) -> None:
    if saved.structure != live.structure:
        raise BadInput(f"path: the checkpoint's adapters (rank {saved.rank}, {saved.target()}) do not fit this "
                       f"training client's (rank {live.rank}, {live.target()})")

