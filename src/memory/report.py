"""`packlora memory-report`: the plan (and measurement) as a table, JSON or a stacked bar chart."""
import json
from pathlib import Path

from rich.console import Console
from rich.table import Table

from ..errors import ConfigError, check_count
from ..fileio import atomic_path
from ..tracker import CATEGORIES
from .measurement import measure as run_measure
from .planner import plan
from .process import process_overhead_bytes, quantizer_load_bytes

_ALT_NAMES = {"whole_model_fp32": "whole base dense, float32",
              "whole_model_bf16": "whole base dense, bfloat16",
              "per_layer_dequant": "full dequant per matmul (bnb/torchao/Unsloth)",
              "dense_effective_weight": "dense W + s·B·A per layer (Burn 0.22)"}
PLOT_FORMATS = ("png", "svg", "pdf")


def mib(n):
    return "—" if n is None else f"{round(n / 2**20, 1) or 0.0:,.1f}"  # never "-0.0"


def report_dict(config, overrides=(), measure=False, steps=2, ranks=1):
    """The JSON contract: {"run", "plan", "dense_alternatives"[, "measured"]}; with ranks > 1
    the plan of one rank of a data-parallel run."""
    check_count("memory-report", "ranks", ranks, 1)
    if measure:
        check_count("memory-report", "steps", steps, 1)
    if measure:
        if ranks > 1:
            raise ConfigError("--measure runs one process; measure a data-parallel run by "
                              "running it under mpiexec (metrics.jsonl records each step's peaks)")
        rep = run_measure(config, steps, overrides)
    else:
        rep = plan(config, overrides, ranks=ranks)
    add_process(rep)
    add_merge_code(rep)
    return rep


def add_process(rep):
    """On the CPU: the process's own untracked bytes and the RAM the run needs in all."""
    if not rep["run"]["device"].startswith("cpu"):
        return rep
    extra = process_overhead_bytes()
    if extra is not None:
        rep["process"] = {"bytes": extra,
                          "rss_estimate_bytes": rep["plan"]["peak_bytes"] + extra}
    return rep


def add_merge_code(rep):
    """The merge table's compiled code: a merge that re-quantizes to a K-quant or IQ4 type loads
    the compiled searches and with them Numba's runtime, measured once per machine (here, not in
    the planner, so a training run's memory check never measures it); a merge that keeps the
    stored types needs that much less."""
    code = quantizer_load_bytes()
    if code is not None:
        merge = rep["plan"]["merge"]
        merge["compiled_code"] = code
        merge["peak_bytes"] += code
    return rep


def _category_table(rep):
    plan, meas = rep["plan"], rep.get("measured")
    t = Table(title="memory by category (MiB; per-category peaks)")
    t.add_column("category")
    t.add_column("planned", justify="right")
    t.add_column("at plan peak", justify="right")
    if meas:
        t.add_column("measured (tracker)", justify="right")
        t.add_column("error", justify="right")
    for c in CATEGORIES:
        row = [c, mib(plan["categories"][c]), mib(plan["at_peak"][c])]
        if meas:
            err = meas["category_error_pct"].get(c)
            row += [mib(meas["categories"][c]), "" if err is None else f"{err:+.1f}%"]
        t.add_row(*row)
    row = ["[bold]peak", f"[bold]{mib(plan['peak_bytes'])}", plan["peak_at"]]
    if meas:
        row += [f"[bold]{mib(meas['peak_bytes'])}", f"{meas['plan_error_pct']:+.1f}%"]
    t.add_row(*row)
    if meas:
        vs = meas.get("tracker_vs_process_pct")
        t.add_row(f"process ({meas['process_measure']})", "", "",
                  mib(meas.get("process_peak_bytes")),
                  "" if vs is None else f"tracker {vs:+.1f}%")
        if meas.get("rss_peak_bytes"):
            t.add_row("RSS peak (whole process, measured steps)", "", "",
                      mib(meas["rss_peak_bytes"]), "")
        if meas.get("rss_load_peak_bytes"):
            t.add_row("RSS peak while loading", "", "", mib(meas["rss_load_peak_bytes"]), "")
    return t


def _activation_table(rep):
    plan = rep["plan"]
    det, ck = plan["activations_detail"], plan["checkpointing"]
    t = Table(title="activations and logits (MiB)")
    t.add_column("item")
    t.add_column("bytes", justify="right")
    t.add_row("one block, all activations kept", mib(det["per_block"]))
    t.add_row("one block, checkpointed (its input)", mib(det["per_block_checkpointed"]))
    for mode in ("off", "on"):
        t.add_row(f"checkpointing {mode}: activations / step peak",
                  f"{mib(ck[mode]['activations'])} / {mib(ck[mode]['peak_bytes'])}")
    t.add_row("logits: one loss chunk", mib(det["logits_chunk"]))
    t.add_row("logits: full (and with their gradient)",
              f"{mib(det['logits_full'])} ({mib(det['logits_full_with_grad'])})")
    gen = plan["generation"]
    t.add_row(f"generation: KV cache (batch {gen['batch']}, {gen['max_len']} positions)",
              mib(gen["kv_cache"]))
    return t


_MERGE_ROWS = {"process": "the process itself (measured now)",
               "compiled_code": "compiled quantizer searches, Numba's runtime (measured once)",
               "adapter": "adapter tensors",
               "working_set": "rows being merged and re-quantized",
               "whole_tensor": "one HF tensor read whole (+ its row order)",
               "copy_buffer": "copy buffer"}


def _merge_table(rep):
    merge = rep["plan"]["merge"]
    t = Table(title="packlora merge --out model.gguf (MiB)")
    t.add_column("held at the peak")
    t.add_column("bytes", justify="right")
    for key, name in _MERGE_ROWS.items():
        t.add_row(name, mib(merge.get(key)))
    t.add_row("[bold]peak", f"[bold]{mib(merge['peak_bytes'])}")
    return t


def _alternatives_table(rep):
    t = Table(title="the price of dense expansion (MiB)")
    for col in ("the same run, with", "extra", "peak", "× packlora"):
        t.add_column(col, justify="left" if col.startswith("the") else "right")
    t.add_row("packlora (packed, bounded scratch)", "0", mib(rep["plan"]["peak_bytes"]), "1.00")
    for key, alt in rep["dense_alternatives"].items():
        t.add_row(_ALT_NAMES[key], mib(alt["extra_bytes"]), mib(alt["peak_bytes"]),
                  f"{alt['ratio_to_packlora']:.2f}")
    return t


def _formats(counts):
    """'q4_1', or 'q5_0 ×166, q4_k ×16, ...' when the tensors are held in several formats."""
    if len(counts) == 1:
        return next(iter(counts))
    return ", ".join(f"{fmt} ×{n}" for fmt, n in counts.items())


def print_report(rep, console=None):
    console = console or Console()
    run = rep["run"]
    console.print(f"[bold]{run['model']}[/]  batch {run['batch_size']} × seq {run['seq_len']}, "
                  f"checkpointing {'on' if run['grad_checkpointing'] else 'off'}, "
                  f"linears in {_formats(run['held']['linears'])}, embedding and head in "
                  f"{_formats(run['held']['embeddings'])}, LoRA r={run['lora']['rank']}")
    dist = rep["plan"].get("distributed", {})
    if dist.get("ranks", 1) > 1:
        console.print(f"per rank of {dist['ranks']}: batch {dist['batch_per_rank']} of the global "
                      f"{dist['batch_per_rank'] * dist['ranks']}, allreduce buffer "
                      f"{mib(dist['allreduce_bytes'])} MiB (counted under workspace)")
    for table in (_category_table(rep), _activation_table(rep), _alternatives_table(rep),
                  _merge_table(rep)):
        console.print(table)
    proc = rep.get("process")
    if proc:
        console.print(f"RAM this run needs: {mib(proc['rss_estimate_bytes'])} MiB — the plan's "
                      f"peak plus {mib(proc['bytes'])} MiB the process holds itself "
                      "(interpreter, numpy/BLAS, Numba's kernels; measured once on this machine)")
    loftq = rep["plan"].get("loftq_init")
    if loftq:
        console.print(f"LoftQ initialisation (before training): {mib(loftq['peak_bytes'])} MiB "
                      f"at its peak, of which {mib(loftq['svd_workspace'])} MiB is one layer's "
                      "SVD workspace")


def check_plot_path(path):
    """(path, format) of a --plot file, checked before the report runs (--measure trains)."""
    p = Path(path)
    fmt = p.suffix.lower().lstrip(".")
    if p.is_dir():
        raise ConfigError(f"--plot {path}: a folder, not a file")
    if fmt not in PLOT_FORMATS:
        raise ConfigError(f"--plot {path}: give a file ending in "
                          f"{', '.join('.' + f for f in PLOT_FORMATS)}")
    return p, fmt


def plot_report(rep, path):
    """Stacked bars: planned and measured by category, then the dense alternatives."""
    path, fmt = check_plot_path(path)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    bars = [("planned", rep["plan"]["at_peak"])]
    if rep.get("measured"):
        bars.append(("measured", rep["measured"]["categories"]))
    fig, ax = plt.subplots(figsize=(9, 5))
    cats = [c for c in CATEGORIES if any(b[1].get(c) for b in bars)]
    colors = plt.get_cmap("tab10")
    for x, (_, values) in enumerate(bars):
        bottom = 0.0
        for j, c in enumerate(cats):
            v = values.get(c, 0) / 2**20
            ax.bar(x, v, bottom=bottom, color=colors(j), label=c if x == 0 else None)
            bottom += v
    names = [b[0] for b in bars]
    alts = rep["dense_alternatives"]
    for k, (key, alt) in enumerate(alts.items()):
        x = len(bars) + k
        ax.bar(x, alt["peak_bytes"] / 2**20, color="0.6", hatch="//")
        ax.text(x, alt["peak_bytes"] / 2**20, f"{alt['ratio_to_packlora']:.2f}×",
                ha="center", va="bottom", fontsize=8)
        names.append(_ALT_NAMES[key].split(" (")[0].replace(", ", "\n"))
    ax.set_xticks(range(len(names)), names, fontsize=7)
    ax.set_ylabel("MiB")
    ax.set_title(f"memory of one training step: {rep['run']['model']}", fontsize=9)
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    with atomic_path(path, f".{fmt}") as tmp:
        fig.savefig(tmp, dpi=110, format=fmt)
    plt.close(fig)
    return path


def run_memory_report(args):
    """CLI entry: args has config, overrides, measure, steps, json, plot."""
    if args.plot:
        check_plot_path(args.plot)
    rep = report_dict(args.config, args.overrides or (), args.measure, args.steps,
                      getattr(args, "ranks", 1))
    if args.json:
        print(json.dumps(rep, indent=2))
    else:
        print_report(rep)
    if args.plot:
        plot_report(rep, args.plot)
        if not args.json:
            print(f"wrote {args.plot}")
    return rep
