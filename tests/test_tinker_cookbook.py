"""tinker-cookbook's loop recipes, run to completion against posttrain's Tinker server (tiny:llama, offline).

No tinker-cookbook release installs beside this environment's pins (docs/tutorials/tinker.md says why), so these are
the recipes' API call sequences, step for step, written here: `recipes/sl_loop.py` (supervised: `forward_backward`
with `cross_entropy` and `optim_step` submitted together, a state checkpoint every `save_every` steps, the final
`save_state` + `save_weights_for_sampler`, and a second run that resumes from the last checkpoint with
`create_training_client_from_state_with_optimizer`) and `recipes/rl_loop.py` with `loss_fn="importance_sampling"`
(`save_weights_and_get_sampling_client` every step, one `sample` of `group_size` sequences per prompt with the
renderer's stop strings, group-centred advantages, datums whose prompt positions carry zero advantage, the
importance-sampling step). What the recipes take from a hub is replaced by local pieces, as a user without one
would: the tokenizer comes from the server (`get_tokenizer()`, a local folder), a role-colon chat renderer, rows
written here, and (for RL) a reward a random tiny model can earn."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

os.environ.setdefault("TINKER_TELEMETRY", "0")
tinker = pytest.importorskip("tinker")
torch = pytest.importorskip("torch")
from tinker import types  # noqa: E402
from tinker.types.tensor_data import TensorData  # noqa: E402

BASE = "tiny:llama"
pytestmark = pytest.mark.slow  # the SDK against a live server, two training loops: ~2 minutes on this machine


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    """`posttrain serve tiny:llama --tinker` in this process."""
    from posttrain.serve import ServeConfig, Server

    srv = Server(ServeConfig(model=BASE, port=0, max_slots=8, segment_steps=8, tinker=True,
                             tinker_checkpoints=str(tmp_path_factory.mktemp("ckpts")))).start()
    yield srv.url
    srv.stop()


class RoleColonRenderer:
    """The cookbook's role-colon format ("User: ...\\n\\nAssistant: ...\\n\\n"), over any tokenizer."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def build_supervised_example(self, messages):
        tokens, weights = [], []
        for m in messages:
            head, body = self._encode(m["role"].capitalize() + ":"), self._encode(" " + m["content"] + "\n\n")
            train = m["role"] == "assistant"
            tokens += head + body
            weights += [0.0] * len(head) + [1.0 if train else 0.0] * len(body)
        return tokens, weights

    def build_generation_prompt(self, messages) -> types.ModelInput:
        tokens, _ = self.build_supervised_example(messages)
        return types.ModelInput.from_ints(tokens + self._encode("Assistant:"))

    def get_stop_sequences(self) -> list[str]:
        return ["\n\nUser:"]

    def parse_response(self, tokens: list[int]) -> str:
        text = self.tokenizer.decode(tokens)
        parts = text.split("\n\nUser:")
        assert len(parts) <= 2, "stop strings end a sequence at the first one"
        return parts[0].strip()


def conversation_to_datum(messages, renderer, max_length: int) -> types.Datum:
    """The cookbook's `supervised.data.conversation_to_datum`: inputs [:-1], targets and weights [1:]."""
    tokens, weights = renderer.build_supervised_example(messages)
    tokens, weights = torch.tensor(tokens[:max_length]), torch.tensor(weights[:max_length])
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1].tolist()),
                       loss_fn_inputs={"weights": TensorData.from_torch(weights[1:]),
                                       "target_tokens": TensorData.from_torch(tokens[1:])})


def save_checkpoint(training_client, name: str, log_path: Path, kind: str, loop_state: dict) -> dict:
    """The cookbook's `checkpoint_utils.save_checkpoint`: state and/or sampler weights, a line in checkpoints.jsonl."""
    futures = {}
    if kind in ("state", "both"):
        futures["state"] = training_client.save_state(name)
    if kind in ("sampler", "both"):
        futures["sampler"] = training_client.save_weights_for_sampler(name)
    paths = {k + "_path": f.result().path for k, f in futures.items()}
    with open(log_path / "checkpoints.jsonl", "a") as f:
        f.write(json.dumps({"name": name, **loop_state, **paths}) + "\n")
    return paths


def get_last_checkpoint(log_path: Path) -> dict | None:
    path = log_path / "checkpoints.jsonl"
    rows = [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []
    rows = [r for r in rows if "state_path" in r]
    return rows[-1] if rows else None


CHATS = [[{"role": "user", "content": f"say {w}"}, {"role": "assistant", "content": w}]
         for w in ("apple", "pear", "plum", "fig", "kiwi", "lime", "date", "peach")]


def sl_loop(url: str, log_path: Path, n_batches: int, batch_size: int = 4, save_every: int = 2,
            lr: float = 1e-2) -> list[float]:
    """recipes/sl_loop.py's calls; returns each step's mean NLL."""
    service_client = tinker.ServiceClient(base_url=url, api_key="tml-cookbook")
    resume = get_last_checkpoint(log_path)
    if resume:
        training_client = service_client.create_training_client_from_state_with_optimizer(resume["state_path"]).result()
        start = resume["batch"]
    else:
        training_client = service_client.create_lora_training_client(base_model=BASE, rank=8).result()
        start = 0
    renderer = RoleColonRenderer(training_client.get_tokenizer())
    nll = []
    for step in range(start, n_batches):
        if save_every > 0 and step % save_every == 0 and step > 0:
            save_checkpoint(training_client, f"{step:06d}", log_path, "state", {"batch": step})
        adam = tinker.AdamParams(learning_rate=lr * max(0.0, 1.0 - step / n_batches), beta1=0.9, beta2=0.95,
                                 eps=1e-8)
        rows = [CHATS[(step * batch_size + i) % len(CHATS)] for i in range(batch_size)]
        batch = [conversation_to_datum(r, renderer, 64) for r in rows]
        fwd_bwd_future = training_client.forward_backward(batch, loss_fn="cross_entropy")
        optim_future = training_client.optim_step(adam)
        result, optim_result = fwd_bwd_future.result(), optim_future.result()
        assert optim_result.metrics
        logprobs = [x["logprobs"].to_torch() for x in result.loss_fn_outputs]
        weights = [d.loss_fn_inputs["weights"].to_torch() for d in batch]
        nll.append(float(-sum((lp * w).sum() for lp, w in zip(logprobs, weights)) / sum(w.sum() for w in weights)))
    save_checkpoint(training_client, "final", log_path, "both", {"batch": n_batches})
    service_client.close("success").result()
    return nll


def test_supervised_loop_recipe_runs_resumes_and_learns(url, tmp_path):
    first = sl_loop(url, tmp_path, n_batches=4)  # saves a state at step 2, then the final one
    assert len(first) == 4 and first[-1] < first[0]
    rows = [json.loads(x) for x in (tmp_path / "checkpoints.jsonl").read_text().splitlines()]
    assert [r["name"] for r in rows] == ["000002", "final"] and "sampler_path" in rows[-1]
    (tmp_path / "checkpoints.jsonl").write_text(json.dumps(rows[0]) + "\n")  # as if the run had died at step 3
    again = sl_loop(url, tmp_path, n_batches=4)  # resumes from step 2 with its optimizer state
    assert len(again) == 2
    np.testing.assert_allclose(again, first[2:], rtol=2e-3)  # the same steps again, from the same state
    sampler = tinker.ServiceClient(base_url=url, api_key="tml-cookbook").create_sampling_client(
        model_path=json.loads((tmp_path / "checkpoints.jsonl").read_text().splitlines()[-1])["sampler_path"]).result()
    assert len(sampler.sample(types.ModelInput.from_ints([5, 6, 7]), 1, types.SamplingParams(max_tokens=3))
               .result().sequences) == 1


def reward(text: str) -> float:
    """A local task a random model can score on: the share of vowels in the answer."""
    return sum(c in "aeiou" for c in text) / max(len(text), 1)


def test_rl_loop_recipe_with_importance_sampling_runs_to_completion(url, tmp_path):
    """recipes/rl_loop.py's calls with loss_fn="importance_sampling"."""
    service_client = tinker.ServiceClient(base_url=url, api_key="tml-cookbook")
    training_client = service_client.create_lora_training_client(base_model=BASE, rank=8).result()
    renderer = RoleColonRenderer(training_client.get_tokenizer())
    sampling_params = tinker.types.SamplingParams(max_tokens=12, stop=renderer.get_stop_sequences())
    adam = types.AdamParams(learning_rate=1e-2, beta1=0.9, beta2=0.95, eps=1e-8)
    questions = ["a word", "a name", "a sound", "a color"]
    mean_rewards, trained = [], 0
    for batch_idx in range(3):
        sampling_client = training_client.save_weights_and_get_sampling_client().result()
        futures, prompts = [], []
        for q in questions[:2]:
            model_input = renderer.build_generation_prompt([{"role": "user", "content": q}])
            futures.append(sampling_client.sample(prompt=model_input, num_samples=4, sampling_params=sampling_params))
            prompts.append(model_input)
        datums, rewards = [], []
        for future, prompt in zip(futures, prompts):
            result = future.result()
            group = [(s.tokens, s.logprobs, reward(renderer.parse_response(s.tokens))) for s in result.sequences]
            assert all(len(s.sequence_id) > 0 for s in result.sequences)
            mean = sum(r for _, _, r in group) / len(group)
            rewards.append(mean)
            advantages = [r - mean for _, _, r in group]
            if all(a == 0.0 for a in advantages):
                continue
            for (tokens, logprobs, _), advantage in zip(group, advantages):
                ob_len = prompt.length - 1
                model_input = prompt.append(types.EncodedTextChunk(tokens=tokens[:-1]))
                datums.append(types.Datum(model_input=model_input, loss_fn_inputs={
                    "target_tokens": TensorData.from_torch(torch.tensor([0] * ob_len + tokens)),
                    "logprobs": TensorData.from_torch(torch.tensor([0.0] * ob_len + logprobs)),
                    "advantages": TensorData.from_torch(torch.tensor(
                        [0.0] * ob_len + [advantage] * (model_input.length - ob_len)))}))
        if datums:
            fwd_bwd_future = training_client.forward_backward(datums, loss_fn="importance_sampling")
            optim_step_future = training_client.optim_step(adam)
            assert len(fwd_bwd_future.result().loss_fn_outputs) == len(datums)
            optim_step_future.result()
            trained += 1
        mean_rewards.append(sum(rewards) / len(rewards))
    paths = save_checkpoint(training_client, "final", tmp_path, "both", {"batch": 3})
    assert paths["state_path"].startswith("tinker://") and trained >= 1 and len(mean_rewards) == 3
    service_client.close("success").result()
