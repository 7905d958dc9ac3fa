"""posttrain.serve.tinker: the Tinker training API (the `tinker` SDK 0.38.0 and tinker-cookbook loops) on posttrain,
served by `posttrain serve MODEL --tinker` under `/api/v1` beside the OpenAI-compatible routes.

A client writes its training loop (`forward_backward`, `optim_step`, `sample`, `save_state`); this server runs it:
each training client is a LoRA over the served base (several at once, each with its own optimizer state), its
operations run in `seq_id` order on one training thread, and sampling sessions sample on the server's serving engine
from the weights saved for them. Layout: `wire` (the SDK's protobuf and JSON bodies), `futures` (request ids and
`retrieve_future`), `ops` (the ordered training worker), `sampling` and `requests` (sampling sessions on the
engine), `store` (`tinker://` checkpoint paths), `service` (the state and operations), `routes` (the routes).
"""

from posttrain.serve.tinker.routes import PREFIX, build_router
from posttrain.serve.tinker.service import TinkerService

__all__ = ["PREFIX", "TinkerService", "build_router"]
