"""Write a model group's tokenizer as a Hugging Face folder, for a config-built model that should
share it (``model.tokenizer=FOLDER``): a distillation student of that model, say.

    python scripts/tools/save_tokenizer.py smollm2_135m smollm2-tokenizer

``MODEL`` is a ``conf/model`` group name (a GGUF model's tokenizer is read from its file).
Exit status 0, or 2 with one line naming the problem.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout's llmtrain


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 2 or any(a in ("-h", "--help") for a in args):
        print(__doc__)
        return 0 if args and args[0] in ("-h", "--help") else 2
    from llmtrain.common.errors import ConfigError, ModelSourceError
    from llmtrain.config.compose import compose
    from llmtrain.models.build import build_tokenizer

    model, out = args
    try:
        tokenizer = build_tokenizer(compose([f"model={model}"]).model)
    except (ConfigError, ModelSourceError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except Exception as err:  # noqa: BLE001  (Hydra's unknown group option and the like)
        print(f"error: model={model}: {err}", file=sys.stderr)
        return 2
    tokenizer.save_pretrained(out)
    print(f"wrote the {model} tokenizer ({len(tokenizer)} tokens) to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
