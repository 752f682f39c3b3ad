"""`pip install .` ships conf/ and recipes/, and the installed package finds and composes them."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

from conftest import REPO


def test_installed_wheel_finds_its_configs_and_recipes(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", str(REPO),
                    "-w", str(tmp_path / "dist")], check=True, capture_output=True, cwd=tmp_path)
    wheel = next((tmp_path / "dist").glob("llmtrain-*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    shipped = {f"llmtrain/{p.relative_to(REPO).as_posix()}" for folder in ("conf", "recipes")
               for p in (REPO / folder).rglob("*.yaml")}
    shipped |= {p.relative_to(REPO).as_posix() for p in (REPO / "llmtrain" / "evaluation" / "tasks").glob("*.yaml")}
    assert shipped and shipped <= names, shipped - names
    # Every sub-package of the source tree is in the wheel (a missing one imports only from a checkout).
    modules = {f"llmtrain/{p.relative_to(REPO / 'llmtrain').as_posix()}" for p in (REPO / "llmtrain").rglob("*.py")}
    assert modules <= names, modules - names
    assert "hydra_plugins/llmtrain_launcher/launchers.py" in names  # hydra/launcher=slurm: where Hydra looks
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), str(wheel)],
                   check=True, capture_output=True)
    probe = ("import llmtrain.trainer, llmtrain.export, llmtrain.prepare\n"
             "from llmtrain.common.paths import CONF_DIR, RECIPES_DIR; print(CONF_DIR); print(RECIPES_DIR)\n"
             "from llmtrain.config.compose import register_configs; register_configs()\n"
             "from hydra import compose, initialize_config_dir\n"
             "with initialize_config_dir(config_dir=CONF_DIR, version_base=None):\n"
             "    print(compose('config', overrides=['+recipe=zero3_offload']).recipe.offload_params)\n")
    out = subprocess.run([sys.executable, "-c", probe], check=True, capture_output=True, text=True,
                         cwd=tmp_path, env={"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin"}).stdout.split()
    assert out == [str(target / "llmtrain" / "conf"), str(target / "llmtrain" / "recipes"), "True"]


def test_deepspeed_ops_link_when_the_environment_path_has_a_space(tmp_path, monkeypatch):
    # torch writes -L<torch/lib> unquoted into DeepSpeed's op build: a venv under "/x y/" failed
    # to link (ld: cannot find y/...). The engine points torch at a space-free symlink instead.
    import torch.utils.cpp_extension as cpp_extension

    import llmtrain.engine.deepspeed_imports as ds_engine

    spaced = tmp_path / "with space" / "lib"
    spaced.mkdir(parents=True)
    (spaced / "libc10.so").write_text("stand-in")
    monkeypatch.setattr(cpp_extension, "TORCH_LIB_PATH", str(spaced))
    monkeypatch.setattr("llmtrain.common.paths.CACHE_DIR", tmp_path / "cache")
    ds_engine._link_torch_libs_without_spaces()
    linked = Path(cpp_extension.TORCH_LIB_PATH)
    assert " " not in str(linked) and linked.is_symlink()
    assert (linked / "libc10.so").read_text() == "stand-in"
    ds_engine._link_torch_libs_without_spaces()  # the next rank finds the link in place
    assert Path(cpp_extension.TORCH_LIB_PATH) == linked


def test_deepspeed_on_cpu_skips_building_its_inference_all_reduce_op(monkeypatch):
    # DeepSpeed's init_distributed JIT-built deepspeed_shm_comm (~90 s of g++ on a machine's
    # first DeepSpeed launch) for inference_all_reduce, which training never calls.
    import llmtrain.parallel.distributed  # noqa: F401  (DS_ACCELERATOR=cpu before deepspeed loads)
    import deepspeed
    from deepspeed.comm.torch import build_shm_op

    import llmtrain.engine.deepspeed_imports as ds_engine

    monkeypatch.setitem(deepspeed.ops.__compatible_ops__, "deepspeed_shm_comm", True)  # as probed with g++ here
    ds_engine._skip_inference_all_reduce_op(deepspeed)
    assert build_shm_op() is None  # DeepSpeed's own builder call now declines, before compiling


def test_deepspeed_muon_stand_ins_are_never_matched_and_never_replace_the_real_modules(monkeypatch):
    import pytest
    import torch

    import llmtrain.parallel.distributed  # noqa: F401  (DS_ACCELERATOR=cpu before deepspeed loads)
    import llmtrain.engine.deepspeed_imports as ds_imports

    names = (ds_imports._MUON_OPTIMIZER, ds_imports._MUON_UPDATE)
    real = object()  # a module imported before llmtrain's engine: kept
    monkeypatch.setitem(sys.modules, names[0], real)
    monkeypatch.setitem(sys.modules, names[1], None)
    ds_imports._stub_deepspeed_muon()
    assert sys.modules[names[0]] is real and sys.modules[names[1]] is None
    monkeypatch.setitem(sys.modules, names[0], None)  # neither imported
    ds_imports._stub_deepspeed_muon()
    from deepspeed.runtime.zero.muon.muon_optimizer import MuonWithAuxAdam
    from deepspeed.runtime.zero.muon.original_muon import muon_update

    assert not isinstance(torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))]), MuonWithAuxAdam)
    with pytest.raises(RuntimeError, match="never builds DeepSpeed's Muon"):
        muon_update(torch.zeros(2, 2), torch.zeros(2, 2))


def _stub_python(folder: Path) -> Path:
    """A ``python3`` that logs each call's arguments to ``calls.log`` and whose ``-m venv DIR``
    makes ``DIR/bin/activate`` put the same stub first on PATH as ``python`` (nothing installed)."""
    folder.mkdir()
    log = folder / "calls.log"
    stub = folder / "python3"
    stub.write_text(f"""#!/usr/bin/env bash
echo "$*" >> {log}
if [ "$1 $2" = "-m venv" ]; then
  mkdir -p "$3/bin" && ln -sf {stub} "$3/bin/python"
  echo 'PATH="$(cd "$(dirname "${{BASH_SOURCE[0]}}")" && pwd):$PATH"' > "$3/bin/activate"
elif [ "$1 $2 $3" = "-W ignore -c" ]; then
  echo "setup_venv: torch 2.13.0+cpu installed (CPU build)"
fi
""")
    stub.chmod(0o755)
    return log


def test_setup_script_says_each_phase_lets_pip_talk_and_takes_a_torch_index(tmp_path):
    """scripts/setup_venv.sh prints a line before each phase, runs pip without ``-q`` for torch and
    llmtrain, and passes ``TORCH_INDEX_URL`` (PyTorch's CPU wheels) to torch's install alone; unset,
    pip gets no index of ours (CI's and this machine's pip.conf serve the CPU wheel)."""
    import os

    log = _stub_python(tmp_path / "bin")
    cpu = "https://download.pytorch.org/whl/cpu"
    for index in (cpu, ""):
        log.unlink(missing_ok=True)
        env = {**os.environ, "PATH": f"{tmp_path / 'bin'}:/usr/bin:/bin", "VENV": str(tmp_path / "venv"),
               "LLMTRAIN_EXTRAS": "[dev]", "TORCH_INDEX_URL": index}
        out = subprocess.run(["bash", "-c", ". scripts/setup_venv.sh"], capture_output=True, text=True, env=env,
                             cwd=REPO, check=True).stdout
        lines = [line for line in out.splitlines() if line.startswith("setup_venv: ")]
        assert [line.split()[1] for line in lines] == ["creating", "upgrading", "installing", "torch", "installing",
                                                       "done;"], out
        assert lines[2].startswith(f"setup_venv: installing torch 2.13.0 from {cpu if index else 'pip'}")
        assert lines[4] == "setup_venv: installing llmtrain[dev] and its dependencies"
        calls = log.read_text().splitlines()
        torch_line = f"-m pip install --index-url {cpu} torch==2.13.0" if index else "-m pip install torch==2.13.0"
        assert calls == [f"-m venv {tmp_path / 'venv'}", "-m pip install -q --upgrade pip", torch_line,
                         calls[3], "-m pip install .[dev]"]
        # torch's version check runs before numpy is installed: torch's "Failed to initialize NumPy" warning is off.
        assert calls[3].startswith("-W ignore -c ") and "torch.__version__" in calls[3]
