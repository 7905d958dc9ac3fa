"""Vision-language data: image preprocessing equal to transformers' Gemma3ImageProcessor, TRL's VLM record format
(JSONL, Parquet, datasets), image token expansion, loss masks, packing with images, and one-line errors."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image, ImageDraw

from posttrain.data import DataError, encode_record
from posttrain.data.images import ImageProcessorConfig, load_image, preprocess_image
from posttrain.data.packing import pack_examples
from posttrain.data.pipeline import build_sft_dataset
from posttrain.data.sources import read_records
from posttrain.data.vlm import VisionSpec
from posttrain.models import tokenizer as tk

N_IMG = 4  # mm_tokens_per_image of the test checkpoint


def _image(mode: str, w: int, h: int, seed: int = 0) -> Image.Image:
    """A photo-like image: a random background, filled ellipses and per-pixel noise, in `mode`."""
    rng = np.random.default_rng(seed)
    img = Image.new("RGB", (w, h), tuple(int(v) for v in rng.integers(0, 255, 3)))
    d = ImageDraw.Draw(img)
    for _ in range(6):
        x0, y0 = int(rng.integers(0, w)), int(rng.integers(0, h))
        d.ellipse([x0, y0, x0 + w // 3, y0 + h // 3], fill=tuple(int(v) for v in rng.integers(0, 255, 3)))
    arr = np.asarray(img).astype(np.int16) + rng.integers(-25, 25, (h, w, 3))
    img = Image.fromarray(np.clip(arr, 0, 255).astype(np.uint8))
    if mode == "RGBA":
        img.putalpha(Image.fromarray(rng.integers(0, 256, (h, w)).astype(np.uint8)))
    elif mode == "P":
        img = img.convert("P", palette=Image.Palette.ADAPTIVE, colors=48)
    elif mode == "P+transparency":
        img = img.convert("P", palette=Image.Palette.ADAPTIVE, colors=48)
        img.info["transparency"] = 3
    elif mode != "RGB":
        img = img.convert(mode)
    return img


def _on_white(img: Image.Image) -> Image.Image:
    """`img` composited onto a white background, as RGB (written here, not taken from `posttrain.data.images`: it
    is the reference the preprocessing under test is held to)."""
    rgba = img.convert("RGBA")
    return Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB")


# ----------------------------------------------------------------------------- preprocessing

@pytest.mark.slow  # importing transformers' image processor alone takes ~20 s on a loaded machine
@pytest.mark.parametrize("size", [(224, 224), (64, 48)])
def test_preprocess_equals_transformers(size, tmp_path):
    """Bit-identical pixel values to transformers' Gemma3ImageProcessor (PIL backend, what it uses without
    torchvision) on images of several sizes and modes, given as PIL images and as PNG/JPEG files."""
    from transformers import Gemma3ImageProcessorPil

    hf = Gemma3ImageProcessorPil(size={"height": size[0], "width": size[1]})
    cfg = ImageProcessorConfig.from_dict(hf.to_dict())
    assert (cfg.height, cfg.width) == size
    # transformers composites transparent images onto white (5.23, the pinned version); 5.17 (the GPU machine's)
    # drops the alpha channel instead: there the reference is given the image already composited
    clear = Image.new("RGBA", (size[1], size[0]), (0, 0, 0, 0))
    composites = hf(clear, return_tensors="np")["pixel_values"][0].min() > 0.99
    for i, mode in enumerate(["RGB", "RGBA", "L", "P", "P+transparency", "LA"]):
        for j, (w, h) in enumerate([(320, 240), (31, 97), size[::-1]]):
            img = _image(mode, w, h, seed=10 * i + j)
            shown = img if composites or mode in ("RGB", "L", "P") else _on_white(img)
            ref = hf(shown, return_tensors="np")["pixel_values"][0]
            got = preprocess_image(img, cfg)
            assert got.dtype == np.float32 and got.shape == (3, *size)
            assert np.array_equal(ref, got), (mode, w, h)
    path = tmp_path / "photo.jpg"
    _image("RGB", 300, 200, seed=99).save(path, quality=85)
    loaded = load_image(str(path), where="t")
    assert np.array_equal(hf(Image.open(path), return_tensors="np")["pixel_values"][0],
                          preprocess_image(loaded, cfg))


def test_processor_config_from_folder(tmp_path):
    body = {"size": {"height": 896, "width": 896}, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
            "rescale_factor": 0.00392156862745098, "resample": 2, "do_pan_and_scan": None}
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(body))
    cfg = ImageProcessorConfig.from_folder(tmp_path)
    assert (cfg.height, cfg.width, cfg.resample) == (896, 896, 2)
    assert ImageProcessorConfig.from_folder(tmp_path / "none", image_size=32).height == 32
    assert ImageProcessorConfig.from_dict(cfg.to_dict()) == cfg


# ----------------------------------------------------------------------------- records and masks

def make_vlm_checkpoint(folder: Path, image_size: int = 16) -> Path:
    """A folder with a Gemma 3 VLM's config.json (image tokens, mm_tokens_per_image) and a char tokenizer that
    has the three image tokens as special tokens."""
    folder.mkdir(parents=True, exist_ok=True)
    tok = tk.build_tokenizer(folder)
    tok.hf.add_special_tokens({"additional_special_tokens": ["<start_of_image>", "<end_of_image>",
                                                             "<image_soft_token>"]})
    tok.hf.save_pretrained(str(folder))
    ids = tok.hf.convert_tokens_to_ids(["<start_of_image>", "<end_of_image>", "<image_soft_token>"])
    cfg = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
           "boi_token_index": ids[0], "eoi_token_index": ids[1], "image_token_index": ids[2],
           "mm_tokens_per_image": N_IMG, "text_config": {"model_type": "gemma3_text"},
           "vision_config": {"model_type": "siglip_vision_model", "image_size": image_size, "patch_size": 4}}
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    folder = make_vlm_checkpoint(tmp_path_factory.mktemp("vlm"))
    tok = tk.load(folder)
    return tok, VisionSpec.from_checkpoint(folder, tok)


def _rec(*user_parts, answer="yes", images=None):
    rec = {"messages": [{"role": "user", "content": list(user_parts)},
                        {"role": "assistant", "content": [{"type": "text", "text": answer}]}]}
    if images is not None:
        rec["images"] = images
    return rec


def test_image_tokens_expanded_and_masked(vlm):
    tok, spec = vlm
    img = _image("RGB", 20, 20)
    ex = encode_record(_rec({"type": "image"}, {"type": "text", "text": "How many?"}, images=[img]), tok,
                       vision=spec)
    ids, mask = ex.input_ids.tolist(), ex.loss_mask.tolist()
    b = ids.index(spec.boi_id)
    assert ids[b:b + N_IMG + 2] == [spec.boi_id] + [spec.image_id] * N_IMG + [spec.eoi_id]
    assert ids.count(spec.image_id) == N_IMG and len(ex.images) == 1 and ex.images[0].source is img
    assert ex.image_end == b + N_IMG + 2
    text_only = encode_record({"messages": [{"role": "user", "content": "How many?"},
                                            {"role": "assistant", "content": "yes"}]}, tok)
    # same tokens as the text-only rendering with the image block in front of the question
    assert [t for t in ids if t not in (spec.boi_id, spec.eoi_id, spec.image_id)] == text_only.input_ids.tolist()
    # loss only on the assistant's answer and its end: never on image, prompt or header tokens
    targets = [t for t, m in zip(ids, mask) if m]
    assert targets == tok.encode("yes", add_special_tokens=False) + [tok.eos_token_id]
    assert all(m == 0 for t, m in zip(ids, mask) if t in (spec.boi_id, spec.eoi_id, spec.image_id))


def test_image_parts_and_images_column(vlm, tmp_path):
    """Images from the `images` column in part order, from a part's own path/url/image, in several turns."""
    tok, spec = vlm
    _image("RGB", 8, 8).save(tmp_path / "a.png")
    rec = {"messages": [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "a"},
                                     {"type": "image", "path": str(tmp_path / "a.png")}]},
        {"role": "assistant", "content": "b"},
        {"role": "user", "content": [{"type": "text", "text": "c"}, {"type": "image"}]},
        {"role": "assistant", "content": "d"}], "images": ["first.png", "third.png"]}
    ex = encode_record(rec, tok, vision=spec)
    assert [r.source for r in ex.images] == ["first.png", str(tmp_path / "a.png"), "third.png"]
    assert ex.input_ids.tolist().count(spec.image_id) == 3 * N_IMG
    assert ex.loss_mask.sum() == 4  # "b" <eos> "d" <eos>


def _write_jsonl(path: Path, records) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _err(capsys_or_call) -> str:
    with pytest.raises(DataError) as e:
        capsys_or_call()
    msg = str(e.value)
    assert "\n" not in msg
    return msg


def test_bad_inputs_name_file_and_line(vlm, tmp_path):
    tok, spec = vlm
    _image("RGB", 8, 8).save(tmp_path / "ok.png")
    (tmp_path / "notes.png").write_text("not an image")
    ok = _rec({"type": "image"}, {"type": "text", "text": "q"}, images=["ok.png"])

    def build(bad, model=spec):
        path = _write_jsonl(tmp_path / "d.jsonl", [ok, bad])
        return lambda: build_sft_dataset(str(path), tok, seq_len=64, batch_size=2, vision=model)

    msg = _err(build(_rec({"type": "image"}, images=["missing.png"])))
    assert "d.jsonl, line 2" in msg and "'missing.png' does not exist" in msg
    msg = _err(build(_rec({"type": "image"}, images=["notes.png"])))
    assert "d.jsonl, line 2" in msg and "notes.png" in msg and "not a readable image" in msg
    msg = _err(build(_rec({"type": "image"}, {"type": "image"}, images=["ok.png"])))
    assert "d.jsonl, line 2" in msg and "image part without an image" in msg
    msg = _err(build(_rec({"type": "image"})))
    assert "d.jsonl, line 2" in msg and "image part without an image" in msg
    msg = _err(build(_rec({"type": "text", "text": "q"}, images=["ok.png"])))
    assert "d.jsonl, line 2" in msg and "1 image(s) in 'images' but only 0 image part" in msg
    msg = _err(build(ok, model=None))
    assert "d.jsonl, line 1" in msg and "the record has 1 image(s) but the model is text-only" in msg
    msg = _err(build(_rec({"type": "text", "text": "<start_of_image>"}, {"type": "image"}, images=["ok.png"])))
    assert "d.jsonl, line 2" in msg and "2 <start_of_image> token(s) for 1 image(s)" in msg


@pytest.mark.slow
def test_cli_error_is_one_line(vlm, tmp_path):
    """Through `posttrain sft`: one `error:` line naming file and line, no traceback."""
    tok, spec = vlm
    data = _write_jsonl(tmp_path / "bad.jsonl", [_rec({"type": "image"}, images=["gone.png"])])
    out = subprocess.run([sys.executable, "-m", "posttrain.cli.main", "sft",
                          str(Path(__file__).parents[1] / "configs" / "sft_smoke.yaml"), f"model.path={Path(tok.path)}",
                          f"data.train={data}", f"output_dir={tmp_path / 'out'}"],
                         capture_output=True, text=True, timeout=300, check=False)
    assert out.returncode != 0
    err = out.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and "bad.jsonl, line 1" in err[0] \
        and "'gone.png' does not exist" in err[0], out.stderr


# ----------------------------------------------------------------------------- sources, packing, batches

def _records(n, tmp_path):
    out = []
    for i in range(n):
        path = tmp_path / f"img{i}.png"
        _image("RGB", 12 + i, 10, seed=i).save(path)
        out.append(_rec({"type": "image"}, {"type": "text", "text": f"q{i}"}, answer=f"a{i}",
                        images=[path.name]))
    return out


@pytest.mark.slow  # datasets import
def test_parquet_and_datasets_images(vlm, tmp_path):
    """Images stored in Parquet ({'bytes', 'path'}) and in a `datasets` Image column give the same pixels as
    the same image files."""
    import datasets

    tok, spec = vlm
    recs = _records(3, tmp_path)
    ref = build_sft_dataset(str(_write_jsonl(tmp_path / "d.jsonl", recs)), tok, seq_len=64, batch_size=3,
                            shuffle=False, pack=False, vision=spec)
    ref_batch = next(iter(ref))
    feats = datasets.Features({"messages": datasets.Value("string"), "images": [datasets.Image()]})
    ds = datasets.Dataset.from_dict({"messages": [json.dumps(r["messages"]) for r in recs],
                                     "images": [[str(tmp_path / r["images"][0])] for r in recs]}, features=feats)
    ds.to_parquet(str(tmp_path / "d.parquet"))
    ds.save_to_disk(str(tmp_path / "ds"))
    for src in (tmp_path / "d.parquet", tmp_path / "ds"):
        rows = read_records(str(src))
        for r in rows:
            r["messages"] = json.loads(r["messages"])
        got = build_sft_dataset(rows, tok, seq_len=64, batch_size=3, shuffle=False, pack=False, vision=spec)
        batch = next(iter(got))
        assert np.array_equal(batch["pixel_values"], ref_batch["pixel_values"]), src
        assert np.array_equal(batch["input_ids"], ref_batch["input_ids"])


def test_packing_keeps_images_whole(vlm, tmp_path):
    tok, spec = vlm
    recs = _records(5, tmp_path)
    recs[4]["messages"][0]["content"].append({"type": "image", "path": recs[0]["images"][0]})
    path = _write_jsonl(tmp_path / "d.jsonl", recs)
    ds = build_sft_dataset(str(path), tok, seq_len=64, batch_size=2, shuffle=False, vision=spec)
    assert ds.stats["max_images_per_row"] == 2 and ds.stats["num_images"] == 6
    assert ds.stats["num_packed"] == 5 and ds.num_rows < 5  # several examples share a row
    batch = next(iter(ds))
    assert batch["pixel_values"].shape == (2, 2, 3, 16, 16)
    for r in range(2):
        ids, seg = batch["input_ids"][r], batch["segment_ids"][r]
        n_img = int((ids == spec.image_id).sum()) // N_IMG
        assert (np.abs(batch["pixel_values"][r, n_img:]).sum() == 0) and \
            all(np.abs(batch["pixel_values"][r, k]).sum() > 0 for k in range(n_img))
        for b in np.flatnonzero(ids == spec.boi_id):  # every image's tokens whole, in one segment
            assert ids[b + N_IMG + 1] == spec.eoi_id and len(set(seg[b:b + N_IMG + 2])) == 1
        assert batch["loss_mask"][r][np.isin(ids, [spec.boi_id, spec.eoi_id, spec.image_id])].sum() == 0
        assert batch["loss_mask"][r][batch["attention_mask"][r] == 0].sum() == 0  # padding masked


def test_image_examples_never_cut_inside_an_image(vlm):
    tok, spec = vlm
    ex = encode_record(_rec({"type": "text", "text": "q"}, {"type": "image"}, answer="a" * 20,
                            images=["x.png"]), tok, vision=spec)
    rows, stats = pack_examples([ex], ex.image_end + 3)  # a cut after the image: truncated
    assert stats.num_truncated == 1 and rows.images == [ex.images]
    rows, stats = pack_examples([ex], ex.image_end - 1)  # a cut inside it: dropped
    assert stats.num_dropped == 1 and len(rows) == 0


def test_shapes_task_and_exact_answer():
    """The synthetic visual task: deterministic in its seed, answers match what is drawn, scored exactly."""
    from posttrain.data.shapes import COLOURS, draw
    from posttrain.rewards.exact import exact_answer

    a, b = read_records("shapes:?size=30&seed=3"), read_records("shapes:?size=30&seed=3")
    assert [r["answer"] for r in a] == [r["answer"] for r in b]
    assert all(np.array_equal(np.asarray(x["prompt"][0]["content"][0]["image"]),
                              np.asarray(y["prompt"][0]["content"][0]["image"])) for x, y in zip(a, b))
    assert a[0]["messages"][0] is a[0]["prompt"][0] and a[0]["messages"][1]["content"] == a[0]["answer"]
    img = np.asarray(draw([("square", "red"), None, ("circle", "blue"), ("square", "red")], 32))
    assert img.shape == (32, 32, 3) and tuple(img[4, 4]) == COLOURS["red"] and tuple(img[4, 20]) == (255, 255, 255)
    assert tuple(img[24, 8]) == COLOURS["blue"] and tuple(img[24, 24]) == COLOURS["red"]
    assert exact_answer(None, [" 2\n", "red", "3"], ["2", "blue", "3"]) == [1.0, 0.0, 1.0]
    with pytest.raises(DataError, match="unknown option"):
        read_records("shapes:?colour=1")
