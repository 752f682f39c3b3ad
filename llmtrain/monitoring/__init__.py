"""What watches a run and reports on it: the trackers (:mod:`.tracking`: ``metrics.jsonl``,
wandb, TensorBoard, MLflow), goodput and the timeline (:mod:`.goodput`), the hang watchdog
(:mod:`.watchdog`), preemption signals and time-based saves (:mod:`.preemption`), loss spikes,
non-finite steps and peak memory (:mod:`.health`), the start-up log (:mod:`.startup`), console
and library output (:mod:`.console`), and the run report (:mod:`.report`).

May import :mod:`llmtrain.parallel` (collectives, the launch environment), :mod:`llmtrain.models`,
:mod:`llmtrain.config` and :mod:`llmtrain.common`; never data, objectives, engines or checkpoints
(the train state is passed in)."""
