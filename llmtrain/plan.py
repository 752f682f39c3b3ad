"""Memory planner: per-rank bytes of a run's layout before launching it, and ``+recipe=auto``.

``python -m llmtrain.plan <the overrides of a run> world_size=N [device_memory=80GiB]`` prints,
per rank, the bytes of parameters, gradients, optimizer state (and the fp32 master copy the
DeepSpeed engine keeps), activations and the largest temporary buffers, for the chosen recipe and,
as a table, for every shipped recipe that is valid on N ranks. Nothing is trained, no weights are
read and no process group is needed: the model is built on the meta device (parameter counts) and
one and two of its decoder layers are run under ``FakeTensorMode`` at the run's micro-batch shape
(bytes saved for backward), so a 70B model plans in seconds on a laptop. ``--check`` runs a dry
run of the layout instead (:mod:`llmtrain.planning.dry_run`).

How the bytes are counted: :mod:`llmtrain.planning.memory`; how ``+recipe=auto`` chooses:
:mod:`llmtrain.planning.auto`."""

from __future__ import annotations

import sys
import time

from llmtrain.common.interrupt import one_line_on_ctrl_c

# Run as a command, Ctrl-C from here on (the imports: a second or more) ends in one line.
with one_line_on_ctrl_c("llmtrain.plan", active=__name__ == "__main__"):
    from llmtrain.common.errors import ConfigError, LlmtrainError
    from llmtrain.common.hardware import default_device, resolve_precision
    from llmtrain.config.compose import compose
    from llmtrain.config.validate import parse_bytes
    from llmtrain.planning.auto import check_auto_overrides, choose, chosen_config, plan_all, with_fitting_batch
    from llmtrain.planning.memory import describe, fmt_bytes, plan_recipe, table


def main(argv: list[str] | None = None) -> int:
    """``python -m llmtrain.plan OVERRIDES world_size=N [device_memory=SIZE] [margin=F] [--check]``.
    Returns 0, or 2 on bad input (the message names the field)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if {"-h", "--help"} & set(args):
        from llmtrain.monitoring.console import plain_text

        print(plain_text(__doc__.split("\n\nHow the bytes")[0]) + "\n\nOptions besides a run's overrides: world_size=N (required), "
              "device_memory=SIZE (e.g. 80GiB; needed by +recipe=auto), host_memory=SIZE (per rank, for offload), "
              "margin=F (0.1), --check (a dry run of the layout instead of the bytes).")
        return 0
    options = {k: v for k, v in (a.split("=", 1) for a in args if "=" in a and a.split("=", 1)[0] in
                                 ("world_size", "device_memory", "margin", "host_memory"))}
    check = "--check" in args
    overrides = [a for a in args if a != "--check" and a.split("=", 1)[0] not in options]
    if "device_memory" in options:
        overrides.append(f"recipe.device_memory={options['device_memory']}")
    if "margin" in options:
        overrides.append(f"recipe.memory_margin={options['margin']}")
    try:
        if not options.get("world_size", "").isdigit() or int(options["world_size"]) < 1:
            raise ConfigError("world_size=N is required (the number of ranks to plan for, e.g. world_size=64)")
        world_size = int(options["world_size"])
        started = time.perf_counter()
        try:
            cfg = compose(overrides)
        except Exception as err:  # noqa: BLE001  (Hydra's and OmegaConf's composition errors)
            raise ConfigError(str(err).splitlines()[0]) from err
        r = cfg.recipe
        if cfg.trainer.precision == "auto":
            # A plan for devices elsewhere (device_memory given) assumes GPUs with bf16 tensor cores
            # (compute capability >= 8.0); without, the run would be on this machine's kind.
            cfg.trainer.precision = ("bf16" if r.device_memory is not None
                                     else resolve_precision("auto", default_device())[0])
            print(f"trainer.precision=auto planned as {cfg.trainer.precision}"
                  + (" (GPUs of compute capability >= 8.0; set trainer.precision=fp32 for older ones)"
                     if r.device_memory is not None else " (this machine's devices)"))
        if not 0 <= r.memory_margin < 1:
            raise ConfigError(f"margin={r.memory_margin} must be in [0, 1) (a fraction of device memory kept free)")
        device_memory = None if r.device_memory is None else parse_bytes(r.device_memory, "device_memory")
        budget = None if device_memory is None else int(device_memory * (1 - r.memory_margin))
        if r.auto:
            if device_memory is None:
                raise ConfigError("+recipe=auto needs device_memory=SIZE here (e.g. device_memory=80GiB): the "
                                  "planner runs without the devices")
            host = parse_bytes(options["host_memory"], "host_memory") if "host_memory" in options else None
            check_auto_overrides(cfg)
            choice = choose(cfg, world_size, device_memory, r.memory_margin, host_memory=host)
            cfg = chosen_config(cfg, choice)
            if choice.plan.host and host is None:
                choice.reasons.append(f"note: {choice.plan.recipe} offloads {fmt_bytes(choice.plan.host)} per rank to "
                                      "host memory, not checked here: give host_memory=SIZE (per rank) to check it")
            print("\n".join(choice.reasons))
            print(describe(choice.plan))
        if check:
            from llmtrain.planning.dry_run import dry_run

            print(dry_run(cfg, world_size))
            return 0
        # The global batch is the run's, but a planner asked about memory plans the default (or a
        # sweep's value) on any world size: the smallest divisible batch, said below.
        fit_batch = not any(a.lstrip("+").startswith("trainer.global_batch_size=") for a in overrides)
        if fit_batch and not r.auto:
            fitted = with_fitting_batch(cfg, world_size)
            if fitted is not cfg:
                print(f"note: trainer.global_batch_size={cfg.trainer.global_batch_size} does not divide into "
                      f"{r.name}'s micro-batches on {world_size} ranks; planned with {fitted.trainer.global_batch_size}, "
                      "the smallest that does (set trainer.global_batch_size to plan another)")
                cfg = fitted
        if not r.auto:
            plan = plan_recipe(cfg, world_size)
            if plan.error:
                raise ConfigError(f"{plan.recipe} is not valid on {world_size} ranks: {plan.error}")
            print(describe(plan))
        from llmtrain.models.adapters import is_partial

        if is_partial(cfg) and cfg.get("peft") is None:  # LoRA and QLoRA are counted as they train
            print("note: the planner counts full training; with model.freeze the frozen parameters carry no "
                  "gradient or optimizer state, so these figures are upper bounds")
        t = cfg.trainer
        print(f"\nevery recipe on {world_size} ranks (per rank; global batch {t.global_batch_size}, micro-batch "
              f"{t.micro_batch_size}, activation checkpointing {'on' if t.activation_checkpointing else 'off'}"
              f"{'; fits: total within ' + fmt_bytes(budget) if budget else ''}):")
        checkpointed = plan_all(cfg, world_size, checkpointing=True, fit_batch=fit_batch) if budget else None
        plans = plan_all(cfg, world_size, fit_batch=fit_batch)
        print(table(plans, budget, checkpointed))
        batches = {p.global_batch for p in plans if not p.error}
        if fit_batch and batches != {cfg.trainer.global_batch_size}:
            print("global batch per recipe (the smallest at or above trainer.global_batch_size that each layout "
                  "divides): " + ", ".join(f"{p.recipe}{f' ep {p.ep}' if p.ep > 1 else ''} {p.global_batch}"
                                            for p in plans if not p.error))
        print(f"\nplanned in {time.perf_counter() - started:.1f} s (model on the meta device, activations under "
              "FakeTensorMode; no weights read)")
    except LlmtrainError as err:  # a config's fields, or its model's files (ModelSourceError)
        print(f"llmtrain.plan: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    with one_line_on_ctrl_c("llmtrain.plan"):
        raise SystemExit(main())
