"""The run report: a finished (or interrupted) run summarised (``python -m llmtrain.report RUN_DIR``).

Reads ``metrics.jsonl`` (required), ``config.yaml`` and ``timeline.jsonl`` (both optional) from a
run directory and writes next to them ``report.png`` (loss, learning rate, grad norm, throughput
and memory curves) and ``report.md`` (config summary, final figures with MFU and the peak it is
measured against, goodput breakdown, one row per process of the run). Times are in seconds, memory in GiB (2**30 bytes).
"""

from __future__ import annotations

import json
import logging
import math
import os
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import EngFormatter, MaxNLocator
from omegaconf import DictConfig, OmegaConf

log = logging.getLogger("llmtrain")

GIB = 2**30
CONFIG_FIELDS = ["name", "model.name", "data.name", "data.seq_len", "objective.name", "recipe.name", "recipe.engine",
                 "recipe.zero_stage", "recipe.auto", "trainer.max_steps", "trainer.global_batch_size",
                 "trainer.micro_batch_size", "trainer.precision", "trainer.lr"]
GOODPUT_ROWS = [("productive", "time/productive_s"), ("startup", "time/startup_s"), ("eval", "time/eval_s"),
                ("checkpoint", "time/checkpoint_s"), ("lost (redone after crash)", "time/lost_s"),
                ("restart", "time/restart_s")]


def read_jsonl(path: Path) -> list[dict]:
    """The JSON objects of ``path``, one per line; a missing file gives ``[]`` and lines that do
    not parse (a write cut short by a crash) are skipped."""
    if not path.is_file():
        return []
    records = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            obj = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(obj, dict):
            records.append(obj)
    return records


# Values whose NaN or infinity is news (a diverged run); any other number must be finite.
_MAY_BE_NONFINITE = ("train/loss", "train/grad_norm", "val/loss", "val/perplexity")


def _clean(record: dict) -> dict:
    """The record's numeric values (bools and strings dropped; non-finite ones kept only for
    the losses and the gradient norm, which report them)."""
    return {k: v for k, v in record.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool)
            and (k in _MAY_BE_NONFINITE or math.isfinite(v))}


def series(records: list[dict], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of the records that hold a number under ``key``."""
    pairs = [(r["step"], float(r[key])) for r in records
             if isinstance(r.get(key), (int, float)) and not isinstance(r.get(key), bool) and "step" in r]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def processes(events: list[dict], last_step: int | None) -> list[dict]:
    """One dict per process (``start`` event) of the timeline: ``time`` (Unix s), ``from_step``,
    ``to_step``, ``world_size``, ``recipe`` and ``ended`` (how it ended, in words)."""
    out = []
    for i, ev in enumerate(events):
        if ev.get("event") != "start":
            continue
        nxt = next((e for e in events[i + 1:] if e.get("event") in ("start", "end")), None)
        proc = {"time": ev.get("time"), "from_step": ev.get("step", 0), "world_size": ev.get("world_size"),
                "recipe": ev.get("recipe")}
        if nxt is None:
            # No record after the last start: still running, or killed too hard to write one.
            proc.update(to_step=last_step, ended="no end record (still running, or killed)")
        elif nxt["event"] == "end":
            proc.update(to_step=nxt.get("step"), ended=str(nxt.get("reason", "ended")))
        else:
            proc.update(to_step=nxt.get("step"), ended="killed or crashed (no end record); the next start "
                                                       f"resumed from step {nxt.get('step')}")
        out.append(proc)
    return out


def _fmt(x, spec: str | None = None) -> str:
    if x is None:
        return "n/a"
    if spec is None:  # ints as they are (max_steps=100000 is not "1e+05"), floats to 4 significant digits
        spec = ".4g" if isinstance(x, float) else ""
    return format(x, spec) if isinstance(x, (int, float)) else str(x)


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def _data_wait(records: list[dict]) -> str:
    """The seconds a step waited for its micro-batches (``time/data_wait_s``), mean over the
    logged steps, in ms and as a share of their step time (``train/step_time_s``)."""
    waits, steps = dict(zip(*series(records, "time/data_wait_s"))), dict(zip(*series(records, "train/step_time_s")))
    both = [s for s in waits if s in steps]
    wait, stepped = _mean(list(waits.values())), sum(steps[s] for s in both)
    share = sum(waits[s] for s in both) / stepped if stepped > 0 else None
    return f"{1000 * wait:.1f} ms per step" + (f" ({100 * share:.1f} % of step time)" if share is not None else "")


def _tokens_at(records: list[dict], steps: list[int]) -> list[float]:
    """Tokens seen at ``steps``, interpolated between logged records; step 0 has seen none."""
    known_steps, known_tokens = series(records, "train/tokens_seen")
    xs, ys = [0] + known_steps, [0.0] + known_tokens
    return list(np.interp(steps, xs, ys)) if known_steps else []


def _no_data(ax) -> None:
    ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes, color="gray")
    ax.set_xticks([])
    ax.set_yticks([])


def _resume_lines(ax, xs: list[float]) -> None:
    for i, x in enumerate(xs):
        ax.axvline(x, color="gray", linestyle="--", linewidth=1, label="resume" if i == 0 else "_nolegend_")
        # Labelled on the line too: not every subplot has a legend.
        ax.text(x, 0.98, " resume", transform=ax.get_xaxis_transform(), rotation=90, va="top", ha="left",
                fontsize=8, color="gray")


def _step_ticks(ax) -> None:
    """Integer ticks on the x axis (steps, tokens): a 3-step run shows 1, 2, 3, not 1.5."""
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def proportional_scale(xs: tuple[list[int], list[float]], ys: tuple[list[int], list[float]],
                       rtol: float = 1e-6) -> float | None:
    """The factor ``k`` with ``y = k * x`` at every step both series log (``perf/tflops_per_device``
    and ``perf/mfu`` are fixed multiples of ``train/tokens_per_s`` within a run), or None when
    they share no step with ``x > 0`` or the ratio varies by more than ``rtol`` (a resume on
    another world size changes it)."""
    x_at = dict(zip(*xs))
    ratios = [y / x_at[s] for s, y in zip(*ys) if x_at.get(s, 0) > 0]
    if not ratios or not all(math.isfinite(r) for r in ratios):
        return None
    lo, hi = min(ratios), max(ratios)
    return ratios[0] if hi - lo <= rtol * max(abs(hi), abs(lo), 1e-300) else None


def _throughput(ax, records: list[dict], resumes: list[int]) -> None:
    """tokens/s against steps, and MFU (%) or else TFLOP/s per device: while the second is
    proportional to the first, a secondary y axis (one curve, two scales); otherwise its own
    dashed curve on a twin axis."""
    tps = series(records, "train/tokens_per_s")
    mfu, tflops = series(records, "perf/mfu"), series(records, "perf/tflops_per_device")
    other, other_label, factor = ((mfu, "MFU (%)", 100.0) if mfu[0] else (tflops, "TFLOP/s per device", 1.0))
    if not tps[0] and not other[0]:
        _no_data(ax)
        return
    ax.set(xlabel="step", title="throughput")
    _step_ticks(ax)
    if not tps[0]:  # a second quantity without tokens/s: plotted on its own
        ax.plot(other[0], [factor * v for v in other[1]], color="tab:orange", label=other_label)
        ax.set_ylabel(other_label)
        _resume_lines(ax, resumes)
        return
    ax.plot(tps[0], tps[1], label="tokens/s")
    ax.set_ylabel("tokens/s")
    _resume_lines(ax, resumes)
    if not other[0]:
        return
    k = proportional_scale(tps, other)
    if k is not None and k > 0:
        scale = factor * k
        ax.secondary_yaxis("right", functions=(lambda t: t * scale, lambda m: m / scale)).set_ylabel(other_label)
        return
    right = ax.twinx()
    right.plot(other[0], [factor * v for v in other[1]], color="tab:orange", linestyle="--", label=other_label)
    right.set_ylabel(other_label)
    handles = ax.get_legend_handles_labels()[0] + right.get_legend_handles_labels()[0]
    ax.legend(handles, [h.get_label() for h in handles], loc="lower right")


def build_figure(records: list[dict], resumes: list[int], title: str, expert_load: dict | None = None) -> Figure:
    """The report's 3 x 2 panels (figsize 12 x 10 inches): loss against steps and against tokens
    seen (train curve, validation points), learning rate, gradient norm, throughput (tokens/s,
    with MFU or TFLOP/s per device as a second scale) and peak memory (GiB) against steps, with
    a dashed line at each resume step. Step axes have integer ticks. ``records`` are the cleaned
    ``metrics.jsonl`` records sorted by step; a panel without data says so.

    Task scores (``eval/TASK/METRIC`` records, :mod:`llmtrain.evaluation.in_loop`): a last row (4 inches
    more) with each score against the step of the checkpoint it was measured on, scores in [0, 1]
    (accuracies) on the left and the others (perplexities, bits per byte) on the right.

    ``expert_load`` (a mixture-of-experts run's ``expert_load.json``): a fourth row (figsize 12 x
    14) with the heatmap of tokens per expert over the run (MoE layers x experts, each cell the
    expert's share of its layer's assignments over the uniform share 1/E: 1 = balanced) and each
    layer's busiest expert over the mean against steps (``moe/layer*/load_max_over_mean``)."""
    scores = eval_keys(records)
    rows = 3 + bool(expert_load) + bool(scores)
    fig = Figure(figsize=(12, 10 + 4 * (rows - 3)), dpi=100)
    FigureCanvasAgg(fig)  # attaches itself to fig: no pyplot, no global backend state
    axes = fig.subplots(rows, 2).ravel()
    if expert_load:
        _expert_panels(fig, axes[6], axes[7], records, expert_load, resumes)
    if scores:
        _eval_panels(axes[-2], axes[-1], task_scores(records), scores, resumes)
    fig.suptitle(title)
    train, val = series(records, "train/loss"), series(records, "val/loss")
    resume_tokens = _tokens_at(records, resumes)
    unit = loss_unit(records)
    panels = [(axes[0], lambda s: s, "step", resumes)]
    if unit == "token":
        panels.append((axes[1], lambda s: _tokens_at(records, s), "tokens seen", resume_tokens))
    elif unit == "completion":  # online RL: reward and completion length where others show loss vs tokens
        _rollout_panel(axes[1], records, resumes)
    else:  # preference runs: accuracy and margins where token-based runs show loss vs tokens
        _preference_panel(axes[1], records, resumes)

    for ax, xs_of, xlabel, resume_xs in panels:
        if not train[0] and not val[0]:
            _no_data(ax)
            continue
        if train[0] and xs_of(train[0]):
            ax.plot(xs_of(train[0]), train[1], label="train loss")
        if val[0] and xs_of(val[0]):
            ax.plot(xs_of(val[0]), val[1], "o", label="val loss")
        if not ax.lines:  # losses vs tokens without train/tokens_seen
            _no_data(ax)
            continue
        _resume_lines(ax, resume_xs)
        ylabel = {"token": "loss (nats/token)", "completion": "loss (clipped surrogate)"}.get(unit, f"loss (per {unit})")
        ax.set(xlabel=xlabel, ylabel=ylabel,
               title=f"loss vs {xlabel}")
        _step_ticks(ax)
        if xlabel == "tokens seen":  # 1.2M, not 1200000: millions of tokens at 5-6 ticks do not overlap
            ax.xaxis.set_major_locator(MaxNLocator(nbins=5, integer=True))
            ax.xaxis.set_major_formatter(EngFormatter(sep=""))
        ax.legend()

    single = [(axes[2], "train/lr", 1.0, "learning rate", "learning rate"),
              (axes[3], "train/grad_norm", 1.0, "grad norm (L2)", "gradient norm"),
              (axes[5], "memory/peak_bytes", 1 / GIB, "peak memory (GiB)", "peak memory")]
    for ax, key, scale, ylabel, name in single:
        steps, values = series(records, key)
        if not steps:
            _no_data(ax)
            continue
        ax.plot(steps, [v * scale for v in values])
        _resume_lines(ax, resumes)
        ax.set(xlabel="step", ylabel=ylabel, title=name)
        _step_ticks(ax)

    _throughput(axes[4], records, resumes)
    fig.tight_layout()
    return fig


def _task_keys(record: dict) -> list[str]:
    return [k for k in record if k.startswith("eval/") and k.count("/") >= 2]


def task_scores(records: list[dict]) -> list[dict]:
    """One record per step (sorted) with its task scores (``eval/TASK/METRIC``): of a task scored
    more than once at a step, the evaluation over the most documents (``eval/TASK/documents``; the
    first of equals, as the trackers keep it), so a whole task supersedes a ``limit``ed one."""
    best: dict[tuple[int, str], tuple[float, dict]] = {}
    for record in records:
        step = record.get("step")
        for task in dict.fromkeys(k.split("/")[1] for k in _task_keys(record)):
            documents = record.get(f"eval/{task}/documents", 0)
            if (step, task) not in best or documents > best[(step, task)][0]:
                best[(step, task)] = (documents, {k: record[k] for k in _task_keys(record)
                                                  if k.split("/")[1] == task})
    by_step: dict[int, dict] = {}
    for (step, _), (_, values) in best.items():
        by_step.setdefault(step, {"step": step}).update(values)
    return [by_step[step] for step in sorted(by_step)]


def eval_keys(records: list[dict]) -> list[str]:
    """The task-score keys (``eval/TASK/METRIC``) the records hold, sorted (document counts left out)."""
    return sorted({k for r in records for k in _task_keys(r) if not k.endswith("/documents")})


def _eval_panels(bounded_ax, other_ax, records: list[dict], keys: list[str], resumes: list[int]) -> None:
    series_of = {key: series(records, key) for key in keys}
    bounded = [k for k, (_, values) in series_of.items() if all(0.0 <= v <= 1.0 for v in values)]
    for ax, chosen, ylabel, title in ((bounded_ax, bounded, "score", "task scores (accuracy)"),
                                      (other_ax, [k for k in keys if k not in bounded], "value",
                                       "task scores (perplexity, bits per byte)")):
        if not chosen:
            _no_data(ax)
            continue
        for key in chosen:
            steps, values = series_of[key]
            ax.plot(steps, values, "o-", label=key[len("eval/"):])
        values = [v for key in chosen for v in series_of[key][1] if v > 0]
        if ax is other_ax and values and max(values) > 10 * min(values):
            ax.set_yscale("log")  # perplexities and bits per byte differ by orders of magnitude
        _resume_lines(ax, resumes)
        ax.set(xlabel="step (checkpoint evaluated)", ylabel=ylabel, title=title)
        _step_ticks(ax)
        ax.legend(fontsize="small")


def _expert_panels(fig: Figure, heat_ax, load_ax, records: list[dict], load: dict, resumes: list[int]) -> None:
    layers = [int(i) for i in load.get("moe_layers", [])]
    counts = load.get("tokens_per_expert") or []
    grid = []
    for layer in layers:
        row = counts[layer] if layer < len(counts) else []
        total = sum(row)
        grid.append([c * len(row) / total if total else 0.0 for c in row])
    if not grid or not grid[0]:
        _no_data(heat_ax)
    else:
        image = heat_ax.imshow(grid, aspect="auto", cmap="viridis", interpolation="nearest")
        if len(grid[0]) <= 32:
            heat_ax.set_xticks(range(len(grid[0])))
        heat_ax.set(xlabel="expert", ylabel="MoE layer", yticks=range(len(layers)), yticklabels=layers,
                    title=f"expert load over steps 1-{load.get('step')} (share x E; 1 = balanced)")
        fig.colorbar(image, ax=heat_ax)
    plotted = False
    for layer in layers:
        steps, values = series(records, f"moe/layer{layer}/load_max_over_mean")
        if steps:
            load_ax.plot(steps, values, label=f"layer {layer}")
            plotted = True
    if not plotted:
        _no_data(load_ax)
        return
    _resume_lines(load_ax, resumes)
    load_ax.set(xlabel="step", ylabel="busiest expert / mean", title="router balance per layer")
    _step_ticks(load_ax)
    if len(layers) <= 12:
        load_ax.legend(fontsize="small")


def loss_unit(records: list[dict]) -> str:
    """What a run's loss is a mean over: ``token`` (next-token objectives), ``pair`` (preference
    and reward objectives), ``example`` (KTO) or ``completion`` (online RL: a policy-gradient
    surrogate over sampled completions), told by the metrics the run logged."""
    keys = set().union(*(r.keys() for r in records)) if records else set()
    if "train/reward" in keys or "val/reward" in keys:
        return "completion"
    if "train/kl" in keys or "val/kl" in keys:
        return "example"
    if "train/rewards/chosen" in keys or "val/rewards/chosen" in keys:
        return "pair"
    return "token"


def _preference_panel(ax, records: list[dict], resumes: list[int]) -> None:
    """Preference accuracy (train line, validation points) and, on a second scale, the mean
    reward margin, against steps; KTO (no accuracy): the desirable and undesirable rewards."""
    plotted = False
    for key, style, label in (("train/rewards/accuracies", "-", "train accuracy"),
                              ("val/rewards/accuracies", "o", "val accuracy"),
                              ("train/rewards/chosen", "-", "train reward (desirable)"),
                              ("train/rewards/rejected", "-", "train reward (undesirable)")):
        if key.endswith(("chosen", "rejected")) and series(records, "train/rewards/accuracies")[0]:
            continue
        steps, values = series(records, key)
        if steps:
            ax.plot(steps, values, style, label=label)
            plotted = True
    if not plotted:
        _no_data(ax)
        return
    _second_scale(ax, series(records, "val/rewards/margins"), "s", "tab:red", "val margin",
                  "reward margin (chosen - rejected)")
    _finish_step_panel(ax, resumes, "preference accuracy" if series(records, "train/rewards/accuracies")[0]
                       else "implicit reward", "preference accuracy and margin")


def _second_scale(ax, xy: tuple[list[int], list[float]], style: str, color: str, label: str, ylabel: str) -> None:
    """``xy`` (steps, values) on a second y scale of ``ax``, its legend at the lower right; nothing
    without data."""
    if xy[0]:
        twin = ax.twinx()
        twin.plot(xy[0], xy[1], style, color=color, label=label)
        twin.set_ylabel(ylabel)
        twin.legend(loc="lower right")


def _finish_step_panel(ax, resumes: list[int], ylabel: str, title: str) -> None:
    """A panel against steps: resume lines, labels, integer step ticks, the legend at the upper left."""
    _resume_lines(ax, resumes)
    ax.set(xlabel="step", ylabel=ylabel, title=title)
    _step_ticks(ax)
    ax.legend(loc="upper left")


def _rollout_panel(ax, records: list[dict], resumes: list[int]) -> None:
    """Online RL: the mean reward of the sampled completions (train line) and of the greedy
    held-out ones (validation points) against steps, and on a second scale the completions'
    mean length in tokens."""
    for key, style, label in (("train/reward", "-", "train reward"), ("val/reward", "o", "val reward (greedy)")):
        steps, values = series(records, key)
        if steps:
            ax.plot(steps, values, style, label=label)
    if not ax.lines:
        _no_data(ax)
        return
    _second_scale(ax, series(records, "train/completions/mean_length"), ":", "tab:gray", "mean completion length",
                  "completion length (tokens)")
    _finish_step_panel(ax, resumes, "mean reward", "reward and completion length")


def _table(header: list[str], rows: list[list]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    return lines + ["| " + " | ".join(_fmt(c) for c in row) + " |" for row in rows]


def peak_of(events: list[dict]) -> str | None:
    """The peak MFU is measured against, in words (``0.167 TFLOP/s fp32 per device (measured by
    ...)``), from the timeline's ``peak_flops`` events (one per process); a resume that measured
    against another peak adds it after ``; then``. None without such events (runs before they
    were recorded)."""
    said: list[str] = []
    for ev in events:
        tflops = ev.get("tflops")
        if ev.get("event") != "peak_flops" or not isinstance(tflops, (int, float)) or isinstance(tflops, bool):
            continue
        text = f"{tflops:.3g} TFLOP/s {ev.get('precision', '')} per device ({ev.get('detail') or ev.get('source')})"
        if not said or said[-1] != text:
            said.append(text)
    return "; then ".join(said) or None


def _markdown(run_dir: Path, records: list[dict], cfg, procs: list[dict] | None, title: str,
              mfu_peak: str | None = None) -> str:
    out = [f"# {title}", "", f"Run directory: `{run_dir}`", "", "## Config", ""]
    if cfg is None:
        out.append("_No readable `config.yaml` in the run directory._")
    else:
        out += _table(["field", "value"], [[f"`{k}`", OmegaConf.select(cfg, k, default=None)] for k in CONFIG_FIELDS])

    train = series(records, "train/loss")[1]
    val_steps, val = series(records, "val/loss")
    ppl = dict(zip(*series(records, "val/perplexity")))
    finite_val = [(v, s) for s, v in zip(val_steps, val) if math.isfinite(v)]
    best_val, best_step = min(finite_val) if finite_val else (None, None)
    tokens = series(records, "train/tokens_seen")[1]
    mfu, tflops = series(records, "perf/mfu")[1], series(records, "perf/tflops_per_device")[1]
    mem = [r for r in records if isinstance(r.get("memory/peak_bytes"), (int, float))]
    peak = max(mem, key=lambda r: r["memory/peak_bytes"]) if mem else None
    goodput = series(records, "time/goodput")[1]
    skipped = series(records, "train/skipped_update")[1]
    figures = [
        ["final train loss", _fmt(train[-1] if train else None, ".4f")],
        ["last val loss", f"{val[-1]:.4f} (step {val_steps[-1]})" if val else "n/a"],
        ["last val perplexity", _fmt(ppl.get(val_steps[-1]) if val else None, ".3f")],
        ["best val loss", f"{best_val:.4f} (step {best_step})" if best_val is not None else "n/a"],
        ["best val perplexity", _fmt(ppl.get(best_step), ".3f")],
        *([["last val preference accuracy", _fmt(series(records, "val/rewards/accuracies")[1][-1], ".3f")],
           ["last val reward margin", _fmt(series(records, "val/rewards/margins")[1][-1], ".4f")]]
          if series(records, "val/rewards/accuracies")[0] else []),
        *([["last train reward (sampled)", _fmt(series(records, "train/reward")[1][-1], ".4f")],
           ["last val reward (greedy)", _fmt(series(records, "val/reward")[1][-1] if series(records, "val/reward")[0]
                                             else None, ".4f")]]
          if series(records, "train/reward")[0] else []),
        ["total steps", _fmt(max((r["step"] for r in records if "step" in r), default=None), "d")],
        ["tokens seen", _fmt(int(tokens[-1]) if tokens else None, ",d")],
        ["tokens/s (mean of last 10 logged steps)",
         _fmt(_mean(series(records, "train/tokens_per_s")[1][-10:]), ",.0f")],
        ["MFU (mean)", _fmt(100 * _mean(mfu) if mfu else None, ".1f") + (" %" if mfu else "")],
        *([["MFU peak", mfu_peak]] if mfu_peak else []),
        ["TFLOP/s per device (mean)", _fmt(_mean(tflops), ".2f")],
        ["max peak memory", f"{peak['memory/peak_bytes'] / GIB:.2f} GiB (rank {_fmt(peak.get('memory/peak_rank'))})"
         if peak else "n/a"],
        ["goodput", f"{100 * goodput[-1]:.1f} %" if goodput else "n/a"],
        *([["data wait (mean of logged steps)", _data_wait(records)]]
          if series(records, "time/data_wait_s")[0] else []),
    ]
    if skipped:
        figures.append(["skipped updates (non-finite)", _fmt(int(sum(skipped)), "d")])
    out += ["", "## Final figures", ""] + _table(["metric", "value"], figures)

    scored = task_scores(records)
    keys = sorted({k for r in scored for k in r if k != "step"})
    if keys:
        out += ["", "## Task scores (lm-evaluation-harness)", "",
                "Each task at each step from its evaluation over the most documents (`TASK/documents`).", ""] + _table(
            ["step", *(f"`{k[len('eval/'):]}`" for k in keys)],
            [[row["step"], *(_fmt(row.get(k), ".0f" if k.endswith("/documents") else ".4f") for k in keys)]
             for row in scored])

    out += ["", "## Goodput breakdown", ""]
    last = next((r for r in reversed(records) if isinstance(r.get("time/wall_s"), (int, float))), None)
    if last is None:
        out.append("_No `time/wall_s` in metrics.jsonl._")
    else:
        wall = last["time/wall_s"]
        parts = [(name, float(last.get(key) or 0.0)) for name, key in GOODPUT_ROWS]
        parts.append(("other", max(0.0, wall - sum(s for _, s in parts))))
        # Online RL: sampling and scoring happen inside the productive steps; shown as their parts.
        within = [(f"productive: {name}", float(last[key])) for name, key in
                  (("generation", "time/generation_s"), ("reward functions", "time/reward_s")) if key in last]
        parts[1:1] = within
        rows = [[name, f"{s:.1f}", f"{100 * s / wall:.1f} %" if wall > 0 else "n/a"] for name, s in parts]
        rows.append(["**wall**", f"{wall:.1f}", "100.0 %"])
        out += [f"At step {last.get('step')}:", ""] + _table(["time", "seconds", "% of wall"], rows)

    out += ["", "## Timeline", ""]
    if procs is None:
        out.append("_No `timeline.jsonl` (a run from before timelines were recorded)._")
    elif not procs:
        out.append("_`timeline.jsonl` has no start events._")
    else:
        rows = [[i + 1,
                 _utc(p["time"]),
                 p["from_step"], p["to_step"], p["world_size"], p["recipe"], p["ended"]] for i, p in enumerate(procs)]
        out += _table(["process", "start (UTC)", "from step", "to step", "world size", "recipe", "ended"], rows)

    out += ["", "## Curves", "", "![report](report.png)", ""]
    return "\n".join(out)


def _utc(unix: object) -> str | None:
    """``YYYY-MM-DD HH:MM:SSZ`` of a Unix time, or None when it is not a representable time."""
    try:
        return datetime.fromtimestamp(float(unix), tz=timezone.utc).strftime("%Y-%m-%d %H:%M:%SZ")
    except (TypeError, ValueError, OverflowError, OSError):
        return None


def write_report(run_dir: Path) -> tuple[Path, Path]:
    """Write ``report.png`` and ``report.md`` into ``run_dir`` (each atomically: ``<name>.tmp``,
    then renamed) and return their paths. ``config.yaml`` and ``timeline.jsonl`` are optional;
    raises :class:`FileNotFoundError` when ``run_dir`` has no ``metrics.jsonl``."""
    run_dir = Path(run_dir)
    metrics_path = run_dir / "metrics.jsonl"
    if not metrics_path.is_file():
        raise FileNotFoundError(f"{metrics_path}: not found; expected a run directory with metrics.jsonl")
    records = sorted((_clean(r) for r in read_jsonl(metrics_path)
                      if isinstance(r.get("step"), int) and not isinstance(r.get("step"), bool)),
                     key=lambda r: r["step"])
    cfg = None
    if (run_dir / "config.yaml").is_file():
        try:
            cfg = OmegaConf.load(run_dir / "config.yaml")
        except Exception:  # a corrupt config must not cost the curves; the summary says it is unreadable
            cfg = None
        if not isinstance(cfg, DictConfig):
            cfg = None
    timeline_path = run_dir / "timeline.jsonl"
    last_step = records[-1]["step"] if records else None
    events = read_jsonl(timeline_path)
    procs = processes(events, last_step) if timeline_path.is_file() else None
    resumes = [p["from_step"] for p in procs or [] if isinstance(p["from_step"], int) and p["from_step"] > 0]

    name = OmegaConf.select(cfg, "name", default=None) if cfg is not None else None
    recipe = OmegaConf.select(cfg, "recipe.name", default=None) if cfg is not None else None
    title = f"Training report: {name or run_dir.name}" + (f" ({recipe})" if recipe else "")

    png, md = run_dir / "report.png", run_dir / "report.md"
    # Both are rendered before either replaces the previous report: they never disagree.
    text = _markdown(run_dir, records, cfg, procs, title, peak_of(events))
    png_tmp, md_tmp = png.with_name(png.name + ".tmp"), md.with_name(md.name + ".tmp")
    expert_load = None
    if (run_dir / "expert_load.json").is_file():
        try:
            expert_load = json.loads((run_dir / "expert_load.json").read_text())
        except ValueError:  # a torn file must not cost the other panels
            expert_load = None
    build_figure(records, resumes, title, expert_load).savefig(png_tmp, format="png")
    md_tmp.write_text(text, encoding="utf-8")
    os.replace(png_tmp, png)
    os.replace(md_tmp, md)
    return png, md


def write_report_or_warn(run_dir: Path) -> str | None:
    """:func:`write_report` of the run so far, returning the PNG's path; a failure to plot is a
    warning (and None), never a failed run."""
    try:
        png, _ = write_report(run_dir)
    except Exception as err:  # noqa: BLE001  (matplotlib missing or a plotting error)
        log.warning("could not write the run report (%s); `python -m llmtrain.report %s` retries", err, run_dir)
        return None
    return str(png)
