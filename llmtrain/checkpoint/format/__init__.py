"""The checkpoint format as written: DCP's file writer with checksums taken while writing and
framed tensor archives (:mod:`.dcp_writer`, :mod:`.archive_frames`) and the save-plan cache
(:mod:`.plan_cache`).

Sits below the engines, which call it to write their state (:mod:`llmtrain.engine.dcp_state`,
DeepSpeed's shards); may import parallel's process-group helpers and common only: never engines,
models or the rest of :mod:`llmtrain.checkpoint` (``.importlinter``).
"""
