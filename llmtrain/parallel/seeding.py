"""Random streams per rank: the seed of everything drawn at start-up, and each rank's dropout
stream for the training loop (one per data-parallel and pipeline rank, shared over tensor
parallel), so a run draws the same masks on any number of ranks it resumes on."""

from __future__ import annotations

import random

import numpy as np
import torch

from llmtrain.parallel import distributed


def seed_everything(seed: int) -> None:
    """Seed Python's, NumPy's and torch's generators (CPU and every device) with ``seed``."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def seed_streams(seed: int, dp_rank: int, pp_rank: int, start_step: int) -> int:
    """Seed this rank's random stream (dropout) for the training loop; returns the stream seed.

    Scheme: one stream per (data-parallel rank, pipeline rank), so data-parallel ranks draw
    different masks for their different samples and each pipeline stage its own (as Megatron-LM
    and torchtitan seed pipeline stages apart; unlike their default, data-parallel ranks differ
    too, because llmtrain's initialisation never draws from this stream: parameters come from
    (seed, parameter name), see :func:`llmtrain.models.build.init_weights`). Tensor-parallel ranks share
    this stream, so dropout on replicated activations agrees across the TP group; inside
    attention, whose activations are sharded over it, each TP rank draws its own
    (:func:`llmtrain.parallel.parallelize.apply_tp_rng`, the role of Megatron-LM's model-parallel RNG
    tracker).
    Exact resume restores each rank's saved state instead; a resume on another world size (whose
    saved states do not map onto the new ranks) reseeds with the resumed step mixed in, so no
    rank replays the masks of step 0. Rank (0, 0) of a fresh run keeps ``seed`` itself, so a
    single process draws exactly what it always did.
    """
    if (dp_rank, pp_rank, start_step) == (0, 0, 0):
        stream = seed
    else:
        stream = distributed.derived_seed(seed, f"dp{dp_rank}", f"pp{pp_rank}", f"step{start_step}")
    seed_everything(stream)
    return stream
