"""Dry run: build a run's real N-rank layout in one process, without communication.

``trainer.dry_run=true`` (with ``trainer.dry_run_world_size=N``) or ``python -m llmtrain.plan
... world_size=N --check``. For the torch engine every rank's layout is built with the code a run
uses (``ParallelDims`` → device mesh → pipeline split → ``parallelize``: TP, activation
checkpointing, FSDP2) on torch's fake process group (``init_process_group("fake")``: collectives
return at once) and a meta-device model, so a 64-rank 3D layout is checked on a laptop in seconds.
It reports each rank's mesh coordinates and parameter shard shapes. For DeepSpeed it prints the
generated DeepSpeed config and each rank's ZeRO partition of the parameters.
"""

from __future__ import annotations

import json
import math
import time
from collections import defaultdict
from typing import Any

import torch


def _torch_layout(cfg: Any, world_size: int, dims: Any, hf_config: Any) -> list[dict]:
    """Per rank: coordinates and ``[(name, global shape, local shape, placements)]``."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from transformers import AutoModelForCausalLM

    from llmtrain.parallel.parallelize import parallelize, tp_plan

    ranks = []
    for rank in range(world_size):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
        try:
            mesh = dims.build_mesh("cpu")
            coords = {name: mesh.get_local_rank(name) for name in mesh.mesh_dim_names}
            if dims.ep > 1:
                from llmtrain.parallel.expert_parallel import expert_meshes

                coords["ep"] = expert_meshes(mesh, dims)[0].get_local_rank()
            with torch.device("meta"):
                model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
            if getattr(hf_config, "tie_word_embeddings", False):
                model.tie_weights()
            plan = tp_plan(model, cfg.model.get("tp_plan")) if dims.tp > 1 else None
            if dims.pp > 1:
                from llmtrain.parallel.pipeline import split_stages

                parts = [part for _, part in split_stages(model, dims.pp, coords["pp"], cfg.recipe.pp_stages_per_rank)]
            else:
                parts = [model]
            shards = []
            for part in parts:
                parallelize(part, cfg, mesh, dims, plan)
                for name, param in part.named_parameters():
                    local = param.to_local() if hasattr(param, "to_local") else param
                    placements = "; ".join(str(p) for p in getattr(param, "placements", ())) or "whole"
                    shards.append((name, tuple(param.shape), tuple(local.shape), placements))
            ranks.append({"rank": rank, "coords": coords, "shards": shards})
        finally:
            dist.destroy_process_group()
    return ranks


def dry_run(cfg: Any, world_size: int) -> str:
    """The layout report of ``cfg`` on ``world_size`` ranks (see the module).

    Raises:
        ConfigError: the layout is not valid on ``world_size`` ranks (degrees, heads, layers,
            batch divisibility), as a real launch would report it.
    """
    from llmtrain.config.validate import validate
    from llmtrain.models.build import language_config
    from llmtrain.parallel.dims import ParallelDims
    from llmtrain.planning.preflight import preflight

    started = time.perf_counter()
    layout = validate(cfg, world_size)
    preflight(cfg)  # as the launch would: a dry run answers whether this run would start
    r = cfg.recipe
    dims = ParallelDims.from_layout(layout)
    hf_config = language_config(cfg.model)
    dims.check_model_config(hf_config, r.pp_stages_per_rank)
    from llmtrain.parallel.context_parallel import check_model
    from llmtrain.models.moe import num_experts_of

    check_model(r.cp_style, dims.cp, dims.tp, hf_config)
    accumulation = layout.accumulation
    lines = [f"dry run of recipe {r.name} (engine {r.engine}, ZeRO {r.zero_stage}) on {world_size} ranks: "
             f"pp {dims.pp} x dp_replicate {dims.dp_replicate} x dp_shard {dims.dp_shard}"
             f"{f' x cp {dims.cp} ({r.cp_style})' if dims.cp > 1 else ''} x tp {dims.tp}"
             f"{f' (ep {dims.ep} within dp_shard)' if dims.ep > 1 else ''}; "
             f"global batch {cfg.trainer.global_batch_size} = micro {cfg.trainer.micro_batch_size} x accumulation "
             f"{accumulation} x dp {dims.dp}"]
    if dims.cp > 1:
        lines.append(f"each row is split over the {dims.cp} ranks of a cp group (neighbouring ranks, same samples); "
                     + (f"FSDP2 shards over dp_shard x cp = {dims.dp_shard * dims.cp} ranks, so even a replicating "
                        "recipe (zero_stage 0) shards over its cp ranks" if r.engine == "torch" else
                        "DeepSpeed counts every rank as data parallel (its train_batch_size includes the cp ranks)"))
    if dims.ep > 1:
        experts = num_experts_of(hf_config)
        lines.append(f"experts: each MoE layer's {experts} experts split over the {dims.ep} ranks of an ep group "
                     f"(neighbouring dp_shard ranks; ep rank e holds experts [e x {experts // dims.ep}, (e + 1) x "
                     f"{experts // dims.ep})), tokens dispatched and combined by all-to-all; each expert is FSDP-sharded "
                     f"over the {dims.dp_replicate} x {dims.dp_shard // dims.ep} ranks holding the same experts "
                     "(dp_replicate x dp_shard / ep); dense layers shard over dp_shard as without ep")
    if r.engine == "deepspeed":
        lines += _deepspeed_report(cfg, world_size, accumulation, hf_config)
        lines.append(f"computed in {time.perf_counter() - started:.1f} s from DeepSpeed's partitioning rules "
                     "(parameters on the meta device; DeepSpeed itself is not started)")
    else:
        lines += _torch_report(_torch_layout(cfg, world_size, dims, hf_config), num_experts_of(hf_config), dims.ep)
        lines.append(f"built in {time.perf_counter() - started:.1f} s on the fake process group (no communication, "
                     "parameters on the meta device)")
    return "\n".join(lines)


def _torch_report(ranks: list[dict], experts: int = 0, ep: int = 1) -> list[str]:
    expert_head = "  ep  experts" if ep > 1 else ""
    lines = [f"rank  pp dp_rep dp_shard cp tp{expert_head}   parameters (local elements)  tensors"]
    groups: dict[tuple, list[int]] = defaultdict(list)
    for entry in ranks:
        c = entry["coords"]
        local = sum(math.prod(s[2]) for s in entry["shards"])
        held = ""
        if ep > 1:
            per = experts // ep
            first = c["ep"] * per
            held = f" {c['ep']:>3}  {f'{first}-{first + per - 1}':>7}"
        lines.append(f"{entry['rank']:>4} {c['pp']:>3} {c['dp_replicate']:>6} {c['dp_shard']:>8} {c['cp']:>2} {c['tp']:>2}"
                     f"{held}   {local:>27,}  {len(entry['shards'])}")
        groups[tuple(entry["shards"])].append(entry["rank"])
    lines.append(f"{len(groups)} distinct shard layout(s); each with its ranks and parameter shards "
                 "(name: global shape -> local shape [placements]):")
    for shards, members in groups.items():
        lines.append(f"ranks {_ranges(members)}:")
        lines += [f"  {name}: {list(full)} -> {list(local)} [{placements}]" for name, full, local, placements in shards]
    return lines


def _deepspeed_report(cfg: Any, world_size: int, accumulation: int, hf_config: Any) -> list[str]:
    """The generated DeepSpeed config and each rank's ZeRO partition (elements), following
    DeepSpeed's layout: stages 1-2 flatten each parameter group (decayed, not decayed), pad it to
    a multiple of 2 x world size (``stage_1_and_2.py``, ``nccl_start_alignment_factor``) and give
    each rank one contiguous slice; stage 3 splits every parameter into world-size pieces of
    ceil(numel / world size), the last ones padded, and keeps parameters of at most
    ``stage3_param_persistence_threshold`` elements whole on every rank."""
    from transformers import AutoModelForCausalLM

    from llmtrain.engine.base import param_groups
    from llmtrain.engine.deepspeed_engine import communication_sizes, deepspeed_config

    config = deepspeed_config(cfg, world_size, accumulation)
    stage = cfg.recipe.zero_stage
    lines = ["DeepSpeed config (generated from the recipe):", json.dumps(config, indent=2, sort_keys=True)]
    if stage == 0:
        return lines + ["ZeRO-0: every rank holds every parameter, gradient and optimizer state"]
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    # Per rank: [partitioned real elements, padding, elements kept whole].
    ranks = [[0, 0, 0] for _ in range(world_size)]

    def split(numel: int, part: int) -> None:  # rank r holds elements [r * part, (r + 1) * part)
        for r, entry in enumerate(ranks):
            real = max(0, min(part, numel - r * part))
            entry[0] += real
            entry[1] += part - real

    if stage in (1, 2):
        for group in param_groups(model, cfg.trainer.weight_decay):
            flat = sum(p.numel() for p in group["params"])
            align = 2 * world_size
            split(flat, math.ceil(flat / align) * align // world_size)
        what = "optimizer state" + (" and gradients" if stage == 2 else "")
    else:
        threshold = communication_sizes(cfg.recipe, hf_config.hidden_size)["param_persistence_threshold"]
        for param in model.parameters():
            if param.numel() <= threshold:
                for entry in ranks:
                    entry[2] += param.numel()
                continue
            split(param.numel(), math.ceil(param.numel() / world_size))
        what = f"parameters, gradients and optimizer state (parameters <= {threshold:,} elements kept whole)"
    total = sum(p.numel() for p in model.parameters())
    lines.append(f"ZeRO-{stage} partitions {what} of {total:,} parameters over {world_size} ranks "
                 "(elements per rank):")
    lines.append("ranks              partition   padding   kept whole")
    groups: dict[tuple, list[int]] = defaultdict(list)
    for r, entry in enumerate(ranks):
        groups[tuple(entry)].append(r)
    for (real, pad, whole), members in groups.items():
        lines.append(f"{_ranges(members):<18} {real:>9,} {pad:>9,} {whole:>12,}")
    return lines


def _ranges(ranks: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``0-2, 5``."""
    out, start = [], ranks[0]
    for prev, cur in zip(ranks, ranks[1:] + [None]):
        if cur != prev + 1:
            out.append(f"{start}-{prev}" if start != prev else f"{start}")
            start = cur
    return ", ".join(out)
