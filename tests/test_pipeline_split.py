"""Pipeline split and tensor-parallel plans, in one process (no process group needed)."""

from __future__ import annotations

import pytest
import torch

from conftest import make_cfg
from llmtrain.common.errors import ConfigError
from llmtrain.models.build import build_model
from llmtrain.parallel.parallelize import tp_plan
from llmtrain.parallel.pipeline import split_stages, stage_layer_ids


def test_layers_are_split_contiguously_and_balanced():
    assert stage_layer_ids(4, 2) == [[0, 1], [2, 3]]
    assert stage_layer_ids(5, 2) == [[0, 1, 2], [3, 4]]
    assert stage_layer_ids(30, 4) == [list(range(0, 8)), list(range(8, 16)), list(range(16, 23)), list(range(23, 30))]


@pytest.mark.parametrize("model_name,stages_per_rank", [("tiny_llama", 1), ("tiny_llama", 2), ("tiny_qwen2", 2)])
@torch.no_grad()
def test_stages_chained_equal_the_whole_model_and_keep_its_names(model_name, stages_per_rank):
    model = build_model(make_cfg([f"model={model_name}"]).model, seed=3).eval()
    pp = 2
    stages = dict(s for rank in range(pp) for s in split_stages(model, pp, rank, stages_per_rank))
    assert sorted(stages) == list(range(pp * stages_per_rank))
    ids = torch.randint(0, 256, (2, 12))
    h = ids
    for s in sorted(stages):
        h = stages[s](h)
    torch.testing.assert_close(h, model(input_ids=ids).logits, rtol=0, atol=1e-5)
    # Every parameter name of the full model appears on exactly one stage, except a tied
    # embedding, which the last stage holds under the embedding's own name.
    names = [n for s in stages.values() for n, _ in s.named_parameters()]
    tied = model.config.tie_word_embeddings
    expected = sorted(n for n, _ in model.named_parameters()) + (["model.embed_tokens.weight"] if tied else [])
    assert sorted(names) == sorted(expected)
    last = stages[max(stages)]
    assert hasattr(last.model, "embed_tokens") == tied
    if tied:
        assert last.lm_head.weight is last.model.embed_tokens.weight


def test_tp_plan_comes_from_the_model_and_keeps_ties_replicated():
    llama = build_model(make_cfg([]).model, seed=0)
    plan = tp_plan(llama)
    assert plan["model.layers.*.self_attn.q_proj"] == "colwise" and plan["model.layers.*.mlp.down_proj"] == "rowwise"
    assert "lm_head" not in plan and "model.embed_tokens" not in plan  # tied: both stay replicated
    qwen = build_model(make_cfg(["model=tiny_qwen2"]).model, seed=0)
    assert tp_plan(qwen)["lm_head"] == "colwise_gather_output"
    with pytest.raises(ConfigError, match=r"paths \['layers\.\*\.mlp\.up_proj'\] match no module"):
        tp_plan(llama, {"layers.*.mlp.up_proj": "colwise"})
