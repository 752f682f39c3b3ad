"""llmtrain: a config-driven trainer for Hugging Face causal LMs (DDP, ZeRO 0-3, offload)."""

import sys

if sys.argv[:1] == ["-m"]:  # runpy is importing this package for python -m llmtrain[.COMMAND]: first of all
    from llmtrain.common.interrupt import defer_sigint

    defer_sigint(sys.orig_argv)

import logging  # noqa: E402

__version__ = "0.1.0"

# transformers imports torchao whenever it is installed (llmtrain's lowbit extra); torchao then logs
# that its CUDA-only kernels (mxfp8, cutlass) do not load on this machine, and torch that
# torchao registers enums it no longer needs registered. Neither is actionable in a run; their
# errors still show.
for _chatty in ("torchao", "torch.utils._pytree"):
    logging.getLogger(_chatty).setLevel(logging.ERROR)
