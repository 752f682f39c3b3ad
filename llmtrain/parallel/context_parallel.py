"""Context parallelism: each sequence split over ``recipe.cp`` ranks, attention exchanged between them.

Layout (load-balanced for causal attention, as torchtitan and Megatron-LM do): a row of ``T``
tokens is cut into ``2 cp`` chunks and cp rank ``r`` holds chunks ``r`` and ``2 cp - 1 - r``, so
every rank holds as many early (cheap) as late (expensive) queries. Positions stay global
(rotary embeddings see the token's place in the whole row) and so do the targets: each token's
next-token label is taken before the split, so no target is lost at a chunk boundary.

Two ways to compute attention over the split sequence (``recipe.cp_style``), both registered as a
``transformers`` attention implementation, so any Hugging Face decoder runs them unchanged:

* ``ulysses`` (Jacobs et al., "DeepSpeed Ulysses", 2023, section 3): an all-to-all turns the
  sequence-sharded ``q, k, v`` ``[B, H, T/cp, D]`` into head-sharded ``[B, H/cp, T, D]``, ordinary
  causal attention runs on whole sequences (``scaled_dot_product_attention``), and a second
  all-to-all turns the output back. Needs the heads divisible by cp; KV heads that are not are
  replicated up to the query heads (as DeepSpeed's ``UlyssesSPAttentionHF`` does).
* ``ring`` (Liu et al., "Ring Attention with Blockwise Transformers", 2023; the online-softmax
  merge of Milakov & Gimelshein 2018 / FlashAttention): each rank keeps its queries and passes
  its K/V block around the ring; each block's partial output and log-sum-exp are merged, so the
  result equals softmax attention over the whole row. No divisibility needed. On CPU the blocks
  run torch's flash kernel (``_scaled_dot_product_flash_attention_for_cpu``, which returns the
  log-sum-exp) with its own backward against the merged statistics, so memory stays linear in
  the row; elsewhere plain tensor ops under autograd (correct, but (T/cp)^2 scores per block are
  kept: prefer Ulysses on GPUs).

Packed rows keep each document's attention to itself: the mask is rebuilt from the global
positions (a document starts where the position restarts at 0), per block for ring and over the
whole row after the all-to-all for Ulysses.

Why not torch's ``context_parallel``: in torch 2.13 it shards only the CUDA attention ops (on CPU
it fails with "aten._scaled_dot_product_flash_attention_for_cpu.default does not have a sharding
strategy registered"), so it cannot run in this project's CPU suite. DeepSpeed's ALST Ulysses
(``UlyssesSPAttentionHF``) splits sequences contiguously, drops the attention mask (no document
masking under ``sdpa``) and replaces a global attention entry; the implementation here serves
both engines with one layout, so ``recipe.cp`` means the same on ``+recipe=zero3`` and ``fsdp``.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch
import torch.nn.functional as F

from llmtrain.common.errors import ConfigError

ATTENTION_NAME = "llmtrain_context_parallel"
CP_STYLES = ("ulysses", "ring")


def chunk_order(cp: int) -> list[int]:
    """The ``2 cp`` chunks of a row in the order the cp ranks hold them: rank 0's two chunks,
    then rank 1's, ... (rank ``r`` holds ``r`` and ``2 cp - 1 - r``)."""
    return [c for r in range(cp) for c in (r, 2 * cp - 1 - r)]


def local_index(length: int, cp: int, rank: int, device: torch.device | None = None) -> torch.Tensor:
    """Global token indices ``[length / cp]`` that cp rank ``rank`` holds of a row of ``length``
    tokens (``length`` a multiple of ``2 cp``)."""
    chunk = length // (2 * cp)
    starts = (rank * chunk, (2 * cp - 1 - rank) * chunk)
    return torch.cat([torch.arange(s, s + chunk, device=device) for s in starts])


def check_heads(style: str, cp: int, num_attention_heads: int, num_key_value_heads: int) -> None:
    """Ulysses splits heads over the cp ranks; ring needs nothing.

    Raises:
        ConfigError: ``recipe.cp_style=ulysses`` with attention heads not divisible by cp.
    """
    if style == "ulysses" and num_attention_heads % cp:
        raise ConfigError(f"recipe.cp_style=ulysses with recipe.cp={cp}: the model's {num_attention_heads} attention "
                          f"heads are not divisible by {cp}; use recipe.cp_style=ring or a cp that divides the heads")


def check_model(style: str, cp: int, tp: int, hf_config: Any) -> None:
    """What context parallelism needs of the model (``transformers`` config), checked before
    anything is built: Ulysses' heads per tensor-parallel rank divisible by cp
    (:func:`check_heads`), no attention dropout (the split attention applies none), no
    attention soft-capping, no sliding-window layers.

    Raises:
        ConfigError: naming the model field and the fix.
    """
    if cp == 1:
        return
    heads = hf_config.num_attention_heads
    check_heads(style, cp, heads // tp, getattr(hf_config, "num_key_value_heads", None) or heads)
    if float(getattr(hf_config, "attention_dropout", 0.0) or 0.0) > 0:
        raise ConfigError(f"recipe.cp={cp} with model.architecture.attention_dropout={hf_config.attention_dropout}: "
                          "the context-parallel attention applies no dropout; set it to 0")
    for field in ("attn_logit_softcapping",):
        if getattr(hf_config, field, None):
            raise ConfigError(f"recipe.cp={cp} with model.architecture.{field}={getattr(hf_config, field)}: the "
                              "context-parallel attention computes plain softmax attention; set recipe.cp=1")
    if getattr(hf_config, "use_sliding_window", False) and getattr(hf_config, "sliding_window", None):
        raise ConfigError(f"recipe.cp={cp}: the model uses sliding-window attention "
                          f"(sliding_window={hf_config.sliding_window}), which the context-parallel attention does "
                          "not mask; set model.architecture.use_sliding_window=false or recipe.cp=1")


class ContextParallel:
    """One rank's view of a context-parallel group: splits batches, and runs attention over the
    split sequences (the attention function reads the row layout the last :meth:`split` set).

    Args:
        group: the process group of this rank's cp peers (ranks holding parts of the same rows).
        style: ``ulysses`` or ``ring``.
        ring_kernel: ``auto`` (the CPU flash kernel on CPU, plain tensor ops elsewhere),
            ``flash`` or ``eager``.
    """

    def __init__(self, group, style: str, ring_kernel: str = "auto"):
        import torch.distributed as dist

        if style not in CP_STYLES:
            raise ConfigError(f"recipe.cp_style={style!r}: choose one of {', '.join(CP_STYLES)}")
        self.group, self.style, self.ring_kernel = group, style, ring_kernel
        self.cp, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self._index: torch.Tensor | None = None  # [T/cp] global indices this rank holds
        self._documents: torch.Tensor | None = None  # [B, T] document id per token (packed rows)
        self._length = 0
        self._layout_cache: dict = {}

    # ---- batches ---------------------------------------------------------------------------
    def split(self, batch: dict[str, torch.Tensor], carries: Mapping[str, float]) -> dict[str, torch.Tensor]:
        """This rank's part of ``batch`` (every key ``[B, T]``): ``input_ids`` and global
        ``position_ids`` ``[B, T/cp]``, and each :attr:`~llmtrain.objectives.Objective.carries` key
        shifted by one before the split and given one leading pad column, ``[B, T/cp + 1]``: an
        objective's own shift (output ``i`` against carried ``i + 1``) then pairs each local output
        with its global next token once the output gets a trailing column (:meth:`pad_output`).

        Raises:
            ValueError: ``T`` is not a multiple of ``2 cp`` (engines right-pad batches to one first).
        """
        ids = batch["input_ids"]
        rows, length = ids.shape
        if length % (2 * self.cp):
            raise ValueError(f"rows of {length} tokens cannot be split into 2 x cp = {2 * self.cp} chunks; "
                             "pad them to a multiple first (Engine._padded_rows)")
        positions = batch.get("position_ids")
        if positions is None:
            positions = torch.arange(length, device=ids.device).expand(rows, -1)
        index = local_index(length, self.cp, self.rank, ids.device)
        starts = positions == 0
        self._documents = starts.cumsum(1) if bool((starts.sum(1) > 1).any()) else None
        self._index, self._length = index, length
        self._layout_cache = {}  # masks and orders of this row layout, shared by every layer
        local = {"input_ids": ids[:, index], "position_ids": positions[:, index]}
        for key, pad in carries.items():
            shifted = F.pad(batch[key][:, 1:], (0, 1), value=pad)
            local[key] = F.pad(shifted[:, index], (1, 0), value=pad)
        return local

    def _cached(self, key: Any, build):
        """``build()`` once per row layout (:meth:`split`): every decoder layer, forward and
        backward, uses the same masks and orders."""
        if key not in self._layout_cache:
            self._layout_cache[key] = build()
        return self._layout_cache[key]

    @staticmethod
    def pad_output(output: torch.Tensor) -> torch.Tensor:
        """``output`` ``[B, T/cp, ...]`` with one trailing position, so an objective's shift
        (dropping the last output) keeps every local output (see :meth:`split`)."""
        return torch.cat([output, torch.zeros_like(output[:, :1])], dim=1)

    # ---- attention -------------------------------------------------------------------------
    def _allowed(self, q_index: torch.Tensor, k_index: torch.Tensor) -> torch.Tensor:
        """Boolean ``[B or 1, 1, Tq, Tk]``: causal by global index, within one document."""
        allowed = (q_index[:, None] >= k_index[None, :])[None, None]
        if self._documents is not None:
            same = self._documents[:, q_index][:, :, None] == self._documents[:, k_index][:, None, :]
            allowed = allowed & same[:, None]
        return allowed

    def attention(self, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask: Any, dropout: float = 0.0, scaling: float | None = None,
                  **kwargs: Any) -> tuple[torch.Tensor, None]:
        """A ``transformers`` attention function over the split rows: ``query`` ``[B, H, T/cp, D]``,
        ``key``/``value`` ``[B, Hkv, T/cp, D]`` -> output ``[B, T/cp, H, D]`` (and no weights).
        ``attention_mask`` is ignored (rebuilt from the global layout of :meth:`split`).

        Raises:
            ConfigError: attention dropout during training, or a sliding-window layer.
        """
        if dropout and module.training:
            raise ConfigError("recipe.cp > 1 does not apply attention dropout; set model.architecture.attention_dropout=0")
        if kwargs.get("sliding_window"):
            raise ConfigError("recipe.cp > 1 does not support sliding-window attention layers")
        if kwargs.get("softcap") or kwargs.get("s_aux") is not None:
            raise ConfigError("recipe.cp > 1 computes plain softmax attention: this model's attention has a soft cap "
                              "or sink logits (softcap / s_aux); set recipe.cp=1")
        if self._index is None:
            raise RuntimeError("context-parallel attention called before ContextParallel.split set the row layout")
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        if self.style == "ulysses":
            out = self._ulysses(query, key, value, scale)
        else:
            out = self._ring(query, key, value, scale)
        return out.transpose(1, 2).contiguous(), None

    def _all_to_all(self, x: torch.Tensor, receive: list[int] | None = None, send: list[int] | None = None
                    ) -> torch.Tensor:
        """Differentiable all-to-all over dim 0 (torch's functional collective, as torchtitan uses
        for expert dispatch; its backward is the reverse all-to-all)."""
        from torch.distributed._functional_collectives import all_to_all_single_autograd, wait_tensor

        return wait_tensor(all_to_all_single_autograd(x.contiguous(), receive, send, self.group))

    def _ulysses(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        cp, (b, heads, local, d) = self.cp, q.shape
        if k.shape[1] % cp:  # too few KV heads to split: replicate them up to the query heads
            k = k.repeat_interleave(heads // k.shape[1], dim=1)
            v = v.repeat_interleave(heads // v.shape[1], dim=1)
        to_natural, to_ranks = self._cached("ulysses order", lambda: self._ulysses_order(local // 2, q.device))

        def gather_sequence(x: torch.Tensor) -> torch.Tensor:  # [B, h, T/cp, D] -> [B, h/cp, T, D]
            h = x.shape[1] // cp
            x = self._all_to_all(x.reshape(b, cp, h, local, d).transpose(0, 1))  # [cp source, B, h/cp, T/cp, D]
            return x.permute(1, 2, 0, 3, 4).reshape(b, h, cp * local, d)[:, :, to_natural]

        q, k, v = gather_sequence(q), gather_sequence(k), gather_sequence(v)
        gqa = k.shape[1] != q.shape[1]  # SDPA shares each KV head over its query heads (nothing repeated)
        if self._documents is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
        else:
            whole = torch.arange(self._length, device=q.device)
            mask = self._cached("ulysses mask", lambda: self._allowed(whole, whole))
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)
        h = out.shape[1]
        out = out[:, :, to_ranks].reshape(b, h, cp, local, d).permute(2, 0, 1, 3, 4)  # [cp dest, B, h/cp, T/cp, D]
        out = self._all_to_all(out)  # [cp source = head group, B, h/cp, T/cp, D]
        return out.transpose(0, 1).reshape(b, heads, local, d)

    def _ulysses_order(self, chunk: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Indices from the gathered (rank-ordered) row to the natural one and back."""
        order = torch.tensor(chunk_order(self.cp), device=device)
        # natural chunk c sits at place order.index(c) of the gathered (rank-ordered) row
        to_natural = torch.cat([torch.arange(p * chunk, (p + 1) * chunk, device=device)
                                for p in torch.argsort(order).tolist()])
        return to_natural, torch.argsort(to_natural)

    def _shift(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` from the previous cp rank (this rank's goes to the next); differentiable under
        autograd, plain inside :class:`_RingFlash`, which owns its backward."""
        n = x.numel()
        send, receive = [0] * self.cp, [0] * self.cp
        send[(self.rank + 1) % self.cp], receive[(self.rank - 1) % self.cp] = n, n
        return self._all_to_all(x.reshape(-1), receive, send).view_as(x)

    def _ring(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        if self.ring_kernel == "flash" or (self.ring_kernel == "auto" and q.device.type == "cpu"):
            return _RingFlash.apply(q, k, v, self, scale)
        return self._ring_eager(q, k, v, scale)

    def _pieces(self, source: int, device: torch.device):
        return self._cached(("ring pieces", source), lambda: self._build_pieces(source, device))

    def _build_pieces(self, source: int, device: torch.device):
        """The (query chunk, key chunk) pairs of this rank's queries against ``source``'s keys that
        see anything: ``(a, b, causal, additive mask or None)``, chunks 0/1 = head/tail of each
        side. A key chunk after the query chunk is skipped, the same chunk is causal, an earlier
        one fully visible (with packed rows, a document mask restricts both)."""
        chunk = self._length // (2 * self.cp)
        q_chunks, k_chunks = (self.rank, 2 * self.cp - 1 - self.rank), (source, 2 * self.cp - 1 - source)
        pieces = []
        for a, cq in enumerate(q_chunks):
            for b, ck in enumerate(k_chunks):
                if ck > cq:
                    continue
                mask = None
                if self._documents is not None:
                    qi = torch.arange(cq * chunk, (cq + 1) * chunk, device=device)
                    ki = torch.arange(ck * chunk, (ck + 1) * chunk, device=device)
                    allowed = self._allowed(qi, ki)  # [B, 1, chunk, chunk]
                    mask = torch.zeros(allowed.shape, device=device).masked_fill_(~allowed, float("-inf"))
                pieces.append((a, b, ck == cq and mask is None, mask))
        return pieces

    def _ring_eager(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        """Ring attention by plain tensor ops under autograd (devices without the CPU flash
        kernel): each block's fp32 scores are kept for backward, ``(T/cp)^2`` per head."""
        groups = q.shape[1] // k.shape[1]
        length = self._length
        q_index = self._index
        qf = q.float() * scale
        kv = torch.stack([k, v])  # K/V travel unreplicated (fewer bytes per hop)
        outputs, lses = [], []
        floor = torch.finfo(torch.float32).min  # finite: a row masked in one block gets weight exp(-huge) = 0
        for step in range(self.cp):
            source = (self.rank - step) % self.cp
            k_index = local_index(length, self.cp, source, q.device)
            kb, vb = kv[0].repeat_interleave(groups, dim=1), kv[1].repeat_interleave(groups, dim=1)
            scores = qf @ kb.float().transpose(-1, -2)  # [B, H, Tq, Tk]
            scores = scores.masked_fill(~self._allowed(q_index, k_index), floor)
            lse = torch.logsumexp(scores, dim=-1, keepdim=True)
            outputs.append(torch.exp(scores - lse) @ vb.float())
            lses.append(lse)
            if step + 1 < self.cp:
                kv = self._shift(kv)
        total = torch.logsumexp(torch.stack(lses), dim=0)
        out = sum(torch.exp(lse - total) * o for lse, o in zip(lses, outputs))
        return out.to(q.dtype)


def _flash_forward(q, k, v, scale, causal, mask):
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, causal, attn_mask=None if mask is None else mask.to(q.dtype), scale=scale)
    lse = lse.float()
    if mask is not None:  # the kernel gives a row with no visible key lse 0; it has weight 0
        lse = lse.masked_fill(torch.isinf(mask).all(-1).expand_as(lse), float("-inf"))
    return out, lse


def _merge(acc: tuple | None, out: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Online-softmax merge of two partial attentions over disjoint keys (FlashAttention's rescale):
    ``[B, H, T, D]`` fp32 outputs normalised by their own ``lse`` ``[B, H, T]``."""
    out = out.float()
    if acc is None:
        return out, lse
    acc_out, acc_lse = acc
    total = torch.logaddexp(acc_lse, lse)
    finite = torch.isfinite(total)
    w_acc = torch.where(finite, torch.exp(acc_lse - total), 0.0)[..., None]
    w_new = torch.where(finite, torch.exp(lse - total), 0.0)[..., None]
    return acc_out * w_acc + out * w_new, total


class _RingFlash(torch.autograd.Function):
    """Ring attention over CPU flash-attention blocks (``aten._scaled_dot_product_flash_attention_for_cpu``,
    which returns each block's log-sum-exp): forward merges the blocks online and saves only the
    local q, k, v, output and log-sum-exp; backward passes K/V around the ring again with their
    gradient buffers and runs the kernel's backward per block against the merged output and
    log-sum-exp (the gradient of softmax over all keys, as in FlashAttention-2's backward and
    torch's own ring attention), so no ``(T/cp)^2`` scores are kept."""

    @staticmethod
    def forward(ctx, q, k, v, context: ContextParallel, scale: float):
        groups = q.shape[1] // k.shape[1]
        chunk = q.shape[2] // 2
        q_parts = (q[:, :, :chunk], q[:, :, chunk:])
        acc: list[tuple | None] = [None, None]
        kv = torch.stack([k, v])
        for step in range(context.cp):
            source = (context.rank - step) % context.cp
            kb, vb = kv[0].repeat_interleave(groups, dim=1), kv[1].repeat_interleave(groups, dim=1)
            for a, b, causal, mask in context._pieces(source, q.device):
                keys = slice(b * chunk, (b + 1) * chunk)
                out, lse = _flash_forward(q_parts[a], kb[:, :, keys], vb[:, :, keys], scale, causal, mask)
                acc[a] = _merge(acc[a], out, lse)
            if step + 1 < context.cp:
                kv = context._shift(kv)
        out = torch.cat([acc[0][0], acc[1][0]], dim=2).to(q.dtype)
        lse = torch.cat([acc[0][1], acc[1][1]], dim=2)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.context, ctx.scale = context, scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        context, scale = ctx.context, ctx.scale
        groups = q.shape[1] // k.shape[1]
        chunk = q.shape[2] // 2
        grad_out = grad_out.contiguous().to(q.dtype)
        grad_q = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        kv = torch.stack([k, v])
        dkv = torch.zeros(kv.shape, dtype=torch.float32, device=q.device)  # travels with its K/V
        rows = lambda x, a: x[:, :, a * chunk:(a + 1) * chunk]  # noqa: E731
        for step in range(context.cp):
            source = (context.rank - step) % context.cp
            kb, vb = kv[0].repeat_interleave(groups, dim=1), kv[1].repeat_interleave(groups, dim=1)
            for a, b, causal, mask in context._pieces(source, q.device):
                keys = slice(b * chunk, (b + 1) * chunk)
                dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                    rows(grad_out, a).contiguous(), rows(q, a).contiguous(), kb[:, :, keys].contiguous(),
                    vb[:, :, keys].contiguous(), rows(out, a).contiguous(),
                    rows(lse, a).to(torch.float32).contiguous(), 0.0, causal,
                    attn_mask=None if mask is None else mask.to(q.dtype), scale=scale)
                grad_q[:, :, a * chunk:(a + 1) * chunk] += dq.float()
                shape = (dk.shape[0], k.shape[1], groups, chunk, dk.shape[-1])
                dkv[0][:, :, keys] += dk.float().view(shape).sum(2)  # repeated KV heads add up
                dkv[1][:, :, keys] += dv.float().view(shape).sum(2)
            if step + 1 < context.cp:
                kv = context._shift(kv)
            dkv = context._shift(dkv)  # after the last step this brings each buffer home
        return grad_q.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None


def install(model: torch.nn.Module, context: ContextParallel) -> None:
    """Route ``model``'s attention (every decoder layer's attention module) through ``context``:
    registers :data:`ATTENTION_NAME` with ``transformers.AttentionInterface`` (a dispatcher that
    finds the calling module's :class:`ContextParallel`) and switches the model to it."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, _dispatch)
    for module in model.modules():
        if hasattr(module, "o_proj") and hasattr(module, "q_proj"):
            module._llmtrain_context_parallel = context
    model.set_attn_implementation(ATTENTION_NAME)


def _dispatch(module, query, key, value, attention_mask, **kwargs):
    context = getattr(module, "_llmtrain_context_parallel", None)
    if context is None:
        raise RuntimeError(f"{type(module).__name__} runs {ATTENTION_NAME} attention without a ContextParallel "
                           "installed (llmtrain.parallel.context_parallel.install)")
    return context.attention(module, query, key, value, attention_mask, **kwargs)
