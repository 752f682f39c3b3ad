"""The frozen reference policy of DPO-style objectives: where its log-probs come from.

Three sources, one contract: a micro-batch's ``ref_logps`` (``[rows, seq]`` fp32) holds, summed
over each sequence's completion tokens, the reference policy's log-prob of that completion.

* :class:`LiveReference` over the policy's own model with its LoRA layers switched off
  (``+peft=lora``), run without gradients: the base model is the reference and there is no
  second copy;
* :class:`LiveReference` over a frozen copy of the initial weights (full fine-tuning), built and
  laid out by the engine like the policy (:meth:`llmtrain.engine.base.Engine.frozen_copy`);
* precomputed (``objective.precompute_reference=true``): :func:`precompute` runs the policy
  before its first update (it *is* the reference then) over every training and validation item
  once and stores the sums in ``run_dir/reference_logps.safetensors``; the data then carries them
  (:class:`llmtrain.data.preference.WithReference`) and each step runs one model. A resumed run
  reads the file back: the weights it would need to recompute them are gone.
"""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path
from typing import Any, Callable

import torch

from llmtrain.parallel import distributed
from llmtrain.data import WithReference, pairs_of
from llmtrain.common.errors import ConfigError, DataError, ResumeError
from llmtrain.objectives.preference import PairObjective, completion_token_logps, segment_sums

log = logging.getLogger("llmtrain")
REFERENCE_FILE = "reference_logps.safetensors"


def reference_kind(cfg: Any) -> str:
    """``objective.reference`` with ``auto`` resolved: ``adapters_disabled`` under ``+peft=lora``,
    else ``copy``."""
    kind = cfg.objective.reference
    if kind == "auto":
        return "adapters_disabled" if cfg.get("peft") is not None else "copy"
    return kind


@contextlib.contextmanager
def adapters_disabled(model: torch.nn.Module):
    """Switch every LoRA layer of ``model`` off for the duration (peft's ``BaseTunerLayer``
    flag). Set directly rather than by ``enable_adapters(False)``, which would also flip the
    adapters' ``requires_grad`` under the engine's feet (DeepSpeed and FSDP2 track them)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = [m for m in model.modules() if isinstance(m, BaseTunerLayer)]
    before = [m._disable_adapters for m in layers]
    for m in layers:
        m._disable_adapters = True
    try:
        yield
    finally:
        for m, flag in zip(layers, before):
            m._disable_adapters = flag


class LiveReference:
    """Reference log-probs of a micro-batch, per token (``[rows, seq]``), from ``forward``
    (``batch -> logits``) run without gradients: the policy's model with its adapters off, or the
    engine's frozen copy (:meth:`~llmtrain.engine.base.Engine.frozen_copy`). ``logps``
    (``(logits, labels) -> [rows, seq]``) turns logits into log-probs: each label's log-softmax,
    or an objective's own (GRPO's of the tempered logits)."""

    def __init__(self, forward: Callable[[dict[str, torch.Tensor]], torch.Tensor],
                 logps: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = completion_token_logps):
        self.forward, self.logps = forward, logps

    @torch.no_grad()
    def __call__(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.logps(self.forward(batch), batch["labels"])


def _adapters_off_forward(engine: Any, label_logps: bool) -> Callable[[dict[str, torch.Tensor]], torch.Tensor]:
    """The policy's forward with its adapters off. ``label_logps``: the reference wants only each
    label's log-prob, so the engine's label head (where installed: ``engine.labelling``) runs the
    output layer on the labelled rows, as the policy's forward does: the two then compute alike
    and step 1's rewards are exactly 0."""
    def forward(batch: dict[str, torch.Tensor]) -> torch.Tensor:
        with engine.labelling(batch) if label_logps else contextlib.nullcontext(), adapters_disabled(engine.model):
            return engine.forward(batch)
    return forward


def annotate_batches(reference: Callable[[dict[str, torch.Tensor]], torch.Tensor], engine: Any,
                     batches: list[dict[str, torch.Tensor]], device: torch.device, key: str = "ref_logps") -> None:
    """Fill each host batch's ``key`` (``ref_logps``) from ``reference``, in eval mode. Ranks holding fewer
    batches run the last one again (its result unused), so every rank makes the same number of
    forwards: ZeRO-3 and FSDP2 gather parameters collectively in each. Collective call."""
    most = int(distributed.all_reduce_max(torch.tensor(len(batches), device=device)))
    engine.train(False)
    for j in range(most):
        batch = batches[min(j, len(batches) - 1)] if batches else None
        if batch is None:  # no batch at all on this rank: a one-pair stand-in
            batch = {"input_ids": torch.zeros(2, 2, dtype=torch.long), "attention_mask": torch.ones(2, 2, dtype=torch.long),
                     "labels": torch.full((2, 2), -100, dtype=torch.long)}
        logps = reference({k: v.to(device) for k, v in batch.items()}).cpu()
        if j < len(batches):
            batch[key] = logps
    engine.train(True)


def _item_sums(engine: Any, items: list[dict], collate: Any, device: torch.device) -> torch.Tensor:
    """float64 ``[pairs, 2]``: (chosen, rejected) policy log-probs of the items' pairs in order."""
    batch = {k: v.to(device) for k, v in collate(items).items()}
    count = PairObjective.count(batch)
    with torch.no_grad(), engine.labelling(batch):  # the policy's output layer on the labelled rows, as in training
        logits = engine.forward(batch)
    sums = segment_sums(completion_token_logps(logits, batch["labels"]), batch["segment"], count)
    return sums.view(-1, 2).cpu()


def compute_table(engine: Any, dataset: Any, collate: Any, micro_batch: int, device: torch.device,
                  dp_rank: int, dp_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference log-probs of every item of ``dataset``: (values float64 ``[pairs, 2]``,
    offsets int64 ``[items + 1]``), item ``k``'s pairs at ``values[offsets[k]:offsets[k+1]]``.
    Data-parallel rank ``r`` computes items ``r::dp_size``; every rank makes the same number of
    forwards (ZeRO-3 gathers parameters collectively), and the results are gathered on all ranks.
    Collective call."""
    mine = list(range(dp_rank, len(dataset), dp_size))
    chunks = [mine[j:j + micro_batch] for j in range(0, len(mine), micro_batch)]
    most = int(distributed.all_reduce_max(torch.tensor(len(chunks), device=device)))
    engine.train(False)
    results: dict[int, torch.Tensor] = {}
    for j in range(most):
        indices = chunks[j] if j < len(chunks) else [0]  # a filler forward keeps ranks in step
        items = [dataset[k] for k in indices]
        sums = _item_sums(engine, items, collate, device)
        if j < len(chunks):
            start = 0
            for k, item in zip(indices, items):
                n = len(pairs_of(item))
                results[k] = sums[start:start + n]
                start += n
    engine.train(True)
    gathered = distributed.all_gather_objects(results)
    merged: dict[int, torch.Tensor] = {}
    for part in gathered:
        merged.update(part)
    counts = torch.tensor([len(merged[k]) for k in range(len(dataset))], dtype=torch.int64)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)])
    values = torch.cat([merged[k] for k in range(len(dataset))]) if len(dataset) else torch.zeros(0, 2)
    return values.to(torch.float64), offsets


def data_digest(dataset: Any, n: int | None = None) -> str:
    """SHA-256 of the token ids of the first ``n`` (default all) items of ``dataset`` (pairs, or
    packed rows of pairs), in order: what precomputed reference log-probs belong to."""
    import hashlib

    h = hashlib.sha256()
    for k in range(len(dataset) if n is None else n):
        for pair in pairs_of(dataset[k]):
            h.update(repr((pair["chosen_ids"], pair["rejected_ids"], pair["prompt_len"])).encode())
    return h.hexdigest()


def check_stored(run_dir: Path, splits: Any, eval_samples: int) -> None:
    """Before anything of a resumed run is written: its ``reference_logps.safetensors`` exists and
    belongs to this data (item counts and token ids of the training pairs and of the held-out
    pairs it covers), and covers the held-out pairs evaluation now reads.

    Raises:
        ResumeError: the file is missing or was written for other data (naming the fix).
    """
    from safetensors import safe_open

    path = run_dir / REFERENCE_FILE
    if not path.is_file():
        raise ResumeError(f"objective.precompute_reference=true: {path} is missing, and the reference is the policy "
                          "before its first update, which a resumed run no longer has; restore the file or start a "
                          "new run (another run_dir)")
    with safe_open(str(path), "pt") as f:
        meta, train_items, stored = f.metadata() or {}, len(f.get_tensor("train_offsets")) - 1, len(
            f.get_tensor("val_offsets")) - 1
    needed = min(len(splits.val), eval_samples) if eval_samples else len(splits.val)
    if train_items != len(splits.train) or meta.get("train_digest") != data_digest(splits.train):
        raise ResumeError(f"{path} holds the reference log-probs of other training data ({train_items} items; the data "
                          f"now give {len(splits.train)}, or their tokens changed): restore the data and data.* "
                          "settings the run started with, or start a new run")
    if stored < needed:
        raise ResumeError(f"{path} holds reference log-probs of {stored} held-out items and evaluation now reads "
                          f"{needed}: set trainer.eval_samples={stored} (or fewer), or start a new run")
    if meta.get("val_digest") != data_digest(splits.val, stored):
        raise ResumeError(f"{path} holds the reference log-probs of other held-out data: restore the data the run "
                          "started with, or start a new run")


def precompute(engine: Any, splits: Any, collate: Any, micro_batch: int, device: torch.device, dp_rank: int,
               dp_size: int, run_dir: Path, resumed: bool, is_main: bool, eval_samples: int = 0) -> None:
    """Attach reference log-probs to ``splits.train`` and to the first ``eval_samples`` (0: all)
    items of ``splits.val``, those evaluation reads (in place): read from
    ``run_dir/reference_logps.safetensors`` when resuming (:func:`check_stored` vouched for it),
    or, on a fresh run, computed with the policy before its first update and written there
    (atomically, by rank 0, with the digests of the data it covers). Collective call."""
    from safetensors.torch import load_file, save_file

    from llmtrain.common.paths import follow_umask

    if eval_samples and eval_samples < len(splits.val):
        splits.val = torch.utils.data.Subset(splits.val, range(eval_samples))
    path = run_dir / REFERENCE_FILE
    if resumed:  # checked by check_stored before the run wrote anything
        tables = load_file(str(path))
        tables["val_offsets"] = tables["val_offsets"][:len(splits.val) + 1]
    else:
        tables = {}
        for name, split in (("train", splits.train), ("val", splits.val)):
            values, offsets = compute_table(engine, split, collate, micro_batch, device, dp_rank, dp_size)
            tables[f"{name}_values"], tables[f"{name}_offsets"] = values, offsets
        if is_main:  # a fresh run's file is always its own: one left by an earlier start is replaced
            pending = path.with_name(f".{path.name}.{os.getpid()}")
            save_file(tables, str(pending), metadata={"train_digest": data_digest(splits.train),
                                                     "val_digest": data_digest(splits.val)})
            pending.replace(path)
            follow_umask(run_dir, only=path.name)  # safetensors writes 0600
            log.info("reference log-probs of %d train and %d val items precomputed into %s", len(splits.train),
                     len(splits.val), path)
        distributed.barrier()
    splits.train = WithReference(splits.train, tables["train_values"], tables["train_offsets"])
    splits.val = WithReference(splits.val, tables["val_values"], tables["val_offsets"])


def build_reference(cfg: Any, engine: Any, build: Callable[[], torch.nn.Module],
                    logps: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = completion_token_logps,
                    label_logps: bool | None = None) -> Callable[[dict[str, torch.Tensor]], torch.Tensor]:
    """The live reference of the run (see the module docstring); ``build()`` makes the model
    with its initial weights (for the frozen copy); ``logps``: see :class:`LiveReference`, which
    also takes the label head's ``[rows, seq]`` log-probs where ``label_logps`` (default: ``logps``
    is :func:`completion_token_logps`; GRPO's ``token_logps`` of the head's tempered log-probs too).

    Raises:
        ConfigError: ``objective.reference=copy`` on an engine that cannot lay out a frozen copy.
    """
    kind = reference_kind(cfg)
    if label_logps is None:
        label_logps = logps is completion_token_logps
    if kind == "adapters_disabled":
        return LiveReference(_adapters_off_forward(engine, label_logps), logps)
    forward = engine.frozen_reference(build) if label_logps else engine.frozen_copy(build)
    if forward is None:
        raise ConfigError(f"objective.reference=copy: the {type(engine).__name__} engine of recipe {cfg.recipe.name} "
                          "cannot lay out a frozen copy of the model; set objective.precompute_reference=true "
                          "(one pass before step 1, no second model) or train LoRA adapters (+peft=lora)")
    return LiveReference(forward, logps)


def setup_reference(cfg: Any, objective: Any, engine: Any, splits: Any, collator: Callable[[], Any], env: Any,
                    dp: int, run_dir: Path, resumed: bool, phases: Any, build: Callable[[], torch.nn.Module],
                    teacher: Callable[[], Any]) -> Any:
    """The reference policy of an objective that has one: log-probs precomputed into the data
    (:func:`precompute`; returns None), the objective's own frozen model (``teacher()``:
    distillation's), or a live reference called on every micro-batch (:func:`build_reference`,
    from ``build()``: the policy's initial weights). None for an objective without one; start-up
    phases named on ``phases``. Collective call."""
    if not objective.needs_reference:
        return None
    if cfg.objective.precompute_reference:
        phases.begin("reference", "reading the precomputed reference log-probs" if resumed
                     else "precomputing the reference log-probs of every pair")
        precompute(engine, splits, collator(), cfg.trainer.micro_batch_size, env.device, engine.dp_rank, dp, run_dir,
                   resumed, env.is_main, cfg.trainer.eval_samples)
        return None
    if objective.reference_model() is not None:
        return teacher()
    phases.begin("reference", f"objective.reference={reference_kind(cfg)}")
    # GRPO's log-probs are of temperature-scaled logits; the preference objectives' are plain.
    # (GRPO's label head computes them tempered: label_temperature.)
    logps = getattr(objective, "token_logps", completion_token_logps)
    return build_reference(cfg, engine, build, logps, bool(objective.label_logps_only))


def check_data(cfg: Any, objective: Any, splits: Any, run_dir: Path, resumed: bool) -> None:
    """What the objective needs of the data that only the data can tell, before anything is
    written: a margin column for ``objective.margin_column``, and a resumed run's precomputed
    reference log-probs matching the data (:func:`check_stored`).

    Raises:
        DataError, ResumeError: naming the field or file and the fix.
    """
    o = cfg.objective
    if o.get("margin_column") and "margin" not in splits.train[0]:
        raise DataError(f"objective.margin_column=true, but data.path={cfg.data.path} has no margin "
                        "column; map yours with data.columns.margin=COLUMN, or drop the setting")
    if objective.needs_reference and o.get("precompute_reference") and resumed:
        check_stored(run_dir, splits, cfg.trainer.eval_samples)
