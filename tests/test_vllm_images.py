"""Image prompts on ``rollout.engine=vllm`` (:mod:`llmtrain.rollout.vllm_images`).

Everywhere: the ids sent to vLLM are the chat template's ids before llmtrain's processor expanded
the images (an independent rendering of the prompt), for Idefics3, LLaVA and Gemma 3; the
architectures vLLM is asked about; a family vLLM lacks is refused in one line naming it.
With vLLM's environment (skipped without it, as in CI): the engine against the policy itself on
image prompts (tiny Idefics3, its decoder at head_dim 32, which vLLM's CPU attention needs):
vLLM expands the images into llmtrain's very ids, its greedy completions equal the ``hf``
engine's, its sampled tokens' log-probs equal the policy's (fp32, 1e-5) before and after a
weight sync; and 3 steps of GRPO on the digits' images train with every step's
``rollout/logp_diff_max`` small.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch

from conftest import assert_ok, make_cfg, run_cli, train_rows
from test_grpo_vllm import PYTHON, needs_vllm, stand_in_policy
from test_vision_grpo import write_prompts

# vLLM's CPU attention takes head sizes 32, 64, ... (CPUAttentionBackend.get_supported_head_sizes):
# the tiny presets' decoders have 16.
HEAD_32 = {"tiny_idefics3": ["model.architecture.text_config.num_attention_heads=2",
                             "model.architecture.text_config.num_key_value_heads=1"],
           "tiny_gemma3": ["model.architecture.text_config.head_dim=32"]}
HEAD_32["tiny_llava"] = HEAD_32["tiny_idefics3"]


def _has_torchvision() -> bool:
    if not PYTHON.is_file():
        return False
    code = "import importlib.util as u, sys; sys.exit(0 if u.find_spec('torchvision') else 3)"
    return subprocess.run([str(PYTHON), "-c", code], capture_output=True).returncode == 0


# vLLM 0.32's llava and gemma3_mm modules import transformers' processors that need torchvision, and the
# CPU set-up (docs/online-rl.md) removes torchvision because it breaks `import vllm` there.
needs_torchvision = pytest.mark.skipif(not _has_torchvision(), reason="vLLM's LLaVA and Gemma 3 need torchvision in its venv")


def image_cfg(path: Path, run_dir: Path, model: str = "tiny_idefics3", *extra: str):
    return make_cfg([f"model={model}", "objective=grpo", "data=prompts", f"data.path={path}",
                     "data.columns.prompt=messages", "data.val_fraction=0.25", "reward.functions=[answer]",
                     "rollout.engine=vllm", "rollout.max_completion_length=6", "objective.num_generations=2",
                     "trainer.global_batch_size=2", "trainer.micro_batch_size=1", "trainer.eval_every=0",
                     "tracker=none", "trainer.progress_bar=false", "trainer.export_hf=false", "trainer.precision=fp32",
                     "data.seq_len=128", "rollout.vllm_args=[--enforce-eager]", f"run_dir={run_dir}", *extra])


def _samples(cfg, tokenizer) -> list[dict]:
    from llmtrain import data

    splits = data.load_splits(cfg.data, tokenizer, 0, prompt_budget=128 - 6)
    return [splits.train[i] for i in range(len(splits.train))]


@pytest.mark.parametrize("model", ["tiny_idefics3", "tiny_llava", "tiny_gemma3"])
def test_the_ids_sent_to_vllm_are_the_chat_templates_before_the_processor(tmp_path, model):
    """What vLLM's processor expands: the prompt rendered by the chat template (each image as
    the processor's placeholder) and tokenized, without the processor's expansion; llmtrain's
    expanded ids hold more tokens than that (the image's)."""
    from llmtrain.data.formats import render
    from llmtrain.models.build import build_tokenizer
    from llmtrain.rollout.vllm_images import ImagePrompts

    cfg = image_cfg(write_prompts(tmp_path), tmp_path / "run", model)
    tokenizer = build_tokenizer(cfg.model)
    records = [json.loads(line) for line in (tmp_path / "train.jsonl").read_text().splitlines()]
    prompts = ImagePrompts(tokenizer)
    for sample in _samples(cfg, tokenizer)[:3]:
        text = render(tokenizer, records[sample["record"]]["messages"][:1], True, "test")
        reference = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert prompts.collapse(list(sample["prompt_ids"]), sample["images"]) == reference
        assert len(sample["prompt_ids"]) > len(reference)
    with pytest.raises(ValueError, match="do not hold the tokens of image"):
        prompts.collapse(reference, sample["images"])  # no expansion in it


def test_image_prompts_on_two_servers_go_whole_to_one_with_their_images(tmp_path, monkeypatch):
    """rollout.vllm_servers=2 (requests answered in place of the servers): every completion of an
    image prompt is a generate request with the chat template's ids (an independent rendering),
    its image and the weights' version, the image token suppressed, sent to the server of its
    record (:func:`~llmtrain.rollout.vllm_engine.server_of`), both servers used; the answers come
    back as completions."""
    from llmtrain.data.formats import render
    from llmtrain.models.build import build_tokenizer
    from llmtrain.rollout import build_sampler, vllm_engine
    from llmtrain.rollout.vllm_images import GENERATE_PATH

    cfg = image_cfg(write_prompts(tmp_path), tmp_path / "run", "tiny_idefics3", "rollout.vllm_servers=2")
    tokenizer = build_tokenizer(cfg.model)
    engine = build_sampler(cfg, tokenizer, [256])
    for k, server in enumerate(engine.servers):
        server.url = f"http://server{k}"
    engine.version = 3
    samples = _samples(cfg, tokenizer)
    records = [json.loads(line) for line in (tmp_path / "train.jsonl").read_text().splitlines()]
    rendered = {tuple(tokenizer(render(tokenizer, records[s["record"]]["messages"][:1], True, "test"),
                                add_special_tokens=False)["input_ids"]): s for s in samples}
    sent = []

    def answer(url, path, body, timeout=600):
        sent.append((url, path, body))
        sample = rendered[tuple(body["token_ids"])]
        return {"prompt_token_ids": list(sample["prompt_ids"]),
                "choices": [{"token_ids": [7, sample["record"]], "finish_reason": "length",
                             "logprobs": {"content": [{"logprob": -1.0}, {"logprob": -2.0}]}}]}

    monkeypatch.setattr(vllm_engine, "_request", answer)
    groups = engine._requests(samples, [[11, 12]] * len(samples))
    (image_id,) = engine.sampling.suppress
    assert len(sent) == 2 * len(samples) and {path for _, path, _ in sent} == {GENERATE_PATH}
    for sample, group in zip(samples, groups):
        bodies = [(url, b) for url, _, b in sent if rendered[tuple(b["token_ids"])] is sample]
        assert {url for url, _ in bodies} == {f"http://server{vllm_engine.server_of(sample, 0, 2)}"}
        assert sorted(b["sampling_params"]["seed"] for _, b in bodies) == [11, 12]
        for _, b in bodies:
            (part,) = b["content_parts"]
            assert part["url"].startswith("data:image/png;base64,") and part["uuid"].endswith("-w3")
            assert b["sampling_params"]["logit_bias"] == {str(image_id): -100.0}
        assert [(c.ids, c.truncated, c.logps) for c in group] == [([7, sample["record"]], True, [-1.0, -2.0])] * 2
    assert {url for url, _, _ in sent} == {"http://server0", "http://server1"}


def test_a_family_vllm_lacks_is_refused_naming_its_architecture(tmp_path, monkeypatch):
    from llmtrain.common.errors import ConfigError
    from llmtrain.models.build import build_tokenizer
    from llmtrain.rollout import vllm_images

    cfg = image_cfg(write_prompts(tmp_path), tmp_path / "run")
    tokenizer = build_tokenizer(cfg.model)
    assert [vllm_images.architecture(make_cfg([f"model={m}"]).model) for m in ("tiny_idefics3", "tiny_llava",
                                                                               "tiny_gemma3", "tiny_llama")] == [
        "Idefics3ForConditionalGeneration", "LlavaForConditionalGeneration", "Gemma3ForConditionalGeneration", None]
    monkeypatch.setattr(vllm_images, "why_not_served",
                        lambda python, name: "" if name == "LlavaForConditionalGeneration" else "not in its model registry")
    with pytest.raises(ConfigError, match=r"cannot serve Idefics3ForConditionalGeneration \(not in its model registry\)"
                                          ".*use rollout.engine=hf"):
        vllm_images.check_architecture(cfg, tokenizer, Path("/vllm/bin/python"))
    llava = image_cfg(tmp_path / "train.jsonl", tmp_path / "run", "tiny_llava")
    vllm_images.check_architecture(llava, build_tokenizer(llava.model), Path("/vllm/bin/python"))  # served: no error


@needs_vllm
def test_vllm_says_which_families_it_serves():
    """Idefics3 is served; an architecture vLLM's registry lacks is named as such; LLaVA's module
    imports only with torchvision (the CPU set-up removes it)."""
    from llmtrain.rollout.vllm_images import why_not_served

    assert why_not_served(PYTHON, "Idefics3ForConditionalGeneration") == ""
    assert why_not_served(PYTHON, "FooForConditionalGeneration") == "not in its model registry"
    llava = why_not_served(PYTHON, "LlavaForConditionalGeneration")
    assert llava == "" if _has_torchvision() else "No module named 'torchvision'" in llava


@needs_vllm
@pytest.mark.parametrize("model", ["tiny_idefics3", pytest.param("tiny_llava", marks=[pytest.mark.slow, needs_torchvision]),
                                   pytest.param("tiny_gemma3", marks=[pytest.mark.slow, needs_torchvision])])
def test_vllm_samples_image_prompts_with_the_policys_weights_before_and_after_a_sync(tmp_path, model):
    """Greedy completions equal llmtrain's sampler's on the same weights and pixels; sampled
    tokens' log-probs equal the policy's (its forward with the pixels, the image token
    suppressed as the sampler does) within 1e-5 in fp32, before and after the weights change."""
    from llmtrain.checkpoint.export import write_policy
    from llmtrain.common.images import processor_of
    from llmtrain.data.vision import image_tensors
    from llmtrain.models.build import build_model, build_tokenizer
    from llmtrain.rollout import build_sampler
    from llmtrain.rollout.generate import sample_group

    cfg = image_cfg(write_prompts(tmp_path), tmp_path / "run", model, *HEAD_32[model])
    tokenizer = build_tokenizer(cfg.model)
    model = build_model(cfg.model, 0).eval()
    engine = build_sampler(cfg, tokenizer, [256])
    step = [0]
    policy = stand_in_policy(model, step)
    engine.publish = lambda directory, part: write_policy(policy, cfg, tokenizer, directory, part, [256])
    samples = [s for s in _samples(cfg, tokenizer)][:3]
    (image_id,) = engine.sampling.suppress
    largest = []
    try:
        engine.check()
        for version in range(2):
            if version:
                torch.manual_seed(5)
                with torch.no_grad():  # an optimizer step's worth of change
                    for p in model.parameters():
                        p.add_(0.05 * torch.randn_like(p))
                step[0] = 1
            greedy = engine.sample(policy, samples, [[None]] * len(samples))
            sampled = engine.sample(policy, samples, [[11, 12, 13]] * len(samples))
            assert engine.version == step[0]
            for sample, (completion,), group in zip(samples, greedy, sampled):
                pixels = image_tensors(processor_of(tokenizer), [sample["images"]])
                prompt = list(sample["prompt_ids"])
                (ours,) = sample_group(model, prompt, [None], engine.sampling, torch.device("cpu"), images=pixels)
                assert completion.ids == ours.ids and completion.truncated == ours.truncated
                for c in group:
                    ids = torch.tensor([prompt + c.ids])
                    with torch.no_grad():
                        logits = model(input_ids=ids, **pixels).logits[0, len(prompt) - 1:-1].double()
                    logits[:, image_id] = float("-inf")
                    ref = torch.log_softmax(logits / cfg.rollout.temperature, -1).gather(-1, ids[0, len(prompt):, None])
                    largest.append(float((ref[:, 0] - torch.tensor(c.logps, dtype=torch.float64)).abs().max()))
            assert {len({tuple(c.ids) for c in group}) for group in sampled} != {1}  # seeds differ, completions too
        print(f"largest |log-prob difference| vLLM vs policy over {len(largest)} image completions: {max(largest):.2e}")
        assert max(largest) <= 1e-5
    finally:
        engine.close()


@needs_vllm
@pytest.mark.slow
@pytest.mark.server
def test_grpo_on_the_digits_images_trains_on_vllm(tmp_path, shared_data):
    """3 steps of GRPO on the digits' images, sampled by vLLM: every step logged, rewarded, and
    vLLM's log-probs of the sampled tokens within 1e-2 of the policy's (their difference is the
    suppressed image token's probability, ~1/320 for a random tiny model), and no server left."""
    from test_grpo_vllm import _servers_of

    run_dir = tmp_path / "digits"
    args = ["model=tiny_idefics3", *HEAD_32["tiny_idefics3"], "objective=grpo", "data=prompts",
            f"data.path={shared_data / 'digits' / 'train.jsonl'}", "data.columns.prompt=messages",
            "data.val_fraction=0.01", "reward.functions=[answer]", "rollout.engine=vllm",
            "rollout.max_completion_length=2", "objective.num_generations=4", "trainer.global_batch_size=4",
            "trainer.micro_batch_size=4", "trainer.max_steps=3", "trainer.lr=1e-3", "trainer.eval_every=0",
            "trainer.precision=fp32", "trainer.export_hf=false", "tracker=none", "trainer.progress_bar=false",
            "data.seq_len=128", "rollout.vllm_args=[--enforce-eager]", f"run_dir={run_dir}"]
    assert_ok(run_cli(args, timeout=900))
    rows = train_rows(run_dir, 3)
    diffs = [r["rollout/logp_diff_max"] for r in rows]
    print("rollout/logp_diff_max per step:", [f"{d:.1e}" for d in diffs], "reward:", [r["train/reward"] for r in rows])
    assert len(rows) == 3 and max(diffs) <= 1e-2 and all(r["train/loss"] == r["train/loss"] for r in rows)
    logged = [json.loads(line) for line in (run_dir / "completions" / "step_3.jsonl").read_text().splitlines()]
    assert len(logged) == 4 and logged[0]["prompt"][0]["content"][0]["type"] == "image"
    assert not _servers_of(run_dir), "the vLLM server outlived its run"
