"""Evaluation: held-out loss during training (:mod:`.validation`), and benchmark scores through
lm-evaluation-harness (:mod:`.harness`: a run, checkpoint, export or adapter scored on tasks),
during training in processes of their own (:mod:`.in_loop`) or from
``python -m llmtrain.evaluate``, with local tasks read from files (:mod:`.local_tasks`).

May import checkpoints (exports), objectives, data, monitoring's trackers, the process-group
helpers of :mod:`llmtrain.parallel.distributed`, config and common; never engines or parallel
plans itself (contract ``evaluation-apart``)."""
