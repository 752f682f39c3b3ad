"""The optimizers ``trainer.optimizer`` names, built over one model (or pipeline stage):

- ``adamw``: ``torch.optim.AdamW`` (Loshchilov & Hutter, ICLR 2019), decay on matrices and
  embeddings only (:func:`llmtrain.engine.base.param_groups`). State: two fp32 moments, 8 bytes
  per trainable parameter.
- ``adamw_8bit``: torchao's ``AdamW8bit`` (Dettmers et al., "8-bit Optimizers via Block-wise
  Quantization", ICLR 2022): both moments stored as 8-bit codes with an fp32 scale per block of
  256 elements (tensors under 4096 elements keep fp32 moments), ~2 bytes per parameter. The
  quantization is blockwise over each rank's local shard; FSDP2 shards on row boundaries, so a
  block of a shard is a block of the whole tensor wherever the shard's size is a multiple of 256.
- ``adafactor``: ``torch.optim.Adafactor`` (Shazeer & Stern, ICML 2018): the second moment of a
  ``[rows, cols]`` matrix is kept as a row and a column vector (factored), no first moment, so
  its state is ``rows + cols`` floats per matrix, a full vector for 1-D tensors.
- ``muon``: :class:`MuonWithAdamW`: ``torch.optim.Muon`` (Jordan et al. 2024; Liu et al.,
  "Muon is Scalable for LLM Training", 2025) on the hidden 2-D matrices, AdamW on everything
  else (embeddings, the output head, norms, biases, 3-D expert stacks), as Moonlight's recipe.
  State: one momentum buffer (4 bytes per Muon parameter) plus AdamW's 8 on the rest.

Everything is one ``torch.optim.Optimizer`` per model part, so the checkpoint (DCP's
``get_optimizer_state_dict``, keyed by parameter name) and the LR schedule treat every choice
alike; the resume check refuses a checkpoint of another optimizer by name (``trainer.optimizer``
is not among the settings a resumed run may change).
"""

from __future__ import annotations

from typing import Any

import torch

from llmtrain.config.schema import OPTIMIZERS
from llmtrain.engine.base import build_adamw, param_groups


def build_optimizer(model: torch.nn.Module, trainer_cfg: Any, *, foreach: bool | None = None,
                    model_cfg: Any = None) -> torch.optim.Optimizer:
    """The ``trainer.optimizer`` of ``trainer_cfg`` over ``model``'s trainable parameters, with
    the trainer's learning rate and weight decay (the LR schedule scales every group alike).
    ``model_cfg``: the ``model`` node, whose ``lr_multipliers`` (part -> multiplier of the learning
    rate, :mod:`llmtrain.models.parts`) give parts groups of their own; validation refuses them
    with Muon.

    Raises:
        ConfigError: an unknown ``trainer.optimizer``, or a multiplier for a part the model lacks.
    """
    t = trainer_cfg
    name = t.get("optimizer", "adamw")

    def groups() -> list[dict]:
        return param_groups(model, t.weight_decay, group_scales(model, model_cfg), t.lr)
    if name == "adamw":
        return build_adamw(groups(), t, foreach=foreach)
    if name == "adamw_8bit":
        import warnings

        from torchao.optim import AdamW8bit

        # torch.compile (which torchao's step uses) notes once that the state subclass has no
        # cache hash: it only means the compiled step is not cached across processes.
        warnings.filterwarnings("ignore", message="OptimState8bit does not implement _stable_hash_for_caching")
        return AdamW8bit(groups(), lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps)
    if name == "adafactor":  # whole tensors only: validation refuses FSDP2 and TP layouts
        a = t.adafactor
        return torch.optim.Adafactor(groups(), lr=t.lr, beta2_decay=a.beta2_decay,
                                     eps=(a.eps1, a.eps2), foreach=foreach)
    if name == "muon":
        matrices, rest = muon_split(model)
        m = t.muon
        adamw = [group for group in ({"params": [p for p in rest if p.ndim >= 2], "weight_decay": t.weight_decay},
                                     {"params": [p for p in rest if p.ndim < 2], "weight_decay": 0.0}) if group["params"]]
        return MuonWithAdamW(
            [{"params": matrices}] if matrices else [], adamw,
            muon_options={"lr": m.lr if m.lr is not None else t.lr, "weight_decay": t.weight_decay,
                          "momentum": m.momentum, "nesterov": m.nesterov, "ns_steps": m.ns_steps,
                          "adjust_lr_fn": m.adjust_lr},
            adamw_options={"lr": t.lr, "betas": (t.beta1, t.beta2), "eps": t.eps, "foreach": foreach})
    from llmtrain.common.errors import ConfigError

    raise ConfigError(f"trainer.optimizer={name!r} is not one of {', '.join(OPTIMIZERS)}")


def group_scales(model: torch.nn.Module, model_cfg: Any) -> dict[int, float]:
    """``id(parameter) -> multiplier`` of ``model.lr_multipliers`` (of ``model_cfg``) over
    ``model``'s parts; {} without multipliers (or without ``model_cfg``)."""
    from llmtrain.models.parts import multipliers, rates_of

    rates = rates_of(model_cfg) if model_cfg is not None else {}
    if not rates:
        return {}
    from llmtrain.models.build import canonical_name

    return multipliers(model, rates, canonical_name)


def muon_split(model: torch.nn.Module) -> tuple[list[torch.nn.Parameter], list[torch.nn.Parameter]]:
    """The trainable parameters Muon updates (2-D weights of hidden layers) and the rest (for
    AdamW): token embeddings and the output head are matrices too but are lookups / a classifier,
    not hidden transforms, so they stay with AdamW (Jordan et al. 2024; Liu et al. 2025, §2)."""
    lookups = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is not None:
        lookups.add(id(head.weight))
    matrices, rest = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        hidden = p.ndim == 2 and id(p) not in lookups and not name.endswith("lm_head.weight")
        (matrices if hidden else rest).append(p)
    return matrices, rest


class MuonWithAdamW(torch.optim.Optimizer):
    """Muon on ``muon_groups``, AdamW on ``adamw_groups``, as one optimizer.

    Muon's update of a ``[rows, cols]`` matrix is exactly ``torch.optim.Muon``'s (its
    Newton-Schulz iteration in bf16, ``torch.optim._muon``): momentum ``B ← μB + (1-μ)g``,
    Nesterov ``u = g + μ(B - g)``, ``O = NS₅(u)``, ``θ ← θ(1 - ηλ) - η'O``
    with ``η'`` from ``adjust_lr_fn``. The iteration needs the *whole* matrix: a parameter
    sharded as a DTensor (FSDP2, HSDP, TP) has its momentum-corrected update all-gathered
    (one ``rows × cols`` fp32 gather per matrix per step, the size of the forward's parameter
    gather), orthogonalised identically on every rank, and each rank keeps its own shard
    (``distribute_tensor(src_data_rank=None)``: no second collective). That repeats the
    iteration on every rank (compute × world size for the NS flops, small beside the step's);
    the momentum buffer stays sharded like its parameter. The AdamW half is
    ``torch.optim.AdamW`` stepping the same group dicts and the same state.

    Each Muon parameter's state also counts ``step`` (as AdamW's does), so the number of
    updates taken is readable from any parameter.
    """

    def __init__(self, muon_groups: list[dict], adamw_groups: list[dict], *, muon_options: dict, adamw_options: dict):
        muon_defaults = dict(torch.optim.Muon([torch.nn.Parameter(torch.zeros(1, 1))]).defaults)
        muon_defaults.update({k: v for k, v in muon_options.items() if v is not None})
        groups = [{**muon_defaults, **group, "use_muon": True} for group in muon_groups]
        adamw_keys = {k: v for k, v in adamw_options.items() if k != "foreach"}
        self._adamw = None
        if adamw_groups:
            self._adamw = torch.optim.AdamW(adamw_groups, **adamw_keys, foreach=adamw_options.get("foreach"))
            for group in self._adamw.param_groups:
                group["use_muon"] = False
            groups += self._adamw.param_groups
        for group in groups:
            for p in group["params"]:
                if group["use_muon"] and p.ndim != 2:
                    raise ValueError(f"Muon updates 2-D matrices; got a parameter of shape {tuple(p.shape)}")
        super().__init__(groups, {})

    @torch.no_grad()
    def step(self, closure=None):
        """One update of every parameter that has a gradient (``closure`` as ``torch.optim``)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        adamw_groups = [group for group in self.param_groups if not group["use_muon"]]
        for group in self.param_groups:
            if group["use_muon"]:
                self._muon_group(group)
        if self._adamw is not None and adamw_groups:
            # load_state_dict replaces the group dicts and the state: point AdamW at the current ones.
            self._adamw.param_groups, self._adamw.state = adamw_groups, self.state
            self._adamw.step()
        return loss

    def _muon_group(self, group: dict) -> None:
        from torch.distributed.tensor import DTensor, distribute_tensor
        from torch.optim._muon import _adjust_lr, _zeropower_via_newtonschulz

        lr, momentum = group["lr"], group["momentum"]
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p.grad, memory_format=torch.preserve_format)
                state["step"] = torch.tensor(0.0)
            state["step"] += 1
            buf = state["momentum_buffer"]
            buf.lerp_(p.grad, 1 - momentum)
            update = p.grad.lerp(buf, momentum) if group["nesterov"] else buf
            sharded = isinstance(update, DTensor)
            whole = update.full_tensor() if sharded else update
            ortho = _zeropower_via_newtonschulz(whole, group["ns_coefficients"], group["ns_steps"], group["eps"])
            if sharded:
                ortho = distribute_tensor(ortho, update.device_mesh, update.placements, src_data_rank=None)
            p.mul_(1 - lr * group["weight_decay"])
            p.add_(ortho, alpha=-_adjust_lr(lr, group["adjust_lr_fn"], p.shape))
