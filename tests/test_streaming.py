"""``data.streaming=true`` (:mod:`llmtrain.data.streaming`): sources read as streams.

Where the order is the same, a stream trains on what the map-style reader trains on, loss for
loss: with ``data.shuffle=false`` on both, the stream holds out its first ``data.val_samples``
samples and then trains in file order, and the map-style run holds out ``val_fraction`` of the
samples chosen by the seed and trains on the rest in order. So the streamed file is the map-style
file rearranged by :func:`_stream_order`: the map-style run's held-out records first, then its
training records, in order.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import FAST, make_cfg, read_metrics
from llmtrain.data import _split, load_splits, StepBatchSampler
from llmtrain.models.build import byte_tokenizer

COMMON = [o for o in FAST if not o.startswith("data.max_bytes")] + ["trainer.export_hf=false"]


def _losses(run_dir: Path) -> list[tuple]:
    return [(r["step"], r["train/loss"], r["data/sample_digest"]) for r in read_metrics(run_dir) if "train/loss" in r]


def _val_losses(run_dir: Path) -> list[tuple]:
    return [(r["step"], r["val/loss"]) for r in read_metrics(run_dir) if "val/loss" in r]


def _write(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _stream_order(records: list[dict], val_fraction: float, seed: int) -> list[dict]:
    """``records`` as the stream must read them to train as the map-style run does: the map-style
    run's held-out records first (sorted, as it evaluates them), then its training records in order
    (every record gives one sample here, so records and samples line up)."""
    train, val = _split(len(records), val_fraction, seed)
    return [records[i] for i in val.tolist()] + [records[train[k]] for k in range(len(train))]


def _alpaca(n: int, offset: int = 0) -> list[dict]:
    return [{"instruction": f"Add {i} and {i + 3}.", "input": "", "output": f"{i} + {i + 3} = {2 * i + 3}."}
            for i in range(offset, offset + n)]


@pytest.mark.parametrize("kind", ["sft", "text"])
def test_a_stream_in_file_order_trains_as_the_map_style_run(kind, tmp_path):
    """SFT (alpaca records) and pre-training text (documents of exactly one block each: 63 bytes
    and EOS, so documents and blocks line up): ``data.streaming=true`` from the rearranged file
    gives the map-style run's training losses, samples and held-out losses, bit for bit. The
    stream runs past the end of its 38 training samples (5 steps of 8 samples: a second epoch),
    which wraps as the map-style order does (``g % n``)."""
    from llmtrain.trainer import train

    seed = make_cfg(["tracker=none"]).trainer.seed
    if kind == "sft":
        records, data = _alpaca(40), ["data=alpaca", "data.seq_len=256"]
    else:
        records = [{"text": f"document {i:03d} " + "abcdefghij"[i % 10] * 50} for i in range(40)]
        assert {len(r["text"]) for r in records} == {63}
        data = ["data=text", "data.seq_len=64"]
    common = COMMON + data + ["data.shuffle=false", "trainer.max_steps=5", "trainer.global_batch_size=8",
                              "trainer.micro_batch_size=4", "trainer.eval_every=5", "data.val_fraction=0.05"]
    mapped = _write(tmp_path / "map.jsonl", records)
    streamed = _write(tmp_path / "stream.jsonl", _stream_order(records, 0.05, seed))
    train(make_cfg(common + [f"data.path={mapped}", f"run_dir={tmp_path / 'map'}"]))
    train(make_cfg(common + [f"data.path={streamed}", f"run_dir={tmp_path / 'stream'}", "data.streaming=true",
                             "data.val_samples=2"]))
    assert len(_losses(tmp_path / "map")) == 5
    assert _losses(tmp_path / "stream") == _losses(tmp_path / "map")
    assert _val_losses(tmp_path / "stream") == _val_losses(tmp_path / "map") and _val_losses(tmp_path / "map")


def _steps(cfg, world: int, start: int, stop: int, seed: int) -> list[list[list[int]]]:
    """The samples (their token ids) of steps ``start..stop-1`` as ``world`` ranks read them, each
    step's ranks' micro-batches concatenated in rank order."""
    per_rank = []
    for rank in range(world):
        # A fresh read for each rank and start, as each process of a resumed launch reads.
        fresh = load_splits(cfg, byte_tokenizer(), seed)
        sampler = StepBatchSampler(fresh.order(seed, True), 2, 4 // (2 * world), rank, world, start, stop)
        micro = [[fresh.train[g]["input_ids"] for g in batch] for batch in sampler]
        per_rank.append([sum(micro[i:i + sampler.a], []) for i in range(0, len(micro), sampler.a)])
    return [sum((per_rank[r][s] for r in range(world)), []) for s in range(stop - start)]


def test_a_shuffled_mixture_stream_gives_each_step_the_same_samples_on_any_number_of_ranks(tmp_path):
    """A shuffled mixture of two streams, read as 1 rank and as 2 ranks (global batch 4) and
    resumed at step 3 on either: the same samples at every step. A step's samples are a function
    of the global sample index, not of the ranks, so a checkpoint of 2 ranks resumes exactly on 1.
    Each source's totals count its draws."""
    from omegaconf import OmegaConf

    from llmtrain.config.schema import DataConfig

    a, b = _write(tmp_path / "a.jsonl", _alpaca(30)), _write(tmp_path / "b.jsonl", _alpaca(20, offset=100))
    cfg = OmegaConf.merge(OmegaConf.structured(DataConfig), {
        "name": "mix", "path": None, "seq_len": 256, "streaming": True, "shuffle_buffer": 5, "val_samples": 2,
        "template": "alpaca", "datasets": [{"name": "a", "format": "instruction", "path": str(a)},
                                           {"name": "b", "format": "instruction", "path": str(b)}],
        "weights": [0.6, 0.4]})
    whole = _steps(cfg, 1, 0, 12, seed=3)  # 48 samples: both sources wrap into a second epoch
    assert _steps(cfg, 2, 0, 12, seed=3) == whole
    assert _steps(cfg, 2, 3, 12, seed=3) == whole[3:] == _steps(cfg, 1, 3, 12, seed=3)
    assert len({tuple(s) for step in whole[:5] for s in step}) == 20  # the first 20 samples: no repeats
    assert whole != _steps(OmegaConf.merge(cfg, {"shuffle": False}), 1, 0, 12, seed=3)  # the buffer shuffles
    totals = StepBatchSampler(load_splits(cfg, byte_tokenizer(), 3).order(3, True), 2, 2, 0, 1, 0, 12).source_totals(11)
    assert sum(totals) == 48 and min(totals) > 0


@pytest.mark.slow  # two launches; the fast tier checks the resume position above, in-process
def test_kill_9_mid_run_and_the_same_command_continues_exactly(tmp_path):
    """A shuffled mixture of two streamed sources, one process, checkpoint every 2 steps: killed
    with SIGKILL while stalled before step 4 and launched again with the same command, it
    continues at the next sample: the losses and samples of an uninterrupted run, bit for bit."""
    from test_resume import kill_after, launch

    from llmtrain.trainer import train

    a, b = _write(tmp_path / "a.jsonl", _alpaca(30)), _write(tmp_path / "b.jsonl", _alpaca(20, offset=100))
    args = COMMON + ["data=mix", "data.seq_len=256", "data.template=alpaca", f"data.datasets.0.path={a}",
                     "data.datasets.1.format=instruction", f"data.datasets.1.path={b}", "data.streaming=true",
                     "data.shuffle_buffer=6", "trainer.max_steps=6", "trainer.save_every=2",
                     "trainer.global_batch_size=4", "trainer.micro_batch_size=2"]
    train(make_cfg(args + [f"run_dir={tmp_path / 'whole'}"]))
    killed = tmp_path / "killed"
    kill_after(args + [f"run_dir={killed}"], killed, 3, nproc=1)  # a sealed step-2 checkpoint, step 3 done
    rerun = launch(args + [f"run_dir={killed}"], nproc=1)
    out = rerun.communicate(timeout=300)[0]
    assert rerun.returncode == 0, out[-3000:]
    whole = _losses(tmp_path / "whole")
    assert len(whole) == 6
    assert [r for r in _losses(killed) if r[0] > 2][-4:] == whole[2:]
    totals = [r for r in read_metrics(killed) if "data/source/alpaca_total" in r][-1]
    assert totals["data/source/alpaca_total"] + totals["data/source/sharegpt_total"] == 24 and totals["data/source/sharegpt_total"] > 0


@pytest.mark.parametrize("overrides, needle", [
    (["data=preference", "objective=dpo", "data.path=x.jsonl"], "data.streaming=true reads formats text"),
    (["data=alpaca", "data.path=x.jsonl", "data.packing=true"], "set data.packing=false"),
    (["data=text", "data.path=x.jsonl", "data.max_bytes=1000"], "drop data.max_bytes"),
    (["data=alpaca", "data.path=x.jsonl", "data.val_samples=0"], "data.val_samples=0 must be >= 1"),
])
def test_what_a_stream_cannot_do_is_refused_in_one_line(overrides, needle):
    """Formats a stream cannot feed (preference pairs, token folders), packing (it needs the
    whole set), a byte cap and nothing held out: one line naming the field and the fix."""
    from llmtrain.common.errors import ConfigError
    from llmtrain.config.validate import validate_data

    with pytest.raises(ConfigError, match=needle) as err:
        validate_data(make_cfg(["tracker=none", "data.streaming=true", *overrides]).data)
    assert "\n" not in str(err.value)


@pytest.mark.slow
def test_a_stream_saved_on_2_ranks_resumes_on_1_with_the_same_samples(tmp_path):
    """A shuffled stream trained by 2 processes (gloo), killed with SIGKILL while stalled before
    step 4 (a step-2 checkpoint), and resumed by 1 process: steps 3-6 train on the samples of an
    uninterrupted 1-process run (equal digests), with its losses up to the order of the sums."""
    from test_resume import kill_after, launch

    from llmtrain.trainer import train

    path = _write(tmp_path / "a.jsonl", _alpaca(40))
    args = COMMON + ["data=alpaca", "data.seq_len=256", f"data.path={path}", "data.streaming=true",
                     "data.shuffle_buffer=6", "trainer.max_steps=6", "trainer.save_every=2",
                     "trainer.global_batch_size=4", "trainer.micro_batch_size=2", "trainer.hang_timeout_s=0"]
    train(make_cfg(args + [f"run_dir={tmp_path / 'one'}"]))
    moved = tmp_path / "moved"
    kill_after(args + [f"run_dir={moved}"], moved, 3, nproc=2)
    rerun = launch(args + [f"run_dir={moved}"], nproc=1)
    out = rerun.communicate(timeout=300)[0]
    assert rerun.returncode == 0, out[-3000:]
    one, resumed = _losses(tmp_path / "one"), [r for r in _losses(moved) if r[0] > 2][-4:]
    assert [(r[0], r[2]) for r in resumed] == [(r[0], r[2]) for r in one[2:]]
    assert [r[1] for r in resumed] == pytest.approx([r[1] for r in one[2:]], rel=1e-5)
