"""Model FLOPs per token, achieved TFLOP/s and model FLOPs utilisation (MFU).

MFU follows Chowdhery et al., "PaLM" (2022), appendix B: the FLOPs the model needs per token,
whatever the implementation recomputes (activation checkpointing does not count), times the
tokens per second, over the accelerators' peak (:func:`peak_tflops`: the user's figure, a data
sheet's, or one measured on this machine by a matmul probe, which is how CPUs get MFU). Units:
FLOPs per token, TFLOP/s (10^12 FLOP/s) per device, MFU a fraction. For a mixture of experts the parameters are
those a token passes through (its *active* parameters: Fedus et al., "Switch Transformers",
2021, section 2; DeepSeek-V3's and Qwen3's "activated parameters"): every dense weight, the
router, shared experts, and k of the E routed experts per MoE layer.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

from llmtrain.common import hardware
from llmtrain.models.build import parameter_numel
from llmtrain.monitoring import goodput

log = logging.getLogger("llmtrain")

# Dense peak TFLOP/s per device, by precision (vendor data sheets, without sparsity). fp32 runs on
# NVIDIA use TF32 tensor cores for matmuls (torch's default allows it for convolutions only, but
# the peak is the honest ceiling); keys are matched against torch.cuda.get_device_name().
PEAK_TFLOPS: dict[str, dict[str, float]] = {
    "B200": {"bf16": 2250.0, "fp32": 1100.0},
    "H200": {"bf16": 989.4, "fp32": 494.7},
    "H100 SXM": {"bf16": 989.4, "fp32": 494.7},
    "H100 80GB HBM3": {"bf16": 989.4, "fp32": 494.7},  # the SXM part's device name
    "H100 NVL": {"bf16": 835.0, "fp32": 417.5},
    "H100 PCIe": {"bf16": 756.5, "fp32": 378.0},
    "A100": {"bf16": 312.0, "fp32": 156.0},
    "L40S": {"bf16": 362.0, "fp32": 183.0},
    "A10G": {"bf16": 70.0, "fp32": 35.0},
    "MI300X": {"bf16": 1307.4, "fp32": 653.7},
    "MI250X": {"bf16": 383.0, "fp32": 95.7},
}


@dataclass(frozen=True)
class Peak:
    """The peak MFU is measured against: ``tflops`` (dense TFLOP/s of one device), the
    ``precision`` it is for, ``source`` (``trainer.peak_tflops``, ``data sheet`` or
    ``measured``) and ``detail`` (where the figure came from, in words, for the start-up line
    and the run report)."""

    tflops: float
    precision: str
    source: str
    detail: str

    def describe(self) -> str:
        """E.g. ``0.0885 TFLOP/s fp32 per device (measured by a 2048x2048 matmul probe ...)``."""
        return f"{self.tflops:.3g} TFLOP/s {self.precision} per device ({self.detail})"


def data_sheet_tflops(device: torch.device, precision: str) -> tuple[str, float] | None:
    """(table key, peak dense TFLOP/s) of the :data:`PEAK_TFLOPS` entry matching the CUDA/ROCm
    device name of ``device``, else None (CPUs, accelerators the table lacks)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name(device)
    for key in sorted(PEAK_TFLOPS, key=len, reverse=True):  # "H100 PCIe" before "H100"
        if re.search(re.escape(key), name, re.IGNORECASE):
            return key, PEAK_TFLOPS[key][precision]
    return None


def peak_tflops(device: torch.device, precision: str, configured: float = 0.0,
                announce: Callable[[str], None] | None = None,
                probe: Callable[[torch.device, str, float | None], hardware.MatmulProbe] = hardware.probe_matmul_flops,
                ) -> Peak | None:
    """Peak dense TFLOP/s of one ``device`` at ``precision`` (``bf16``/``fp32``), the
    denominator of MFU (PaLM, appendix B), and where it came from, in this order:

    1. ``configured`` when > 0 (``trainer.peak_tflops``);
    2. the vendor data sheet (:data:`PEAK_TFLOPS`, by CUDA/ROCm device name);
    3. measured on this machine by a matmul probe (:func:`llmtrain.common.hardware.probe_matmul_flops`,
       a second or two), cached per machine in ``LLMTRAIN_CACHE/peak_flops.json``: CPUs, and GPUs
       the table lacks. ``announce`` is called (with what is measured) just before a probe runs.

    One device on a CPU is one rank with the torch threads it trains with (torchrun gives each
    of N local ranks ``OMP_NUM_THREADS=1``), credited with at most its share of the cores,
    ``min(threads, cores / N)``: the N ranks' peaks then add up to the machine's, as their
    ``perf/tflops_per_device`` add up to the run's. The probe counts CPU time against that share
    (:func:`llmtrain.common.hardware.probe_matmul_flops`), so other processes on a busy machine
    do not lower the figure that is cached for good. The N ranks probe together, after a
    barrier, because that is what a training step gets: cores that share caches, memory
    bandwidth and an all-core clock. Every rank then uses the mean over ranks (every node
    assumed alike), which local rank 0 caches under the key of the thread and rank counts. All
    ranks probe when any lacks the entry, so the call is collective on a CPU under
    torch.distributed. GPUs probe each their own device (wall time), with no collective.

    Returns:
        :class:`Peak`, or None for a device type no rule covers (neither CPU nor CUDA/ROCm).
    """
    if configured > 0:
        return Peak(float(configured), precision, "trainer.peak_tflops", f"trainer.peak_tflops={configured:g}")
    sheet = data_sheet_tflops(device, precision)
    if sheet is not None:
        return Peak(sheet[1], precision, "data sheet", f"the {sheet[0]} data sheet, dense")
    if device.type not in ("cpu", "cuda"):
        return None
    together = device.type == "cpu" and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE") or 1) if together else 1
    key = hardware.peak_cache_key(device, precision, local_ranks)
    path = hardware.peak_cache_path()
    entry = hardware.read_cached_peak(key, path)
    missing = entry is None
    if together:
        flag = torch.tensor([float(missing)], dtype=torch.float64)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        missing = bool(flag.item())
    threads, cores, kind = torch.get_num_threads(), hardware.usable_cores(), "CPU" if device.type == "cpu" else "GPU"
    share = min(threads, cores / local_ranks) if device.type == "cpu" else None
    what = (f"{hardware.device_label(device)}, {precision}"
            + (f", {threads} thread(s) x {local_ranks} rank(s) on {cores} core(s)" if device.type == "cpu" else ""))
    if missing:
        if announce is not None:
            announce(f"a matmul probe of this {kind} ({what}); once per machine, cached in {path}")
        if together:
            dist.barrier()  # the ranks sharing the cores probe at the same time
        found = probe(device, precision, share)
        tflops, n, layout = found.flops_per_s / 1e12, found.n, found.layout
    else:
        tflops, n, layout = float(entry["tflops"]), int(entry.get("n", 0)), str(entry.get("layout", "?"))
    if together:
        figure = torch.tensor([tflops], dtype=torch.float64)
        dist.all_reduce(figure)
        tflops = figure.item() / dist.get_world_size()
    if missing:
        if int(os.environ.get("LOCAL_RANK") or 0) == 0:  # one writer per machine
            hardware.write_cached_peak(key, hardware.peak_entry(tflops, n, layout, found.wall_s), path)
        if together:
            dist.barrier()  # written before any rank returns: a next call anywhere reads it
        detail = f"measured by a {n}x{n} matmul probe ({layout} layout) on this {kind} ({what}), cached in {path}"
    else:
        detail = (f"measured by a {n}x{n} matmul probe ({layout} layout) on this {kind} ({what}) on "
                  f"{entry.get('measured_at', '?')}, read from {path}; delete the file to measure again")
    return Peak(tflops, precision, "measured", detail)


def parameter_counts(hf_config: Any) -> tuple[int, int]:
    """(all parameters, input-embedding parameters) of the model ``hf_config`` describes,
    counted on the meta device (no memory, any size). Tied input/output embeddings count once
    in the first figure."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config)
    total = sum(p.numel() for p in model.parameters())
    embedding = model.get_input_embeddings().weight.numel()
    return total, embedding


def active_parameters(hf_config: Any, total: int | None = None) -> tuple[int, int]:
    """(parameters, parameters one token passes through) of the model ``hf_config`` describes:
    equal for a dense model; for a mixture of experts the second counts k / E of the routed
    experts (:class:`llmtrain.models.moe.MoeShape`), e.g. Qwen3-30B-A3B's 30.5 B and 3.3 B.
    ``total``: :func:`parameter_counts`' first figure when the caller has it (one meta build fewer)."""
    from llmtrain.models.moe import moe_shape

    if total is None:
        total, _ = parameter_counts(hf_config)
    shape = moe_shape(hf_config)
    if shape is None:
        return total, total
    return total, total - shape.routed_params + shape.active_routed_params


def flops_per_token(hf_config: Any, seq_len: int, frozen: int = 0, adapter: int = 0) -> float:
    """Training FLOPs per token of a decoder-only transformer (PaLM, appendix B):
    ``6 N + 12 L H Q T``, with N the parameters that take part in matmuls (all but the input
    embedding lookup, which costs no FLOPs; a tied output projection still multiplies, so it
    counts), L layers, H attention heads of size Q, T = ``seq_len`` (the attention score and
    value products, forward and backward).

    Mixture of experts: N counts the active parameters (:func:`active_parameters`): k of the E
    routed experts of each MoE layer, the router and shared experts in full.

    Partial training (LoRA, ``model.freeze``): a frozen weight still costs its forward (2 FLOPs
    per parameter per token) and the gradient with respect to its input (2), only not its own
    weight gradient (2): ``frozen`` of the N count 4 instead of 6. ``adapter``: parameters added
    to the base model (LoRA's A and B), trained, 6 each. Both as a token sees them (active
    parameters, :func:`partial_training_counts`).

    Returns:
        FLOPs per token (a multiply-add is 2 FLOPs).
    """
    total, embedding = parameter_counts(hf_config)
    _, active = active_parameters(hf_config, total)
    tied = bool(getattr(hf_config, "tie_word_embeddings", False))
    matmul = active - embedding + (embedding if tied else 0)  # a tied lm_head is still a matmul
    layers = int(hf_config.num_hidden_layers)
    heads = int(hf_config.num_attention_heads)
    head_dim = int(getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads)
    attention = 12 * layers * heads * head_dim * seq_len
    return float(6 * (matmul + adapter) - 2 * min(frozen, matmul) + attention)


def partial_training_counts(model: torch.nn.Module) -> tuple[int, int]:
    """(frozen matmul parameters, adapter parameters) of a LoRA / ``model.freeze`` model, for
    :func:`flops_per_token`. Counts global sizes under ZeRO-3 and FSDP2; the input embedding
    table is left out unless it is tied to the output projection. Routed experts' weights (and
    adapters on them) count k / E, as a token sees them."""
    from llmtrain.models.moe import num_experts_of

    embedding = model.get_input_embeddings().weight
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    experts = num_experts_of(model.config)
    routed_share = (getattr(model.config, "num_experts_per_tok", experts) / experts) if experts else 1.0
    frozen = adapter = 0
    for name, param in model.named_parameters():
        numel = parameter_numel(param)
        if experts and ".experts." in name:
            numel = int(numel * routed_share)
        if "lora_" in name:
            adapter += numel
        elif not param.requires_grad and (param is not embedding or tied):
            frozen += numel
    return frozen, adapter


def achieved(tokens_per_s: float, flops_per_token: float, world_size: int, peak: float | None) -> dict[str, float]:
    """``perf/tflops_per_device`` (model TFLOP/s per device: the global rate over the world
    size) and, when ``peak`` (TFLOP/s per device) is known, ``perf/mfu`` (a fraction)."""
    tflops = tokens_per_s * flops_per_token / world_size / 1e12
    return {"perf/tflops_per_device": tflops, **({"perf/mfu": tflops / peak} if peak else {})}


def for_run(model: Any, hf_config: Any, cfg: Any, env: Any, partial: bool, run_dir: Any,
            announce: Callable[[str], None]) -> tuple[float, Peak | None]:
    """A run's model FLOPs per token at ``data.seq_len`` (:func:`flops_per_token`; a ``partial``
    run's frozen and adapter parameters counted apart) and the peak its MFU is measured against
    (:func:`peak_tflops`; ``announce`` names a probe's start-up phase), said by rank 0 and
    recorded in the timeline (``run_dir``) for the run report. Collective on a CPU."""
    t = cfg.trainer
    frozen, adapter = partial_training_counts(model) if partial else (0, 0)
    peak = peak_tflops(env.device, t.precision, t.peak_tflops, announce=announce)
    if env.is_main and peak is not None:
        log.info("MFU against %s", peak.describe())
        goodput.timeline_event(run_dir, "peak_flops", tflops=peak.tflops, precision=peak.precision,
                               source=peak.source, detail=peak.detail)
    return flops_per_token(hf_config, cfg.data.seq_len, frozen, adapter), peak
