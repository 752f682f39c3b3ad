"""Documents of the local lm-evaluation-harness tasks shipped in ``llmtrain/evaluation/tasks/``
(their YAMLs name these functions as ``custom_dataset: !function
llmtrain.evaluation.local_tasks.NAME``), read from files on disk: no dataset hub, so they run on an
offline machine.

Which file: lm-eval passes its ``metadata`` (``--metadata '{"data_file": PATH}'`` or
``'{"data_dir": DIR}'`` on its CLI; ``python -m llmtrain.evaluate`` passes its ``data_file=`` and
``data_dir=``) and the task's ``dataset_kwargs`` to these functions as keyword arguments.
``data_file`` is the file itself; otherwise the task's file names (the download names docs/data.md
gives) are looked for in ``data_dir``, else ``$LLMTRAIN_DATA_DIR``, and in the working directory.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import IO, Any

from llmtrain.common.errors import DataError
from llmtrain.data.formats import alpaca_prompt
from llmtrain.data.preference import extract_prompt
from llmtrain.data.sources import compression_problem

DATA_DIR_ENV = "LLMTRAIN_DATA_DIR"
HH_FILES = ("hh_rlhf_harmless_test.jsonl.gz",)  # anthropics/hh-rlhf harmless-base/test.jsonl.gz, saved so
ALPACA_FILES = ("alpaca_data.json", "alpaca_5000.json")  # Stanford Alpaca's download, or a 5,000-record subset
GSM8K_FILES = ("gsm8k_test.jsonl", "gsm8k_test.jsonl.gz")  # openai/grade-school-math's test.jsonl, saved so
DIGITS_FILES = ("digits/test.jsonl",)  # scripts/make_digits.py's folder (docs/vision.md), images beside it


def _data_file(names: tuple[str, ...], data_dir: str | None = None, data_file: str | None = None) -> Path:
    """The data file of a local task: ``data_file`` itself, else the first of ``names`` found in
    ``data_dir`` (or ``$LLMTRAIN_DATA_DIR``) and then in the working directory.

    Raises:
        DataError: ``data_file`` does not exist, or no such file in those folders (each listed
            once, with the fix).
    """
    if data_file:
        path = Path(data_file).expanduser()
        if not path.is_file():
            raise DataError(f"evaluation data_file={data_file}: no such file; the task reads {' or '.join(names)} "
                            "(download: docs/data.md#downloads)")
        return path
    folder = data_dir or os.environ.get(DATA_DIR_ENV)
    places = list(dict.fromkeys(p.resolve() for p in ([Path(folder).expanduser()] if folder else []) + [Path.cwd()]))
    for place in places:
        for name in names:
            if (place / name).is_file():
                return place / name
    raise DataError(f"evaluation data file {' or '.join(names)} is not in {' or '.join(str(p) for p in places)}; "
                    "download it (docs/data.md#downloads), then give its folder as data_dir=DIR or "
                    f"the file as data_file=PATH (lm_eval: --metadata '{{\"data_dir\": \"DIR\"}}'), or set {DATA_DIR_ENV}=DIR")


def _dataset(rows: list[dict], where: Path) -> dict[str, Any]:
    from llmtrain.common import lazy_datasets

    datasets = lazy_datasets.module()

    if not rows:
        raise DataError(f"{where}: no documents")
    return {"test": datasets.Dataset.from_list(rows)}


def _open_text(path: Path) -> IO[str]:
    """``path`` opened as UTF-8 text, a ``.gz`` file decompressed once it has been checked to be
    whole gzip data (a download cut short gave an EOFError from deep in the harness).

    Raises:
        DataError: naming the file, what is wrong with it and the fix (:func:`compression_problem`).
    """
    import gzip

    if path.suffix == ".gz":
        problem = compression_problem(path)
        if problem is not None:
            raise DataError(problem)
        return gzip.open(path, "rt", encoding="utf-8")
    return open(path, encoding="utf-8")


def _json_lines(path: Path, document: Any, what: str) -> list[dict]:
    """``document(record)`` for each non-empty JSON line of ``path`` (gzipped or not).

    Raises:
        DataError: ``path line N: not WHAT (...)``, for a line that is not JSON or a record
            ``document`` cannot read.
    """
    rows = []
    with _open_text(path) as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                rows.append(document(json.loads(line)))
            except (json.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError) as err:
                raise DataError(f"{path} line {number}: not {what} ({type(err).__name__}: {err})") from err
    return rows


def hh_rlhf_pairs(data_dir: str | None = None, data_file: str | None = None, max_completion_chars: int | None = None,
                  **_: Any) -> dict[str, Any]:
    """Anthropic HH-RLHF preference pairs as two-choice documents ``{"prompt", "choices":
    [chosen completion, rejected completion], "label": 0}``: the prompt is the pair's shared
    prefix (the implicit-prompt layout, split as TRL's ``extract_prompt`` splits it, as
    llmtrain's preference data does), so the task's accuracy is the share of pairs whose
    chosen response has the higher log-likelihood (lm-eval's ``acc``; its ``acc_norm`` divides
    each completion's log-likelihood by its length in characters, ``acc_bytes`` in UTF-8 bytes).
    Pairs with an empty completion are skipped (no continuation to score), and, with
    ``max_completion_chars``, pairs with a longer completion (the harness keeps a continuation
    whole, so it must fit the model's context: 1,000 characters fit a byte-level tokenizer at
    1,024 positions; the shipped task keeps 2,277 of the 2,312 pairs).

    Raises:
        DataError: the file is missing (:func:`data_file`), not whole gzip data (a ``.gz`` one), or a
            line is not a pair.
    """
    path = _data_file(HH_FILES, data_dir, data_file)
    rows = []
    with _open_text(path) as file:
        for number, line in enumerate(file, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                prompt, chosen, rejected = extract_prompt(record["chosen"], record["rejected"])
            except (json.JSONDecodeError, KeyError, TypeError) as err:
                raise DataError(f"{path} line {number}: not a chosen/rejected pair ({err})") from err
            if chosen and rejected and (not max_completion_chars
                                        or max(len(chosen), len(rejected)) <= max_completion_chars):
                rows.append({"prompt": prompt, "choices": [chosen, rejected], "label": 0})
    return _dataset(rows, path)


def alpaca_responses(data_dir: str | None = None, data_file: str | None = None, max_completion_chars: int | None = None,
                     **_: Any) -> dict[str, Any]:
    """Alpaca instruction records as ``{"prompt", "response"}`` documents: the prompt in the
    Alpaca template llmtrain trains with (``data.template=alpaca``), the reference output as
    the continuation whose log-likelihood lm-eval scores (per byte, :func:`response_scores`). Records with an empty output are skipped, and with
    ``max_completion_chars`` those with a longer one (see :func:`hh_rlhf_pairs`; the shipped task
    keeps 4,884 of the 5,000-record subset). The response is kept as the string it is (a
    reference output like ``[1, 2, 3]`` included: the task names the field, not a template).

    Raises:
        DataError: the file is missing or is not a JSON list of instruction records.
    """
    path = _data_file(ALPACA_FILES, data_dir, data_file)
    try:
        records = json.loads(path.read_text(encoding="utf-8"))
        rows = [{"prompt": alpaca_prompt(r["instruction"].strip(), (r.get("input") or "").strip()),
                 "response": r["output"].strip()} for r in records
                if (r.get("output") or "").strip() and len(r["output"].strip()) <= (max_completion_chars or float("inf"))]
    except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as err:
        raise DataError(f"{path}: not a JSON list of Alpaca records with instruction/output ({err})") from err
    return _dataset(rows, path)


def response_scores(doc: dict, results: list[tuple[float, bool]]) -> dict[str, Any]:
    """lm-eval ``process_results`` of ``alpaca_local``: from the response's (log-likelihood in
    nats, is-greedy) pair, per-byte scores that do not depend on the tokenizer, so runs with
    different tokenizers compare: ``byte_perplexity`` = exp(-sum ll / sum bytes) and
    ``bits_per_byte`` = -sum ll / (sum bytes x ln 2) over the documents (lm-eval's
    ``weighted_perplexity`` and ``bits_per_byte`` aggregations of (ll, bytes) pairs), and
    ``acc``, the share of responses that are the greedy continuation."""
    loglikelihood, is_greedy = results[0]
    size = len(doc["response"].encode("utf-8"))
    return {"byte_perplexity": (loglikelihood, size), "bits_per_byte": (loglikelihood, size), "acc": int(is_greedy)}


def gsm8k_problems(data_dir: str | None = None, data_file: str | None = None, **_: Any) -> dict[str, Any]:
    """GSM8K's test problems (Cobbe et al. 2021) as ``{"prompt", "question", "answer"}``
    documents: the prompt is lm-eval's own zero-shot ``gsm8k`` layout (``Question: ...\nAnswer:``),
    the answer the worked solution ending in ``#### N`` that :func:`gsm8k_scores` checks against.
    Reads JSON lines, gzipped or not.

    Raises:
        DataError: the file is missing, not whole gzip data (a ``.gz`` one), or a line is not a
            ``{question, answer}`` record.
    """
    def document(record: dict) -> dict:
        question, answer = record["question"].strip(), str(record["answer"])
        return {"prompt": f"Question: {question}\nAnswer:", "question": question, "answer": answer}

    path = _data_file(GSM8K_FILES, data_dir, data_file)
    return _dataset(_json_lines(path, document, "a GSM8K record with question/answer"), path)


def gsm8k_scores(doc: dict, results: list[str]) -> dict[str, Any]:
    """lm-eval ``process_results`` of ``gsm8k_local``: ``exact_match`` is 1 when the generated
    answer's final number equals the reference's (the ``gsm8k`` reward of online RL, so a
    run's held-out ``val/reward`` and this score check answers the same way)."""
    from llmtrain.rollout.rewards import gsm8k_reward

    return {"exact_match": float(gsm8k_reward([results[0]], answer=[doc["answer"]])[0] or 0.0)}


def digits_images(data_dir: str | None = None, data_file: str | None = None, **_: Any) -> dict[str, Any]:
    """The digits test set (``digits/test.jsonl``, TRL's conversational vision layout with an
    ``answer`` column; docs/vision.md) as ``{"prompt", "image", "answer"}`` documents: the prompt
    is the record's user text after lm-eval's ``<image>`` placeholder (which ``hf-multimodal``
    turns into an image part of the chat, or the model's image token), ``image`` the path of its
    one image (relative paths are relative to the file's folder; :func:`digit_image` opens it).

    Raises:
        DataError: the file is missing, or a line is not a one-image record with an answer.
    """
    def document(record: dict) -> dict:
        [user] = [m for m in record["messages"] if m["role"] == "user"]
        parts = user["content"] if isinstance(user["content"], list) else [{"type": "text", "text": user["content"]}]
        text = " ".join(p["text"] for p in parts if p.get("type") == "text").strip()
        [image] = record["images"]
        image_path = Path(image).expanduser()
        return {"prompt": f"<image>{text}", "answer": str(record["answer"]),
                "image": str(image_path if image_path.is_absolute() else path.parent / image_path)}

    path = _data_file(DIGITS_FILES, data_dir, data_file)
    return _dataset(_json_lines(path, document, "a one-image record with a user turn and an answer"), path)


def digit_image(doc: dict) -> list[Any]:
    """lm-eval ``doc_to_image`` of ``digits_local``: the document's image, RGB (PIL), in a list
    (``hf-multimodal`` reads each request's ``visual`` list).

    Raises:
        DataError: the image is missing or PIL cannot read it (naming the path).
    """
    from llmtrain.data.vision import load_image

    return [load_image(Path(doc["image"]), "digits_local", "images")]


def digit_scores(doc: dict, results: list[str]) -> dict[str, Any]:
    """lm-eval ``process_results`` of ``digits_local``: ``exact_match`` is 1 when the generated
    text's final answer is the digit (online RL's ``answer`` reward: "7", " 7." and "The digit is
    7" match "7"), so the task and a GRPO run's reward check answers the same way."""
    from llmtrain.rollout.rewards import answer_matches

    return {"exact_match": float(answer_matches(results[0], doc["answer"]))}
