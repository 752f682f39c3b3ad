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
  result equals softmax attention over the whole row. No divisibility needed.

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

from llmtrain.errors import ConfigError

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


class ContextParallel:
    """One rank's view of a context-parallel group: splits batches, and runs attention over the
    split sequences (the attention function reads the row layout the last :meth:`split` set).

    Args:
        group: the process group of this rank's cp peers (ranks holding parts of the same rows).
        style: ``ulysses`` or ``ring``.
    """

    def __init__(self, group, style: str):
        import torch.distributed as dist

        if style not in CP_STYLES:
            raise ConfigError(f"recipe.cp_style={style!r}: choose one of {', '.join(CP_STYLES)}")
        self.group, self.style = group, style
        self.cp, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self._index: torch.Tensor | None = None  # [T/cp] global indices this rank holds
        self._documents: torch.Tensor | None = None  # [B, T] document id per token (packed rows)
        self._length = 0

    # ---- batches ---------------------------------------------------------------------------
    def split(self, batch: dict[str, torch.Tensor], carries: Mapping[str, float]) -> dict[str, torch.Tensor]:
        """This rank's part of ``batch`` (every key ``[B, T]``): ``input_ids`` and global
        ``position_ids`` ``[B, T/cp]`` (rows right-padded to a multiple of ``2 cp``), and each
        :attr:`~llmtrain.objectives.Objective.carries` key shifted by one before the split and
        given one leading pad column, ``[B, T/cp + 1]``: an objective's own shift (output ``i``
        against carried ``i + 1``) then pairs each local output with its global next token once
        the output gets a trailing column (:meth:`pad_output`)."""
        ids = batch["input_ids"]
        rows, length = ids.shape
        extra = -length % (2 * self.cp)
        positions = batch.get("position_ids")
        if positions is None:
            positions = torch.arange(length, device=ids.device).expand(rows, -1)
        if extra:  # pad tokens continue the last document; causal attention keeps them out of it
            ids = F.pad(ids, (0, extra))
            positions = torch.cat([positions, positions[:, -1:] + 1 + torch.arange(extra, device=ids.device)], dim=1)
        total = length + extra
        index = local_index(total, self.cp, self.rank, ids.device)
        starts = positions == 0
        self._documents = starts.cumsum(1) if bool((starts.sum(1) > 1).any()) else None
        self._index, self._length = index, total
        local = {"input_ids": ids[:, index], "position_ids": positions[:, index]}
        for key, pad in carries.items():
            value = batch[key]
            shifted = F.pad(value[:, 1:], (0, 1 + extra), value=pad)
            local[key] = F.pad(shifted[:, index], (1, 0), value=pad)
        return local

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
        order = torch.tensor(chunk_order(cp), device=q.device)
        chunk = local // 2
        # natural chunk c sits at place order.index(c) of the gathered (rank-ordered) row
        to_natural = torch.cat([torch.arange(p * chunk, (p + 1) * chunk, device=q.device)
                                for p in torch.argsort(order).tolist()])
        to_ranks = torch.argsort(to_natural)

        def gather_sequence(x: torch.Tensor) -> torch.Tensor:  # [B, h, T/cp, D] -> [B, h/cp, T, D]
            h = x.shape[1] // cp
            x = self._all_to_all(x.reshape(b, cp, h, local, d).transpose(0, 1))  # [cp source, B, h/cp, T/cp, D]
            return x.permute(1, 2, 0, 3, 4).reshape(b, h, cp * local, d)[:, :, to_natural]

        q, k, v = gather_sequence(q), gather_sequence(k), gather_sequence(v)
        if k.shape[1] != q.shape[1]:
            k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
            v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
        if self._documents is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
        else:
            whole = torch.arange(self._length, device=q.device)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=self._allowed(whole, whole), scale=scale)
        h = out.shape[1]
        out = out[:, :, to_ranks].reshape(b, h, cp, local, d).permute(2, 0, 1, 3, 4)  # [cp dest, B, h/cp, T/cp, D]
        out = self._all_to_all(out)  # [cp source = head group, B, h/cp, T/cp, D]
        return out.transpose(0, 1).reshape(b, heads, local, d)

    def _shift(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` from the previous cp rank (this rank's goes to the next), differentiably."""
        n = x.numel()
        send, receive = [0] * self.cp, [0] * self.cp
        send[(self.rank + 1) % self.cp], receive[(self.rank - 1) % self.cp] = n, n
        return self._all_to_all(x.reshape(-1), receive, send).view_as(x)

    def _ring(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
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
                           "installed (llmtrain.context_parallel.install)")
    return context.attention(module, query, key, value, attention_mask, **kwargs)
