"""Assistant-only loss masks under the chat templates of real model families (tests/data/chat_templates/, each
file names the checkpoint whose template it reproduces), and GSM8K prompts rendered as the RL config says."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from posttrain.data import encode_record, read_prompts
from posttrain.rollout.prompts import encode_prompt
from posttrain.models.tokenizer import build_tokenizer

TEMPLATES = Path(__file__).resolve().parent / "data" / "chat_templates"

# family -> (special tokens: bos, eos, others), whether it takes a system message
FAMILIES = {
    "llama3": ("<|begin_of_text|>", "<|eot_id|>", ["<|start_header_id|>", "<|end_header_id|>"], True),
    "qwen2.5": (None, "<|im_end|>", ["<|im_start|>"], True),
    "qwen3": (None, "<|im_end|>", ["<|im_start|>", "<think>", "</think>"], True),
    "gemma": ("<bos>", "<eos>", ["<start_of_turn>", "<end_of_turn>"], False),
    "mistral": ("<s>", "</s>", [], False),
}

# What the loss sees per family: each assistant turn as the full rendering shows it, with its end-of-turn
# tokens, and nothing of the system/user turns or the assistant headers. Qwen3 drops the reasoning of the
# first answer (a later user turn follows it) and keeps that of the last one.
EXPECTED = {
    "llama3": "Hello.<|eot_id|>4<|eot_id|>",
    "qwen2.5": "Hello.<|im_end|>\n4<|im_end|>\n",
    "qwen3": "Hello.<|im_end|>\n<think>\nadd them\n</think>\n\n4<|im_end|>\n",
    "gemma": "Hello.<end_of_turn>\n4<end_of_turn>\n",
    "mistral": "Hello.</s>4</s>",
}


def family_tokenizer(family: str, folder: Path):
    """The character tokenizer with the family's special tokens and chat template."""
    bos, eos, extra, _ = FAMILIES[family]
    tok = build_tokenizer(folder)
    special = {"eos_token": eos, "additional_special_tokens": extra}
    if bos:
        special["bos_token"] = bos
    tok.hf.add_special_tokens(special)
    tok.hf.chat_template = (TEMPLATES / f"{family}.jinja").read_text()
    return tok


@pytest.mark.parametrize("family", list(FAMILIES))
def test_assistant_mask_under_real_templates(family, tmp_path):
    tok = family_tokenizer(family, tmp_path)
    think = family == "qwen3"
    messages = [
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": ("<think>\ngreet back\n</think>\n\n" if think else "") + "Hello."},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": ("<think>\nadd them\n</think>\n\n" if think else "") + "4"},
    ]
    if FAMILIES[family][3]:
        messages.insert(0, {"role": "system", "content": "Be brief."})
    ex = encode_record({"messages": messages}, tok)
    full = tok.apply_chat_template(messages, tokenize=False)
    assert tok.decode(ex.input_ids, skip_special_tokens=False) == full
    assert "Hello." in full and "greet back" not in full  # (qwen3: the earlier reasoning is not rendered)
    assert tok.decode(ex.input_ids[ex.loss_mask > 0], skip_special_tokens=False) == EXPECTED[family]
    # the masked tokens are contiguous runs: one per assistant turn
    runs = sum(1 for i in range(1, len(ex.loss_mask)) if ex.loss_mask[i] > 0 and ex.loss_mask[i - 1] == 0)
    assert runs == 2


def test_gsm8k_prompts_with_chat_template_and_system_prompt(gsm8k, tmp_path):
    """GSM8K as configs/gsm8k_grpo.yaml reads it: `question` as the prompt, the other fields for the rewards,
    rendered with the Qwen2.5 template, the configured system prompt and the generation prompt."""
    from posttrain.rl.loop import load_rl_config

    cfg = load_rl_config(Path(__file__).resolve().parents[1] / "configs" / "gsm8k_grpo.yaml")
    records = read_prompts(str(gsm8k / "train.jsonl"), prompt_field=cfg.data.prompt_field)
    raw = [json.loads(line) for line in open(gsm8k / "train.jsonl")]
    assert len(records) == len(raw) == 7473
    assert records[0] == {"prompt": raw[0]["question"], "answer": raw[0]["answer"]}
    tok = family_tokenizer("qwen2.5", tmp_path)
    ids = encode_prompt(tok, records[0]["prompt"], chat=cfg.data.chat, system_prompt=cfg.data.system_prompt)
    expected = (f"<|im_start|>system\n{cfg.data.system_prompt}<|im_end|>\n"
                f"<|im_start|>user\n{raw[0]['question']}<|im_end|>\n<|im_start|>assistant\n")
    assert "\\boxed{}" in cfg.data.system_prompt
    assert ids == tok.encode(expected, add_special_tokens=False)
