"""Does a row's logits depend on the other rows of its generation batch? The measurement behind
the ``hf`` engine's fixed-shape batches (:mod:`llmtrain.rollout.generate`): a SmolLM2-135M-shaped
Llama (4 of its 30 layers, config-built, random weights) on this CPU, 8 prompts of 5-31 tokens
left-padded (masked, positions from each prompt's first token), the prefill's last-position
logits and 6 greedy decoding steps with a KV cache, compared bit for bit between batches that
hold a prompt's row with other companions, at another row, with dummy rows, at another row count
``R`` or another padded width ``P``, and a batch with no padding at all (an all-ones mask, which
``transformers`` drops for causal attention) against one with a dummy row. Prints ``bitwise`` or the largest absolute difference.

    python scripts/bench/rollout_shapes.py [fp32|bf16] [threads]
"""

from __future__ import annotations

import sys

import benchlib  # noqa: F401  (the checkout's llmtrain first)
import torch

STEPS = 6


def model_of(dtype: torch.dtype) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=4,
                         num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048,
                         tie_word_embeddings=True)
    return LlamaForCausalLM(config).eval().to(dtype)


@torch.no_grad()
def logits(model: torch.nn.Module, rows: list[list[int] | None], width: int, last_only: bool = True) -> torch.Tensor:
    """fp32 ``[rows, 1 + STEPS, vocab]``: each row's prefill logits (last position) and greedy steps';
    a row of None is a dummy (one token)."""
    from transformers import DynamicCache

    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, row in enumerate(rows):
        row = row if row is not None else [0]
        ids[i, width - len(row):] = torch.tensor(row)
        mask[i, width - len(row):] = 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    cache = DynamicCache()
    keep = {"logits_to_keep": 1} if last_only else {}
    out = model(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache, use_cache=True,
                **keep).logits[:, -1].float()
    steps = [out]
    for _ in range(STEPS):
        mask = torch.cat([mask, torch.ones(len(rows), 1, dtype=torch.long)], 1)
        positions = positions[:, -1:] + 1
        out = model(input_ids=out.argmax(-1)[:, None], attention_mask=mask, position_ids=positions,
                    past_key_values=cache, use_cache=True).logits[:, -1].float()
        steps.append(out)
    return torch.stack(steps, 1)


def compare(a: torch.Tensor, b: torch.Tensor) -> str:
    return "bitwise" if torch.equal(a, b) else f"max {float((a - b).abs().max()):.2e}"


def main() -> None:
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[sys.argv[1] if len(sys.argv) > 1 else "fp32"]
    torch.set_num_threads(int(sys.argv[2]) if len(sys.argv) > 2 else 1)
    model = model_of(dtype)
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, 49152, (n,), generator=generator).tolist() for n in (9, 23, 17, 31, 5, 12, 28, 20)]
    base = logits(model, prompts, 32)  # R = 8, P = 32
    perm = [3, 0, 7, 5, 1, 6, 2, 4]
    permuted = logits(model, [prompts[i] for i in perm], 32)
    others = logits(model, [prompts[1], None, None, prompts[6], None, prompts[1], None, None], 32)
    group = logits(model, [prompts[2]] * 8, 32)
    print(f"{sys.argv[1:] or ['fp32']} threads {torch.get_num_threads()}")
    print("R=8 P=32, rows permuted:", compare(torch.stack([permuted[j] for j in range(8)]),
                                             torch.stack([base[i] for i in perm])))
    print("R=8 P=32, other companions and dummy rows:", compare(others[[0, 3, 5]], base[[1, 6, 1]]))
    print("R=8 P=32, one prompt's group of 8 rows:", compare(group, base[[2] * 8]))
    for width in (31, 40, 48, 64, 100):
        print(f"R=8 P={width} against P=32:", compare(logits(model, prompts, width), base))
    for count in (1, 2, 4, 6, 12, 16):
        rows = (prompts * 2)[:count]
        print(f"R={count} P=32 against R=8:", compare(logits(model, rows, 32)[:min(count, 8)], base[:min(count, 8)]))
    same = [prompts[3]] * 4  # 31 tokens each: no padding at P = 31, an all-ones mask
    print("R=4 P=31, no padding against 3 rows + a dummy row:",
          compare(logits(model, same, 31)[:3], logits(model, same[:3] + [None], 31)[:3]))
    print("R=4 P=32 (a pad column in every row), the same:",
          compare(logits(model, same, 32)[:3], logits(model, same[:3] + [None], 32)[:3]))
    print("every position's logits in the prefill against the last one's:",
          compare(logits(model, prompts, 32, last_only=False), base))


if __name__ == "__main__":
    main()
