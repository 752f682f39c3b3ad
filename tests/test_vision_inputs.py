"""What an image-text record may hold besides TRL's layout with paths: LLaMA-Factory's ``<image>``
placeholders in ``messages`` or ShareGPT ``conversations`` text, and images as bytes,
``{"bytes", "path"}`` dicts or PIL images, also from a parquet file with a ``datasets.Image``
column. Each gives the samples (ids, labels) and pixels of the same records written with paths."""

from __future__ import annotations

import hashlib
import io
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import FAST, run_cli, subprocess_env
from test_vision import COLOURS, QUESTION, loaded, record, write_dataset

NAMES = list(COLOURS)


def llamafactory(k: int, sharegpt: bool = False) -> dict:
    """Record ``k`` of :func:`trl_records` in LLaMA-Factory's layout: the question's text holds one
    ``<image>`` per image (the second image after the question), ``images`` the same paths."""
    images = [f"images/{NAMES[k % 4]}.png"] + ([f"images/{NAMES[(k + 1) % 4]}.png"] if k % 2 else [])
    text = "<image>" + QUESTION + ("<image>" if k % 2 else "")
    turns = [("user", text), ("assistant", NAMES[k % 4])]
    if sharegpt:
        return {"conversations": [{"from": {"user": "human", "assistant": "gpt"}[r], "value": t} for r, t in turns],
                "images": images}
    return {"messages": [{"role": r, "content": t} for r, t in turns], "images": images}


def trl_records(n: int = 8) -> list[dict]:
    """The same records in TRL's layout (image parts around the question's text part)."""
    out = []
    for k in range(n):
        rec = record(f"images/{NAMES[k % 4]}.png", NAMES[k % 4])
        if k % 2:
            rec["messages"][0]["content"].append({"type": "image"})
            rec["images"].append(f"images/{NAMES[(k + 1) % 4]}.png")
        out.append(rec)
    return out


def samples_of(splits) -> list[tuple]:
    return sorted((tuple(s["input_ids"]), tuple(s["labels"])) for part in (splits.train, splits.val)
                  for s in (part[i] for i in range(len(part))))


@pytest.mark.parametrize("sharegpt", [False, True])
def test_llamafactory_placeholders_give_the_samples_of_image_parts(sharegpt, tmp_path):
    expected = samples_of(loaded("tiny_idefics3", write_dataset(tmp_path / "trl", trl_records()))[2])
    rows = [llamafactory(k, sharegpt) for k in range(8)]
    _, _, splits = loaded("tiny_idefics3", write_dataset(tmp_path / "lf", rows))
    assert samples_of(splits) == expected
    assert any(s.count(261) == 8 for s, _ in expected)  # records with two images (4 tokens each) among them


@pytest.mark.parametrize("images, said", [
    (["images/red.png"], "line 2: 2 <image> placeholder(s) in field 'messages' but 1 image(s) in field 'images'"),
    ([], "line 2: 2 <image> placeholder(s) in field 'messages' but 0 image(s) in field 'images'"),
])
def test_placeholders_and_images_that_differ_in_number_are_refused_naming_the_record(images, said, tmp_path):
    from llmtrain.common.errors import DataError

    bad = {"messages": [{"role": "user", "content": "<image><image>" + QUESTION},
                        {"role": "assistant", "content": "red"}], "images": images}
    path = write_dataset(tmp_path, [llamafactory(0), bad] + [llamafactory(k) for k in range(2, 5)])
    with pytest.raises(DataError) as err:
        loaded("tiny_llava", path)
    assert str(err.value).startswith(f"data.path: {path} {said}"), str(err.value)


def png(name: str) -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (12, 12), COLOURS[name]).save(out, format="PNG")
    return out.getvalue()


def test_a_parquet_image_column_of_bytes_and_paths_gives_the_samples_and_pixels_of_paths(tmp_path, monkeypatch):
    """A parquet file whose ``images`` column is a ``datasets.Image`` list (bytes for even
    records, paths for odd ones): the samples equal the path records', bytes are kept as
    content-addressed files in the cache, and the collator's pixels equal the path records'."""
    import datasets

    from llmtrain import data
    from llmtrain.data import image_refs

    monkeypatch.setattr(image_refs, "IMAGE_CACHE", tmp_path / "cache")
    reference = trl_records()
    write_dataset(tmp_path, reference)
    rows = [dict(r, images=[{"bytes": png(p.split("/")[1][:-4]), "path": None} if k % 2 == 0 else
                            {"bytes": None, "path": str(tmp_path / p)} for p in r["images"]])
            for k, r in enumerate(reference)]
    table = datasets.Dataset.from_list(rows).cast_column("images", datasets.List(datasets.Image()))
    table.to_parquet(str(tmp_path / "train.parquet"))
    cfg, tokenizer, splits = loaded("tiny_llava", tmp_path / "train.parquet")
    _, _, by_path = loaded("tiny_llava", tmp_path / "train.jsonl")
    assert samples_of(splits) == samples_of(by_path)
    cached = sorted(p.name for p in (tmp_path / "cache").iterdir())
    stored = {hashlib.sha256(i["bytes"]).hexdigest() for r in rows for i in r["images"] if i["bytes"] is not None}
    assert cached == sorted(stored) and len(stored) == 2  # one file per distinct image held as bytes
    collate = data.collator_for(cfg.data, tokenizer)
    assert torch.equal(collate([splits.train[0], splits.train[1]])["pixel_values"],
                       collate([by_path.train[0], by_path.train[1]])["pixel_values"])


def test_raw_bytes_pil_images_and_one_image_instead_of_a_list(tmp_path, monkeypatch):
    from PIL import Image

    from llmtrain.common.errors import DataError
    from llmtrain.data import image_refs
    from llmtrain.data.vision import load_image

    monkeypatch.setattr(image_refs, "IMAGE_CACHE", tmp_path / "cache")
    picture = Image.new("RGB", (12, 12), COLOURS["blue"])
    paths = image_refs.image_paths([png("red"), picture, "images/x.png"], tmp_path, "record 3", "images")
    assert paths[2] == tmp_path / "images" / "x.png"
    assert np.array_equal(np.asarray(load_image(paths[0], "", "")), np.full((12, 12, 3), COLOURS["red"]))
    assert np.array_equal(np.asarray(load_image(paths[1], "", "")), np.full((12, 12, 3), COLOURS["blue"]))
    assert image_refs.image_paths({"bytes": None, "path": "/a.png"}, tmp_path, "r", "images") == [Path("/a.png")]

    with pytest.raises(DataError, match=r"^record 3: field 'images' image 1: 9 bytes that are not an image PIL reads"):
        image_refs.image_paths([png("red"), b"not a png"], tmp_path, "record 3", "images")
    with pytest.raises(DataError, match=r"^record 3: field 'images' image 0: an image is a path, .* got int 7"):
        image_refs.image_paths([7], tmp_path, "record 3", "images")


def test_bytes_that_are_no_image_exit_2_with_one_line_naming_the_record(tmp_path):
    import datasets

    rows = [dict(r, images=[{"bytes": png("red"), "path": None}]) for r in trl_records(4) if len(r["images"]) == 1]
    rows.insert(1, dict(rows[0], images=[{"bytes": b"\x89PNG broken", "path": None}]))
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "train.parquet"))
    proc = run_cli(["model=tiny_llava", "data=vlm_chat", f"data.path={tmp_path / 'train.parquet'}", *FAST,
                    f"run_dir={tmp_path / 'run'}"], env={**subprocess_env(), "LLMTRAIN_CACHE": str(tmp_path / "cache")})
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.splitlines() == [f"llmtrain: error: data.path: {tmp_path / 'train.parquet'} record 1: field "
                                        "'images' image 0: 11 bytes that are not an image PIL reads (no known image "
                                        "format)"], proc.stderr


def test_sixteen_bit_grey_gray_rgba_and_palette_pngs_read_as_the_rgb_pixels_they_show(tmp_path):
    """A 16-bit grayscale PNG (values v * 257, PIL mode I;16) reads as the 8-bit image v, not
    clipped at 255 (what a bare ``convert("RGB")`` gives); 8-bit gray, RGBA and palette copies of
    an image read as its RGB pixels."""
    from PIL import Image

    from llmtrain.data.vision import load_image

    grey = np.arange(0, 256, 4, dtype=np.uint8).reshape(8, 8)  # 0 .. 252: mostly above 255 / 257
    Image.fromarray(grey.astype(np.uint16) * 257).save(tmp_path / "g16.png")
    assert Image.open(tmp_path / "g16.png").mode == "I;16"
    assert np.array_equal(np.asarray(load_image(tmp_path / "g16.png", "", "")), np.stack([grey] * 3, -1))
    assert np.asarray(Image.open(tmp_path / "g16.png").convert("RGB")).max() == 255  # the clipping avoided
    source = Image.fromarray(np.stack([grey] * 3, -1), "RGB")
    for mode in ("L", "RGBA"):
        source.convert(mode).save(tmp_path / f"{mode}.png")
        assert np.array_equal(np.asarray(load_image(tmp_path / f"{mode}.png", "", "")), np.asarray(source)), mode
    palette = Image.fromarray(np.arange(64, dtype=np.uint8).reshape(8, 8), "P")  # index k: the colour grey[k]
    palette.putpalette([v for g in grey.flat for v in (g, g, g)])
    palette.save(tmp_path / "P.png")
    assert np.array_equal(np.asarray(load_image(tmp_path / "P.png", "", "")), np.asarray(source))


def test_an_image_over_pils_bomb_limit_is_a_one_line_data_error(tmp_path, monkeypatch):
    """PIL raises DecompressionBombError (not an OSError) past twice ``MAX_IMAGE_PIXELS``: a path
    or bytes that large is refused naming the record and field, not a traceback."""
    from PIL import Image

    from llmtrain.common.errors import DataError
    from llmtrain.data import image_refs
    from llmtrain.data.vision import load_image

    monkeypatch.setattr(image_refs, "IMAGE_CACHE", tmp_path / "cache")
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 50)  # an error past 100 pixels: 12 x 12 is over it
    (tmp_path / "big.png").write_bytes(png("red"))
    with pytest.raises(DataError, match=r"^line 3: field 'images': image .*big.png is too large: Image size \(144 "
                                        r"pixels\) exceeds limit of 100 pixels"):
        load_image(tmp_path / "big.png", "line 3", "images")
    with pytest.raises(DataError, match=r"^record 3: field 'images' image 0: an image too large: Image size"):
        image_refs.image_paths([png("red")], tmp_path, "record 3", "images")


def test_a_string_content_read_back_as_a_number_is_refused_saying_why(tmp_path):
    """datasets 5 reads a messages column that mixes string contents and lists of parts as Json, and
    a string content that is valid JSON ("7") comes back as the int 7: refused naming the record and
    turn, and what to write instead."""
    from llmtrain.common.errors import DataError

    mixed = {"messages": [{"role": "user", "content": "<image>" + QUESTION}, {"role": "assistant", "content": "7"}],
             "images": ["images/red.png"]}
    path = write_dataset(tmp_path, [record("images/red.png", "red"), mixed, record("images/blue.png", "blue")] * 2)
    with pytest.raises(DataError) as err:
        loaded("tiny_idefics3", path)
    assert str(err.value) == (f"data.path: {path} line 2 turn 1: 'content' is the int 7: when a file mixes string "
                              "contents with lists of parts, datasets reads a string that is a JSON number or boolean "
                              "as one; write every content as a list of parts (or every one as a string)")


def test_a_placeholder_inside_a_text_part_is_an_image_as_in_a_string_content(tmp_path):
    """``[{"type": "text", "text": "<image>Which colour..."}]`` gives the samples of an image part
    then the text (the template writes the placeholder as it is and the processor would expand it);
    once it was no image, and a record with its image was refused as having none."""
    expected = samples_of(loaded("tiny_idefics3", write_dataset(tmp_path / "parts", trl_records()))[2])
    rows = []
    for rec in trl_records():
        user = rec["messages"][0]
        text = "".join("<image>" if p["type"] == "image" else p["text"] for p in user["content"])
        rows.append({**rec, "messages": [{"role": "user", "content": [{"type": "text", "text": text}]},
                                         *rec["messages"][1:]]})
    assert all("<image>" in r["messages"][0]["content"][0]["text"] for r in rows)
    _, _, splits = loaded("tiny_idefics3", write_dataset(tmp_path / "text", rows))
    assert samples_of(splits) == expected
