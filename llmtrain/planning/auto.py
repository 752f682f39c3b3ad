"""``+recipe=auto``: the first recipe, in :data:`PREFERENCE` order (cheapest communication first),
whose plan (:mod:`llmtrain.planning.memory`) fits the device memory less a margin, with the
largest micro-batch that fits and activation checkpointing only where nothing fits without it;
context and expert parallel degrees tried where the model and the world size allow them. Every
rank decides alone from its own device memory; :func:`check_same_layout` refuses ranks that chose
differently."""

from __future__ import annotations

import copy
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from llmtrain.parallel import distributed
from llmtrain.common.errors import ConfigError
from llmtrain.config.validate import parse_bytes
from llmtrain.planning.memory import RankPlan, fmt_bytes, plan_recipe

DEFAULT_MARGIN = 0.1  # of device memory, for the allocator's fragmentation and the CUDA context
# Preference of +recipe=auto, cheapest communication first (per step, Ψ = parameter bytes moved):
# DDP 2Ψ all-reduce; ZeRO-1/2 the same 2Ψ as reduce-scatter + all-gather (optimizer state / also
# gradients sharded); FSDP2 and ZeRO-3 3Ψ (parameters gathered in forward and again in
# backward); tensor parallel adds two activation all-reduces per layer and wants one node;
# pipelines add a bubble of (pp-1)/(micro-batches+pp-1) of the step; offload is bound by the
# host link. Within a recipe a larger micro-batch is preferred, then no activation checkpointing
# (it recomputes the forward, ~33% more compute).
PREFERENCE = ("ddp", "zero1", "zero2", "fsdp", "zero3", "hsdp", "fsdp_tp", "tp", "pp_fsdp", "pp", "3d",
              "zero3_offload")


# --- every recipe, and the choice of +recipe=auto ---------------------------------------------


def recipe_names() -> list[str]:
    """The shipped recipes (``recipes/*.yaml``) other than ``auto``."""
    from llmtrain.common.paths import RECIPES_DIR

    return sorted(p.stem for p in Path(RECIPES_DIR).glob("*.yaml") if p.stem != "auto")


def with_recipe(cfg: Any, name: str, cp: int = 1, cp_style: str = "ulysses", ep: int = 1, **trainer: Any) -> Any:
    """A copy of ``cfg`` with ``recipes/<name>.yaml`` as its recipe (on the recipe's own engine),
    ``recipe.cp`` = ``cp`` with ``cp_style``, ``recipe.ep`` = ``ep``, and ``trainer`` fields
    replaced. ``name`` may carry the ep degree as ``fsdp@ep4`` (+recipe=auto's candidates)."""
    if "@ep" in name:
        name, degree = name.split("@ep")
        ep = int(degree)
    from omegaconf import OmegaConf

    from llmtrain.config.compose import load_recipe

    new = copy.deepcopy(cfg)
    OmegaConf.set_readonly(new, False)
    new.engine = None
    new.recipe = load_recipe(name)
    if cp > 1:
        new.recipe.cp, new.recipe.cp_style = cp, cp_style
    if ep > 1:
        new.recipe.ep = ep
    for key, value in trainer.items():
        new.trainer[key] = value
    return new


def fitting_global_batch(cfg: Any, world_size: int) -> int:
    """The smallest global batch at or above ``trainer.global_batch_size`` that ``cfg``'s recipe
    divides on ``world_size`` ranks: a whole number of micro-batches per data-parallel rank (and,
    with pipeline stages, at least ``pp`` of them, in rounds of ``pp``). The planner plans with it
    where the user did not set the global batch, rather than refusing the default.

    Raises:
        ConfigError: the recipe's degrees do not fit ``world_size`` (named by the layout).
    """
    import math

    from llmtrain.config.layout import recipe_degrees

    dp_replicate, dp_shard, _, pp = recipe_degrees(cfg.recipe, world_size)
    per_pass = cfg.trainer.micro_batch_size * dp_replicate * dp_shard
    steps = max(1, math.ceil(cfg.trainer.global_batch_size / per_pass))
    if pp > 1:
        steps = pp * math.ceil(max(steps, pp) / pp)
    return steps * per_pass


def with_fitting_batch(cfg: Any, world_size: int) -> Any:
    """``cfg`` with :func:`fitting_global_batch` as its global batch (``cfg`` itself when its own
    fits, or when the recipe fits no layout on ``world_size`` ranks: its plan says why)."""
    try:
        fitting = fitting_global_batch(cfg, world_size)
    except ConfigError:
        return cfg
    if fitting == cfg.trainer.global_batch_size:
        return cfg
    from omegaconf import OmegaConf

    new = copy.deepcopy(cfg)
    OmegaConf.set_readonly(new, False)
    new.trainer.global_batch_size = fitting
    return new


def plan_all(cfg: Any, world_size: int, checkpointing: bool | None = None, fit_batch: bool = False) -> list[RankPlan]:
    """One :class:`RankPlan` per shipped recipe on ``world_size`` ranks for ``cfg``'s model,
    data and trainer settings, at the run's ``recipe.cp`` and ``recipe.cp_style``
    (``checkpointing``: override ``trainer.activation_checkpointing``; ``fit_batch``: each recipe
    at its :func:`fitting_global_batch`); for a mixture of experts also each FSDP2 recipe at ep 2,
    4 and 8 where that layout is valid."""
    from llmtrain.models.build import language_config

    cp, style = cfg.recipe.get("cp", 1), cfg.recipe.get("cp_style", "ulysses")
    hf_config = language_config(cfg.model)
    plans = []
    for name in expert_parallel_candidates(recipe_names(), hf_config):
        candidate = with_recipe(cfg, name, cp, style)
        candidate = with_fitting_batch(candidate, world_size) if fit_batch else candidate
        plans.append(plan_recipe(candidate, world_size, hf_config, checkpointing=checkpointing))
    return [p for p in plans if p.ep == 1 or not p.error]  # an MoE model's ep rows where they are valid


@dataclass
class Choice:
    """What ``+recipe=auto`` picked: the plan, and the reasoning in lines."""

    plan: RankPlan
    reasons: list[str]


def choose(cfg: Any, world_size: int, device_memory: int, margin: float = DEFAULT_MARGIN,
           host_memory: int | None = None, shared_host: bool = False) -> Choice:
    """The first layout whose binding rank fits ``device_memory`` × (1 - ``margin``) bytes, in
    this order: recipes that keep everything on the device before offloading ones (host-link
    bound); context parallelism off before on (:func:`cp_degrees`: cp 2, 4, 8 only when nothing
    fits whole rows; it adds two all-to-alls per layer); without activation checkpointing
    before with it (it recomputes the forward, ~1/3 more compute); then recipes in
    :data:`PREFERENCE` order; then, per recipe, the largest micro-batch (a divisor of the global
    batch, from ``trainer.micro_batch_size`` down).
    Offloaded bytes must fit ``host_memory`` per rank (less the margin) when it is given; with
    ``shared_host`` (CPU training) device and host are one memory and their sum must fit.

    Raises:
        ConfigError: nothing fits; the message names the smallest per-rank need, its recipe and
            the number of ranks at which it would fit.
    """
    budget = int(device_memory * (1 - margin))
    host_budget = None if host_memory is None else int(host_memory * (1 - margin))

    def fits(plan: RankPlan) -> bool:
        if shared_host:
            return plan.total + plan.host <= budget
        return plan.total <= budget and (host_budget is None or plan.host <= host_budget)

    reasons = [f"budget per rank: {fmt_bytes(budget)} = device memory {fmt_bytes(device_memory)} x (1 - margin "
               f"{margin:g}); preference (communication per step, then pipeline bubble, then offload): "
               f"{', '.join(PREFERENCE)}"]
    from llmtrain.models.build import language_config

    hf_config = language_config(cfg.model)  # read once for every candidate
    smallest: RankPlan | None = None
    names = expert_parallel_candidates([n for n in PREFERENCE if n in recipe_names()], hf_config)
    micros = [m for m in range(cfg.trainer.micro_batch_size, 0, -1) if cfg.trainer.global_batch_size % m == 0]
    tried: dict[str, list[str]] = {name: [] for name in names}
    invalid: dict[str, str] = {}
    offloading = [n for n in names if n.endswith("_offload")]
    on_device = [n for n in names if n not in offloading]
    for group, cp, ckpt in [(group, cp, ckpt) for group in (on_device, offloading)
                            for cp in cp_degrees(cfg, world_size)
                            for ckpt in ([False, True] if not cfg.trainer.activation_checkpointing else [True])]:
        skip: set[str] = set()  # recipes invalid at this cp (a batch that does not divide dp may at another)
        for name in group:
            candidate = None  # one copy of the config per recipe and cp, for all its micro-batches
            for micro in micros:
                if name in invalid if cp == 1 else name in skip:
                    break
                candidate = candidate or with_recipe(cfg, name, cp, auto_cp_style(hf_config, cp))
                plan = plan_recipe(candidate, world_size, hf_config, micro_batch=micro, checkpointing=ckpt)
                if plan.error:
                    if micro == micros[0]:  # a layout error, not one of this micro-batch
                        if cp == 1:
                            invalid[name] = plan.error.split("; ")[0]
                        skip.add(name)
                    continue
                if smallest is None or plan.total < smallest.total:
                    smallest = plan
                if fits(plan):
                    if problem := _config_problem(cfg, name, world_size, micro, ckpt, cp, plan.cp_style):
                        if cp == 1:
                            invalid[name] = problem  # fits, but another setting of the run rules it out
                        skip.add(name)
                        break
                    reasons += [f"{label(n)}: not valid on {world_size} ranks ({e})" for n, e in invalid.items()]
                    reasons += [f"{label(n)}: does not fit ({t[0]}{' ... ' + t[-1] if len(t) > 1 else ''})"
                                for n, t in tried.items() if t]
                    host = f" and {fmt_bytes(plan.host)} of host memory" if plan.host else ""
                    reasons.append(f"{label(name)}: {fmt_bytes(plan.total)} per rank{host} at micro-batch {micro}"
                                   f"{' with activation checkpointing' if ckpt else ''}"
                                   f"{f' and context parallel cp={cp}' if cp > 1 else ''}: fits; chosen")
                    return Choice(plan, reasons)
                host = f" + host {fmt_bytes(plan.host)}" if plan.host else ""
                tried[name].append(f"micro-batch {micro}{' + checkpointing' if ckpt else ''}"
                                   f"{f' + cp {cp}' if cp > 1 else ''}: "
                                   f"{fmt_bytes(plan.total)}{host}")
    reasons += [f"{label(n)}: not valid on {world_size} ranks ({e})" for n, e in invalid.items()]
    if smallest is None:
        raise ConfigError(f"+recipe=auto: no shipped recipe is valid on world size {world_size} for this model and "
                          f"batch: {'; '.join(reasons[1:])}")
    fits_at = _ranks_to_fit(cfg, smallest.recipe, world_size, fits, hf_config)
    raise ConfigError(
        f"recipe.device_memory={fmt_bytes(device_memory)} fits no recipe on {world_size} ranks: the smallest per-rank "
        f"need is {fmt_bytes(smallest.total)} ({smallest.recipe}, micro-batch {smallest.micro_batch}"
        f"{', activation checkpointing' if smallest.checkpointing else ''}"
        f"{f', context parallel cp={smallest.cp}' if smallest.cp > 1 else ''}) against a budget of {fmt_bytes(budget)}"
        + (f", with {fmt_bytes(smallest.host)} of host memory per rank against {fmt_bytes(host_budget)}"
           if smallest.host and host_budget is not None else "")
        + (f"; {smallest.recipe} would fit on {fits_at[0]} ranks"
           f"{f' with recipe.cp={fits_at[1]}' if fits_at[1] > 1 else ''}: add ranks or use devices with more memory"
           if fits_at else
           f"; more ranks do not help (activations {fmt_bytes(smallest.activations)} and temporaries "
           f"{fmt_bytes(sum(smallest.temporaries.values()))} per rank do not shrink with data parallelism"
           f"{', nor with context parallelism up to cp=8' if cp_degrees(cfg, world_size * 64)[-1] > 1 else ''}): "
           "shorten data.seq_len, or use devices with more memory"))


def label(name: str) -> str:
    """A candidate's name as printed: ``fsdp@ep4`` -> ``fsdp recipe.ep=4``."""
    return name.replace("@ep", " recipe.ep=")


def expert_parallel_candidates(names: list[str], hf_config: Any) -> list[str]:
    """``names`` with, for a mixture-of-experts model, each FSDP2 recipe followed by its
    expert-parallel variants ``NAME@ep2``, ``@ep4``, ``@ep8`` (those dividing the experts): ep
    gathers 1/ep of a layer's experts (less memory) for two all-to-alls per MoE layer, so each
    comes after its recipe without ep."""
    from llmtrain.config.compose import load_recipe
    from llmtrain.models.moe import num_experts_of

    experts = num_experts_of(hf_config)
    if not experts:
        return names
    out = []
    for name in names:
        out.append(name)
        recipe = load_recipe(name)
        if recipe.engine == "torch" and recipe.zero_stage >= 1 and recipe.pp == 1 and not recipe.offload_params:
            out += [f"{name}@ep{ep}" for ep in (2, 4, 8) if experts % ep == 0]
    return out


def cp_degrees(cfg: Any, world_size: int) -> list[int]:
    """Context-parallel degrees ``+recipe=auto`` may try: 1, then 2, 4, 8 where they divide the
    world size and ``data.seq_len`` is a multiple of 2 x cp (its load-balanced split) and the
    objective is next-token (``objective=causal_lm``)."""
    name = cfg.objective.get("name") or "causal_lm"
    if name != "causal_lm" or cfg.objective.get("target"):
        return [1]
    return [1] + [cp for cp in (2, 4, 8) if world_size % cp == 0 and cfg.data.seq_len % (2 * cp) == 0]


def auto_cp_style(hf_config: Any, cp: int) -> str:
    """``+recipe=auto``'s context-parallel style: Ulysses where the attention heads divide by cp
    (fewer collectives per layer), else ring."""
    return "ulysses" if hf_config.num_attention_heads % cp == 0 else "ring"


def _config_problem(cfg: Any, recipe: str, world_size: int, micro: int, ckpt: bool, cp: int = 1,
                    cp_style: str = "ulysses") -> str | None:
    """Why the run's config rejects this layout (``llmtrain.config.validate``, pure: no package,
    server or file is looked at; e.g. ``trainer.async_checkpoint`` on DeepSpeed), or None."""
    from llmtrain.config.validate import validate

    candidate = with_recipe(cfg, recipe, cp, cp_style, micro_batch_size=micro, activation_checkpointing=ckpt)
    try:
        validate(candidate, world_size)
    except ConfigError as err:
        return str(err).split("; ")[0]
    return None


def check_auto_overrides(cfg: Any) -> None:
    """``+recipe=auto`` chooses the recipe: a top-level ``engine=`` or a ``recipe.*`` value other
    than ``device_memory`` / ``memory_margin`` could not apply to the choice.

    Raises:
        ConfigError: naming the overrides.
    """
    from llmtrain.config.compose import load_recipe

    default = load_recipe("auto")
    given = [f"recipe.{key}={cfg.recipe[key]}" for key in cfg.recipe
             if key not in ("name", "engine", "auto", "device_memory", "memory_margin")
             and cfg.recipe[key] != default[key]]
    if cfg.get("engine") is not None:
        given.insert(0, f"engine={cfg.engine}")
    if given:
        raise ConfigError(f"+recipe=auto chooses the recipe, so {', '.join(given)} cannot apply to it; drop "
                          f"{'them' if len(given) > 1 else 'it'}, or name a recipe (+recipe=zero3 ...) to set "
                          f"{'them' if len(given) > 1 else 'it'}")


def _ranks_to_fit(cfg: Any, recipe: str, world_size: int, fits: Any, hf_config: Any) -> tuple[int, int] | None:
    """``(ranks, cp)``: the smallest doubling of ``world_size`` (up to 64x) at which ``recipe``
    ``fits`` (micro-batch 1, activation checkpointing), with the smallest context-parallel degree
    that does (:func:`cp_degrees`), or None."""
    n = world_size * 2
    while n <= world_size * 64:
        for cp in cp_degrees(cfg, n):
            plan = plan_recipe(with_recipe(cfg, recipe, cp, auto_cp_style(hf_config, cp)), n, hf_config, micro_batch=1,
                               checkpointing=True)
            if not plan.error and fits(plan):
                return n, cp
        n *= 2
    return None


def host_memory_per_rank() -> int:
    """This node's physical memory (bytes) shared by its ranks (``LOCAL_WORLD_SIZE``)."""
    import os

    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // max(local, 1)


def device_memory_bytes(cfg: Any, device: torch.device) -> int:
    """``recipe.device_memory``, or the device's memory: an accelerator's total memory, or on
    CPU :func:`host_memory_per_rank`."""
    if cfg.recipe.device_memory is not None:
        return parse_bytes(cfg.recipe.device_memory, "recipe.device_memory")
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return host_memory_per_rank()


def resolve_auto(cfg: Any, world_size: int, device: torch.device) -> tuple[Any, Choice]:
    """``+recipe=auto``: the run config with the chosen recipe, micro-batch and activation
    checkpointing in place of ``auto``, and the choice (to print).

    Raises:
        ConfigError: see :func:`choose`.
    """
    check_auto_overrides(cfg)
    on_cpu = device.type == "cpu"  # then device and host are one memory
    choice = choose(cfg, world_size, device_memory_bytes(cfg, device), cfg.recipe.memory_margin,
                    host_memory=None if on_cpu else host_memory_per_rank(), shared_host=on_cpu)
    return chosen_config(cfg, choice), choice


def chosen_config(cfg: Any, choice: Choice) -> Any:
    chosen = with_recipe(cfg, choice.plan.recipe, choice.plan.cp, choice.plan.cp_style, choice.plan.ep,
                         micro_batch_size=choice.plan.micro_batch,
                         activation_checkpointing=choice.plan.checkpointing)
    chosen.recipe.device_memory, chosen.recipe.memory_margin = cfg.recipe.device_memory, cfg.recipe.memory_margin
    # Marks the layout as chosen (the trainer checks that every rank chose alike) and keeps the
    # run's name, so relaunching the same command finds the same run directory whatever it chose.
    chosen.recipe.auto = True
    chosen.name = cfg.name
    return chosen


def check_same_layout(cfg: Any, device: torch.device) -> None:
    """``+recipe=auto`` decides on every rank from its own device memory: ranks whose memory
    differs could choose different layouts, which would hang the first collective. Collective call.

    Raises:
        ConfigError: the ranks chose differently.
    """
    choice = f"{cfg.recipe.name}|{cfg.trainer.micro_batch_size}|{cfg.trainer.activation_checkpointing}"
    mine = torch.tensor(float(zlib.crc32(choice.encode())), dtype=torch.float64, device=device)
    if distributed.all_reduce_max(mine.clone()).item() != -distributed.all_reduce_max(-mine).item():
        raise ConfigError(f"+recipe=auto chose different layouts on different ranks (this one: {choice}): their "
                          "device memory differs; set recipe.device_memory to the smallest device's")
