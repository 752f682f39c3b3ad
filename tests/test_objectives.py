"""The objective seam against independent references: the next-token objective equals the loss
``transformers`` computes itself, the token-weighted test objective equals its equation written
out token by token, and objectives are chosen by config."""

from __future__ import annotations

import math

import pytest
import torch

from conftest import make_cfg
from llmtrain.common.errors import ConfigError
from llmtrain.models.build import build_model
from llmtrain.objectives import CausalLM, Objective, build_objective
from token_weighted import TokenWeighted


def _batch(seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 256, (3, 12), generator=gen)
    labels = ids.clone()
    labels[0, :5] = -100  # a masked prompt
    labels[2, 9:] = -100  # padding
    return {"input_ids": ids, "labels": labels, "attention_mask": torch.ones_like(ids)}


def test_causal_lm_mean_equals_the_transformers_model_loss():
    model = build_model(make_cfg([]).model, 0)
    batch = _batch()
    out = model(input_ids=batch["input_ids"], labels=batch["labels"])  # HF's own shifted mean CE
    objective = CausalLM()
    mean = objective.loss_sums(out.logits, batch).loss / objective.normaliser(batch)
    torch.testing.assert_close(mean, out.loss, rtol=1e-6, atol=1e-6)


def test_token_weighted_equals_its_equation_token_by_token():
    gen = torch.Generator().manual_seed(1)
    batch = TokenWeighted().prepare(_batch())
    logits = torch.randn(3, 12, 50, generator=gen)
    batch["input_ids"] %= 50
    batch["labels"] = torch.where(batch["labels"] == -100, batch["labels"], batch["labels"] % 50)
    batch["token_weights"] = 1.0 + (batch["input_ids"] % 3).float()
    total = weights = correct = 0.0
    for b in range(3):
        for t in range(11):
            label = int(batch["labels"][b, t + 1])
            if label == -100:
                continue
            w = float(batch["token_weights"][b, t + 1])
            row = logits[b, t].double()
            total += w * (math.log(row.exp().sum()) - float(row[label]))
            weights += w
            correct += w * float(int(row.argmax()) == label)
    objective = TokenWeighted()
    sums = objective.loss_sums(logits, batch)
    assert float(objective.normaliser(batch)) == pytest.approx(weights)
    assert float(sums.loss) == pytest.approx(total, rel=1e-6)
    assert float(sums.metrics["accuracy"]) == pytest.approx(correct)
    assert objective.stacked(sums).tolist() == pytest.approx([total, correct], rel=1e-6)


def test_objective_chosen_by_config():
    assert isinstance(build_objective(make_cfg([]).objective), CausalLM)
    weighted = build_objective(make_cfg(["objective.target=token_weighted:TokenWeighted",
                                         "objective.name=token_weighted"]).objective)
    assert isinstance(weighted, TokenWeighted) and weighted.name == "token_weighted"
    with pytest.raises(ConfigError, match="objective.name='no_such' is not a built-in objective"):
        build_objective(make_cfg(["objective.name=no_such"]).objective)
    with pytest.raises(ConfigError, match="objective.target='no_such_module:X' cannot be imported"):
        build_objective(make_cfg(["objective.target=no_such_module:X"]).objective)
    with pytest.raises(ConfigError, match="is not a subclass of llmtrain.objectives.Objective"):
        build_objective(make_cfg(["objective.target=math:sqrt"]).objective)


def test_an_objective_needing_hidden_states_is_refused_by_name():
    class Hidden(CausalLM):
        model_output = "hidden"

    from llmtrain.parallel.distributed import DistEnv
    from llmtrain.engine.torch_engine import TorchEngine

    env = DistEnv(0, 1, 0, torch.device("cpu"), "gloo")
    with pytest.raises(ConfigError, match="needs model_output='hidden', which the TorchEngine engine does not provide"):
        TorchEngine(make_cfg([]), env, 1, objective=Hidden())
    assert issubclass(Hidden, Objective)


def test_user_objectives_that_cannot_work_are_refused_by_name():
    import types

    module = types.ModuleType("bad_objectives")

    class Abstract(Objective):  # loss_sums and normaliser left out
        pass

    class Clash(TokenWeighted):
        metric_names = ("loss",)

    module.Abstract, module.Clash = Abstract, Clash
    import sys

    sys.modules["bad_objectives"] = module
    try:
        with pytest.raises(ConfigError, match="cannot be built as Abstract"):
            build_objective(make_cfg(["objective.target=bad_objectives:Abstract"]).objective)
        with pytest.raises(ConfigError, match=r"names metrics \['loss'\], which the trainer logs itself"):
            build_objective(make_cfg(["objective.target=bad_objectives:Clash"]).objective)
    finally:
        del sys.modules["bad_objectives"]
    from llmtrain.objectives import LossSums

    with pytest.raises(KeyError, match="declares metric_names \\['accuracy'\\] but its loss_sums returned no accuracy"):
        TokenWeighted().stacked(LossSums(torch.tensor(1.0)))
