"""Multi-turn episodes with tools (``rollout.environment``, :mod:`llmtrain.rollout.environments`)
and the sampling-policy correction of asynchronous generation, in process: the calculator never
executes model text; episodes alternate model turns and tool answers within their token budget;
the environment's tokens carry no loss and no gradient; the truncated importance weights follow
TRL 1.16's four modes; a sampled-ahead batch survives a checkpoint round trip."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from llmtrain.objectives.grpo import GRPO
from llmtrain.rollout.environments import (Calculator, CalculatorError, Environment, EnvironmentFailure, Turn,
                                           calculate, run_episodes)
from llmtrain.rollout.generate import Completion, Sampling


# ---- the calculator ---------------------------------------------------------------------------
@pytest.mark.parametrize("expression,value", [("2+3*4", 14), ("(2+3)*4", 20), ("1,000 / 8", 125.0), ("-3**2", -9),
                                              ("7 // 2 + 7 % 2", 4), ("$12.50 * 4", 50.0), ("2**10", 1024)])
def test_the_calculator_computes_arithmetic(expression, value):
    assert calculate(expression) == value


@pytest.mark.parametrize("expression,message", [
    ("__import__('os').system('true')", "only numbers"), ("open('/etc/passwd')", "only numbers"),
    ("x + 1", "only numbers"), ("'a' * 3", "only numbers"), ("(1).__class__", "only numbers"),
    ("2 plus 3", "not an arithmetic expression"), ("1/0", "division by zero"), ("9**99", "exponent too large"),
    ("10**15 * 10", "out of range"), ("1+" * 150 + "1", "longer than 200"), ("", "empty")])
def test_the_calculator_refuses_everything_else_without_running_it(expression, message):
    with pytest.raises(CalculatorError, match=message):
        calculate(expression)


def test_a_calculator_turn_is_a_result_a_tool_error_or_the_end():
    env = Calculator()
    assert env.step(None, "so <calc>12*3</calc>") == Turn(observation="<result>36</result>\n", tool_calls=1)
    bad = env.step(None, "<calc>import os</calc>")
    assert bad.tool_errors == 1 and bad.observation.startswith("<result>error:") and not bad.done
    assert env.step(None, "The answer is #### 36").done


# ---- episodes ---------------------------------------------------------------------------------
class _Tokenizer:
    """Characters as ids (end token 0 never decoded)."""

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [ord(c) for c in text]}

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids if i)


class _Scripted:
    """An engine writing a calculator call, then the answer and the end token (0)."""

    def __init__(self, max_new=64):
        self.sampling = Sampling(max_new=max_new, end_ids=frozenset({0}))
        self.calls = []

    def sample(self, policy, samples, seeds):
        self.calls.append((len(samples), self.sampling.max_new, self.sampling.stop))
        out = []
        for sample, row in zip(samples, seeds):
            context = _Tokenizer().decode(sample["prompt_ids"])
            text = "<calc>6*7</calc>" if "<result>" not in context else "#### 42"
            ids = [ord(c) for c in text] + ([0] if "####" in text else [])
            out.append([Completion(ids[:self.sampling.max_new], len(ids) > self.sampling.max_new) for _ in row])
        return out


_POLICY = SimpleNamespace(env=SimpleNamespace(device=torch.device("cpu")))


def test_an_episode_alternates_model_turns_and_tool_answers_with_an_env_mask():
    engine = _Scripted()
    prompt = {"prompt": "q", "prompt_ids": [ord("q")], "record": 0}
    [[episode, other]] = run_episodes(engine, _POLICY, Calculator(), [prompt], [[1, 2]], max_turns=4, budget=64,
                                      tokenizer=_Tokenizer())
    call, answer, final = "<calc>6*7</calc>", "<result>42</result>\n", "#### 42"
    assert _Tokenizer().decode(episode.ids) == call + answer + final
    assert episode.env_mask == [1] * len(call) + [0] * len(answer) + [1] * (len(final) + 1)
    assert (episode.turns, episode.tool_calls, episode.tool_errors, episode.truncated) == (2, 1, 0, False)
    assert other.ids == episode.ids
    # Each turn is one engine call for the episodes still going, with the tool's stop string.
    assert [c[0] for c in engine.calls] == [2, 2] and all("</calc>" in c[2] for c in engine.calls)
    assert engine.sampling.stop == () and engine.sampling.max_new == 64  # restored


def test_an_episode_stops_at_its_token_budget_and_its_turn_limit():
    engine = _Scripted()
    prompt = {"prompt": "q", "prompt_ids": [ord("q")], "record": 0}
    [[cut]] = run_episodes(engine, _POLICY, Calculator(), [prompt], [[1]], max_turns=4, budget=20,
                           tokenizer=_Tokenizer())
    assert len(cut.ids) == 20 and cut.truncated and cut.env_mask[16:] == [0] * 4  # the tool's answer cut short
    [[one]] = run_episodes(engine, _POLICY, Calculator(), [prompt], [[1]], max_turns=1, budget=64,
                           tokenizer=_Tokenizer())
    assert one.turns == 1 and one.env_mask == [1] * len(one.ids) and not one.truncated


def test_an_environment_that_raises_is_named():
    class Broken(Environment):
        def step(self, state, text):
            raise KeyError("boom")

    prompt = {"prompt": "q", "prompt_ids": [ord("q")], "record": 0}
    with pytest.raises(EnvironmentFailure, match="Broken.step raised KeyError"):
        run_episodes(_Scripted(), _POLICY, Broken(), [prompt], [[1]], max_turns=2, budget=64, tokenizer=_Tokenizer())


def test_tool_tokens_carry_no_loss_and_no_gradient():
    """The batch :class:`Rollout` lays out for an episode masks the tool's tokens; the loss and its
    gradient equal those of the same batch with the tool's tokens taken out of the labels."""
    from llmtrain.rollout.rollout import Rollout

    objective = GRPO({"loss_type": "dapo", "num_generations": 2})
    rollout = Rollout.__new__(Rollout)
    rollout.pad_id, rollout.objective, rollout.packing = 0, objective, False
    env_mask = [1, 1, 1, 0, 0, 0, 1, 1]
    rows = [({"prompt_ids": [5, 6]}, Completion(list(range(10, 18)), False, env_mask=env_mask), 0.7),
            ({"prompt_ids": [5, 6]}, Completion([20, 21, 22], False), -0.7)]
    batch = rollout._layout(rows)
    tool = torch.zeros_like(batch["labels"], dtype=torch.bool)
    tool[0, 2 + 3:2 + 6] = True
    assert batch["completion_mask"][tool].eq(0).all() and batch["completion_mask"][0, 2:5].eq(1).all()
    torch.manual_seed(0)
    logits = torch.randn(2, batch["input_ids"].shape[1], 40, requires_grad=True)
    loss = objective.loss_sums(logits, batch).loss
    loss.backward()
    # Position t predicts label t + 1 (the labels are shifted inside): a tool token's logits row is t - 1.
    predicting_tool = torch.roll(tool, -1, dims=1)
    assert logits.grad[predicting_tool].abs().max() == 0
    assert logits.grad[0, 1:4].abs().sum() > 0  # the model's own tokens do get a gradient
    # The same as the tool tokens not being targets at all.
    reference = dict(batch, labels=batch["labels"].masked_fill(tool, -100))
    assert float(objective.loss_sums(logits.detach(), reference).loss) == pytest.approx(float(loss.detach()), abs=1e-7)
    assert float(objective.normaliser(batch)) == 3 + 2 + 3  # dapo: the model's tokens only


# ---- the sampling-policy correction -------------------------------------------------------------
@pytest.mark.parametrize("mode", ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"])
def test_importance_weights_follow_trls_modes(mode):
    """TRL 1.16's ``vllm_importance_sampling_mode`` written out: ratio exp(old - behaviour) per
    token or of the masked sum per sequence, clipped to [min, max] or zeroed outside."""
    objective = GRPO({"sampling_correction": mode, "sampling_correction_max": 2.0, "sampling_correction_min": 0.5})
    old = torch.tensor([[0.0, -1.0, -2.0, -0.5], [-1.0, -1.0, 0.0, 0.0]])
    behaviour = torch.tensor([[-1.5, -1.0, -1.0, 0.0], [-2.2, -1.9, 5.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0]])
    segment = torch.tensor([[0, 0, 0, -1], [1, 1, -1, -1]])
    weight, ratio, corrected = objective.importance_weights(old, behaviour, mask, segment)
    if mode.startswith("token"):
        expected_ratio = torch.exp((old - behaviour) * mask)
    else:  # each completion's ratio on its tokens, 1 off them
        expected_ratio = torch.exp(((old - behaviour) * mask).sum(-1, keepdim=True) * (segment >= 0))
    outside = (expected_ratio > 2.0) | (expected_ratio < 0.5)
    expected = expected_ratio.clamp(0.5, 2.0) if mode.endswith("truncate") else expected_ratio * ~outside
    assert torch.allclose(ratio, expected_ratio) and torch.allclose(weight, expected)
    assert torch.equal(corrected, outside.float()) and bool(outside.any())


def test_the_correction_is_on_for_async_and_vllm_only_and_none_turns_it_off():
    def rollout(**fields):
        return SimpleNamespace(**{"async_generation": False, "max_staleness": 1, "engine": "hf", **fields})

    assert not GRPO.samples_off_policy(rollout())
    assert not GRPO.samples_off_policy(rollout(async_generation=True, max_staleness=0))
    assert GRPO.samples_off_policy(rollout(async_generation=True)) and GRPO.samples_off_policy(rollout(engine="vllm"))
    on, off = GRPO({}), GRPO({"sampling_correction": "none"})
    on.correct_sampling(True)
    off.correct_sampling(True)
    assert on.behaviour and "importance_ratio/mean" in on.metric_names and on.metric_names[-2:] == (
        "_tokens", "_sequences")
    assert not off.behaviour and "importance_ratio/mean" not in off.metric_names


def test_a_sampled_ahead_batch_round_trips_through_its_checkpoint_tensors():
    from llmtrain.rollout.rollout import Sampled, _flatten_sampled, _unflatten_sampled

    micro = [[{"prompt": [{"role": "user", "content": "hi"}], "prompt_ids": [1, 2], "record": 3, "answer": "#### 4"}]]
    groups = [[Completion([5, 6, 7], False, [-0.5, -1.0, -2.0], env_mask=[1, 0, 1], turns=2, tool_calls=1,
                          tool_errors=1, env_reward=0.5),
               Completion([], True, None)]]
    back = _unflatten_sampled(_flatten_sampled(Sampled(4, 3, micro, groups), "s4."), "s4.", 4)
    assert (back.generation, back.sampled_at, back.micro_batches) == (4, 3, micro)
    assert back.groups == groups  # env_reward None stays None (NaN in the tensor), env_mask None stays None
    assert back.groups[0][1].env_reward is None and back.groups[0][1].env_mask is None


# ---- packed completions -------------------------------------------------------------------------
def _tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    return LlamaForCausalLM(config).float()


@pytest.mark.parametrize("fields", [
    {"loss_type": "dapo"}, {"loss_type": "grpo", "importance_sampling_level": "sequence"},
    {"loss_type": "dr_grpo", "beta": 0.04}, {"loss_type": "bnpo", "num_iterations": 2}])
def test_packed_completions_equal_the_padded_layout(fields):
    """The same 6 completions (mixed lengths, one truncated, one empty, one with tool tokens)
    laid out one per row and packed into rows of 48 tokens: through a tiny Llama (the engines'
    forward: ``position_ids`` for packed rows, so each sequence attends to itself only), the
    loss and every parameter's gradient are the same within 1e-5, and every completion token's
    log-prob is."""
    from llmtrain.engine.base import model_inputs
    from llmtrain.rollout.rollout import Rollout

    generator = torch.Generator().manual_seed(1)
    objective = GRPO({**fields, "num_generations": 2})
    objective.correct_sampling(True)
    rows = []
    for k, n in enumerate([12, 3, 20, 0, 7, 15]):
        prompt = {"prompt_ids": torch.randint(1, 64, (4 + k % 3,), generator=generator).tolist()}
        ids = torch.randint(1, 64, (n,), generator=generator).tolist()
        env_mask = [1, 1, 0, 0, 1, 1, 1] if n == 7 else None
        logps = (-torch.rand(n, generator=generator)).tolist()
        rows.append((prompt, Completion(ids, truncated=n == 20, logps=logps, env_mask=env_mask), 0.5 - 0.3 * k))
    layouts = {}
    for packing in (False, True):
        rollout = Rollout.__new__(Rollout)
        rollout.pad_id, rollout.objective, rollout.packing = 0, objective, packing
        rollout.cfg = SimpleNamespace(data=SimpleNamespace(seq_len=48))
        batch = objective.prepare(rollout._layout(rows))
        batch["old_logps"] = batch["behaviour_logps"] + 0.05  # μ = 2: a π_old apart from the current policy
        batch["ref_logps"] = batch["behaviour_logps"] - 0.1
        layouts[packing] = batch
    padded, packed = layouts[False], layouts[True]
    assert packed["input_ids"].shape[0] < padded["input_ids"].shape[0]  # fewer rows ...
    assert packed["input_ids"].numel() < padded["input_ids"].numel()  # ... and fewer tokens
    results = {}
    for packing, batch in layouts.items():
        rollout.packing = packing
        model = _tiny_llama()
        logits = model(**model_inputs(batch)).logits
        sums = objective.loss_sums(logits, batch)
        (sums.loss / objective.normaliser(batch)).backward()
        sums.loss = sums.loss.detach()
        per_token = objective.token_logps(logits.detach(), batch["labels"])
        tokens = torch.cat(rollout._completion_logps(dict(batch, old_logps=per_token), [(s, c) for s, c, _ in rows]))
        results[packing] = (float(sums.loss), {n: p.grad for n, p in model.named_parameters()}, tokens,
                            {k: float(v) for k, v in sums.metrics.items()}, float(objective.normaliser(batch)))
    (loss_a, grads_a, tokens_a, metrics_a, norm_a), (loss_b, grads_b, tokens_b, metrics_b, norm_b) = results.values()
    assert norm_a == norm_b
    assert loss_b == pytest.approx(loss_a, abs=1e-5)
    assert torch.allclose(tokens_a, tokens_b, atol=1e-5)
    for name in grads_a:
        assert torch.allclose(grads_a[name], grads_b[name], atol=1e-5), name
    for name in metrics_a:
        assert metrics_b[name] == pytest.approx(metrics_a[name], abs=1e-5, rel=1e-6), name  # sums of ~200
