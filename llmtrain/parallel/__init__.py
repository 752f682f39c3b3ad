"""Parallelism over ranks: the launch environment and process group (:mod:`.distributed`), the
parallel degrees and device mesh (:mod:`.dims`), the plans that shard a model (:mod:`.parallelize`:
tensor parallel, activation checkpointing, compile, FSDP2), pipeline stages and schedules
(:mod:`.pipeline`), context parallel attention (:mod:`.context_parallel`), expert parallel
dispatch (:mod:`.expert_parallel`), and each rank's random streams (:mod:`.seeding`).

May import :mod:`llmtrain.models`, :mod:`llmtrain.config` and :mod:`llmtrain.common`; never data,
objectives, engines or what runs them."""
