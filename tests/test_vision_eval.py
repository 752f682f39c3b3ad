"""``digits_local``: the local lm-eval multimodal task on the digits test set, scored through
``python -m llmtrain.evaluate`` (lm-eval's ``hf-multimodal`` model) on a tiny image-text export,
against the model's own greedy answers computed here by hand."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import make_cfg

QUESTION = "Which digit (0-9) is written in this image? Answer with the digit only."
UNTIL = ["<|im_end|>", "<end_of_utterance>", "</s>", "<|endoftext|>", "\n"]  # digits_local.yaml's stop strings


def tiny_export(digits: Path, out: Path, model: str = "tiny_idefics3", seed: int = 3) -> Path:
    """A randomly initialised tiny image-text model exported with its processor."""
    from llmtrain import data
    from llmtrain.checkpoint.export import save_hf_folder
    from llmtrain.models.build import build_model, build_tokenizer

    cfg = make_cfg([f"model={model}", "data=vlm_chat", f"data.path={digits / 'train.jsonl'}"])
    tokenizer = build_tokenizer(cfg.model)
    model = build_model(cfg.model, seed=seed).eval()
    return save_hf_folder(model.state_dict(), cfg.model, tokenizer, out, data.end_token_ids(cfg.data, tokenizer))


def greedy_answers(folder: Path, images: list[Path]) -> list[str]:
    """The export's greedy answers (8 new tokens at most, special tokens dropped, cut at
    digits_local's stop strings) to the digits question about each image, prompted by hand
    through the processor's chat template with the image before the question."""
    from PIL import Image
    from transformers import AutoModelForImageTextToText, AutoProcessor

    processor = AutoProcessor.from_pretrained(folder)
    model = AutoModelForImageTextToText.from_pretrained(folder).eval()
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}]
    prompt = processor.apply_chat_template(messages, add_generation_prompt=True)
    answers = []
    for path in images:
        with Image.open(path) as image:
            inputs = processor(text=[prompt], images=[[image.convert("RGB")]], return_tensors="pt")
        out = model.generate(**inputs, max_new_tokens=8, do_sample=False)
        text = processor.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
        for stop in UNTIL:
            text = text.split(stop)[0]
        answers.append(text)
    return answers


@pytest.mark.parametrize("model", ["tiny_idefics3", "tiny_qwen2vl"])
def test_digits_local_scores_an_export_as_its_own_greedy_answers(model, shared_data, tmp_path):
    """The score through llmtrain.evaluate (hf-multimodal, the chat template, the images) equals
    the share of answer-column values that the model's greedy answers, computed by hand, match.
    A random model answers junk, not digits, so the answers of a copy of the first four test
    records are set to its own answers (three of them) and to a string it never gives (one):
    0.75 only when the harness generated the very texts of the hand computation, images included
    (the model's answers differ between the images)."""
    from llmtrain.evaluation.local_tasks import digits_images
    from llmtrain.evaluate import main
    from llmtrain.rollout.rewards import answer_matches

    digits = shared_data / "digits"
    if not (digits / "test.jsonl").is_file():
        pytest.skip(f"{digits} not present")
    docs = digits_images(data_dir=str(shared_data))["test"]
    assert len(docs) == 300 and docs[0]["prompt"] == "<image>" + QUESTION
    records = [json.loads(line) for line in (digits / "test.jsonl").read_text().splitlines()[:4]]
    assert [d["answer"] for d in docs.select(range(4))] == [r["answer"] for r in records] == ["6", "3", "2", "1"]
    folder = tiny_export(digits, tmp_path / "hf", model)
    answers = greedy_answers(folder, [digits / r["images"][0] for r in records])
    assert len(set(answers)) > 1, answers  # the pixels change the answer: they reach generation
    for record, answer in zip(records, [answers[0], "never", answers[2], answers[3]]):
        record["answer"] = answer
        record["images"] = [str(digits / record["images"][0])]  # absolute: the copy lives elsewhere
    mine = tmp_path / "digits" / "test.jsonl"
    mine.parent.mkdir()
    mine.write_text("".join(json.dumps(r) + "\n" for r in records))
    expected = sum(answer_matches(a, r["answer"]) for a, r in zip(answers, records)) / 4
    assert expected == 0.75
    assert main([str(folder), "tasks=[digits_local]", "limit=4", f"data_dir={tmp_path}",
                 f"out_dir={tmp_path / 'eval'}", "batch_size=4", "bootstrap_iters=0"]) == 0
    result = json.loads(next((tmp_path / "eval").glob("*.json")).read_text())
    assert result["scores"]["eval/digits_local/exact_match"] == expected
    assert result["scores"]["eval/digits_local/documents"] == 4


def test_an_image_task_for_a_text_only_model_is_refused_before_the_run_starts(tmp_path):
    """trainer.eval_tasks=[digits_local] on tiny_llama once trained and then failed in the evaluation
    process (lm-eval's multimodal check, exit 1, the run's own exit 0): now one line at start-up.
    The image-text model's check passes on the same file."""
    pytest.importorskip("lm_eval")
    from PIL import Image

    from llmtrain.common.errors import ConfigError
    from llmtrain.evaluation import in_loop

    (tmp_path / "digits" / "images").mkdir(parents=True)
    Image.new("L", (8, 8)).save(tmp_path / "digits" / "images" / "0.png")
    record = {"messages": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]},
                           {"role": "assistant", "content": [{"type": "text", "text": "0"}]}],
              "images": ["images/0.png"], "answer": "0"}
    (tmp_path / "digits" / "test.jsonl").write_text(json.dumps(record) + "\n")
    t = make_cfg(["trainer.eval_tasks=[digits_local]", f"trainer.eval_tasks_data_dir={tmp_path}"]).trainer
    with pytest.raises(ConfigError, match=r"^evaluation task digits_local gives the model images, and this model is "
                                          r"text-only; evaluate an image-text model"):
        in_loop.check(t, image_text=False)
    in_loop.check(t, image_text=True)
