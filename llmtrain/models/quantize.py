"""A frozen base stored in 4 bits for QLoRA (``model.quantize=nf4``, ``+peft=qlora``).

QLoRA (Dettmers et al., "QLoRA: Efficient Finetuning of Quantized LLMs", NeurIPS 2023, section 3)
keeps the base model's Linear weights as 4-bit NormalFloat codes with one absmax scale per block
of 64 weights, the scales themselves quantized to 8 bits in blocks of 256 ("double
quantization"), and trains LoRA adapters in the compute dtype on top; the forward and backward
passes dequantize a weight just before its matmul. The quantization is torchao's NF4
(``torchao.quantization.to_nf4``, the format torchtune's QLoRA uses), bit for bit.

How it runs on every data-parallel engine: torchao's ``NF4Tensor`` is a tensor subclass that
FSDP2 can shard, but DDP broadcasts, DeepSpeed casts and ZeRO-3 partitions ordinary tensors only.
So each quantized layer (:class:`NF4Linear`) holds its 4-bit codes as one frozen 1-D parameter
whose bytes are viewed as the dtype the engine keeps parameters in (``storage_dtype``: fp32, or
bf16 under bf16 mixed precision, so FSDP2's and DeepSpeed's bf16 casts are no-ops), the way
bitsandbytes' ``quant_storage`` serves QLoRA on ZeRO-3. Every engine then treats it as a plain
frozen weight: ZeRO-3 and FSDP2 shard it and all-gather it whole before the layer runs, DDP
broadcasts it once. The quantization constants (int8 scales, 1 byte per 64 weights, plus fp32
second-level factors) are small buffers every rank holds whole, kept as integer tensors so no
dtype cast touches them. Bytes per base weight: 0.5 (codes) + 1/64 (scales) + 4/16384.

Checkpoints hold the adapters only (the base is frozen, :func:`llmtrain.models.adapters.is_partial`):
a resume quantizes the base again from its source, which gives the same codes. Exports merge the
adapters into the dequantized base (:func:`dequantize_model`): the weights the run trained on.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

BLOCK_SIZE = 64  # weights per absmax scale (QLoRA section 3, "blocksize of 64")
SCALER_BLOCK_SIZE = 256  # scales per second-level factor (QLoRA section 3, "blocksize of 256")


def storage_dtype(precision: str) -> torch.dtype:
    """The dtype the packed codes are viewed as: the dtype the engines keep frozen parameters in
    for ``trainer.precision`` (bf16 under bf16 mixed precision, where FSDP2's ``param_dtype`` and
    DeepSpeed's ``bf16`` cast every parameter; fp32 otherwise)."""
    return torch.bfloat16 if precision == "bf16" else torch.float32


def quantizable(module: nn.Module) -> bool:
    """Whether a Linear layer's weight can be stored as NF4 blocks: whole blocks of 64 weights."""
    return type(module) is nn.Linear and module.weight.numel() % BLOCK_SIZE == 0


def _as_bytes(values: torch.Tensor) -> torch.Tensor:
    """fp32 values as a uint8 tensor of their bytes (no dtype cast of the module reaches them)."""
    flat = torch.empty(values.numel(), dtype=torch.float32, device=values.device)
    return flat.copy_(values.reshape(-1)).view(torch.uint8)


class _DequantizedLinear(torch.autograd.Function):
    """``y = x W^T`` with ``W`` dequantized in forward and again in backward, so no full-precision
    copy of a frozen weight is kept between the two passes (QLoRA section 3: "we dequantize the
    storage data type to the computation data type to perform the forward and backward pass").
    ``W`` gets no gradient (frozen); the layer's module is kept rather than a tensor, so that the
    backward reads the codes FSDP2 or ZeRO-3 have gathered again for it."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, layer: "NF4Linear") -> torch.Tensor:
        ctx.layer = layer
        return F.linear(x, layer.dequantized(x.dtype))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad @ ctx.layer.dequantized(grad.dtype), None


class NF4Linear(nn.Linear):
    """A frozen ``nn.Linear`` whose weight is stored as NF4 (see the module docstring).

    A subclass of ``nn.Linear`` (with ``in_features``/``out_features``) so that peft's LoRA
    wraps it like any Linear layer. Its ``weight`` is a stand-in that costs nothing (one fp32 zero
    expanded to ``[out, in]`` on the layer's device) for libraries that read a Linear layer's
    shape, device and dtype; the values are in ``weight_nf4`` (:meth:`dequantized`), and
    assigning a ``weight`` raises. Parameters: ``weight_nf4`` ([out*in/2] bytes viewed as
    ``storage_dtype``, frozen) and ``bias`` (frozen, or None). Buffers (not in the state dict):
    ``nf4_scalers`` (int8 [out*in/64]), ``nf4_factors`` and ``nf4_mean`` (fp32 bytes as uint8).

    Raises:
        ValueError: the weight's element count is not a multiple of 64 (:func:`quantizable`).
    """

    def __init__(self, linear: nn.Linear, storage_dtype: torch.dtype = torch.float32):
        nn.Module.__init__(self)
        from torchao.quantization import to_nf4

        weight = linear.weight.detach()
        if weight.numel() % BLOCK_SIZE:
            raise ValueError(f"NF4 stores whole blocks of {BLOCK_SIZE} weights; this layer has {weight.numel()}")
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.compute_dtype = weight.dtype
        n_blocks = weight.numel() // BLOCK_SIZE
        # torchao needs whole second-level blocks; small layers take the largest power of 2 that fits.
        self.scaler_block_size = math.gcd(n_blocks, SCALER_BLOCK_SIZE)
        nf4 = to_nf4(weight.contiguous(), BLOCK_SIZE, self.scaler_block_size)
        self.weight_nf4 = nn.Parameter(  # named build.PACKED_NF4
            nf4.quantized_data.view(storage_dtype), requires_grad=False)
        self.register_buffer("nf4_scalers", nf4.quantized_scalers, persistent=False)
        self.register_buffer("nf4_factors", _as_bytes(nf4.quantization_factor), persistent=False)
        self.register_buffer("nf4_mean", _as_bytes(nf4.scaler_mean), persistent=False)
        self._table = nf4.nf4.float()
        bias = linear.bias
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)

    @property
    def weight(self) -> torch.Tensor:
        return self.nf4_scalers.new_zeros((), dtype=self.compute_dtype).expand(self.out_features, self.in_features)

    def nf4_tensor(self):
        """The stored weight as torchao's ``NF4Tensor`` (``[out, in]``, fp32); reads the codes this
        rank holds now (whole: call inside the layer's forward under FSDP2 / ZeRO-3)."""
        from torchao.quantization import NF4Tensor
        from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import SubclassTensorArgs

        codes = self.weight_nf4.view(torch.uint8)
        device = codes.device
        shape = torch.Size([self.out_features, self.in_features])
        meta = SubclassTensorArgs(shape, (self.in_features, 1), 0, torch.float32, device, False)
        return NF4Tensor(meta, BLOCK_SIZE, shape.numel() // BLOCK_SIZE, self.scaler_block_size, self.nf4_scalers,
                         self.nf4_factors.view(torch.float32), self.nf4_mean.view(torch.float32)[0], codes,
                         self._table.to(device))

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight the layer computes with, ``[out, in]`` in ``dtype``."""
        codes = self.weight_nf4
        if codes.numel() * codes.element_size() * 2 != self.in_features * self.out_features:
            raise RuntimeError(f"NF4Linear: {codes.numel()} stored elements (of {codes.dtype}) are not this layer's "
                               f"{self.out_features}x{self.in_features} codes; the engine did not gather or kept a "
                               "cast copy of weight_nf4")
        return self.nf4_tensor().get_original_weight().to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = _DequantizedLinear.apply(x, self)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, nf4"


def _skipped(model: nn.Module) -> set[int]:
    """Linear layers that stay in full precision: the output head (QLoRA and bitsandbytes keep
    it), a reward model's ``score`` head, mixture-of-experts routers, and an image-text model's
    vision tower and projector (everything outside its language model, :func:`_language_model`)."""
    from llmtrain.models.moe import sparse_blocks

    keep = {id(model.get_output_embeddings())} if hasattr(model, "get_output_embeddings") else set()
    keep |= {id(module) for name, module in model.named_modules() if name == "score" or name.endswith(".score")}
    keep |= {id(block.gate) for _, block in sparse_blocks(model)}
    language = _language_model(model)
    if language is not None:
        inside = {id(module) for module in language.modules()}
        keep |= {id(module) for module in model.modules() if id(module) not in inside}
    return keep


def _language_model(model: nn.Module) -> nn.Module | None:
    """An image-text model's language model (transformers' ``get_decoder()``: Idefics3's
    ``model.text_model``, LLaVA's and Gemma 3's ``model.language_model``), or None for a text-only
    model. Only its Linear layers are stored in 4 bits: the vision tower and the projector are a
    small share of the weights and feed every image token, so they stay in full precision, as
    LLaVA's QLoRA recipe keeps them (its tower is loaded apart from the 4-bit language model and
    ``BitsAndBytesConfig(llm_int8_skip_modules=["mm_projector"])`` skips the projector)."""
    config = getattr(model, "config", None)
    if getattr(config, "vision_config", None) is None or not hasattr(model, "get_decoder"):
        return None
    return model.get_decoder()


@torch.no_grad()
def quantize_model(model: nn.Module, precision: str, keep: tuple[str, ...] = ()) -> int:
    """Replace the model's Linear layers by :class:`NF4Linear`, in place; the head, routers and
    ``keep`` (module names, e.g. ``peft.modules_to_save``) stay as they are. Call before LoRA
    is injected. Returns the number of weights stored in 4 bits."""
    skipped = _skipped(model)
    named = dict(model.named_modules())
    stored = 0
    for name, module in list(named.items()):
        if id(module) in skipped or name in keep or not quantizable(module):
            continue
        parent_name, _, child = name.rpartition(".")
        setattr(named[parent_name] if parent_name else model, child, NF4Linear(module, storage_dtype(precision)))
        stored += module.weight.numel()
    return stored


@torch.no_grad()
def dequantize_model(model: nn.Module) -> nn.Module:
    """Replace every :class:`NF4Linear` by a plain ``nn.Linear`` holding its dequantized weight
    (fp32), in place: the base a QLoRA run trained on, for exports and merges."""
    named = dict(model.named_modules())
    for name, module in list(named.items()):
        if isinstance(module, NF4Linear):
            plain = nn.Linear(module.in_features, module.out_features, bias=module.bias is not None,
                              device=module.weight_nf4.device)
            plain.weight.copy_(module.dequantized(torch.float32))
            if module.bias is not None:
                plain.bias.copy_(module.bias.float())
            parent_name, _, child = name.rpartition(".")
            setattr(named[parent_name] if parent_name else model, child, plain)
    return model


def is_quantized(cfg: Any) -> bool:
    """Whether the run stores its base in 4 bits (``model.quantize`` other than ``none``)."""
    return (cfg.model.get("quantize") or "none") != "none"


def quantize_base(model: nn.Module, cfg: Any, precision: str | None = None) -> int:
    """:func:`quantize_model` as the run's config asks (``model.quantize``; ``peft.modules_to_save``
    stay whole); returns the number of weights stored in 4 bits (0 when not quantized)."""
    if not is_quantized(cfg):
        return 0
    keep = tuple(cfg.peft.modules_to_save) if cfg.get("peft") is not None else ()
    return quantize_model(model, precision or cfg.trainer.precision, keep)


def round_trip(model: nn.Module, cfg: Any) -> nn.Module:
    """The base as a ``model.quantize`` run computes with: quantized and dequantized again
    (fp32), in place; unchanged when the run is not quantized."""
    if quantize_base(model, cfg, "fp32"):
        dequantize_model(model)
    return model


def stored_bytes_per_weight() -> float:
    """Bytes one base weight costs as NF4: 4-bit code, int8 scale per 64, fp32 factor per 64x256."""
    return 0.5 + 1 / BLOCK_SIZE + 4 / (BLOCK_SIZE * SCALER_BLOCK_SIZE)
