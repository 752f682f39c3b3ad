"""Every code block of README.md and of every docs/*.md page runs as written.

* Python (a ``python`` block or a ``python - <<'EOF'`` heredoc) is executed, in a folder holding
  the run it reads (a tiny model with a chat template where the README's run would be).
* Every llmtrain command line (``python -m llmtrain``, ``torchrun``/``accelerate launch ... -m
  llmtrain``, the install/SLURM scripts) composes and validates for its world size; lines with a
  ``...`` placeholder compose and pass the closed-schema check. ``--help`` and ``--cfg`` lines run.
* Scripts named in a block exist and take the flags the block gives them.
* ``curl`` lines download one of the files docs/data.md's table names, from GitHub.
* Any other line fails the test until it is classified here: a new kind of documented line
  cannot go untested by accident.
* Every docs page is linked from README.md, and every relative link (``docs/x.md#anchor``) of
  README, the docs pages and llmtrain's messages names a page and a heading that exist.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, assert_ok, make_cfg, run_cli, subprocess_env
from llmtrain.config.keys import check_known_keys
from llmtrain.planning.preflight import validate_and_preflight as validate  # the config, then this machine

README = REPO / "README.md"
DOCS = sorted((REPO / "docs").glob("*.md"))
PAGES = [README, *DOCS]
SETUP_COMMANDS = {("pip", "install"), ("python3", "-m"), (".", ".venv/bin/activate"), ("python", "-m", "pytest")}


def sections() -> dict[str, list[tuple[str, str]]]:
    """``FILE: ## heading`` -> [(language, code), ...] for each fenced block under it, for README.md
    and every docs page (blocks before a page's first ``##`` go under ``FILE: ``)."""
    found: dict[str, list[tuple[str, str]]] = {}
    for page in PAGES:
        heading = f"{page.relative_to(REPO)}: "
        for part in re.split(r"(^## .*$)", page.read_text(), flags=re.M):
            if part.startswith("## "):
                heading = f"{page.relative_to(REPO)}: {part[3:].strip()}"
            else:
                found.setdefault(heading, []).extend(re.findall(r"^```(\w*)\n(.*?)^```", part, re.S | re.M))
    return found


def split_block(code: str) -> tuple[list[str], list[str]]:
    """(shell commands, Python heredoc sources) of a bash block; continuations joined."""
    commands, sources = [], []
    lines = iter(code.replace("\\\n", " ").splitlines())
    for line in lines:
        heredoc = re.match(r"\s*python3? - <<'?(\w+)'?\s*$", line)
        if heredoc:
            body = []
            for inner in lines:
                if inner.strip() == heredoc.group(1):
                    break
                body.append(inner)
            sources.append("\n".join(body) + "\n")
            continue
        for command in line.split("&&"):
            tokens = shlex.split(command, comments=True)
            while tokens and re.fullmatch(r"[A-Z_]+=\S*", tokens[0]):
                tokens = tokens[1:]  # environment assignments, e.g. OMP_NUM_THREADS=1
            if tokens:
                commands.append(shlex.join(tokens))
    return commands, sources


def all_blocks() -> list[tuple[str, str, str]]:
    return [(heading, lang, code) for heading, blocks in sections().items() for lang, code in blocks]


def commands_and_sources() -> tuple[list[tuple[str, str]], list[str]]:
    commands, sources = [], []
    for heading, lang, code in all_blocks():
        if lang == "python":
            sources.append(code)
        elif lang in ("bash", "sh", ""):
            cmds, srcs = split_block(code)
            commands.extend((heading, c) for c in cmds)
            sources.extend(srcs)
        else:
            pytest.fail(f"block in {heading!r} has language {lang!r}: teach tests/test_readme.py to run it")
    return commands, sources


def llmtrain_args(tokens: list[str]) -> tuple[list[str], int] | None:
    """(overrides and flags, world size) of a command that runs llmtrain, else None."""
    if tokens[:2] == ["bash", "scripts/install_and_train.sh"]:
        return tokens[2:], 1
    if tokens[:2] == ["sbatch", "scripts/slurm_example.sbatch"]:
        return tokens[2:], 16  # the script's 2 nodes x 8 GPUs
    if "-m" not in tokens or tokens[tokens.index("-m") + 1] != "llmtrain":
        return None
    at = tokens.index("-m")
    launcher = tokens[:at]
    world = 1
    for flag in ("--nproc_per_node", "--num_processes", "--nnodes"):
        if flag in launcher:
            world *= int(launcher[launcher.index(flag) + 1])
    for token in tokens[at + 2:]:  # a dry run lays out its own world size
        if token.startswith("trainer.dry_run_world_size="):
            world = int(token.split("=", 1)[1])
    launchers = {"hydra/launcher=slurm": (1, 8), "hydra/launcher=slurm_local": (1, 2)}  # the presets' nodes, tasks
    for preset, (nodes, tasks) in launchers.items():
        if preset in tokens:  # a submitit job: nodes x tasks_per_node ranks
            given = dict(t.split("=", 1) for t in tokens if t.startswith("hydra.launcher."))
            world = int(given.get("hydra.launcher.nodes", nodes)) * int(given.get("hydra.launcher.tasks_per_node", tasks))
    return tokens[at + 2:], world


COMMANDS, SOURCES = commands_and_sources()


def test_the_readme_has_the_blocks_this_test_expects():
    assert len(COMMANDS) >= 20 and len(SOURCES) >= 1
    assert any("torchrun" in c for _, c in COMMANDS) and any("accelerate launch" in c for _, c in COMMANDS)
    pages_with_commands = {heading.split(":", 1)[0] for heading, _ in COMMANDS}
    assert pages_with_commands == {str(p.relative_to(REPO)) for p in PAGES}, "a page without commands"
    linked = set(re.findall(r"\]\((docs/[\w-]+\.md)", README.read_text()))
    assert linked == {str(p.relative_to(REPO)) for p in DOCS}, "every docs page is linked from README.md"


def anchors(page: Path) -> set[str]:
    """GitHub's anchors for a page's headings (outside code blocks): lower case, punctuation
    dropped, spaces to hyphens."""
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
            for h in re.findall(r"^#+ (.*)$", text, flags=re.M)}


def relative_links() -> list[tuple[str, Path]]:
    """(link, the file it is relative to) of every relative Markdown link of README.md, the docs
    pages and BENCHMARKS.md, and every ``docs/x.md#anchor`` llmtrain's messages name."""
    found = []
    for page in [*PAGES, REPO / "BENCHMARKS.md"]:
        text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)
        found += [(link, page) for link in re.findall(r"\]\(([^)\s]+)\)", text) if not re.match(r"\w+:", link)]
    for source in sorted((REPO / "llmtrain").rglob("*.py")):
        found += [(link, REPO / "README.md") for link in re.findall(r"(docs/[\w-]+\.md(?:#[\w-]+)?)", source.read_text())]
    return found


@pytest.mark.parametrize("link,page", relative_links(), ids=lambda v: v if isinstance(v, str) else v.name)
def test_relative_link_names_a_page_and_heading_that_exist(link, page):
    path, _, anchor = link.partition("#")
    target = (page.parent / path).resolve() if path else page
    assert target.is_file(), f"{page.name}: {link} names no file"
    if anchor and target.suffix == ".md":
        assert anchor in anchors(target), f"{page.name}: {link}: {target.name} has no heading with that anchor"


@pytest.mark.parametrize("heading,command", COMMANDS, ids=[c[:60] for _, c in COMMANDS])
def test_command_line(heading, command, tmp_path):
    tokens = shlex.split(command)
    if tokens[1:3] == ["-m", "llmtrain.prepare"]:
        from llmtrain.config.validate import validate_data

        validate_data(make_cfg([t for t in tokens[3:] if not t.startswith("out=")]).data)
        assert sum(t.startswith("out=") for t in tokens) == 1, command
        return
    if tokens[1:3] == ["-m", "llmtrain.plan"]:  # the planner itself: seconds, nothing launched
        from llmtrain.plan import main as plan

        assert plan(tokens[3:]) == 0, command
        return
    if tokens[1:3] == ["-m", "llmtrain.evaluate"]:  # its arguments parse and its tasks exist (nothing is run)
        from llmtrain.evaluation import harness
        from llmtrain.evaluate import parse_args

        _, args = parse_args([t if not t.startswith("device=cuda") else "device=cpu" for t in tokens[3:]])  # no GPU here
        harness.task_manager(args.tasks, harness.include_paths(args.include))
        return
    if tokens[0] == "lm_eval":  # the harness's CLI: the tasks it names are in the folder it includes
        from llmtrain.evaluation import harness

        folder = REPO / tokens[tokens.index("--include_path") + 1]
        assert folder == REPO / "llmtrain" / "evaluation" / "tasks", command
        harness.task_manager(tokens[tokens.index("--tasks") + 1].split(","), harness.include_paths())
        return
    if tokens[0] == "curl":  # a download of docs/data.md's table: its file name, from GitHub
        name, url = tokens[tokens.index("-o") + 1], tokens[-1]
        assert re.match(r"https://raw\.githubusercontent\.com/[\w.-]+/[\w.-]+/\w+/", url), command
        assert f"| `{name}` |" in (REPO / "docs" / "data.md").read_text(), command
        return
    parsed = llmtrain_args(tokens)
    if parsed is None:
        if tuple(tokens[:2]) in SETUP_COMMANDS or tuple(tokens[:3]) in SETUP_COMMANDS:
            return  # installs: exercised by the install scripts and CI itself
        scripts = [t for t in tokens if t.startswith("scripts/")]
        assert scripts, f"line in {heading!r} is of a kind tests/test_readme.py does not check: {command}"
        source = (REPO / scripts[0]).read_text()
        forwarded = re.search(r'(scripts/\S+\.py) "\$@"', source) if scripts[0].endswith(".sh") else None
        if forwarded:  # a wrapper passing its flags on: they must be the Python script's
            source = (REPO / forwarded.group(1)).read_text()
        for flag in [t for t in tokens[tokens.index(scripts[0]) + 1:] if t.startswith("--")]:
            assert f'"{flag}"' in source, f"{scripts[0]} takes no {flag} ({command})"
        return
    args, world_size = parsed
    if "--help" in args or "--cfg" in args:
        assert_ok(run_cli(args, cwd=tmp_path))
        return
    overrides = [a for a in args if a != "..."]
    if "-m" in overrides:  # a sweep: compose each job
        overrides.remove("-m")
        swept = [o for o in overrides if "," in o.split("=", 1)[1]]
        jobs = [[o for o in overrides if o not in swept] + [f"{s.split('=')[0]}={v}"] for s in swept
                for v in s.split("=", 1)[1].split(",")]
    else:
        jobs = [overrides]
    for job in jobs:
        cfg = make_cfg(job)
        if "..." in args:
            check_known_keys(cfg)  # the rest of the line is the reader's
        elif "recipe.fp8=true" in job and "recipe.fp8_emulate=true" not in job and not _has_fp8_matmuls():
            # A line for GPUs with FP8: the config is valid; this machine is refused in one line.
            from llmtrain.common.errors import ConfigError
            from llmtrain.config.validate import validate as validate_config

            validate_config(cfg, world_size)
            with pytest.raises(ConfigError, match="needs float8 matmuls"):
                validate(cfg, world_size)
        else:
            validate(cfg, world_size)


def _has_fp8_matmuls() -> bool:
    import torch

    from llmtrain.parallel.float8 import fp8_support

    return torch.cuda.is_available() and fp8_support(torch.device("cuda")) is None


def test_quick_start_lines_train_in_separate_run_dirs():
    # Each line of Quick start is run after the previous one: sharing a run_dir would resume it.
    run_dirs = []
    for heading, command in COMMANDS:
        parsed = llmtrain_args(shlex.split(command))
        if heading == "README.md: Quick start" and parsed and not {"--help", "--cfg", "-m"} & set(parsed[0]):
            run_dirs.append(make_cfg(parsed[0]).run_dir)
    assert len(run_dirs) >= 4 and len(set(run_dirs)) == len(run_dirs), run_dirs


def _tiny_chat_model(folder: Path) -> None:
    """A tiny Llama and the byte tokenizer with a chat template: what the snippet's export looks
    like, small enough to build in a second."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from llmtrain.models.build import byte_tokenizer

    tok = byte_tokenizer()
    tok.chat_template = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                         "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    config = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, eos_token_id=tok.eos_token_id,
                         bos_token_id=tok.bos_token_id, pad_token_id=tok.pad_token_id)
    LlamaForCausalLM(config).save_pretrained(folder)
    tok.save_pretrained(folder)


@pytest.mark.parametrize("source", SOURCES, ids=[f"python-{i}" for i in range(len(SOURCES))])
def test_python_snippet_runs_as_written(source, tmp_path):
    for run_path in re.findall(r'"(runs/[^"]+)"', source):
        _tiny_chat_model(tmp_path / run_path)
    proc = subprocess.run([sys.executable, "-"], input=source, capture_output=True, text=True, timeout=300,
                          cwd=tmp_path, env=subprocess_env())
    assert_ok(proc)
