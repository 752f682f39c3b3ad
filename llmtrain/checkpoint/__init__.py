"""Checkpoints and exports: the train state and RNG states (:mod:`.state`), the crash-safe
protocol that saves, seals, verifies, finds, prunes and locks (:mod:`.protocol`), whether a
checkpoint can resume this config (:mod:`.resume`), the trainer's saving cadence
(:mod:`.checkpointer`), and Hugging Face / PEFT exports from a live run or any checkpoint
(:mod:`.export`).

Sits above the engines: an engine writes its own shards (the torch engines through
:mod:`llmtrain.engine.dcp_state`), and exports read every engine's format. May import engines,
objectives, data, monitoring, parallel, models, config and common."""
