"""Image prompts on ``rollout.engine=vllm``: each completion request carries its images, and
its token ids in the form vLLM's multi-modal processor expands.

vLLM's ``/v1/completions`` takes no images; its token-in/token-out endpoint
(``/inference/v1/generate``, served with ``--enable-scale-out``) takes ``token_ids`` with the
images as ``content_parts`` (``image_url`` data URLs), runs the model's HF image processor and
applies its prompt updates to the ids (vLLM 0.32, ``BaseMultiModalProcessor.apply``): each
image's placeholder (Idefics3's and LLaVA's ``<image>``, Gemma 3's ``<start_of_image>``,
Qwen2-VL's ``<|image_pad|>``: ``processor.image_token``) is replaced by the image's tokens.
llmtrain's prompt ids already hold those tokens (:func:`llmtrain.data.vision.encode_image_prompt`),
so they are sent collapsed (:meth:`ImagePrompts.collapse`: each image's expansion, as llmtrain's
processor makes it, back to its placeholder), and the ids vLLM answers it expanded into
(``return_token_ids``) must equal llmtrain's: the policy's log-probs are of those tokens.

Which families: those whose architecture (``transformers``' image-text-to-text class of the
model's ``model_type``) the vLLM environment can serve: in vLLM's model registry, its module
importable (:func:`why_not_served`); any other is refused at start-up in one line naming it.
"""

from __future__ import annotations

import base64
import hashlib
import json
import mimetypes
import subprocess
from pathlib import Path
from typing import Any, Callable

from llmtrain.common.errors import ConfigError
from llmtrain.common.images import processor_of

GENERATE_PATH = "/inference/v1/generate"
SERVER_ARGS = ["--enable-scale-out"]  # what serves GENERATE_PATH (vLLM 0.32)


def architecture(model_cfg: Any) -> str | None:
    """The ``transformers`` image-text-to-text class name of the model (what its exported
    ``config.json`` names under ``architectures``, and what vLLM serves by), from its
    ``model_type``: the preset's for ``model.source=config``, else a local folder's
    ``config.json``; None when it cannot be told without a download."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    if model_cfg.source == "config":
        model_type = str(model_cfg.architecture.model_type)
    else:
        config = Path(str(model_cfg.path or "")).expanduser() / "config.json"
        if not config.is_file():
            return None
        model_type = json.loads(config.read_text()).get("model_type", "")
    return MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES.get(model_type)


# Run by the vLLM environment's python with an architecture: "" where vLLM serves it, else why not.
_PROBE = """import sys
from vllm import ModelRegistry
name = sys.argv[1]
if name not in ModelRegistry.get_supported_archs():
    print("not in its model registry")
else:
    try:
        ModelRegistry.models[name].load_model_cls()
        print("")
    except Exception as err:  # what its model module needs and lacks
        print(f"in its registry, but its model module does not import: {type(err).__name__}: {err}")
"""


def why_not_served(python: Path, name: str) -> str:
    """Why the vLLM of the environment's ``python`` cannot serve the architecture ``name``: not
    in its model registry (``ModelRegistry.get_supported_archs()``), or its model module fails to
    import (vLLM 0.32's LLaVA and Gemma 3 need torchvision, which the CPU set-up removes); "" where
    it can. An import of vLLM: seconds.

    Raises:
        ConfigError: vLLM itself does not import there.
    """
    out = subprocess.run([str(python), "-c", _PROBE, name], capture_output=True, text=True)
    if out.returncode != 0:
        raise ConfigError(f"rollout.vllm_python={python}: importing vLLM's model registry failed: "
                          f"{(out.stderr.strip().splitlines() or ['?'])[-1]}")
    return (out.stdout.strip().splitlines() or [""])[-1]


def check_architecture(cfg: Any, tokenizer: Any, python: Path) -> None:
    """For an image-text model (a processor on ``tokenizer``) on a server llmtrain starts: vLLM
    must serve its architecture (:func:`why_not_served`).

    Raises:
        ConfigError: naming the architecture, the vLLM environment, why, and the fix.
    """
    if processor_of(tokenizer) is None or cfg.rollout.vllm_url:
        return
    name = architecture(cfg.model)
    reason = why_not_served(python, name) if name is not None else ""
    if reason:
        raise ConfigError(f"rollout.engine=vllm: vLLM at rollout.vllm_python={python} cannot serve {name} ({reason}), "
                          "so it cannot sample this model's image prompts; use rollout.engine=hf")


def image_part(path: str, version: int | None) -> dict:
    """The ``content_parts`` entry of the image file at ``path``: its bytes as a ``data:`` URL,
    and a ``uuid`` (what vLLM keys its encoder cache by, instead of the content's hash) of the
    content and the weights' ``version``. vLLM 0.32's in-place weight reload empties the
    workers' encoder cache but not the scheduler's record of it, so an image seen before the
    reload crashed the engine ("Encoder cache miss"); a new key per version also keeps image
    features computed with the old weights from being reused."""
    raw = Path(path).read_bytes()
    kind = mimetypes.guess_type(path)[0] or "image/png"
    return {"type": "image_url", "url": f"data:{kind};base64," + base64.b64encode(raw).decode(),
            "uuid": f"{hashlib.sha256(raw).hexdigest()[:32]}-w{version}"}


class ImagePrompts:
    """Requests for image prompts (see the module). ``tokenizer``: the policy's, with its processor."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.processor = processor_of(tokenizer)
        self._expansions: dict[str, list[int]] = {}  # image path -> its placeholder's expansion

    def _expansion(self, path: str) -> list[int]:
        if path not in self._expansions:
            from llmtrain.data.vision import load_image

            out = self.processor(text=[self.processor.image_token], images=[[load_image(Path(path), "data", "images")]],
                                 add_special_tokens=False)
            self._expansions[path] = [int(t) for t in out["input_ids"][0]]
        return self._expansions[path]

    def collapse(self, prompt_ids: list[int], images: list[str]) -> list[int]:
        """``prompt_ids`` with each image's tokens (in order: the processor's expansion of its
        placeholder for that image) replaced by the placeholder's ids: the chat template's ids
        before the processor ran, which vLLM's processor expands again.

        Raises:
            ValueError: an image's expansion is not in the ids (ids made by another processor).
        """
        placeholder = [int(t) for t in self.tokenizer(self.processor.image_token, add_special_tokens=False)["input_ids"]]
        out, start = [], 0
        for path in images:
            expansion = self._expansion(path)
            at = next((i for i in range(start, len(prompt_ids) - len(expansion) + 1)
                       if prompt_ids[i:i + len(expansion)] == expansion), None)
            if at is None:
                raise ValueError(f"the prompt's ids do not hold the tokens of image {path} as this model's processor "
                                 "expands them")
            out += prompt_ids[start:at] + placeholder
            start = at + len(expansion)
        return out + prompt_ids[start:]

    def choice(self, post: Callable[[str, dict], Any], body: dict, prompt_ids: list[int], images: list[str],
               version: int | None) -> dict:
        """One completion of an image prompt: the ``/v1/completions`` request ``body`` (its
        ``prompt`` is ``prompt_ids``) sent as a ``/inference/v1/generate`` request through
        ``post(path, body)``, the server holding the weights of step ``version``; the answer's choice in ``/v1/completions``' shape (``token_ids``,
        ``finish_reason``, ``logprobs.token_logprobs``).

        Raises:
            ConfigError: vLLM expanded the images into other ids than llmtrain's processor, or
                the prompt's ids do not hold its images' tokens.
        """
        keep = ("max_tokens", "n", "temperature", "seed", "top_k", "top_p", "logprobs", "stop", "stop_token_ids",
                "skip_special_tokens", "include_stop_str_in_output", "logit_bias")
        try:
            collapsed = self.collapse(prompt_ids, images)
        except ValueError as err:
            raise ConfigError(f"rollout.engine=vllm: {err}") from None
        request = {"model": body["model"], "token_ids": collapsed,
                   "content_parts": [image_part(p, version) for p in images],
                   "sampling_params": {k: body[k] for k in keep if k in body}, "return_token_ids": True}
        answer = post(GENERATE_PATH, request)
        if [int(t) for t in answer.get("prompt_token_ids") or []] != list(prompt_ids):
            raise ConfigError(f"rollout.engine=vllm: vLLM expanded an image prompt into "
                                  f"{len(answer.get('prompt_token_ids') or [])} ids that differ from llmtrain's "
                                  f"{len(prompt_ids)} (its processor's settings differ from the exported "
                                  "processor_config.json?)")
        choice = answer["choices"][0]
        content = (choice.get("logprobs") or {}).get("content") or []
        return {"token_ids": choice["token_ids"], "finish_reason": choice.get("finish_reason"),
                "logprobs": {"token_logprobs": [c["logprob"] for c in content]} if content else None}
