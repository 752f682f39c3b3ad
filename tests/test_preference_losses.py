"""The preference losses against their papers' equations (scalar math, one pair at a time) and,
where TRL exposes the loss as a function, against TRL's own code (CPO's SimPO, ORPO)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from llmtrain.objectives.preference_losses import (dpo_losses, kto_losses, orpo_losses, reward_losses,
                                                   simpo_losses)

torch.manual_seed(0)
PAIRS = 6
CHOSEN, REJECTED = -torch.rand(PAIRS, dtype=torch.float64) * 40, -torch.rand(PAIRS, dtype=torch.float64) * 40
REF_CHOSEN, REF_REJECTED = CHOSEN + torch.randn(PAIRS, dtype=torch.float64), REJECTED + torch.randn(PAIRS, dtype=torch.float64)
TOKENS_C, TOKENS_R = torch.randint(1, 30, (PAIRS,)).double(), torch.randint(1, 30, (PAIRS,)).double()


def log_sigmoid(x: float) -> float:
    return -math.log1p(math.exp(-x)) if x >= 0 else x - math.log1p(math.exp(x))


@pytest.mark.parametrize("loss_type,eps", [("sigmoid", 0.0), ("sigmoid", 0.1), ("hinge", 0.0), ("ipo", 0.0),
                                           ("robust", 0.2)])
def test_dpo_family_follows_the_papers_equations(loss_type, eps):
    beta = 0.3
    got = dpo_losses(CHOSEN, REJECTED, REF_CHOSEN, REF_REJECTED, beta, loss_type, eps, TOKENS_C, TOKENS_R)
    for i in range(PAIRS):
        lc, lr = float(CHOSEN[i] - REF_CHOSEN[i]), float(REJECTED[i] - REF_REJECTED[i])
        d = lc - lr
        expected = {"sigmoid": -(1 - eps) * log_sigmoid(beta * d) - eps * log_sigmoid(-beta * d),  # DPO eq. 7, cDPO
                    "hinge": max(0.0, 1 - beta * d),
                    "ipo": (lc / float(TOKENS_C[i]) - lr / float(TOKENS_R[i]) - 1 / (2 * beta)) ** 2,  # IPO eq. 17
                    "robust": (-(1 - eps) * log_sigmoid(beta * d) + eps * log_sigmoid(-beta * d)) / (1 - 2 * eps),
                    }[loss_type]
        assert float(got.losses[i]) == pytest.approx(expected, rel=1e-12, abs=1e-12)
        assert (float(got.chosen_rewards[i]), float(got.rejected_rewards[i])) == pytest.approx((beta * lc, beta * lr))


def test_dpo_refuses_what_it_cannot_compute():
    with pytest.raises(ValueError, match="chosen_tokens"):
        dpo_losses(CHOSEN, REJECTED, REF_CHOSEN, REF_REJECTED, loss_type="ipo")
    with pytest.raises(ValueError, match="label_smoothing < 0.5"):
        dpo_losses(CHOSEN, REJECTED, REF_CHOSEN, REF_REJECTED, loss_type="robust", label_smoothing=0.5)
    with pytest.raises(ValueError, match="not one of sigmoid, hinge, ipo, robust"):
        dpo_losses(CHOSEN, REJECTED, REF_CHOSEN, REF_REJECTED, loss_type="exo")


def test_simpo_and_orpo_equal_trls_own_loss_functions():
    trl_cpo = pytest.importorskip("trl.experimental.cpo.cpo_trainer")
    trl_orpo = pytest.importorskip("trl.experimental.orpo.orpo_trainer")
    avg_c, avg_r = CHOSEN / TOKENS_C, REJECTED / TOKENS_R  # TRL's CPO (simpo) and ORPO take mean log-probs
    device = SimpleNamespace(device=torch.device("cpu"))
    for eps in (0.0, 0.1):
        cpo = SimpleNamespace(alpha=0.0, loss_type="simpo", beta=2.5, simpo_gamma=1.2, label_smoothing=eps,
                              accelerator=device)
        losses, chosen, rejected = trl_cpo.CPOTrainer.cpo_loss(cpo, avg_c, avg_r)
        got = simpo_losses(CHOSEN, REJECTED, TOKENS_C, TOKENS_R, beta=2.5, gamma=1.2, label_smoothing=eps)
        torch.testing.assert_close(got.losses, losses, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close((got.chosen_rewards, got.rejected_rewards), (chosen, rejected))
    orpo = SimpleNamespace(beta=0.1, accelerator=device)
    # TRL works in float32 here; its losses are beta * log sigma(log odds), minimised as their negative.
    losses, chosen, rejected, _, log_odds = trl_orpo.ORPOTrainer.odds_ratio_loss(orpo, avg_c, avg_r)
    got, got_log_odds = orpo_losses(CHOSEN, REJECTED, TOKENS_C, TOKENS_R, beta=0.1)
    torch.testing.assert_close(got.losses.float(), -losses, rtol=1e-5, atol=1e-6)
    assert float(got_log_odds.mean()) == pytest.approx(float(log_odds), rel=1e-5)
    torch.testing.assert_close((got.chosen_rewards.float(), got.rejected_rewards.float()), (chosen, rejected))


def test_kto_follows_eq_8_with_a_clamped_detached_reference_point():
    desirable = torch.tensor([True, False, True, False, False, True])
    kl = torch.tensor(0.7, dtype=torch.float64)
    got = kto_losses(CHOSEN, REF_CHOSEN, desirable, kl, beta=0.2, desirable_weight=1.5, undesirable_weight=0.8)
    for i in range(PAIRS):
        r = float(CHOSEN[i] - REF_CHOSEN[i])
        sigma = 1 / (1 + math.exp(-0.2 * ((r - 0.7) if desirable[i] else (0.7 - r))))
        assert float(got.losses[i]) == pytest.approx((1.5 if desirable[i] else 0.8) * (1 - sigma), rel=1e-12)
        shown = got.chosen_rewards[i] if desirable[i] else got.rejected_rewards[i]
        hidden = got.rejected_rewards[i] if desirable[i] else got.chosen_rewards[i]
        assert float(shown) == pytest.approx(0.2 * r) and math.isnan(float(hidden))
    negative = kto_losses(CHOSEN, REF_CHOSEN, desirable, torch.tensor(-3.0, dtype=torch.float64), beta=0.2)
    at_zero = kto_losses(CHOSEN, REF_CHOSEN, desirable, torch.tensor(0.0, dtype=torch.float64), beta=0.2)
    torch.testing.assert_close(negative.losses, at_zero.losses)  # z0 = max(KL, 0)


def test_reward_loss_is_bradley_terry_with_margin_and_centering():
    scores_c, scores_r = torch.randn(PAIRS, dtype=torch.float64), torch.randn(PAIRS, dtype=torch.float64)
    margin = torch.rand(PAIRS, dtype=torch.float64)
    got = reward_losses(scores_c, scores_r, margin, center_rewards_coefficient=0.01)
    for i in range(PAIRS):
        c, r, m = float(scores_c[i]), float(scores_r[i]), float(margin[i])
        assert float(got.losses[i]) == pytest.approx(-log_sigmoid(c - r - m) + 0.01 * (c + r) ** 2, rel=1e-12)
    # TRL's RewardTrainer: the mean of the same terms over the batch.
    trl_mean = (-torch.nn.functional.logsigmoid(scores_c - scores_r - margin).mean()
                + 0.01 * torch.mean((scores_c + scores_r) ** 2))
    assert float(got.losses.mean()) == pytest.approx(float(trl_mean), rel=1e-12)
