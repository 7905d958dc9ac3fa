"""Image parts for a vision-language model through `posttrain serve` (the tiny Gemma 3 VLM), with the real `openai`
client: a `data:` URL image in a user message gives the tokens the sampler gives for the same conversation encoded
by the prompt encoder; a URL that is not `data:` and bad base64 are 400s naming the part."""

from __future__ import annotations

import base64
import io

import numpy as np
import openai
import pytest

from posttrain.data.vlm import VisionSpec, encode_image_prompt
from posttrain.models import from_pretrained
from posttrain.models import tokenizer as tok_lib
from posttrain.sampling import Sampler, SamplingParams
from posttrain.serve import ServeConfig, Server

pytestmark = pytest.mark.slow  # a vision-language server of its own: the vision tower's prefill compiles


@pytest.fixture(scope="module")
def served(tiny_vlm):
    server = Server(ServeConfig(model=str(tiny_vlm), served_model_name="vlm", port=0, max_slots=4,
                                warmup=False)).start()
    yield server
    server.stop()


def _png(seed: int) -> bytes:
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 255, (40, 48, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


def test_image_parts_give_the_samplers_tokens(served, tiny_vlm):
    client = openai.OpenAI(base_url=served.url + "/v1", api_key="-", max_retries=0, timeout=300)
    png = _png(0)
    url = "data:image/png;base64," + base64.b64encode(png).decode()
    msgs = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": "what is this"}]}]
    r = client.chat.completions.create(model="vlm", messages=msgs, max_tokens=6, temperature=0,
                                       extra_body={"return_token_ids": True})
    tok = tok_lib.load(tiny_vlm)
    spec = VisionSpec.from_checkpoint(tiny_vlm, tok)
    ids, pixels = encode_image_prompt([{"role": "user", "content": [{"type": "image", "image": png},
                                                                   {"type": "text", "text": "what is this"}]}],
                                      tok, spec, "test")
    assert r.model_extra["prompt_token_ids"] == ids
    ref = Sampler(from_pretrained(tiny_vlm), tok).generate([ids], SamplingParams(max_new_tokens=6, temperature=0),
                                                           images=[list(pixels)])[0]
    assert r.choices[0].model_extra["token_ids"] == ref.token_ids

    bad = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://example.com/a.png"}},
                                        {"type": "text", "text": "x"}]}]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="vlm", messages=bad, max_tokens=2)
    assert e.value.body["param"] == "messages.0.content.0.image_url.url"
    bad[0]["content"][0]["image_url"]["url"] = "data:image/png;base64,@@@"
    with pytest.raises(openai.BadRequestError, match="not valid base64"):
        client.chat.completions.create(model="vlm", messages=bad, max_tokens=2)
    assert client.chat.completions.create(model="vlm", messages=msgs, max_tokens=2).choices[0].finish_reason
