"""``python -m llmtrain.export CHECKPOINT OUT_DIR``: any checkpoint of any recipe → a Hugging Face
folder (safetensors + config + tokenizer) that ``AutoModelForCausalLM.from_pretrained`` loads.

Runs in one process without a process group: DeepSpeed ZeRO shards are consolidated from their
fp32 optimizer partitions (DeepSpeed's ``zero_to_fp32``), torch-engine checkpoints (Distributed
Checkpoint, any layout: DDP, FSDP2, TP, PP) are consolidated with DCP's ``dcp_to_torch_save``. The model config and tokenizer come from the checkpoint's own ``config.yaml``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import llmtrain.distributed  # noqa: F401  (DeepSpeed accelerator choice before it is imported)

import torch
from omegaconf import OmegaConf

from llmtrain.checkpoint import ENGINE_DIR, ResumeError, save_hf_folder, verify
from llmtrain.models import ModelSourceError, build_tokenizer


def consolidated_state_dict(checkpoint_dir: Path, engine: str, zero_stage: int = 1) -> dict[str, torch.Tensor]:
    """Full fp32 model state dict from a checkpoint folder written by ``engine``."""
    engine_dir = checkpoint_dir / ENGINE_DIR
    if engine == "deepspeed" and zero_stage == 0:
        # ZeRO-0 keeps no partitions (zero_to_fp32 has nothing to merge): the module is whole, in
        # fp32 (bf16 runs train with fp32 parameters under torch autocast).
        states = torch.load(engine_dir / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)
        return {k: v.float() for k, v in states["module"].items()}
    if engine == "deepspeed":
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        return get_fp32_state_dict_from_zero_checkpoint(str(checkpoint_dir), tag=ENGINE_DIR)
    from llmtrain.engine.dcp_state import consolidated_model, is_dcp_checkpoint
    from llmtrain.engine.torch_engine import LEGACY_STATE

    if not is_dcp_checkpoint(engine_dir) and (engine_dir / LEGACY_STATE).is_file():
        return torch.load(engine_dir / LEGACY_STATE, map_location="cpu", weights_only=True)["model"]
    return consolidated_model(engine_dir)


def export_checkpoint(checkpoint_dir: Path, out_dir: Path, merged: bool = False) -> Path:
    """Verify ``checkpoint_dir`` and write its model as a Hugging Face folder to ``out_dir``.

    A LoRA checkpoint (``+peft=lora``) becomes a PEFT adapter folder (plus, for a model built from
    a config, its base in ``out_dir/base``), or with ``merged`` the merged Hugging Face model. The
    frozen base of a partial checkpoint (LoRA, ``model.freeze``) is rebuilt from the model's
    source, which must still hold the weights it was trained on.

    Raises:
        ResumeError: the checkpoint is missing, fails verification, or its base weights changed.
    """
    if not checkpoint_dir.is_dir():
        raise ResumeError(f"checkpoint {checkpoint_dir} does not exist")
    problem = verify(checkpoint_dir)
    if problem is not None:
        raise ResumeError(f"checkpoint {checkpoint_dir} is not usable: {problem}")
    from llmtrain.config import DataConfig
    from llmtrain.data import apply_template_setting, end_token_ids

    from llmtrain import adapters

    cfg = OmegaConf.load(checkpoint_dir / "config.yaml")
    state = consolidated_state_dict(checkpoint_dir, cfg.recipe.engine, cfg.recipe.zero_stage)
    # Older checkpoints lack newer data fields: the schema's defaults fill them.
    data_cfg = OmegaConf.merge(OmegaConf.structured(DataConfig), cfg.data)
    tokenizer = apply_template_setting(data_cfg, build_tokenizer(cfg.model))
    end_tokens = end_token_ids(data_cfg, tokenizer)
    if adapters.is_partial(cfg):
        saved = json.loads((checkpoint_dir / "trainer_state.json").read_text()).get("base_fingerprint")
        current = adapters.base_fingerprint(cfg.model, cfg.trainer.seed)
        if saved and saved != current:
            raise ResumeError(f"checkpoint {checkpoint_dir} was trained on base weights {saved}, but model source "
                              f"{cfg.model.source} ({cfg.model.get('path')}) now has {current}")
        state = adapters.whole_state(state, cfg)
    if cfg.get("peft") is not None:
        written = adapters.export(state, cfg, tokenizer, None if merged else out_dir, out_dir if merged else None,
                                  end_tokens)
        return Path(written["export" if merged else "adapter"])
    return save_hf_folder(state, cfg.model, tokenizer, out_dir, end_tokens)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m llmtrain.export", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", type=Path, help="a checkpoint folder, e.g. runs/NAME/checkpoints/step_200")
    parser.add_argument("out_dir", type=Path, help="folder to write (created)")
    parser.add_argument("--merged", action="store_true",
                        help="LoRA checkpoints: write the merged model instead of the PEFT adapter folder")
    args = parser.parse_args(argv)
    try:
        out = export_checkpoint(args.checkpoint, args.out_dir, merged=args.merged)
    except (ResumeError, ModelSourceError) as err:
        print(f"llmtrain.export: error: {err}", file=sys.stderr)
        return 2
    print(f"exported {args.checkpoint} -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
