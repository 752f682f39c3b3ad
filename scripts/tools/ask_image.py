"""Ask an image-text model's export one question about one image and print the greedy answer.

    python scripts/tools/ask_image.py runs/digits-vlm/hf digits/images/0007.png "Which digit (0-9) is written in this image? Answer with the digit only."

The folder is a run's ``hf`` export of an image-text model (``AutoModelForImageTextToText`` and
``AutoProcessor`` load it); the question goes through the processor's chat template after the
image, as in TRL's conversational vision layout. Generation stops on the ``eos_token_id`` of the
folder's ``generation_config.json``.
"""

from __future__ import annotations

import argparse


def ask(folder: str, image_path: str, question: str, max_new_tokens: int = 16) -> str:
    """The greedy answer (special tokens dropped) of the model in ``folder`` to ``question`` about
    the image at ``image_path``."""
    from PIL import Image
    from transformers import AutoModelForImageTextToText, AutoProcessor

    import llmtrain.models.qwen2vl_images  # noqa: F401  (registers the processor a tiny_qwen2vl export names)

    processor = AutoProcessor.from_pretrained(folder)
    model = AutoModelForImageTextToText.from_pretrained(folder).eval()
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]
    prompt = processor.apply_chat_template(messages, add_generation_prompt=True)
    with Image.open(image_path) as image:
        inputs = processor(text=[prompt], images=[[image.convert("RGB")]], return_tensors="pt")
    output = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    return processor.decode(output[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", help="an image-text model's export, e.g. runs/NAME/hf")
    parser.add_argument("image", help="an image file PIL reads")
    parser.add_argument("question")
    parser.add_argument("--max-new-tokens", type=int, default=16)
    args = parser.parse_args()
    print(ask(args.folder, args.image, args.question, args.max_new_tokens))


if __name__ == "__main__":
    main()
