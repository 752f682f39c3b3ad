"""llmtrain: a config-driven trainer for Hugging Face causal LMs (DDP, ZeRO 0-3, offload)."""

__version__ = "0.1.0"
