"""Peak memory and CPU time of one GRPO optimizer step's training pass (every micro-batch's
forward and backward through the engine's loss path: :meth:`llmtrain.engine.base.Engine._loss_sums`),
with whole logits (``whole``: what GRPO ran before the bounded label head, and what it still runs
without one) against the bounded label head (``chunked``: completion positions only, chunks of
``--chunk`` tokens, 0 = the default :data:`llmtrain.models.chunked_loss.BOUNDED_CHUNK_TOKENS`).

Each cell (prompts x G x completion length, micro-batch in prompts) runs in a fresh process, so
its peak RSS (``ru_maxrss``) is its own; the order of the two modes alternates over rounds (the
machine may be shared: compare the modes within a round). ``full logits`` is one micro-batch's
``[rows, seq, vocab]`` fp32 logits, the unit the issue measured the peak in. The model is a
random-weight Llama of the given shape (memory depends on shapes, not values); ``--lora``
trains LoRA adapters (r=16, every linear layer but the output one) as the issue's job did.
Peak RSS includes what glibc's heap keeps after frees (several micro-batches in a row ratchet it
up); ``--mmap-threshold 65536`` makes it follow the live tensors more closely.

    python scripts/bench/grpo_memory.py --model tiny --grid 2x4x64,2x8x128 --micro 1,2 --rounds 2
    python scripts/bench/grpo_memory.py --model smollm2 --lora --grid 2x8x128 --micro 1

``--plan`` runs the chunked mode only (what GRPO runs) and sets each cell beside the memory
planner's figure for the same job (:func:`llmtrain.planning.memory.plan_recipe`: the shape as
``model=tiny_llama`` with its architecture overridden, ``objective=grpo``, ``data.seq_len`` the
prompt and completion, LoRA as ``+peft=lora peft.r=16``): the planner counts the tensors, so the
measured figure to set beside it is the peak RSS less what the process held before the model was
built (interpreter and libraries, ``base``). Each child also holds AdamW's state and the
gradients, as a training step's peak does, which the planner counts.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

import benchlib

SHAPES = {  # LlamaConfig fields; smollm2: SmolLM2-135M's config (tied embeddings)
    "tiny": dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, tie_word_embeddings=True),
    "smollm2": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True),
}
PROMPT_TOKENS = 68  # GSM8K chat prompts of SmolLM2's tokenizer: 60-80 tokens


def rss_bytes() -> int:
    """This process's resident set now."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def one_cell(model_name: str, mode: str, prompts: int, g: int, length: int, micro: int, chunk: int,
             lora: bool) -> dict:
    """One step's training pass in this process (AdamW's state already there, the gradients
    accumulating); the figures as a dict."""
    from types import SimpleNamespace

    import torch
    from omegaconf import OmegaConf
    from transformers import LlamaConfig, LlamaForCausalLM

    from llmtrain.engine.base import Engine, model_inputs
    from llmtrain.models.chunked_loss import install
    from llmtrain.objectives.grpo import GRPO

    if lora:
        from peft import LoraConfig, get_peft_model
    base = rss_bytes()  # the interpreter and libraries, before any tensor of the model
    torch.manual_seed(0)
    config = LlamaConfig(max_position_embeddings=2048, **SHAPES[model_name])
    model = LlamaForCausalLM(config).float().train()
    if lora:
        model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear"))
    objective = GRPO({"loss_type": "dapo", "num_generations": g})
    objective.temperature, objective.max_completion_length = 0.7, length
    head = install(model, chunk, bounded=True) if mode == "chunked" else None
    trained = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trained)
    for p in trained:  # AdamW's two moments exist from the first step on, as in a run's later steps
        p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)

    class Bare:  # the engine's loss path around the bare model (one process)
        _loss_sums, _padded_rows = Engine._loss_sums, Engine._padded_rows
        cfg, dims = OmegaConf.create({"recipe": {}}), SimpleNamespace(cp=1, tp=1)
        context, routers, label_head = None, [], head

        def __init__(self):
            self.objective = objective

        def forward(self, batch):
            return model(**model_inputs(batch)).logits

    engine, rows, seq = Bare(), micro * g, PROMPT_TOKENS + length
    gen = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(prompts // micro):
        ids = torch.randint(2, config.vocab_size, (rows, seq), generator=gen)
        labels = ids.clone()
        labels[:, :PROMPT_TOKENS] = -100
        shape = ids.shape
        batches.append(objective.prepare({
            "input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels,
            "completion_mask": (labels != -100).float(), "advantages": torch.randn(shape, generator=gen),
            "old_logps": torch.zeros(shape), "ref_logps": torch.zeros(shape)}))
    normaliser = sum(float(objective.normaliser(b)) for b in batches)
    before, began = rss_bytes(), time.process_time()
    for batch in batches:
        sums = engine._loss_sums(batch, training=True)
        (sums.loss / normaliser).backward()
    cpu = time.process_time() - began
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"mode": mode, "cell": f"{prompts}x{g}x{length}", "micro": micro, "peak_rss_gib": peak / 2**30,
            "step_extra_gib": (peak - before) / 2**30, "base_gib": base / 2**30, "cpu_s": cpu,
            "full_logits_gib": rows * seq * config.vocab_size * 4 / 2**30,
            "entropy": float(sums.metrics["entropy"] / sums.metrics["_tokens"])}


def planned_gib(model_name: str, lora: bool, prompts: int, g: int, length: int, micro: int, chunk: int) -> float:
    """The memory planner's figure (GiB, one process, fp32) for a cell's GRPO step."""
    from llmtrain.config.compose import compose
    from llmtrain.planning.memory import plan_recipe

    shape = [f"model.architecture.{k}={v}" for k, v in SHAPES[model_name].items()]
    cfg = compose(["model=tiny_llama", *shape, "model.architecture.max_position_embeddings=2048", "objective=grpo",
                   f"objective.num_generations={g}", "objective.loss_type=dapo", "reward.functions=[gsm8k]", "data=prompts",
                   f"data.seq_len={PROMPT_TOKENS + length}", f"rollout.max_completion_length={length}",
                   f"trainer.micro_batch_size={micro}", f"trainer.global_batch_size={prompts}",
                   "trainer.precision=fp32", f"trainer.loss_chunk_tokens={chunk}",
                   *(["+peft=lora", "peft.r=16", "peft.alpha=32"] if lora else [])])
    plan = plan_recipe(cfg, 1)
    if plan.error:
        raise SystemExit(f"the planner refuses cell {prompts}x{g}x{length} mb {micro}: {plan.error}")
    return plan.total / 2**30


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(SHAPES), default="tiny")
    parser.add_argument("--grid", default="2x4x64,2x8x128", help="prompts x G x completion tokens, comma-separated")
    parser.add_argument("--micro", default="1,2", help="micro-batch sizes in prompts, comma-separated")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--chunk", type=int, default=0, help="tokens per chunk (0: the default)")
    parser.add_argument("--lora", action="store_true")
    parser.add_argument("--mmap-threshold", type=int, default=0, metavar="BYTES",
                        help="children's MALLOC_MMAP_THRESHOLD_ (glibc): allocations above it go back to the system "
                             "when freed, so peak RSS follows live tensors rather than the heap's high-water mark")
    parser.add_argument("--plan", action="store_true",
                        help="the chunked mode only, beside the memory planner's figure for each cell")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        mode, cell, micro = args.child.split(":")
        prompts, g, length = (int(x) for x in cell.split("x"))
        print(json.dumps(one_cell(args.model, mode, prompts, g, length, int(micro), args.chunk, args.lora)))
        return
    print(f"model {args.model}{' + LoRA r=16' if args.lora else ''}, prompt {PROMPT_TOKENS} tokens, "
          f"MALLOC_MMAP_THRESHOLD_={args.mmap_threshold or 'glibc default'}, "
          f"chunk {args.chunk or 'default'}, {os.cpu_count()} cores, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}")
    print(f"{'cell':>10} {'mb':>3} {'round':>5} {'mode':>8} {'peak GiB':>9} {'step +GiB':>9} {'logits GiB':>10} "
          f"{'CPU s':>7}" + (f" {'base GiB':>8} {'peak-base':>9} {'planned':>8} {'ratio':>6}" if args.plan else ""),
          flush=True)
    results: dict[tuple, dict[str, list[dict]]] = {}
    env = {**os.environ, "PYTHONPATH": str(benchlib.REPO)}
    if args.mmap_threshold:
        env["MALLOC_MMAP_THRESHOLD_"] = str(args.mmap_threshold)
    for cell in args.grid.split(","):
        prompts, g, length = (int(x) for x in cell.split("x"))
        for micro in (int(m) for m in args.micro.split(",")):
            planned = planned_gib(args.model, args.lora, prompts, g, length, micro, args.chunk) if args.plan else 0.0
            for r in range(args.rounds):
                for mode in (["chunked"] if args.plan else benchlib.alternating(("whole", "chunked"), r)):
                    run = subprocess.run([sys.executable, __file__, "--model", args.model, "--chunk", str(args.chunk),
                                          *(["--lora"] if args.lora else []), "--child", f"{mode}:{cell}:{micro}"],
                                         capture_output=True, text=True, env=env)
                    if run.returncode:
                        print(f"{cell:>10} {micro:>3} {r:>5} {mode:>8} failed (exit {run.returncode}): "
                              f"{run.stderr.strip().splitlines()[-1:]}", flush=True)
                        continue
                    out = json.loads(run.stdout.strip().splitlines()[-1])
                    results.setdefault((cell, micro), {}).setdefault(mode, []).append(out)
                    live = out["peak_rss_gib"] - out["base_gib"]
                    print(f"{cell:>10} {micro:>3} {r:>5} {mode:>8} {out['peak_rss_gib']:9.2f} {out['step_extra_gib']:9.2f} "
                          f"{out['full_logits_gib']:10.2f} {out['cpu_s']:7.1f}"
                          + (f" {out['base_gib']:8.2f} {live:9.2f} {planned:8.2f} {live / planned:6.2f}"
                             if args.plan else ""), flush=True)
    if args.plan:
        return
    print("\nsummary (medians; chunked / whole)")
    for (cell, micro), modes in results.items():
        if len(modes) < 2:
            continue
        med = {m: {k: sorted(o[k] for o in v)[len(v) // 2] for k in ("peak_rss_gib", "step_extra_gib", "cpu_s")}
               for m, v in modes.items()}
        w, c = med["whole"], med["chunked"]
        print(f"{cell:>10} mb {micro}: peak {w['peak_rss_gib']:.2f} -> {c['peak_rss_gib']:.2f} GiB "
              f"({c['peak_rss_gib'] / w['peak_rss_gib']:.2f}x); step extra {w['step_extra_gib']:.2f} -> "
              f"{c['step_extra_gib']:.2f} GiB; CPU {w['cpu_s']:.1f} -> {c['cpu_s']:.1f} s "
              f"({c['cpu_s'] / w['cpu_s']:.2f}x)")


if __name__ == "__main__":
    main()
