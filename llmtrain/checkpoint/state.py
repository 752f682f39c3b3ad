"""What a checkpoint holds besides the engine's shards: the train state (``trainer_state.json``:
step, samples and tokens seen, global and rank-count independent, with goodput's clocks) and each
rank's RNG states (``rank_<r>.pt``, tensors and plain types read with ``weights_only``)."""

from __future__ import annotations

import json
import logging
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from llmtrain.common.errors import ResumeError
from llmtrain.common.safe_load import load_weights_only, unpickling_reason

log = logging.getLogger("llmtrain")
STATE_FILE = "trainer_state.json"


@dataclass
class TrainState:
    """Loop position saved with every checkpoint. ``consumed_samples`` is the global sample index
    of the next sample (independent of the number of ranks)."""

    step: int = 0
    consumed_samples: int = 0
    tokens_seen: int = 0
    tracker_run_id: str | None = None  # wandb's
    mlflow_run_id: str | None = None
    world_size: int = 1
    global_batch_size: int = 0
    # The checkpoint this one continues (``step_4``): the previous save of the same lineage, or
    # the checkpoint the run resumed from. None for the first checkpoint of a fresh run.
    parent: str | None = None
    # Updates dropped by trainer.nonfinite=skip: the optimizer has taken step - skipped_updates.
    skipped_updates: int = 0
    # Running mean of healthy steps' losses and how many fed it (trainer.spike_factor).
    loss_ema: float = 0.0
    loss_ema_steps: int = 0
    # Wall-time accounting since the run's first start (Unix seconds; rank 0's clock), for
    # time/goodput: productive = the steps this checkpoint includes; lost = work a crash made the
    # run redo; restart = gaps between a crash and the next start (queueing included); idle =
    # gaps between a process that finished and the next one that continues the run (no loss: the
    # run was done until someone raised trainer.max_steps), left out of the wall time.
    run_started_unix: float = 0.0
    saved_unix: float = 0.0
    productive_s: float = 0.0
    startup_s: float = 0.0
    eval_s: float = 0.0
    checkpoint_s: float = 0.0
    lost_s: float = 0.0
    restart_s: float = 0.0
    idle_s: float = 0.0
    # Online RL: the parts of productive_s spent sampling completions and scoring them.
    generation_s: float = 0.0
    reward_s: float = 0.0
    # Partial training (LoRA, model.freeze): the base weights the checkpoint's trainable
    # parameters belong to (llmtrain.models.adapters.base_fingerprint); None in full training.
    base_fingerprint: str | None = None
    # Mixture-of-experts models: tokens routed to each expert [layer][expert] over all steps
    # so far (the report's heatmap, exact across resumes); None for dense models.
    expert_load: list[list[float]] | None = None


def read_state(checkpoint_dir: Path) -> TrainState:
    """The loop position saved in ``checkpoint_dir`` (its ``trainer_state.json``); fields that
    an older checkpoint lacks get their defaults, fields this version does not know are dropped."""
    saved = json.loads((Path(checkpoint_dir) / STATE_FILE).read_text())
    known = set(TrainState.__dataclass_fields__)
    return TrainState(**{k: v for k, v in saved.items() if k in known})


# Layout of rank_<r>.pt. Format 2: tensors and plain types only, so torch.load(weights_only=True)
# reads it with torch's default allow-list. Files without "format" are format 1 (before it):
# random.getstate() and np.random.get_state() tuples as they come, numpy's key a pickled array.
RNG_FORMAT = 2
_RNG_KEYS = ("python", "numpy", "torch")


def capture_rng() -> dict[str, Any]:
    """This rank's RNG states (python, numpy, torch CPU and, where present, CUDA) as tensors and
    plain types, so that ``torch.load(..., weights_only=True)`` reads them back::

        {"format": 2,
         "python": {"version": int, "state": int64 tensor (625 words), "gauss": float | None},
         "numpy": {"bit_generator": "MT19937", "key": int64 tensor (624 uint32 words), "pos": int,
                   "has_gauss": int, "cached_gaussian": float},
         "torch": uint8 tensor, "cuda": [uint8 tensor per device]}
    """
    version, words, gauss = random.getstate()
    name, key, pos, has_gauss, cached = np.random.get_state(legacy=True)
    state: dict[str, Any] = {
        "format": RNG_FORMAT,
        "python": {"version": int(version), "state": torch.tensor(words, dtype=torch.int64), "gauss": gauss},
        "numpy": {"bit_generator": str(name), "key": torch.from_numpy(key.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
        "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    """Set this rank's RNG states from :func:`capture_rng`'s dict (or a format-1 dict of older
    checkpoints, whose python and numpy states are the tuples of ``getstate``)."""
    python, numpy_state = state["python"], state["numpy"]
    if isinstance(python, dict):
        python = (python["version"], tuple(python["state"].tolist()), python["gauss"])
    if isinstance(numpy_state, dict):
        numpy_state = (numpy_state["bit_generator"], numpy_state["key"].numpy().astype(np.uint32), numpy_state["pos"],
                       numpy_state["has_gauss"], numpy_state["cached_gaussian"])
    random.setstate(python)
    np.random.set_state(numpy_state)
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _numpy_array_globals() -> list[Any]:
    """What a pickled numpy array references (a format-1 RNG file's numpy key): the array
    reconstructor under numpy 2's and numpy 1's module name, the array and dtype classes. They
    rebuild data-only arrays; allow-listed for :func:`read_rng`'s ``weights_only`` load only."""
    multiarray = np._core.multiarray if hasattr(np, "_core") else np.core.multiarray
    return [(multiarray._reconstruct, "numpy.core.multiarray._reconstruct"),
            (multiarray._reconstruct, "numpy._core.multiarray._reconstruct"),
            np.ndarray, np.dtype, type(np.dtype(np.uint32))]


def read_rng(path: Path) -> dict[str, Any]:
    """One rank's RNG file (``rank_<r>.pt``), loaded with ``torch.load(weights_only=True)``: only
    tensors and plain types are built, so a crafted file cannot run code. A format-1 file (before
    :data:`RNG_FORMAT`; numpy's key a pickled array) loads the same way with numpy's array types
    allow-listed (:func:`_numpy_array_globals`) and is returned as it is (:func:`restore_rng`
    takes both); the caller says so in the log (``"format"`` absent).

    Raises:
        ResumeError: the file holds other pickled objects (refused: none of it runs), is not a
            torch file, or lacks the python, numpy or torch state; the message names the file.
    """
    import pickle

    fix = ("resume from a checkpoint you wrote yourself (trainer.resume=<step or path>) or start a new run_dir; "
           "load only checkpoints you trust")
    try:
        state = load_weights_only(path, _numpy_array_globals())
    except pickle.UnpicklingError as err:
        raise ResumeError(f"refusing RNG file {path}: it holds pickled objects that are not RNG states "
                          f"({unpickling_reason(err)}); it was not loaded and none of it ran; {fix}") from None
    except (RuntimeError, OSError, EOFError, ValueError) as err:
        raise ResumeError(f"RNG file {path} is not a readable torch file ({err}); {fix}") from None
    missing = [k for k in _RNG_KEYS if not isinstance(state, dict) or k not in state]
    if missing:
        raise ResumeError(f"RNG file {path} lacks the {', '.join(missing)} state(s) of an llmtrain RNG file; {fix}")
    return state
