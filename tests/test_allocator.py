"""trainer.malloc_mmap_threshold: freed tensors go back to the system (llmtrain.common.allocator)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from conftest import assert_ok, run_cli, train_rows

from llmtrain.common.errors import ConfigError

PROBE = textwrap.dedent("""
    import sys
    import torch
    from llmtrain.common.allocator import set_mmap_threshold

    def rss():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096

    print(set_mmap_threshold(int(sys.argv[1])))
    torch.ones(4 * 2**20).sum()  # a 16 MiB free: glibc's dynamic threshold rises to 16 MiB
    held = [torch.ones(2**18) for _ in range(200)]  # 200 x 1 MiB, touched
    before = rss()
    del held[::2]  # every other one: holes inside the heap, which it cannot give back
    print((before - rss()) / 2**20)
""")


def returned_mib(threshold: int) -> tuple[str, float]:
    out = subprocess.run([sys.executable, "-c", PROBE, str(threshold)], capture_output=True, text=True, check=True)
    flag, mib = out.stdout.split()
    return flag, float(mib)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_freed_tensors_go_back_with_a_fixed_threshold():
    # glibc's default (the reference): 100 MiB freed in holes stay resident; at 64 KiB they go back.
    flag, kept = returned_mib(0)
    assert flag == "False" and kept < 20
    flag, returned = returned_mib(65536)
    assert flag == "True" and returned > 90


TRIM_PROBE = textwrap.dedent("""
    import sys
    import torch
    from llmtrain.common.allocator import set_mmap_threshold, trimmer

    def rss():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096

    set_mmap_threshold(65536)
    held = [torch.ones(4096) for _ in range(3000)]  # 3000 x 16 KiB from the heap (below the threshold), touched
    del held[:-1]  # all but the last: ~47 MiB free inside the heap, its top still in use
    before = rss()
    trimmer(int(sys.argv[1]))()
    print((before - rss()) / 2**20)
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim")
def test_the_trimmer_gives_back_small_freed_tensors_inside_the_heap():
    # Below the threshold freed tensors stay resident in the heap (trainer.malloc_mmap_threshold 0:
    # no trim, the reference); the trimmer between phases hands their pages back.
    def returned(threshold: int) -> float:
        out = subprocess.run([sys.executable, "-c", TRIM_PROBE, str(threshold)], capture_output=True, text=True,
                             check=True)
        return float(out.stdout.split()[-1])

    assert returned(0) < 5
    assert returned(65536) > 35


def test_threshold_out_of_range_is_a_config_error():
    from llmtrain.config.compose import compose
    from llmtrain.config.validate import validate

    cfg = compose(["model=tiny_llama", "trainer.malloc_mmap_threshold=67108864"])
    with pytest.raises(ConfigError, match="trainer.malloc_mmap_threshold=67108864"):
        validate(cfg, 1)


@pytest.mark.slow
def test_grpo_samples_and_trains_the_same_under_either_threshold(tmp_path):
    # The allocator moves where tensors live, never their values: glibc's default (the reference)
    # and 64 KiB sample the same completions (the sample digest) and give the same losses, bit for bit.
    import json
    import random

    from test_grpo_layouts import overrides_of

    rng, path = random.Random(0), tmp_path / "questions.jsonl"
    path.write_text("".join(json.dumps({"question": f"What is {a}+{b}?", "answer": f"#### {a + b}"}) + "\n"
                            for a, b in ((rng.randint(0, 50), rng.randint(0, 50)) for _ in range(64))))
    rows = {}
    for threshold in (0, 65536):
        base = [o for o in overrides_of("lora", path) if not o.startswith(("trainer.max_steps", "trainer.save_every",
                                                                          "trainer.eval_every"))]
        run_dir = tmp_path / f"t{threshold}"
        assert_ok(run_cli(base + ["trainer.max_steps=3", "trainer.eval_every=0", "trainer.save_every=0",
                                  f"trainer.malloc_mmap_threshold={threshold}", f"run_dir={run_dir}"]))
        rows[threshold] = [(r["data/sample_digest"], r["train/loss"], r["train/grad_norm"]) for r in train_rows(run_dir, 3)]
    assert rows[0] == rows[65536]
