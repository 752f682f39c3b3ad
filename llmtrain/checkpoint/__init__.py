"""Checkpoints and exports: the train state and RNG states (:mod:`.state`), the crash-safe
protocol that saves, seals, verifies, finds, prunes and locks (:mod:`.protocol`), whether a
checkpoint can resume this config (:mod:`.resume`), the trainer's saving cadence
(:mod:`.checkpointer`), and Hugging Face / PEFT exports from a live run or any checkpoint
(:mod:`.export`); the format files are written in (:mod:`.format`: checksums taken while
writing, framed tensor archives, the save-plan cache).

Sits above the engines: an engine writes its own shards (the torch engines through
:mod:`llmtrain.engine.dcp_state`), and exports read every engine's format. May import engines,
objectives, data, monitoring, parallel, models, config and common. The exception is
:mod:`.format`, which sits below the engines (they write through it) and imports none of them,
nor the rest of this package (``.importlinter``)."""
