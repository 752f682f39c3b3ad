"""``python -m llmtrain.export CHECKPOINT OUT_DIR [--merged]``: any checkpoint of any recipe
written as a Hugging Face folder, or a LoRA checkpoint as a PEFT adapter folder
(:func:`llmtrain.checkpoint.export.export_checkpoint`). Exit status 0, or 2 with one line
naming the problem."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from llmtrain.common.interrupt import one_line_on_ctrl_c

# Run as a command, Ctrl-C from here on (the imports: seconds, torch's) ends in one line.
with one_line_on_ctrl_c("llmtrain.export", active=__name__ == "__main__"):
    from llmtrain.common.errors import ModelSourceError, ResumeError
    from llmtrain.checkpoint.export import export_checkpoint


# ---------------------------------------------------------------- offline, from a checkpoint
_CLI_HELP = """``python -m llmtrain.export CHECKPOINT OUT_DIR``: any checkpoint of any recipe → a Hugging Face
folder (safetensors + config + tokenizer) that ``AutoModelForCausalLM.from_pretrained`` loads.

Runs in one process without a process group: DeepSpeed ZeRO shards are consolidated from their
fp32 optimizer partitions (DeepSpeed's ``zero_to_fp32``), torch-engine checkpoints (Distributed
Checkpoint, any layout: DDP, FSDP2, TP, PP) are consolidated with DCP's ``dcp_to_torch_save``. The model config and tokenizer come from the checkpoint's own ``config.yaml``.
"""


def check_out_dir(out_dir: Path) -> None:
    """``OUT_DIR`` can be a folder to write: it is one, or can be created.

    Raises:
        ConfigError: it (or the nearest existing folder above it) is a file, or is not writable.
    """
    import os

    from llmtrain.common.errors import ConfigError

    existing = next(p for p in (out_dir, *out_dir.absolute().parents) if p.exists())
    if not existing.is_dir():
        where = "is a file" if existing == out_dir else f"cannot be created: {existing} is a file"
        raise ConfigError(f"OUT_DIR {out_dir} {where}; give a folder to write the export to (it is created)")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"OUT_DIR {out_dir} cannot be written: {existing} is not writable; give another folder")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m llmtrain.export", description=_CLI_HELP,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", type=Path, help="a checkpoint folder, e.g. runs/NAME/checkpoints/step_200")
    parser.add_argument("out_dir", type=Path, help="folder to write (created)")
    parser.add_argument("--merged", action="store_true",
                        help="LoRA checkpoints: write the merged model instead of the PEFT adapter folder")
    args = parser.parse_args(argv)
    from llmtrain.monitoring.console import quiet_when_logged
    from llmtrain.common.errors import ConfigError

    try:
        check_out_dir(args.out_dir)
        with quiet_when_logged("export"):  # a log file gets no progress bars or DeepSpeed prints
            out = export_checkpoint(args.checkpoint, args.out_dir, merged=args.merged)
    except (ConfigError, ResumeError, ModelSourceError) as err:
        print(f"llmtrain.export: error: {err}", file=sys.stderr)
        return 2
    print(f"exported {args.checkpoint} -> {out}")
    return 0


if __name__ == "__main__":
    with one_line_on_ctrl_c("llmtrain.export"):
        sys.exit(main())
