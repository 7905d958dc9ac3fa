"""GGUF in: small GGUF files written here with the `gguf` package (layout, errors), then the real SmolLM2-135M and
Gemma 3 270M from the package registry (slow: parity with transformers, greedy generation, tokenizers, convert)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from posttrain.models import from_pretrained
from posttrain.models.config import UnsupportedModelError
from posttrain.models.gguf_io import GGUFError

pytestmark = pytest.mark.full_optimization  # numbers against a reference: compiled as users' runs are (tests/conftest.py)

# ---------------------------------------------------------------------------------------------- small files


def write_gguf(path, arch: str, hf_folder=None, tensors=None, metadata=None, raw_types=None):
    """A GGUF file: from a tiny HF checkpoint (names by gguf's own HF->GGUF map, Llama q/k rows permuted the way
    llama.cpp's converter does), or from the given `tensors`."""
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    if hf_folder is not None:
        from safetensors.numpy import load_file

        cfg = json.loads((hf_folder / "config.json").read_text())
        n, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
        w.add_uint32(f"{arch}.block_count", cfg["num_hidden_layers"])
        w.add_uint32(f"{arch}.embedding_length", cfg["hidden_size"])
        w.add_uint32(f"{arch}.feed_forward_length", cfg["intermediate_size"])
        w.add_uint32(f"{arch}.attention.head_count", n)
        w.add_uint32(f"{arch}.attention.head_count_kv", kv)
        w.add_uint32(f"{arch}.attention.key_length", cfg["head_dim"])
        w.add_uint32(f"{arch}.context_length", cfg["max_position_embeddings"])
        w.add_uint32(f"{arch}.vocab_size", cfg["vocab_size"])
        w.add_float32(f"{arch}.rope.freq_base", cfg.get("rope_parameters", {}).get("rope_theta", cfg.get("rope_theta")))
        w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", cfg["rms_norm_eps"])
        names = gguf.get_tensor_name_map(getattr(gguf.MODEL_ARCH, arch.upper()), cfg["num_hidden_layers"])
        tensors = {}
        for hf_name, t in load_file(str(hf_folder / "model.safetensors")).items():
            if arch == "llama" and (".q_proj." in hf_name or ".k_proj." in hf_name):
                heads = n if ".q_proj." in hf_name else kv
                t = t.reshape(heads, 2, t.shape[0] // heads // 2, *t.shape[1:]).swapaxes(1, 2).reshape(t.shape)
            tensors[names.get_name(hf_name, try_suffixes=(".weight", ".bias"))] = t
    for k, v in (metadata or {}).items():
        w.add_string(k, v) if isinstance(v, str) else w.add_uint32(k, v)
    for name, t in tensors.items():
        if raw_types and name in raw_types:
            w.add_tensor(name, t, raw_dtype=raw_types[name])
        else:
            w.add_tensor(name, np.ascontiguousarray(t, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.slow
def test_gguf_loads_like_the_hf_checkpoint(family, hf_checkpoint, tmp_path):
    folder = hf_checkpoint(family)
    path = write_gguf(tmp_path / "m.gguf", family, hf_folder=folder)
    ids = np.random.default_rng(0).integers(3, 96, size=(2, 9))
    ref = np.asarray(from_pretrained(folder)(ids))
    ours = np.asarray(from_pretrained(path)(ids))
    assert np.abs(ours - ref).max() < 1e-5
    assert from_pretrained(tmp_path, dtype="bfloat16").cfg.param_dtype == "bfloat16"  # a folder holding one


def test_info_reads_a_gguf_file(hf_checkpoint, tmp_path, capsys):
    import gguf
    import transformers

    from posttrain.cli.main import main

    folder = hf_checkpoint("llama")
    path = write_gguf(tmp_path / "m.gguf", "llama", hf_folder=folder)
    assert main(["info", str(path)]) == 0
    out = capsys.readouterr().out
    n = sum(p.numel() for p in transformers.AutoModelForCausalLM.from_pretrained(folder).parameters())
    assert "LlamaForCausalLM" in out and f"{n:,}" in out and "F32 (" in out and "gguf architecture" in out
    raw = np.zeros((2, 292), np.uint8)  # Q8_K: a type we cannot dequantize is an error for info too
    q8k = gguf.GGMLQuantizationType.Q8_K
    bad = write_gguf(tmp_path / "q8k.gguf", "llama", tensors={"token_embd.weight": raw},
                     raw_types={"token_embd.weight": q8k}, metadata={"llama.block_count": 1})
    assert main(["info", str(bad)]) == 1
    assert "quantization type Q8_K" in capsys.readouterr().err
    (tmp_path / "cut.gguf").write_bytes(path.read_bytes()[:300])
    assert main(["info", str(tmp_path / "cut.gguf")]) == 1
    assert "truncated GGUF file" in capsys.readouterr().err


def test_truncated_gguf_is_a_clear_error(hf_checkpoint, tmp_path):
    path = write_gguf(tmp_path / "m.gguf", "llama", hf_folder=hf_checkpoint("llama"))
    data = path.read_bytes()
    for keep in (len(data) - 1000, 300, 10):  # cut in the tensor data, in the header, before the header
        cut = tmp_path / f"cut{keep}.gguf"
        cut.write_bytes(data[:keep])
        with pytest.raises(GGUFError, match=rf"cut{keep}\.gguf: truncated GGUF file") as e:
            from_pretrained(cut)
        assert "\n" not in str(e.value)
    (tmp_path / "not.gguf").write_bytes(b"PK\x03\x04" + data[4:100])
    with pytest.raises(GGUFError, match="not a GGUF file"):
        from_pretrained(tmp_path / "not.gguf")


def test_unsupported_architecture_and_quant_type(tmp_path):
    import gguf

    path = write_gguf(tmp_path / "mamba.gguf", "mamba", tensors={"token_embd.weight": np.zeros((4, 8))})
    with pytest.raises(UnsupportedModelError, match=r"mamba\.gguf: GGUF architecture 'mamba' is not supported"):
        from_pretrained(path)
    q8k = gguf.GGMLQuantizationType.Q8_K  # block of 256 values in 292 bytes: no dequantizer in gguf
    raw = np.zeros((2, 292), np.uint8)
    path = write_gguf(tmp_path / "q8k.gguf", "llama", tensors={"token_embd.weight": raw}, raw_types={"token_embd.weight": q8k},
                      metadata={"llama.block_count": 1})
    with pytest.raises(GGUFError, match=r"q8k\.gguf: tensor 'token_embd.weight' has quantization type Q8_K"):
        from_pretrained(path)


# ---------------------------------------------------------------------------------------------- real models

SENTENCES = [
    "The quick brown fox jumps over the lazy dog, and then it runs back into the forest to find its den.",
    "In 1969, Neil Armstrong became the first person to walk on the Moon.",
    "Photosynthesis converts light energy into chemical energy stored in glucose molecules.",
    "She opened the window; a cold wind rushed in and scattered the papers across the floor.",
]
PARAGRAPH = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg developed a system "
    "of movable metal type in the German city of Mainz. Before his invention, books were copied by hand, which made "
    "them rare and expensive. Printing allowed texts to be produced quickly and in large numbers, and within a few "
    "decades presses had spread to more than two hundred cities across Europe. The new technology helped ideas "
    "travel faster than ever before, and historians often connect it with the Renaissance, the Reformation and the "
    "rise of modern science."
)
PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain photosynthesis in one sentence.",
    "List three prime numbers.",
    "How many legs does a spider have?",
    "Translate 'good morning' into Spanish.",
    "What is 12 times 7?",
    "Give me a tip for learning to cook.",
]
# Max abs logit difference allowed against transformers in float32 (the bound). Two float32
# implementations of an 18-30 layer model each sit ~5e-5..1e-4 from the float64 result (rounding alone), so the
# test also computes transformers in float64 and checks that our float32 logits are at least as close to it as
# transformers' float32 ones. On Gemma 3 transformers' own float32 logits are 1.0e-4 from its float64 ones, so no
# float32 implementation can be held to 1e-4 against them (a float64-exact one would be 1.0e-4 away): there the
# bound is IRREDUCIBLE_TOL, and the float64 check carries the claim. The rounding depends on the CPU's vector
# units (both sides' summation orders): on an AVX-512/AMX Xeon (2026-11-29) SmolLM2's two float32 results were
# 1.02e-4 apart with ours the closer to float64 (8.04e-5 against 8.39e-5), and Gemma 3 on the cpu kernel set 7.57e-5
# from float64 against transformers' 6.78e-5 (1.12x), so the float64 check allows FLOAT64_SLACK.
LOGIT_TOL = 1e-4
IRREDUCIBLE_TOL = {"gemma3-270m": 1.5e-4, "smollm2-135m-instruct": 1.25e-4}
FLOAT64_SLACK = 1.2


@pytest.fixture(scope="module", params=["smollm2-135m-instruct", "gemma3-270m"])
def real(request):
    """(name, gguf path, our model, our tokenizer, transformers model) for one real model, loaded once."""
    import torch
    import transformers

    from posttrain.models.fetch import fetch
    from posttrain.models.tokenizer import load

    torch.set_num_threads(1)  # on a shared 2-core machine torch's two spinning threads run ~10x slower than one
    path = fetch(request.param)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    return request.param, path, from_pretrained(path), load(path), hf


@pytest.fixture(scope="module")
def real_reference(real):
    """transformers' logits of SENTENCES for `real`'s model, computed once and shared by both kernel sets:
    (token rows, padded ids, mask, float32 padded-batch logits, float64 logits of each unpadded row)."""
    import copy

    import torch

    _, _, _, tok, hf = real
    rows = [tok.encode(s) for s in SENTENCES]
    ids, mask = _padded(rows, tok.pad_token_id)
    ref = _hf_logits(hf, ids, mask)
    # float64, one unpadded row at a time (transformers' eager attention gives NaN at real tokens next to left
    # padding in float64: masked probabilities 0 times the NaN values of padded rows)
    hf64 = copy.deepcopy(hf).double()
    with torch.no_grad():
        exact = [hf64(torch.tensor([r])).logits[0].numpy() for r in rows]
    del hf64
    return rows, ids, mask, ref, exact


def _padded(rows, pad):
    width = max(map(len, rows))
    ids = np.full((len(rows), width), pad, np.int64)
    mask = np.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, width - len(r):] = r
        mask[i, width - len(r):] = 1
    return ids, mask


def _hf_logits(hf, ids, mask):
    import torch

    pos = np.clip(np.cumsum(mask, 1) - 1, 0, None)
    with torch.no_grad():
        return hf(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask),
                  position_ids=torch.tensor(pos)).logits.float().numpy()


@pytest.mark.slow
@pytest.mark.parametrize("kernels", ["cpu", "generic"])
def test_real_logits_match_transformers(real, real_reference, kernels):
    from posttrain.models import from_pretrained

    name, path, model, tok, hf = real
    if kernels != model.cfg.kernels:
        model = from_pretrained(path, kernels=kernels)
    rows, ids, mask, ref, exact = real_reference
    ours = np.asarray(model(ids, attention_mask=mask))
    m = mask.astype(bool)
    diff = float(np.abs(ours - ref)[m].max())
    err_ours = err_hf = 0.0
    for b in range(len(rows)):
        err_ours = max(err_ours, float(np.abs(ours[b][m[b]] - exact[b]).max()))
        err_hf = max(err_hf, float(np.abs(ref[b][m[b]] - exact[b]).max()))
    print(f"{name} ({kernels}): max abs logit diff {diff:.2e} (max |logit| {np.abs(ref).max():.1f}); "
          f"against float64: ours {err_ours:.2e}, transformers float32 {err_hf:.2e}")
    assert err_ours <= FLOAT64_SLACK * err_hf, (err_ours, err_hf)  # as close to float64 as transformers is
    assert diff < IRREDUCIBLE_TOL.get(name, LOGIT_TOL)
    if kernels != "cpu":
        return
    # perplexity of a fixed English paragraph (reported; a real model with a right tokenizer gives ~10-20)
    para = np.array([tok.encode(PARAGRAPH)])
    logits = np.asarray(model(para))[0, :-1].astype(np.float64)
    logp = logits - logits.max(-1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
    nll = -logp[np.arange(para.shape[1] - 1), para[0, 1:]].mean()
    print(f"{name}: perplexity {math.exp(nll):.2f} over {para.shape[1]} tokens")
    assert math.exp(nll) < 30


@pytest.mark.slow
def test_real_greedy_generation_matches_transformers(real):
    import torch

    from posttrain.sampling import Sampler, SamplingParams

    name, _, model, tok, hf = real
    if tok.chat_template:
        prompts = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True) for p in PROMPTS]
    else:
        prompts = [tok.encode(p) for p in PROMPTS]
    outs = Sampler(model, tok, max_slots=8).generate(prompts, SamplingParams(max_new_tokens=32, temperature=0.0))
    ids, mask = _padded(prompts, tok.pad_token_id)
    with torch.no_grad():
        ref = hf.generate(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask), max_new_tokens=32,
                          do_sample=False, pad_token_id=tok.pad_token_id)[:, ids.shape[1]:].tolist()
    eos = set(tok.eos_token_ids)
    for p, (o, r) in enumerate(zip(outs, ref)):
        r = r[: next((i + 1 for i, t in enumerate(r) if t in eos), len(r))]  # transformers pads after EOS
        assert o.token_ids == r, (name, PROMPTS[p], tok.decode(o.token_ids), tok.decode(r))
    assert sum(len(o.token_ids) for o in outs) >= 8 * 12  # not all stopping at once


TEXT = ("Hello world!  Two  spaces,\ttabs\tand\nnew\n\nlines.\r\nNumbers: 12345, 3.14159, -42, 1e10, 2024-11-23. "
        "Unicode: café naïve 日本語 テキスト 한국어 emoji 🙂👍🏽 Ωμέγα. code: def f(x):\n    return x**2  # done "
        "don't won't I'm we'll they've <div>tag</div>")


@pytest.mark.slow
def test_smollm2_tokenizer_matches_transformers():
    import transformers

    from posttrain.models.fetch import fetch
    from posttrain.models.tokenizer import load

    path = fetch("smollm2-135m-instruct")
    ours, ref = load(path), transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    for text in [TEXT, *TEXT.split(" "), "<|im_start|>user\nhi<|im_end|>"]:
        assert ours.encode(text) == ref.encode(text), text
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+3?"},
            {"role": "assistant", "content": "5"}, {"role": "user", "content": "And 2*3?"}]
    assert ours.apply_chat_template(msgs, add_generation_prompt=True) == \
        ref.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert ours.eos_token_ids == [2] and ours.decode(ours.encode(TEXT)) == TEXT


@pytest.mark.slow
def test_gemma_tokenizer_matches_sentencepiece():
    """Our byte-fallback BPE (built with `tokenizers` from the GGUF's scores) against SentencePiece itself, run on a
    model proto made from the same pieces, scores and types: the algorithm Gemma's tokenizer was made with."""
    import sentencepiece as spm
    from sentencepiece import sentencepiece_model_pb2 as pb

    from posttrain.models.fetch import fetch
    from posttrain.models.gguf_io import GGUFCheckpoint
    from posttrain.models.tokenizer import load

    path = fetch("gemma3-270m")
    ck, tok = GGUFCheckpoint(path), load(path)
    proto = pb.ModelProto()
    proto.trainer_spec.model_type = pb.TrainerSpec.BPE
    proto.trainer_spec.byte_fallback = True
    proto.normalizer_spec.name = "identity"
    proto.normalizer_spec.add_dummy_prefix = False
    proto.normalizer_spec.remove_extra_whitespaces = False
    proto.normalizer_spec.escape_whitespaces = True
    fields = ("tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.token_type")
    for piece, score, kind in zip(*(ck.field(f) for f in fields)):
        p = proto.pieces.add()
        p.piece, p.score, p.type = piece.replace(" ", "\u2581") if kind == 4 else piece, score, kind
    sp = spm.SentencePieceProcessor(model_proto=proto.SerializeToString())
    texts = [TEXT, PARAGRAPH, *SENTENCES, "\x01\x7f\u0378 rare bytes", "supercalifragilisticexpialidocious"]
    for text in texts:
        ids = tok.encode(text, add_special_tokens=False)
        assert ids == sp.encode(text), text
        assert tok.decode(ids) == text
    assert tok.encode("Hi")[0] == tok.bos_token_id == 2
    for word in ["the", " the", " house", " running", " because", " water", " Paris", " computer", " beautiful"]:
        assert len(tok.encode(word, add_special_tokens=False)) == 1, word
    assert len(tok.encode(PARAGRAPH)) < len(PARAGRAPH) / 3.5  # words, not characters


@pytest.mark.slow
def test_convert_output_loads_in_transformers(tmp_path):
    import torch
    import transformers

    from posttrain.cli.main import main
    from posttrain.models.fetch import fetch
    from posttrain.models.tokenizer import load

    path = fetch("smollm2-135m-instruct")
    assert main(["convert", str(path), str(tmp_path / "hf")]) == 0
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32).eval()
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    ours_tok = load(path)
    assert hf_tok.encode(TEXT) == ours_tok.encode(TEXT)
    assert hf_tok.chat_template == ours_tok.chat_template
    ids, mask = _padded([ours_tok.encode(s) for s in SENTENCES], ours_tok.pad_token_id)
    ours = np.asarray(from_pretrained(path)(ids, attention_mask=mask))
    ref = _hf_logits(hf, ids, mask)
    assert np.abs(ours - ref)[mask.astype(bool)].max() < LOGIT_TOL
    assert main(["convert", str(tmp_path / "hf"), str(tmp_path / "again")]) == 2  # not a GGUF


@pytest.mark.slow
def test_fetch_wrong_sha256_is_a_clear_error(tmp_path, monkeypatch):
    import dataclasses

    from posttrain.models import fetch as fetch_mod

    spec = fetch_mod.MODELS["smollm2-135m-instruct"]
    monkeypatch.setitem(fetch_mod.MODELS, "smollm2-135m-instruct", dataclasses.replace(spec, sha256="0" * 64))
    with pytest.raises(fetch_mod.FetchError, match=r"smollm2-135m-instruct: sha256 of the downloaded "
                                                    r"SmolLM2-135M-Instruct.Q4_1.gguf is b179c952.*expected 0000"):
        fetch_mod.fetch("smollm2-135m-instruct", cache=tmp_path)
    assert not list((tmp_path / "smollm2-135m-instruct").glob("*.gguf"))
    with pytest.raises(fetch_mod.FetchError, match="unknown model 'nope'"):
        fetch_mod.fetch("nope", cache=tmp_path)
