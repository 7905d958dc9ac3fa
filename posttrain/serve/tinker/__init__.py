"""posttrain.serve.tinker: the Tinker training API (the `tinker` SDK 0.38.0 and tinker-cookbook loops) on posttrain.

A client writes its training loop (`forward_backward`, `optim_step`, `sample`, `save_state`); this server runs it:
each training client is a LoRA over the served base (several at once, each with its own optimizer state), its
operations run in `seq_id` order on one training thread, and sampling sessions sample from the weights saved for
them. Layout: `wire` (the SDK's protobuf and JSON bodies), `futures` (request ids and `retrieve_future`), `ops` (the
ordered training worker), `sampling` and `requests` (sampling sessions), `store` (`tinker://` checkpoint paths),
`service` (the state and operations), `routes` (the `/api/v1` routes), `app` (a server of its own).
"""

from posttrain.serve.tinker.app import TinkerServer, build_app, open_service
from posttrain.serve.tinker.routes import build_router
from posttrain.serve.tinker.service import TinkerService

__all__ = ["TinkerServer", "TinkerService", "build_app", "build_router", "open_service"]
