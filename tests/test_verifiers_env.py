"""verifiers environments (``rollout.environment=verifiers:ENV_ID`` or ``module:function``,
:mod:`llmtrain.rollout.verifiers_env`): locally defined ones (``tests/verifiers_fixtures.py``, no
hub and no client) run their prompts, turns, stop conditions and rubrics with llmtrain's engine.
Checked against the environment itself: an episode's tokens are the chat template's rendering of
verifiers' own conversation; a single-turn and a multi-turn environment each train 3 steps on the
``hf`` engine, and the rewards logged are the rubric's own scores of the logged completions."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest
import torch

vf = pytest.importorskip("verifiers")

import verifiers_fixtures as fx  # noqa: E402  (needs verifiers)

from llmtrain.rollout.generate import Completion, Sampling  # noqa: E402
from llmtrain.rollout.verifiers_env import VerifiersEnvironment, messages_as_dicts, write_prompts  # noqa: E402

_POLICY = SimpleNamespace(env=SimpleNamespace(device=torch.device("cpu")))


def _tokenizer():
    from llmtrain.data.formats import CHATML
    from llmtrain.models.build import byte_tokenizer

    tok = byte_tokenizer()
    tok.chat_template = CHATML
    return tok


class _Scripted:
    """Replies ``wrong`` and ``<|im_end|>`` until the environment's second answer, then the answer."""

    def __init__(self, tok, wrong="9"):
        self.tok, self.wrong = tok, wrong
        self.sampling = Sampling(max_new=64, end_ids=frozenset({tok.convert_tokens_to_ids("<|im_end|>"),
                                                                tok.eos_token_id}))
        self.seeds = []

    def sample(self, policy, samples, seeds):
        self.seeds += [row[0] for row in seeds]
        out = []
        for sample in samples:
            context = self.tok.decode(sample["prompt_ids"])
            text = sample["answer"] if "(turn 2)" in context else self.wrong
            ids = self.tok(text, add_special_tokens=False)["input_ids"] + [self.tok.convert_tokens_to_ids("<|im_end|>")]
            out.append([Completion(ids, False)])
        return out


def _samples(env, tok, n=2):
    from llmtrain.data.prompts import render

    rows = env.get_dataset(n)
    return [{"prompt": r["prompt"], "answer": r["answer"], "example_id": r["example_id"], "record": k,
             "prompt_ids": render(r["prompt"], tok, "chatml", "test")} for k, r in enumerate(rows)]


@pytest.mark.parametrize("wrong", ["9", ""])
def test_an_episode_is_the_chat_templates_rendering_of_verifiers_conversation(wrong):
    tok = _tokenizer()
    env = fx.multi_turn()
    samples = _samples(env, tok)[1:]  # 1 + 1 = 2
    engine = _Scripted(tok, wrong)
    [[episode, other]] = VerifiersEnvironment(None, env).episodes(engine, _POLICY, samples, [[11, 12]], max_turns=4,
                                                                  budget=200, tokenizer=tok)
    # The conversation verifiers itself builds from these replies (its env_response), rendered.
    conversation = [*samples[0]["prompt"], {"role": "assistant", "content": wrong},
                    {"role": "user", "content": fx.feedback(1)}, {"role": "assistant", "content": wrong},
                    {"role": "user", "content": fx.feedback(2)}, {"role": "assistant", "content": "2"}]
    rendered = tok.apply_chat_template(conversation, tokenize=False)
    assert tok.decode(samples[0]["prompt_ids"] + episode.ids, skip_special_tokens=False) + "\n" == rendered
    assert episode.turns == 3 and not episode.truncated
    model_tokens = 2 * (len(wrong) + 1) + 2  # the replies and <|im_end|>, each turn
    assert sum(episode.env_mask) == model_tokens and len(episode.env_mask) == len(episode.ids)
    assert episode.env_reward == pytest.approx(1.0 + 0.5)  # all digits, and exact
    assert other.ids == episode.ids and other.env_reward == episode.env_reward
    # Each turn has its own seed, derived from the episode's (the same on any layout).
    assert len(set(engine.seeds)) == 6


def test_the_turn_and_token_limits_end_an_episode_as_verifiers_ends_an_overlong_one():
    tok = _tokenizer()
    env = fx.multi_turn()
    samples = _samples(env, tok)[1:]
    ran = VerifiersEnvironment(None, env).episodes(_Scripted(tok), _POLICY, samples, [[1]], max_turns=2, budget=200,
                                                   tokenizer=tok)
    assert ran[0][0].turns == 2 and ran[0][0].env_reward == pytest.approx(1.0)  # "9": digits, not the answer
    short = VerifiersEnvironment(None, env).episodes(_Scripted(tok), _POLICY, samples, [[1]], max_turns=4, budget=8,
                                                     tokenizer=tok)[0][0]
    assert short.truncated and len(short.ids) == 8 and short.turns == 1


# The single-turn environment by module:function, the multi-turn one as an installed
# environment's id (vf.load_environment imports the module of that name).
SPECS = {"single_turn": "tests.verifiers_fixtures:single_turn", "multi_turn": "verifiers:verifiers_fixtures"}


def _overrides(data, which: str, run_dir) -> list[str]:
    return ["objective=grpo", "data=prompts", f"data.path={data}", "data.template=chatml", "data.seq_len=224",
            "reward.functions=[]", "rollout.max_completion_length=96", f"rollout.environment={SPECS[which]}",
            "objective.num_generations=4", "trainer.global_batch_size=2", "trainer.micro_batch_size=1",
            "rollout.log_completions=8", "trainer.max_steps=3", "trainer.eval_every=3", "trainer.eval_samples=2",
            "tracker=none", "trainer.progress_bar=false", "trainer.export_hf=false", f"run_dir={run_dir}"]


@pytest.mark.parametrize("vf_error", [False, True])
def test_an_environment_that_raises_stops_the_rollout_naming_it(vf_error):
    """A plain exception out of env_response, or the verifiers error verifiers' loop keeps in the
    episode's state, is an EnvironmentFailure naming the environment (no episode left waiting)."""
    from llmtrain.rollout.environments import EnvironmentFailure

    tok = _tokenizer()
    env = fx.broken(vf_error)
    wrapped = VerifiersEnvironment(None, env)
    with pytest.raises(EnvironmentFailure, match="rollout.environment Broken .*the tool is down"):
        wrapped.episodes(_Scripted(tok), _POLICY, _samples(env, tok), [[1, 2], [3, 4]], max_turns=4, budget=200,
                         tokenizer=tok)
    assert not asyncio.all_tasks(wrapped.loop)


def _train(tmp_path, which: str) -> tuple[dict, list[dict]]:
    from conftest import make_cfg
    from llmtrain.trainer import train

    data = tmp_path / f"{which}.jsonl"
    write_prompts(getattr(fx, which)(), data)
    run_dir = tmp_path / "run"
    out = train(make_cfg(_overrides(data, which, run_dir)))
    rows = [json.loads(line) for step in (1, 2, 3)
            for line in (run_dir / "completions" / f"step_{step}.jsonl").read_text().splitlines()]
    assert [r["step"] for r in _metrics(run_dir) if "val/reward" in r] == [0, 3]  # greedy episodes too
    return out, rows


def _metrics(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _rubric_score(prompt, completion, answer) -> float:
    """The fixtures' rubric on one completion, called as verifiers calls it."""
    state = vf.State(input={"prompt": prompt, "answer": answer, "example_id": 0})
    state.update(prompt=prompt, completion=completion, trajectory=[], timing=None)
    rubric = fx.rubric()
    asyncio.run(rubric.score_rollout(state))
    return state["reward"]


def test_a_single_turn_environment_trains_and_its_rubric_is_the_reward(tmp_path):
    out, rows = _train(tmp_path, "single_turn")
    assert len(out["losses"]) == 3 and all(torch.isfinite(torch.tensor(out["losses"])))
    assert len(rows) == 3 * 8
    for row in rows:
        answer = str(2 * int(row["prompt"][-1]["content"].split()[2]))
        expected = _rubric_score(row["prompt"], [{"role": "assistant", "content": row["completion"]}], answer)
        assert row["rewards"]["environment"] == pytest.approx(expected, abs=1e-9)
    assert len({row["reward"] for row in rows}) > 1  # partial credit: not every reward equal


def test_a_multi_turn_environment_trains_and_its_rubric_is_the_reward(tmp_path):
    out, rows = _train(tmp_path, "multi_turn")
    assert len(out["losses"]) == 3 and all(torch.isfinite(torch.tensor(out["losses"])))
    turns_seen = set()
    for row in rows:
        answer = str(2 * int(row["prompt"][-1]["content"].split()[2]))
        replies = [t["text"] for t in row["turns"] if t["role"] == "assistant"]
        turns_seen.add(len(replies))
        completion = []
        for k, reply in enumerate(replies, start=1):  # verifiers' conversation: replies and env_response
            completion.append({"role": "assistant", "content": reply})
            if k < len(replies):
                completion.append({"role": "user", "content": fx.feedback(k)})
        expected = _rubric_score(row["prompt"], completion, answer)
        assert row["rewards"]["environment"] == pytest.approx(expected, abs=1e-9)
    assert max(turns_seen) > 1, turns_seen  # some episodes went on after the environment's answer


def test_a_factory_that_gives_no_verifiers_environment_is_refused(tmp_path):
    from llmtrain.common.errors import ConfigError
    from llmtrain.rollout.verifiers_env import load

    with pytest.raises(ConfigError, match="is not callable"):
        load(None, "verifiers:verifiers_fixtures:SYSTEM")
    with pytest.raises(ConfigError, match="gave a str, not a verifiers MultiTurnEnv"):
        load(None, "verifiers:verifiers_fixtures:feedback_text")
    with pytest.raises(ConfigError, match="verifiers cannot load 'no_such_env'"):
        load(None, "verifiers:no_such_env")
    assert messages_as_dicts([vf.UserMessage(content="hi")]) == [{"role": "user", "content": "hi"}]


def test_the_prompts_script_writes_the_environments_dataset(tmp_path, capsys):
    """scripts/tools/verifiers_prompts.py: the environment's own prompts (its system prompt
    included) and answers, as the data=prompts file the training tests read."""
    import sys

    from conftest import REPO

    sys.path.insert(0, str(REPO / "scripts" / "tools"))
    from verifiers_prompts import main

    assert main(["verifiers_fixtures:single_turn", str(tmp_path / "p.jsonl"), "--size", "3"]) == 0
    rows = [json.loads(line) for line in (tmp_path / "p.jsonl").read_text().splitlines()]
    assert rows == [{"prompt": [{"role": "system", "content": fx.SYSTEM}, {"role": "user", "content": f"What is {i} + {i}?"}],
                     "answer": str(2 * i), "example_id": i} for i in range(3)]
    assert main(["no_such_env", str(tmp_path / "q.jsonl")]) == 2
    assert "verifiers cannot load 'no_such_env'" in capsys.readouterr().err


def test_an_environment_without_rewards_needs_reward_functions(tmp_path):
    from conftest import make_cfg
    from llmtrain.common.errors import ConfigError
    from llmtrain.trainer import train

    data = tmp_path / "p.jsonl"
    write_prompts(fx.single_turn(), data)
    overrides = [o if not o.startswith("rollout.environment=") else "rollout.environment=calculator"
                 for o in _overrides(data, "single_turn", tmp_path / "run")]
    with pytest.raises(ConfigError, match="reward.functions is empty and rollout.environment=calculator gives no "
                                          "rewards"):
        train(make_cfg(overrides))
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_two_ranks_sample_the_same_episodes_as_one_process(tmp_path):
    """Seeds per episode and turn, one engine call per turn on every rank: zero3 on 2 ranks (each
    layer gathered as each turn samples) samples the 1-process run's episodes (equal sample
    digests) and trains to its losses and rewards."""
    from conftest import assert_ok, run_cli, train_rows

    data = tmp_path / "p.jsonl"
    write_prompts(fx.multi_turn(), data)
    runs = {}
    for nproc, recipe in ((1, "ddp"), (2, "zero3")):
        run_dir = tmp_path / f"run{nproc}"
        overrides = [o for o in _overrides(data, "multi_turn", run_dir) if not o.startswith("rollout.environment")]
        assert_ok(run_cli([*overrides, "rollout.environment=tests.verifiers_fixtures:multi_turn", "trainer.precision=fp32",
                           "trainer.global_batch_size=4", f"+recipe={recipe}"], nproc=nproc, timeout=1200))
        runs[nproc] = train_rows(run_dir, 3)
    assert max(r["train/episodes/turns_mean"] for r in runs[1]) > 1  # episodes went on after an answer
    for a, b in zip(runs[1], runs[2]):
        assert b["data/sample_digest"] == a["data/sample_digest"], f"step {a['step']}: other episodes"
        for key in ("train/loss", "train/reward", "train/episodes/turns_mean"):
            assert b[key] == pytest.approx(a[key], abs=1e-5, rel=1e-5), f"step {a['step']} {key}"
