"""Image-text conversations (TRL's conversational vision layout, or LLaMA-Factory's) -> samples, and
their collator.

A record holds ``messages`` whose ``content`` is a string or a list of parts, ``{"type": "text",
"text": ...}`` and ``{"type": "image"}``, and an ``images`` column: the record's images, one per
image part in order (paths relative to the data file's folder or absolute, bytes, ``{"bytes",
"path"}`` dicts or PIL images: :mod:`llmtrain.data.image_refs`)::

    {"messages": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Which digit?"}]},
                  {"role": "assistant", "content": [{"type": "text", "text": "7"}]}],
     "images": ["images/0007.png"]}

LLaMA-Factory's layout writes the images as ``<image>`` placeholders in the text of ``messages``
(or ShareGPT ``conversations``, from/value) instead: each becomes an image part.

The conversation is rendered with the chat template, which writes an image part as the
processor's placeholder (``<image>``); the processor expands each placeholder into the image's
tokens, as many as the model's vision tower gives. Labels are the assistant turns' tokens (as in
:class:`llmtrain.data.formats.ChatEncoder`), never an image's tokens. A sample keeps its image
paths; the collator (:class:`ImageCollator`) reads the images again and runs the image processor,
so the dataset holds token ids and paths, not pixels.
"""

from __future__ import annotations

import bisect
import time
from pathlib import Path
from typing import Any

import torch

from llmtrain.common.errors import ConfigError, DataError
from llmtrain.common.labels import IGNORE_INDEX
from llmtrain.data.formats import (ChatEncoder, MESSAGE_ROLES, chat_field, conversation, render, template_name,
                                   uses_chat_template)
from llmtrain.data.image_refs import image_paths, undecoded  # noqa: F401  (image_paths: public here too)
from llmtrain.data.order import Collator
from llmtrain.data.sources import record_errors
from llmtrain.common.images import IMAGE_INPUTS, PACKED_PROCESSORS, image_token_id, processor_of


def images_column(records: Any, src: Any) -> str | None:
    """The column of images of a chat source: ``columns.images`` when mapped, else
    ``images`` when the records have it; None: a text-only chat source."""
    from llmtrain.config.schema import mapped_columns

    mapped = mapped_columns(src.columns).get("images")
    if mapped is not None:
        return mapped
    return "images" if "images" in records.column_names else None


def parts_conversation(record: dict, field: str, where: str) -> tuple[list[dict], int]:
    """A record's OpenAI-layout turns with list-of-parts content checked, and its number of image
    parts.

    Raises:
        DataError: not a list of turns, an unknown role, or content that is neither a string nor
            a list of ``text``/``image`` parts (names the record, turn and part).
    """
    turns = record[field]
    if not isinstance(turns, list) or not turns:
        raise DataError(f"{where}: field {field!r} must be a non-empty list of turns")
    out, images = [], 0
    for j, turn in enumerate(turns):
        if not isinstance(turn, dict) or turn.get("role") not in MESSAGE_ROLES:
            raise DataError(f"{where} turn {j}: needs a 'role' of {', '.join(MESSAGE_ROLES)} and a 'content'")
        content = turn.get("content")
        if isinstance(content, list):
            parts = []
            for k, part in enumerate(content):
                kind = part.get("type") if isinstance(part, dict) else None
                if kind == "image":
                    images += 1
                    parts.append({"type": "image"})
                elif kind == "text" and isinstance(part.get("text"), str):
                    parts.append({"type": "text", "text": part["text"]})
                else:
                    raise DataError(f"{where} turn {j} part {k}: a content part is {{'type': 'text', 'text': "
                                    f"str}} or {{'type': 'image'}}, got {part!r:.80}")
            content = parts
        elif isinstance(content, (int, float, bool)):
            # datasets 5 stores a column of string and list contents as Json, and reads a string
            # content that is valid JSON ("7", "true") back as that value: the text is lost there.
            raise DataError(f"{where} turn {j}: 'content' is the {type(content).__name__} {content!r}: when a file "
                            "mixes string contents with lists of parts, datasets reads a string that is a JSON number or "
                            "boolean as one; write every content as a list of parts (or every one as a string)")
        elif not isinstance(content, str):
            raise DataError(f"{where} turn {j}: 'content' must be a string or a list of parts, got "
                            f"{type(content).__name__}")
        out.append({"role": turn["role"], "content": content})
    return out, images


# LLaMA-Factory's image placeholder in a turn's text (its IMAGE_PLACEHOLDER default): one per image, in order.
IMAGE_PLACEHOLDER = "<image>"


def _split_text(text: str) -> list[dict]:
    """``text`` as ``text``/``image`` parts, an image part at each :data:`IMAGE_PLACEHOLDER`."""
    pieces = text.split(IMAGE_PLACEHOLDER)
    parts = [{"type": "text", "text": pieces[0]}] if pieces[0] else []
    for piece in pieces[1:]:
        parts += [{"type": "image"}] + ([{"type": "text", "text": piece}] if piece else [])
    return parts


def placeholder_parts(turns: list[dict]) -> tuple[list[dict], int]:
    """``turns`` with each string content or text part that holds :data:`IMAGE_PLACEHOLDER` split
    into ``text``/``image`` parts (LLaMA-Factory's layout: ``"<image>Which digit?"`` is an image
    part, then the text), and the number of placeholders. A text part's placeholder counts too:
    the chat template writes it as it is, and the processor would expand it into an image's tokens."""
    out, count = [], 0
    for turn in turns:
        content = turn["content"]
        if isinstance(content, str) and IMAGE_PLACEHOLDER in content:
            count += content.count(IMAGE_PLACEHOLDER)
            turn = {**turn, "content": _split_text(content)}
        elif isinstance(content, list) and any(IMAGE_PLACEHOLDER in p.get("text", "") for p in content):
            parts = []
            for part in content:
                text = part.get("text", "") if part["type"] == "text" else ""
                count += text.count(IMAGE_PLACEHOLDER)
                parts += _split_text(text) if IMAGE_PLACEHOLDER in text else [part]
            turn = {**turn, "content": parts}
        out.append(turn)
    return out, count


def count_mismatch(at: str, counts: tuple[int, int], field: str, images: int, column: str) -> DataError:
    """The one-line error of a record whose image parts and ``<image>`` placeholders (``counts``)
    are not its number of images."""
    parts, placeholders = counts
    said = [f"{parts} image part(s)"] * bool(parts) + [f"{placeholders} {IMAGE_PLACEHOLDER} placeholder(s)"] * bool(
        placeholders)
    return DataError(f"{at}: {' and '.join(said) or 'no image part or ' + IMAGE_PLACEHOLDER + ' placeholder'} in field "
                     f"{field!r} but {images} image(s) in field {column!r}; each {{'type': 'image'}} part or "
                     f"{IMAGE_PLACEHOLDER} needs one image, in order")


# PIL's modes of 16-bit grayscale (16-bit PNGs): ``convert("RGB")`` clips their 0-65535 values at
# 255, which turns the image into black and white; they are scaled to 8 bits first.
_SIXTEEN_BIT = ("I;16", "I;16B", "I;16L", "I;16N")


def rgb(image: Any) -> Any:
    """``image`` (PIL) as RGB: ``convert("RGB")`` (what transformers' processors and TRL do), but a
    16-bit grayscale image is first scaled to 8 bits (``value >> 8``) instead of clipped at 255."""
    if image.mode in _SIXTEEN_BIT:
        import numpy as np
        from PIL import Image

        image = Image.fromarray((np.asarray(image).astype(np.uint32) >> 8).astype(np.uint8), "L")
    return image.convert("RGB")


def load_image(path: Path, where: str, field: str):
    """The RGB image at ``path`` (PIL, :func:`rgb`).

    Raises:
        DataError: the file is missing or not an image PIL reads, or larger than PIL's
            decompression-bomb limit (names ``where``, the field and the path).
    """
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as image:
            return rgb(image)
    except FileNotFoundError:
        raise DataError(f"{where}: field {field!r}: image {path} does not exist") from None
    except Image.DecompressionBombError as err:
        raise DataError(f"{where}: field {field!r}: image {path} is too large: {err}; resize it (the "
                        "processor shrinks it to its own size anyway)") from None
    except (UnidentifiedImageError, OSError) as err:
        raise DataError(f"{where}: field {field!r}: image {path} cannot be read: {err}") from None


class ImageChatEncoder:
    """``(record, index) -> (input_ids, labels, image paths) | None`` of one image-text
    conversation (None: no assistant turn), for :func:`encode_image_records`."""

    def __init__(self, records: Any, src: Any, data_cfg: Any, tokenizer: Any, key: str, where: str, images: str):
        self.field, self.layout = chat_field(records, src, key, where)
        self.images, self.where, self.tokenizer, self.data_cfg = images, where, tokenizer, data_cfg
        self.processor = processor_of(tokenizer)
        self.chat: ChatEncoder | None = None
        path = Path(str(src.path)).expanduser()
        self.base = path if path.is_dir() else path.parent  # relative image paths: next to the data file
        if self.processor is not None:
            self.image_token = self.processor.image_token
            self._chat()

    def _chat(self) -> ChatEncoder:
        """The chat encoder, made at the first record that needs it: a text-only model's records
        with images are refused for that before its template is asked for."""
        if self.chat is None:
            uses_chat_template(self.data_cfg, "chat", self.tokenizer)
            self.chat = ChatEncoder(self.tokenizer, template_name(self.data_cfg, self.tokenizer))
        return self.chat

    def __call__(self, record: dict, i: int) -> tuple[list[int], list[int], list[str]] | None:
        at = f"{self.where} record {i}"
        if self.layout == "sharegpt":  # from/value turns of strings
            turns, parts = conversation(record, self.field, self.layout, at), 0
        else:
            turns, parts = parts_conversation(record, self.field, at)
        turns, placeholders = placeholder_parts(turns)
        paths = image_paths(record.get(self.images), self.base, at, self.images)
        if paths and self.processor is None:
            raise DataError(f"{at}: field {self.images!r} holds {len(paths)} image(s), and the model is text-only "
                            "(no image processor); use an image-text model (e.g. model=tiny_idefics3) or drop "
                            "the images")
        if parts + placeholders != len(paths):
            raise count_mismatch(at, (parts, placeholders), self.field, len(paths), self.images)
        if not any(t["role"] == "assistant" for t in turns):
            return None
        if self.processor is None:  # a text-only model and records without images: plain chat
            text = [{"role": t["role"], "content": t["content"] if isinstance(t["content"], str) else "".join(
                p.get("text", "") for p in t["content"])} for t in turns]
            ids, labels = self._chat()(text, at)
            return ids, labels, []
        pictures = [load_image(p, at, self.images) for p in paths]
        return self._encode(turns, pictures, at) + ([str(p) for p in paths],)

    def _encode(self, turns: list[dict], pictures: list, at: str) -> tuple[list[int], list[int]]:
        """Ids and labels: assistant spans of the rendered text (:meth:`ChatEncoder._span`) moved
        past the placeholders the processor expanded before them; tokens of an expansion are
        never targets."""
        full = render(self.tokenizer, turns, False, at)
        if full.count(self.image_token) != len(pictures):
            raise DataError(f"{at}: the text holds {self.image_token} {full.count(self.image_token)} time(s) besides "
                            f"the {len(pictures)} image part(s); remove it from the text")
        spans = [self._chat()._span(turns, j, full, at) for j, t in enumerate(turns) if t["role"] == "assistant"]
        out = self.processor(text=[full], images=[pictures] if pictures else None, add_special_tokens=False,
                             return_offsets_mapping=True, return_text_replacement_offsets=True)
        ids, offsets = list(out["input_ids"][0]), [tuple(o) for o in out["offset_mapping"][0]]
        replaced = (out.get("text_replacement_offsets") or [[]])[0]
        ends = [r["span"][1] for r in replaced]
        gained = [0]
        for r in replaced:
            gained.append(r["new_span"][1] - r["span"][1])
        expanded = [r["new_span"] for r in replaced]
        # A span's ends shift by the characters the expansions before them added.
        spans = [tuple(c + gained[bisect.bisect_right(ends, c)] for c in span) for span in spans]
        labels = []
        for token, (start, _) in zip(ids, offsets):
            in_image = any(a <= start < b for a, b in expanded)
            trained = not in_image and any(a <= start < b for a, b in spans)
            labels.append(int(token) if trained else IGNORE_INDEX)
        return [int(t) for t in ids], labels


def image_conversations_ids(tokenizer: Any, prompt: Any, completions: list[Any], names: tuple[str, list[str]],
                            images: tuple[str, list[Path]], at: str) -> list[list[int]]:
    """The ids of an image-text preference record (TRL's VLM DPO layout: message-list ``prompt``
    with ``{"type": "image"}`` parts, message-list completions, ``images`` paths): first the
    prompt's (chat template with the generation prompt), then prompt + each completion's, every
    image placeholder expanded by the processor into the image's tokens, so the pair's prompts
    hold the same image tokens. ``names``: (prompt column, completion columns); ``images``: (images
    column, the record's paths).

    Raises:
        DataError: string fields with images, an image part in a completion, image parts that do
            not match the paths in number, a missing or unreadable image (naming ``at`` and the field).
    """
    column, paths = images
    if not isinstance(prompt, list):
        raise DataError(f"{at}: field {column!r} holds images, which go with message-list prompts ({{'type': 'image'}} "
                        f"parts, TRL's layout); field {names[0]!r} is a {type(prompt).__name__}")
    turns, count = parts_conversation({names[0]: prompt}, names[0], at)
    conversations = [(turns, True)]
    for name, completion in zip(names[1], completions):
        continued, inside = parts_conversation({name: completion}, name, at)
        if inside:
            raise DataError(f"{at}: field {name!r} holds {inside} image part(s); a pair's images go in its prompt")
        conversations.append((turns + continued, False))
    if count != len(paths):
        raise DataError(f"{at}: {count} image part(s) in field {names[0]!r} but {len(paths)} path(s) in field "
                        f"{column!r}; each {{'type': 'image'}} part needs one image, in order")
    processor = processor_of(tokenizer)
    pictures = [load_image(p, at, column) for p in paths]
    out = []
    for conversation, generation_prompt in conversations:
        text = render(tokenizer, conversation, generation_prompt, at)
        if text.count(processor.image_token) != len(pictures):
            raise DataError(f"{at}: the text holds {processor.image_token} {text.count(processor.image_token)} "
                            f"time(s) besides the {len(pictures)} image part(s); remove it from the text")
        ids = processor(text=[text], images=[pictures] if pictures else None, add_special_tokens=False)["input_ids"][0]
        out.append([int(t) for t in ids])
    return out


def encode_image_records(records: Any, src: Any, data_cfg: Any, tokenizer: Any, key: str, where: str, images: str):
    """Encode every image-text record into samples ``{"input_ids", "labels", "images"}`` (image
    paths as strings), truncating at ``data.seq_len`` (``data.truncation=right``) only after the
    last image token; a sample whose image tokens do not fit is dropped as too long.

    Returns:
        (``datasets.Dataset``, counts) as :func:`llmtrain.data.formats.encode_records` does.

    Raises:
        DataError: a malformed record, a missing or unreadable image, a count mismatch, images for
            a text-only model (names the record and field); fewer than 2 usable samples.
    """
    from llmtrain.common import lazy_datasets
    from llmtrain.data.formats import fit_to_length

    records = undecoded(records, images)  # datasets.Image columns: their bytes or paths, not decoded pixels
    encode = ImageChatEncoder(records, src, data_cfg, tokenizer, key, where, images)
    processor = processor_of(tokenizer)
    image_ids = set() if processor is None else {image_token_id(processor)}
    seq_len, drop_long = data_cfg.seq_len, data_cfg.truncation == "drop"
    rows: dict[str, list] = {"input_ids": [], "labels": [], "images": []}
    counts = {"records": len(records), "truncated": 0, "dropped_too_long": 0, "dropped_no_target": 0,
              "dropped_truncated_away": 0}
    with record_errors(where):
        for i, record in enumerate(records):
            encoded = encode(record, i)
            paths = encoded[2] if encoded is not None else []
            if encoded is not None and len(encoded[0]) > seq_len and image_ids & set(encoded[0][seq_len:]):
                counts["dropped_too_long"] += 1  # cutting through an image would orphan its features
                continue
            ids, labels, outcome = fit_to_length(encoded[:2] if encoded is not None else None, seq_len, drop_long)
            if outcome not in ("kept", "truncated"):
                counts[outcome] += 1
                continue
            counts["truncated"] += outcome == "truncated"
            rows["input_ids"].append(ids)
            rows["labels"].append(labels)
            rows["images"].append(paths)
    if len(rows["input_ids"]) < 2:
        short = counts["dropped_too_long"] + counts["dropped_truncated_away"]
        raise DataError(f"{where}: {len(rows['input_ids'])} of {len(records)} records give a usable sample at "
                        f"data.seq_len={seq_len} (dropped as too long or cut through an image "
                        f"{counts['dropped_too_long']}, cut before their first target token "
                        f"{counts['dropped_truncated_away']}, without an assistant turn {counts['dropped_no_target']}); "
                        "need at least 2" + ("; raise data.seq_len" if short else ""))
    datasets = lazy_datasets.module()
    features = datasets.Features({"input_ids": datasets.Sequence(datasets.Value("int32")),
                                  "labels": datasets.Sequence(datasets.Value("int32")),
                                  "images": datasets.Sequence(datasets.Value("string"))})
    return datasets.Dataset.from_dict(rows, features=features), counts


def apply_pixel_budget(data_cfg: Any, tokenizer: Any) -> Any:
    """Set ``data.max_pixels``/``data.min_pixels`` (the pixel budget of each image) on the image
    processor that ``tokenizer`` carries, which then saves them with the export, so inference
    resizes images as training did. Unset: the processor's own. Returns ``tokenizer``.

    Raises:
        ConfigError: a budget for a text-only model or an image processor of fixed size (not
            Qwen2-VL's dynamic resolution), one not positive, or ``min_pixels`` over ``max_pixels``.
    """
    from llmtrain.common.images import has_pixel_budget

    wanted = {k: data_cfg.get(k) for k in ("min_pixels", "max_pixels") if data_cfg.get(k) is not None}
    if not wanted:
        return tokenizer
    field = "data." + ("max_pixels" if "max_pixels" in wanted else "min_pixels")
    processor = processor_of(tokenizer)
    if processor is None or not has_pixel_budget(processor.image_processor):
        kind = type(processor.image_processor).__name__ if processor is not None else "none: the model is text-only"
        raise ConfigError(f"{field}={wanted[field[5:]]}: a pixel budget is for image processors with dynamic "
                          f"resolution (Qwen2-VL's), and this model's image processor ({kind}) resizes to a fixed "
                          "size (model.processor.image_processor sets it); unset data.max_pixels and data.min_pixels")
    size = dict(processor.image_processor.size)
    size.update({"shortest_edge": wanted.get("min_pixels", size.get("shortest_edge")),
                 "longest_edge": wanted.get("max_pixels", size.get("longest_edge"))})
    for key, edge in (("min_pixels", "shortest_edge"), ("max_pixels", "longest_edge")):
        if not isinstance(size[edge], int) or size[edge] <= 0:
            raise ConfigError(f"data.{key}={size[edge]} must be a positive number of pixels")
    if size["shortest_edge"] > size["longest_edge"]:
        raise ConfigError(f"data.min_pixels={size['shortest_edge']} is over data.max_pixels={size['longest_edge']}; "
                          "lower data.min_pixels or raise data.max_pixels")
    processor.image_processor.size = size
    return tokenizer


def refuse_packing(data_cfg: Any, tokenizer: Any) -> None:
    """Image-text samples are packed (``data.packing=true``) for the families whose packed rows are
    tested to equal their unpacked samples (:data:`llmtrain.common.images.PACKED_PROCESSORS`).

    Raises:
        ConfigError: ``data.packing=true`` with image-text data for another family's processor.
    """
    processor = processor_of(tokenizer)
    name = type(processor).__name__
    if data_cfg.packing and processor is not None and name not in PACKED_PROCESSORS:
        families = ", ".join(dict.fromkeys(PACKED_PROCESSORS.values()))
        raise ConfigError(f"data.packing=true: image-text samples are packed for {families} models only, not this "
                          f"model's {name} (its positions and attention across packed samples are not checked); "
                          "set data.packing=false")


def refuse_image_pairs(data_cfg: Any, unpaired: bool) -> None:
    """Image-text preference data train the DPO family on unpacked pairs only.

    Raises:
        ConfigError: KTO's unpaired examples (``objective=kto``) or ``data.packing=true`` with images.
    """
    if unpaired:
        raise ConfigError("objective=kto with an images column: unpaired examples do not carry images yet; use "
                          "objective=dpo (or simpo, orpo) on the pairs, or drop the images column")
    if data_cfg.packing:
        raise ConfigError("data.packing=true: image-text preference pairs are not packed yet (each row's images must "
                          "stay with its tokens); set data.packing=false")


class ImageCollator(Collator):
    """:class:`~llmtrain.data.order.Collator`'s padded ``input_ids``/``labels``/``attention_mask``
    plus the image processor's tensors of the samples' images (``pixel_values`` and, per family,
    ``pixel_attention_mask``, ``image_grid_thw``, ``image_sizes``), in sample order; samples
    without images add none. Shapes are the processor's: Idefics3 ``pixel_values``
    ``[samples with images, images, 3, H, W]``, LLaVA ``[images, 3, H, W]``."""

    def __init__(self, pad_id: int, processor: Any):
        super().__init__(pad_id)
        self.processor = processor
        self.prepared_s = 0.0  # seconds spent reading and processing images since take_metrics()

    def __call__(self, samples: list[dict]) -> dict[str, torch.Tensor]:
        batch = super().__call__(samples)
        started = time.perf_counter()
        batch.update(image_tensors(self.processor, [s.get("images") or [] for s in samples]))
        self.prepared_s += time.perf_counter() - started
        return batch

    def take_metrics(self) -> dict[str, float]:
        """``time/image_prep_s``: the seconds this collator spent reading and processing images
        since the previous call; the trainer takes it once a step. With ``data.prefetch`` > 0 that
        work runs in the read-ahead thread beside the step (``time/data_wait_s`` is what the step
        waited), so it is the images' cost per step, not time the step lost."""
        spent, self.prepared_s = self.prepared_s, 0.0
        return {"time/image_prep_s": spent}


def image_tensors(processor: Any, paths: list[list[str]]) -> dict[str, torch.Tensor]:
    """The image processor's forward tensors (:data:`~llmtrain.common.images.IMAGE_INPUTS` it
    gives) of each row's images, read from ``paths`` (one list per row, in order; rows without
    images add none), as :class:`ImageCollator` hands them to the model: Idefics3
    ``pixel_values`` ``[rows with images, images, 3, H, W]``, LLaVA ``[images, 3, H, W]``;
    ``{}`` when no row has an image.

    Raises:
        DataError: an image missing or unreadable (naming its path).
    """
    nested = [[load_image(Path(p), "data", "images") for p in row] for row in paths if row]
    if not nested:
        return {}
    pixels = processor.image_processor(images=nested, return_tensors="pt")
    return {key: pixels[key] for key in IMAGE_INPUTS if key in pixels}


def encode_image_prompt(turns: list[dict], paths: list[Path], tokenizer: Any, where: str) -> list[int]:
    """The token ids an image-text model is prompted with for the conversation ``turns`` (OpenAI
    layout with ``{"type": "image"}`` parts) and its images at ``paths``: the processor's chat
    template with the generation prompt, each image placeholder expanded into the image's tokens
    (as :class:`ImageChatEncoder` does for SFT). Trailing assistant turns are left out: in an SFT
    file such as the digits' they hold the reference answer, which the ``answer`` column gives.

    Raises:
        DataError: images for a text-only model, image parts that do not match the paths in
            number, a missing or unreadable image (naming ``where`` and the field).
    """
    from llmtrain.data.formats import render as render_chat

    processor = processor_of(tokenizer)
    if processor is None:
        raise DataError(f"{where}: field 'images' holds {len(paths)} image(s), and the model is text-only (no image "
                        "processor); use an image-text model (e.g. model=tiny_idefics3) or drop the images")
    checked, _ = parts_conversation({"prompt": turns}, "prompt", where)
    while checked and checked[-1]["role"] == "assistant":
        checked = checked[:-1]
    parts = sum(1 for t in checked if isinstance(t["content"], list) for p in t["content"] if p["type"] == "image")
    if parts != len(paths):
        raise DataError(f"{where}: {parts} image part(s) in the prompt but {len(paths)} path(s) in field 'images'; "
                        "each {'type': 'image'} part needs one image, in order")
    text = render_chat(tokenizer, checked, True, where)
    pictures = [load_image(p, where, "images") for p in paths]
    out = processor(text=[text], images=[pictures] if pictures else None, add_special_tokens=False)
    return [int(t) for t in out["input_ids"][0]]

