"""Task scores from EleutherAI's lm-evaluation-harness (``lm_eval``) for what llmtrain writes: a
checkpoint (any recipe), a run directory (its newest complete checkpoint), a Hugging Face export
or a PEFT adapter. Everything about tasks and scoring is the harness's own: tasks come from its
``TaskManager`` (its standard tasks, the local tasks in ``tasks/`` beside this module and folders of task YAMLs a
user names), the model is its ``HFLM`` wrapper and the scores are ``simple_evaluate``'s, so a
number here is the number ``lm_eval --model hf --model_args pretrained=EXPORT`` prints.

A checkpoint is first written as a Hugging Face folder (:func:`llmtrain.checkpoint.export.export_checkpoint`,
LoRA merged) in a temporary folder under ``~/.cache/llmtrain/eval``, which ``HFLM`` then loads as it
would any export.

Scores are flattened as ``eval/TASK/METRIC`` (a harness filter other than ``none`` is appended,
``eval/gsm8k/exact_match_strict-match``), each task's with ``eval/TASK/documents``, the number of
documents it was scored on, and written with the harness's whole results to ``eval/step_N.json``
(:func:`write_result`). A score is logged once per step, unless a later evaluation of the same step
covers more documents, which supersedes it (:func:`unlogged`).

An image-text model's export (a ``config.json`` with a ``vision_config``) is loaded by the
harness's multimodal wrapper instead (``HFMultimodalLM``, ``lm_eval --model hf-multimodal``) and
prompted through its processor's chat template (``--apply_chat_template``, the layout it was
fine-tuned in): image tasks (``digits_local``) hand it their images; text-only requests fall back
to ``HFLM``'s own code.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from llmtrain.checkpoint.protocol import MARKER, step_dirs, step_of, verify
from llmtrain.checkpoint.state import STATE_FILE, read_state
from llmtrain.common import lazy_datasets
from llmtrain.common.errors import ConfigError, DataError
from llmtrain.common.paths import CACHE_DIR
from llmtrain.monitoring.console import quiet_library_warnings

log = logging.getLogger("llmtrain")

LOCAL_TASKS_DIR = Path(__file__).resolve().parent / "tasks"  # the local tasks' YAMLs (local_tasks reads their files)
SCORE_PREFIX = "eval/"
DOCUMENTS = "documents"  # eval/TASK/documents: how many documents the task's scores cover


@dataclass
class EvalSource:
    """What to evaluate. ``kind``: ``checkpoint`` | ``export`` (a ``from_pretrained`` folder) |
    ``adapter`` (a PEFT adapter folder, whose ``base_model_name_or_path`` names its base);
    ``run_dir``: the run it belongs to (results and tracker records go there), else None;
    ``step``: the optimizer step it holds, where known."""

    kind: str
    path: Path
    run_dir: Path | None
    step: int | None

    def describe(self) -> str:
        at = f" (step {self.step})" if self.step is not None else ""
        return f"{self.kind} {self.path}{at}"


def _newest_checkpoint(run_dir: Path) -> Path | None:
    """The newest checkpoint of ``run_dir`` that verifies (as ``trainer.resume=auto`` picks)."""
    for _, path in step_dirs(run_dir / "checkpoints"):
        problem = verify(path)
        if problem is None:
            return path
        log.warning("skipping checkpoint %s: %s", path, problem)
    return None


def _run_of(folder: Path) -> Path | None:
    """The run directory holding ``folder`` (an export or adapter written by a run), if any."""
    parent = folder.resolve().parent
    return parent if (parent / "checkpoints").is_dir() or (parent / "metrics.jsonl").is_file() else None


def resolve_source(path: Path) -> EvalSource:
    """What ``path`` is (see :class:`EvalSource`). A run directory stands for its newest complete
    checkpoint (or, without checkpoints, its export ``hf/``); an export or adapter inside a run
    directory takes the step of the run's newest checkpoint (the run exports after its last save).

    Raises:
        ConfigError: ``path`` does not exist or is none of these (what each looks like is said).
    """
    path = Path(path).expanduser()
    if not path.exists():
        raise ConfigError(f"{path} does not exist; give a run directory, a checkpoint (RUN/checkpoints/step_N), "
                          "an export (RUN/hf) or an adapter (RUN/adapter)")
    if (path / "adapter_config.json").is_file() or (path / "config.json").is_file():
        kind = "adapter" if (path / "adapter_config.json").is_file() else "export"
        run_dir = _run_of(path)
        # Only the step is needed: the newest sealed checkpoint's (its marker), not a checksum pass.
        sealed = [s for s, p in step_dirs(run_dir / "checkpoints") if (p / MARKER).is_file()] \
            if run_dir is not None else []
        return EvalSource(kind, path, run_dir, sealed[0] if sealed else None)
    if (path / STATE_FILE).is_file():
        problem = verify(path)
        if problem is not None:
            raise ConfigError(f"checkpoint {path} is not usable: {problem}")
        run_dir = path.resolve().parent.parent if path.resolve().parent.name == "checkpoints" else None
        return EvalSource("checkpoint", path, run_dir, read_state(path).step)  # any folder name
    if (path / "checkpoints").is_dir() or (path / "metrics.jsonl").is_file():
        newest = _newest_checkpoint(path)
        if newest is not None:
            return EvalSource("checkpoint", newest, path, step_of(newest))
        for name in ("hf", "adapter"):
            if (path / name).is_dir():
                return resolve_source(path / name)
        raise ConfigError(f"run directory {path} has no complete checkpoint and no export (hf/, adapter/) to evaluate")
    raise ConfigError(f"{path} is not a run directory, checkpoint, export or adapter: a run directory holds "
                      "checkpoints/, a checkpoint trainer_state.json, an export config.json, an adapter "
                      "adapter_config.json")


def check_device(device: str, field: str) -> None:
    """``device`` exists on this machine (``cpu``, ``mps``, ``cuda``, ``cuda:N``).

    Raises:
        ConfigError: naming ``field`` and the devices there are.
    """
    import torch

    if device.startswith("cuda"):
        index = device.split(":", 1)[1] if ":" in device else "0"
        if not index.isdigit() or not torch.cuda.is_available() or int(index) >= torch.cuda.device_count():
            raise ConfigError(f"{field}={device}: this machine has {torch.cuda.device_count()} CUDA device(s); "
                              "use cpu or a device it has")
    elif device not in ("cpu", "mps"):
        raise ConfigError(f"{field}={device} is not a device: cpu, cuda or cuda:N")


def include_paths(extra: list[str] | tuple[str, ...] = ()) -> list[str]:
    """Folders of task YAMLs: llmtrain's local tasks (:data:`LOCAL_TASKS_DIR`) and the user's ``extra`` ones.

    Raises:
        ConfigError: an ``extra`` folder does not exist.
    """
    for folder in extra:
        if not Path(folder).expanduser().is_dir():
            raise ConfigError(f"task folder {folder} does not exist; give folders of lm-eval task YAMLs")
    return [str(LOCAL_TASKS_DIR), *(str(Path(f).expanduser()) for f in extra)]


def task_manager(tasks: list[str], include: list[str], metadata: dict[str, Any] | None = None):
    """The harness's ``TaskManager`` that knows ``tasks``: over the local folders alone when they
    hold every one (indexing the harness's own ~15,000 task YAMLs takes seconds), else over
    those too.

    Raises:
        ConfigError: a task is known to neither (the local ones are listed).
    """
    lazy_datasets.module()  # the harness imports datasets: its bars as the run set them
    from lm_eval.tasks import TaskManager

    local = TaskManager(include_path=include, include_defaults=False, metadata=metadata)
    if all(t in local.all_tasks for t in tasks):
        return local
    manager = TaskManager(include_path=include, metadata=metadata)
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown:
        raise ConfigError(f"unknown evaluation task(s) {', '.join(unknown)}: not among the local tasks "
                          f"({', '.join(sorted(local.all_tasks)) or 'none'}, in {', '.join(include)}) nor lm-eval's "
                          "own (`lm_eval ls tasks`); check the name, or add the folder of its YAML")
    return manager


def data_metadata(data_dir: str | None = None, data_file: str | None = None) -> dict[str, Any] | None:
    """The harness ``metadata`` that tells the local tasks where their file is
    (:mod:`llmtrain.evaluation.local_tasks`), or None."""
    metadata = {k: v for k, v in (("data_dir", data_dir), ("data_file", data_file)) if v}
    return metadata or None


def check_tasks(tasks: list[str], include: list[str], data_dir: str | None = None, data_file: str | None = None,
                image_text: bool | None = None):
    """Every task is known and its documents load (before a run writes anything); returns the
    ``TaskManager``. ``data_dir`` / ``data_file``: where the local tasks read their file;
    ``image_text``: whether the model to evaluate takes images (None: not known yet).

    Raises:
        ConfigError: an unknown task, or a task with images (``digits_local``: the harness's
            ``MULTIMODAL``) for a text-only model (``image_text=False``); DataError: a task whose data
            files are missing or unreadable (a standard task offline without the datasets cache, too).
    """
    manager = task_manager(tasks, include, data_metadata(data_dir, data_file))
    for name in tasks:
        try:
            with _quiet_harness():
                loaded = manager.load([name])
        except DataError:
            raise
        except Exception as err:  # noqa: BLE001  (datasets' and the hub's many errors)
            raise DataError(f"evaluation task {name}: its documents could not be loaded ({type(err).__name__}: "
                            f"{str(err).splitlines()[0] if str(err) else ''}); a standard task needs the network or "
                            "its datasets cache, a local one its data files") from None
        leaves = loaded.get("tasks", {}) if isinstance(loaded, dict) else {}
        if image_text is False and any(getattr(task, "MULTIMODAL", False) for task in leaves.values()):
            raise ConfigError(f"evaluation task {name} gives the model images, and this model is text-only; evaluate "
                              "an image-text model (e.g. model=tiny_idefics3) or drop the task")
    return manager


# The harness's notices that say nothing about this evaluation (a custom dataset's hint about
# --metadata); its other warnings (a context truncated from the left changes a score) still show.
_HARNESS_NOTICES = ("Custom kwargs can be passed to `--metadata`",)


def _not_a_notice(record: logging.LogRecord) -> bool:
    return not any(notice in record.getMessage() for notice in _HARNESS_NOTICES)


@contextlib.contextmanager
def _quiet_harness() -> Iterator[None]:
    """The harness's per-task notices (:data:`_HARNESS_NOTICES`) and its info lines stay out of
    the run's output; its warnings (a truncated context) and errors still show."""
    harness, tasks = logging.getLogger("lm_eval"), logging.getLogger("lm_eval.api.task")  # the notices' logger
    level = harness.level
    harness.setLevel(logging.WARNING)
    tasks.addFilter(_not_a_notice)  # a logger's filters do not reach its children: on the one that logs
    try:
        yield
    finally:
        tasks.removeFilter(_not_a_notice)
        harness.setLevel(level)


@contextlib.contextmanager
def _git_hash_without_stderr() -> Iterator[None]:
    """The harness records ``git describe --always`` of the working directory in its results,
    and outside a git checkout git's "fatal: not a git repository" reaches the console: the same
    value here, with git's stderr dropped."""
    import subprocess

    import lm_eval.evaluator
    from lm_eval.loggers.utils import get_commit_from_path

    def git_hash() -> str | None:
        try:
            return subprocess.check_output(["git", "describe", "--always"], stderr=subprocess.DEVNULL).strip().decode()
        except (subprocess.CalledProcessError, FileNotFoundError):
            return get_commit_from_path(os.getcwd())

    original = lm_eval.evaluator.get_git_commit_hash
    lm_eval.evaluator.get_git_commit_hash = git_hash
    try:
        yield
    finally:
        lm_eval.evaluator.get_git_commit_hash = original


@contextlib.contextmanager
def model_folder(source: EvalSource) -> Iterator[str]:
    """The Hugging Face folder ``HFLM`` loads: an export as it is; an adapter (merged onto its
    base) or a checkpoint written as a Hugging Face folder into a temporary folder under
    ``~/.cache/llmtrain/eval`` (removed after).

    Raises:
        ConfigError: as :func:`check_source`; ResumeError: the checkpoint cannot be exported.
    """
    check_source(source)
    if source.kind == "export":
        yield str(source.path)
        return
    (CACHE_DIR / "eval").mkdir(parents=True, exist_ok=True)
    folder = Path(tempfile.mkdtemp(prefix=f"{source.path.name}-", dir=CACHE_DIR / "eval"))
    try:
        log.info("writing %s as a Hugging Face folder for the harness (in %s, removed after)", source.describe(),
                 folder)
        yield str(_write_model(source, folder / "hf"))
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _write_model(source: EvalSource, out_dir: Path) -> Path:
    """An adapter merged onto its base by peft (``merge_and_unload``), or a checkpoint exported
    (:func:`llmtrain.checkpoint.export.export_checkpoint`, LoRA merged), as a Hugging Face folder. An
    adapter is merged rather than handed to ``HFLM(peft=...)``, which resizes the embeddings to
    the tokenizer's length when the model's vocabulary is padded beyond it (320 rows for 260
    tokens here) and so scores another model than the checkpoint's."""
    if source.kind == "adapter":
        from peft import AutoPeftModelForCausalLM
        from transformers import AutoTokenizer

        base = json.loads((source.path / "adapter_config.json").read_text()).get("base_model_name_or_path")
        if not base:
            raise ConfigError(f"adapter {source.path} names no base model (base_model_name_or_path)")
        with quiet_library_warnings():
            merged = AutoPeftModelForCausalLM.from_pretrained(str(source.path), dtype="float32").merge_and_unload()
        from llmtrain.models.build import save_pretrained

        save_pretrained(merged, out_dir)
        tokenizer_dir = source.path if (source.path / "tokenizer_config.json").is_file() else base
        AutoTokenizer.from_pretrained(str(tokenizer_dir)).save_pretrained(out_dir)
        return out_dir

    from llmtrain.checkpoint.export import export_checkpoint

    return export_checkpoint(source.path, out_dir, merged=True, verified=True)  # resolve_source verified it


def check_source(source: EvalSource) -> None:
    """What can be told of ``source`` before a model is built.

    Raises:
        ConfigError: a reward model's checkpoint, export or adapter (no language-model head to
            score text with), an adapter naming no base.
    """
    if source.kind == "checkpoint":
        from omegaconf import OmegaConf

        cfg = OmegaConf.load(source.path / "config.yaml")
        if cfg.get("objective", {}).get("name") == "reward":
            raise ConfigError(f"checkpoint {source.path} is a reward model (objective=reward): it scores sequences "
                              "and has no language-model head for lm-eval's tasks")
    if source.kind == "adapter":
        adapter = json.loads((source.path / "adapter_config.json").read_text())
        if not adapter.get("base_model_name_or_path"):
            raise ConfigError(f"adapter {source.path} names no base model (base_model_name_or_path)")
        if adapter.get("task_type") == "SEQ_CLS":
            raise ConfigError(f"adapter {source.path} is a reward model's (task_type SEQ_CLS): it scores sequences "
                              "and has no language-model head for lm-eval's tasks")
    if source.kind == "export":
        architectures = json.loads((source.path / "config.json").read_text()).get("architectures") or []
        if not any(a.endswith("ForCausalLM") for a in architectures) and not is_image_text(source.path):
            raise ConfigError(f"export {source.path} is a {', '.join(architectures) or 'model without a stated '}"
                              " architecture, not a causal language model (a reward model scores sequences): "
                              "lm-eval's tasks need a language-model head")


def is_image_text(folder: Path) -> bool:
    """Whether the Hugging Face folder holds an image-text model (its ``config.json`` has a
    ``vision_config``, as every ``AutoModelForImageTextToText`` family's does)."""
    config = Path(folder) / "config.json"
    return config.is_file() and "vision_config" in json.loads(config.read_text())


def _harness_model(folder: str, dtype: str, batch_size: int | str, device: str) -> tuple[Any, bool]:
    """(the harness's model wrapper of ``folder``, whether to apply its chat template): ``HFLM``
    and False for a language model; ``HFMultimodalLM`` and True (when its processor has a chat
    template) for an image-text one (see the module).

    Raises:
        ConfigError: ``batch_size=auto`` for an image-text model (the harness does not size its batches).
    """
    if not is_image_text(Path(folder)):
        from lm_eval.models.huggingface import HFLM

        return HFLM(pretrained=folder, dtype=dtype, batch_size=batch_size, device=device), False
    if not isinstance(batch_size, int):
        raise ConfigError(f"batch_size={batch_size}: lm-eval's multimodal model takes a number of documents, not "
                          "auto; give batch_size=8")
    from lm_eval.models.hf_vlms import HFMultimodalLM

    import llmtrain.models.qwen2vl_images  # noqa: F401  (registers the processor a tiny_qwen2vl export names)

    lm = HFMultimodalLM(pretrained=folder, dtype=dtype, batch_size=batch_size, device=device)
    return lm, bool(getattr(lm.processor, "chat_template", None))


def evaluate(source: EvalSource, tasks: list[str], include: list[str] | None = None, data_dir: str | None = None,
             limit: int | float | None = None, batch_size: int | str = 8, device: str = "cpu",
             num_fewshot: int | None = None, dtype: str = "auto", bootstrap_iters: int = 100000,
             manager: Any = None, data_file: str | None = None) -> dict[str, Any]:
    """Run ``tasks`` on ``source`` with ``lm_eval.simple_evaluate`` and ``HFLM``; returns the
    harness's results (``results``, ``n-samples``, ``configs``, ``versions``, ...). ``limit``:
    documents per task (all when None); ``data_dir`` / ``data_file``: where local tasks read their files
    (:mod:`llmtrain.evaluation.local_tasks`); the other arguments are the harness CLI's of the same names,
    with the same defaults except ``batch_size``; ``manager``: a ``TaskManager`` that
    :func:`check_tasks` returned (checked again when None).

    Raises:
        ConfigError, DataError: as :func:`check_tasks`, :func:`model_folder`.
    """
    lazy_datasets.module()  # the harness imports datasets: its bars as the run set them
    import lm_eval

    include = include if include is not None else include_paths()
    manager = manager if manager is not None else check_tasks(tasks, include, data_dir, data_file)
    with model_folder(source) as pretrained, _quiet_harness(), _git_hash_without_stderr():
        lm, chat = _harness_model(pretrained, dtype, batch_size, device)
        results = lm_eval.simple_evaluate(model=lm, tasks=list(tasks), task_manager=manager, limit=limit,
                                          num_fewshot=num_fewshot, bootstrap_iters=bootstrap_iters,
                                          log_samples=False, apply_chat_template=chat)
    return results


def scores(results: dict[str, Any]) -> dict[str, float]:
    """The harness's per-task metrics as ``{"eval/TASK/METRIC": value}`` (standard errors and
    non-numeric entries left out; see the module for filters), and each task's
    ``eval/TASK/documents``: the documents it was scored on (the harness's ``n-samples``)."""
    flat: dict[str, float] = {}
    for task, counts in results.get("n-samples", {}).items():
        if isinstance(counts, dict) and isinstance(counts.get("effective"), int):
            flat[f"{SCORE_PREFIX}{task}/{DOCUMENTS}"] = counts["effective"]
    for task, metrics in results.get("results", {}).items():
        for key, value in metrics.items():
            metric, _, filter_name = key.partition(",")
            if metric in ("alias", "sample_len") or metric.endswith("_stderr") or not isinstance(value, (int, float)):
                continue
            name = metric if filter_name in ("", "none") else f"{metric}_{filter_name}"
            flat[f"{SCORE_PREFIX}{task}/{name}"] = float(value)
    return flat


def result_path(out_dir: Path, step: int | None) -> Path:
    """``out_dir/step_N.json`` (``results.json`` for a source without a step)."""
    return out_dir / (f"step_{step}.json" if step is not None else "results.json")


def write_result(out_dir: Path, source: EvalSource, tasks: list[str], results: dict[str, Any]) -> Path:
    """Write ``{"step", "tasks", "scores", "sources", "n_samples", "results", "versions"}`` to
    :func:`result_path` atomically (a reader never sees half a file); returns the path written. A
    file already there (other tasks of the same step) is merged into: each task's entry is its
    evaluation over the most documents (the latest of equals), as in the trackers and the report,
    and ``sources`` says what each was evaluated on. A task scored on fewer documents than the
    file holds goes to ``smaller/`` beside it instead (merged there the same way), so nothing is
    lost and the file never disagrees with the report."""
    path = result_path(out_dir, source.step)
    old = read_result(path) or {}
    new_scores = scores(results)
    smaller = [t for t in tasks if t in old.get("tasks", [])
               and task_documents(new_scores, t) < task_documents(old["scores"], t)]
    if smaller:
        aside = _merge_result(path.parent / "smaller" / path.name, source, smaller, results)
        if len(smaller) == len(tasks):
            return aside
    return _merge_result(path, source, [t for t in tasks if t not in smaller], results)


def _merge_result(path: Path, source: EvalSource, tasks: list[str], results: dict[str, Any]) -> Path:
    """Merge ``tasks``' part of ``results`` into the result file ``path`` (see :func:`write_result`)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    old = read_result(path) or {}
    new_scores = {k: v for k, v in scores(results).items() if k.split("/")[1] in tasks}
    kept = {k: v for k, v in old.get("scores", {}).items() if k.split("/")[1] not in tasks}
    record = {"step": source.step, "tasks": sorted(set(old.get("tasks", [])) | set(tasks)),
              "scores": {**kept, **new_scores},
              "sources": {**old.get("sources", {}), **{t: {"path": str(source.path), "kind": source.kind} for t in tasks}},
              **{key: {**old.get(key, {}), **{t: v for t, v in results.get(source_key, {}).items() if t in tasks}}
                 for key, source_key in (("n_samples", "n-samples"), ("results", "results"), ("versions", "versions"))}}
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(record, indent=1, default=str))
    os.replace(tmp, path)
    return path


def task_documents(record: dict, task: str) -> int:
    """How many documents ``task``'s scores in ``record`` cover (0 when it does not say: results
    written before the count was logged)."""
    count = record.get(f"{SCORE_PREFIX}{task}/{DOCUMENTS}", 0)
    return int(count) if isinstance(count, (int, float)) else 0


def documents_of(record: dict, key: str) -> int:
    """:func:`task_documents` of the task that score ``key`` (``eval/TASK/METRIC``) belongs to."""
    return task_documents(record, key.split("/")[1])


def is_score(key: str) -> bool:
    """Whether ``key`` is a task score or document count (``eval/TASK/METRIC``)."""
    return key.startswith(SCORE_PREFIX) and key.count("/") >= 2


def logged_keys(records: list[dict]) -> dict[int, dict[str, int]]:
    """The task-score keys each step's records hold (``metrics.jsonl``'s), each with the most
    documents it was logged from: what is logged."""
    found: dict[int, dict[str, int]] = {}
    for record in records:
        step = record.get("step")
        if not isinstance(step, int):
            continue
        for key in filter(is_score, record):
            logged = found.setdefault(step, {})
            logged[key] = max(logged.get(key, -1), documents_of(record, key))
    return found


def unlogged(new: dict[str, float], logged: dict[str, int]) -> dict[str, float]:
    """The scores of ``new`` (one step's) to log: those not logged at that step yet, and those
    of a task now scored on more documents than when it was logged (a whole task after a
    ``limit``ed one), which supersede them. ``logged``: :func:`logged_keys` of the step."""
    return {k: v for k, v in new.items() if documents_of(new, k) > logged.get(k, -1)}


def read_result(path: Path) -> dict[str, Any] | None:
    """A result file written by :func:`write_result`, or None if it is not one (cut short)."""
    try:
        record = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return record if isinstance(record, dict) and "scores" in record else None
