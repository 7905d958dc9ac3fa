"""`python -m posttrain.serve.tinker MODEL`: serve the Tinker training API over MODEL until SIGTERM / SIGINT."""

from __future__ import annotations

import argparse
import logging
import os
import sys


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m posttrain.serve.tinker", description=__doc__)
    p.add_argument("model", metavar="MODEL", help="HF checkpoint folder, a run's output folder, tiny:<family>, ...")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", default=None, help="the name clients pass as base_model (default: MODEL)")
    p.add_argument("--checkpoints", default="tinker-checkpoints", help="folder of the tinker:// checkpoints")
    p.add_argument("--api-key", default=os.environ.get("POSTTRAIN_API_KEY"),
                   help="the X-API-Key clients must send (tml-...); default: any tml- key")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--max-slots", type=int, default=32, help="sequences decoded at once per sampling call")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    try:
        from posttrain import compile_cache  # lazy: --help answers without JAX
        from posttrain.serve.tinker.app import TinkerServer, open_service  # lazy: --help answers without JAX

        compile_cache.enable()  # a restarted server compiles nothing it compiled before

        service = open_service(args.model, name=args.served_model_name, checkpoints=args.checkpoints,
                               dtype=args.dtype, max_slots=args.max_slots)
        server = TinkerServer(service, host=args.host, port=args.port, api_key=args.api_key)
    except (ValueError, OSError, ImportError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"Tinker API for {service.name!r} on {server.url}/api/v1", file=sys.stderr, flush=True)
    server.run()
    print("Tinker API: stopped", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
