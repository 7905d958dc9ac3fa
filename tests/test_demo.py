"""A reduced `posttrain demo`: every file is written, numbers are finite, and the final checkpoint loads in
`transformers` with the same greedy answers as ours on 20 held-out problems."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from posttrain.demo.run import DemoSettings, run_demo


@pytest.mark.slow
def test_reduced_demo_plumbing(tmp_path):
    import torch
    import transformers

    out = tmp_path / "demo"
    summary = run_demo(out, seed=1, settings=DemoSettings.reduced())
    assert [s["name"] for s in summary["stages"]] == ["init", "sft", "rl"]
    for s in summary["stages"]:
        assert math.isfinite(s["accuracy"]) and 0 <= s["accuracy"] <= 1
        assert math.isfinite(s["mean_reward"]) and math.isfinite(s["seconds"])
    assert json.loads((out / "summary.json").read_text())["seed"] == 1
    for f in ("sft.yaml", "rl.yaml", "demo.png", "sft/metrics.jsonl", "rl/metrics.jsonl", "rl/samples.jsonl",
              "sft/config.yaml", "rl/config.yaml", "rl/hf/config.json", "rl/hf/model.safetensors"):
        assert (out / f).exists(), f
    assert list((out / "sft" / "tensorboard").iterdir()) and list((out / "rl" / "tensorboard").iterdir())
    for line in open(out / "rl" / "metrics.jsonl"):
        assert all(not isinstance(v, float) or math.isfinite(v) for v in json.loads(line).values())

    # the final checkpoint in transformers: same greedy answers as ours on 20 held-out problems
    from posttrain import tokenizer as tok_lib
    from posttrain.models import from_pretrained
    from posttrain.sampling import Sampler, SamplingParams

    hf_dir = out / "rl" / "hf"
    tok = tok_lib.load(hf_dir)
    problems = [json.loads(x)["prompt"] for x in open(out / "data" / "heldout.jsonl")][:20]
    prompts = [tok.encode(p) for p in problems]
    ours = Sampler(from_pretrained(hf_dir), tok).generate(prompts, SamplingParams(max_new_tokens=24, temperature=0))
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    for p, c in zip(prompts, ours):
        with torch.no_grad():
            g = hf.generate(torch.tensor([p]), max_new_tokens=24, do_sample=False, eos_token_id=tok.eos_token_ids,
                            pad_token_id=tok.pad_token_id)
        theirs = g[0, len(p):].tolist()
        np.testing.assert_array_equal(c.token_ids, theirs[: len(c.token_ids)])
        assert len(theirs) == len(c.token_ids) or c.finish_reason == "stop"
