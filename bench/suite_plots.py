"""PNG plots of a suite result (matplotlib, Agg backend: no display needed).

Each function takes plain dicts from the suite's JSON, so plots can be redrawn from a saved result:

    python bench/suite_plots.py bench/results/suite_latest.json bench/results/plots
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only; never needs a display
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    _pyplot().close(fig)
    return path


def plot_tok_s(tok_s: dict[str, dict[str, float | None]], path: Path, title: str) -> Path:
    """Grouped bars: x = prompt set, one bar per configuration (``tok_s[dataset][config]``)."""
    plt = _pyplot()
    datasets = list(tok_s)
    configs = list(dict.fromkeys(c for d in tok_s.values() for c in d))  # first-seen order (ar, sd, ssd-*, hf, vllm)
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(configs) * len(datasets) / 2), 4))
    width = 0.8 / max(len(configs), 1)
    colors = plt.get_cmap("tab20").colors  # distinct colours for up to 20 configurations (tab10 repeats at 11)
    for i, config in enumerate(configs):
        xs = [j + i * width for j in range(len(datasets))]
        ax.bar(xs, [tok_s[d].get(config) or 0.0 for d in datasets], width, label=config, color=colors[i % 20])
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(datasets))], datasets)
    ax.set_ylabel("decode tok/s (median)")
    ax.set_title(title)
    ax.legend(fontsize=7, ncol=2)
    return _save(fig, path)


def plot_acceptance_histogram(histograms: dict[str, Sequence[int]], path: Path, title: str) -> Path:
    """Fraction of verification rounds per acceptance length (accepted drafts + 1), one bar series per mode."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    modes = [m for m, h in histograms.items() if sum(h)]
    width = 0.8 / max(len(modes), 1)
    for i, mode in enumerate(modes):
        counts = list(histograms[mode])
        total = sum(counts)
        offset = (i - (len(modes) - 1) / 2) * width  # the group of bars is centred on its acceptance length
        ax.bar([k + 1 + offset for k in range(len(counts))], [c / total for c in counts], width, label=mode)
    ax.set_xlabel("acceptance length (tokens per verification round)")
    ax.set_ylabel("fraction of rounds")
    ax.set_title(title)
    if modes:
        ax.legend(fontsize=8)
    return _save(fig, path)


def plot_hit_rate_vs_fan_out(series: dict[str, list[tuple[str, float | None]]], path: Path, title: str) -> Path:
    """SSD cache hit rate against fan-out, one line per series (e.g. dataset and K); x labels are fan-outs."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    labels: list[str] = []
    for points in series.values():
        for x, _ in points:
            if x not in labels:
                labels.append(x)
    for name, points in series.items():
        xs = [labels.index(x) for x, y in points if y is not None]
        ys = [y for _, y in points if y is not None]
        ax.plot(xs, ys, marker="o", label=name)
    ax.set_xticks(range(len(labels)), labels)
    ax.set_xlabel("fan-out")
    ax.set_ylabel("cache hit rate")
    ax.set_ylim(0, 1)
    ax.set_title(title)
    if series:
        ax.legend(fontsize=7)
    return _save(fig, path)


def plot_speedup_vs_batch(speedups: dict[str, dict[str, dict[int, float | None]]], path: Path, title: str) -> Path:
    """Speedup over AR against batch size: one panel per layout, one line per mode (``[layout][mode][batch]``)."""
    plt = _pyplot()
    layouts = list(speedups)
    fig, axes = plt.subplots(1, max(len(layouts), 1), figsize=(5 * max(len(layouts), 1), 4), squeeze=False)
    for ax, layout in zip(axes[0], layouts):
        for mode, by_batch in speedups[layout].items():
            xs = sorted(b for b, v in by_batch.items() if v is not None)
            ax.plot(xs, [by_batch[b] for b in xs], marker="o", label=mode)
        ax.set_xticks(sorted({b for by_batch in speedups[layout].values() for b in by_batch}))
        ax.axhline(1.0, color="grey", linewidth=0.8)
        ax.set_xlabel("batch size")
        ax.set_ylabel("decode tok/s / AR")
        ax.set_title(f"{title}: {layout}")
        ax.legend(fontsize=8)
    return _save(fig, path)


def write_plots(result: dict[str, Any], out_dir: str | Path) -> list[Path]:
    """All four plots of a suite result (``suite.run`` output) into ``out_dir``."""
    out = Path(out_dir)
    batch = result["args"]["batch_sizes"][0]
    per_ds = result.get("per_dataset", {})
    vllm = (result.get("vllm") or {}).get("per_dataset", {})  # peers measured at batch 1 on the target's cores
    paths: list[Path] = []
    for layout in ("extra-device", "same-hardware"):
        tok = {}
        for ds, summary in per_ds.items():
            rows = summary["layouts"].get(layout, {}).get(f"b{batch}", {})
            tok[ds] = {mode: m["decode_tok_s"] for mode, m in rows.items()}
            hf = summary.get("transformers")
            if hf and batch == 1 and layout == "extra-device":
                tok[ds]["hf"] = hf["plain_decode_tok_s"]
                tok[ds]["hf-assisted"] = hf["assisted_decode_tok_s"]
            if ds in vllm and batch == 1 and layout == "extra-device":
                for key, value in vllm[ds].items():  # ar_decode_tok_s -> vllm, sd_... -> vllm-sd, ...
                    if key.endswith("_decode_tok_s"):
                        mode = key.removesuffix("_decode_tok_s")
                        tok[ds]["vllm" if mode == "ar" else f"vllm-{mode}"] = value
        if any(tok.values()):
            paths.append(plot_tok_s(tok, out / f"tok_s_{layout}.png", f"decode tok/s, {layout}, batch {batch}"))
    hist: dict[str, list[int]] = {}
    for summary in per_ds.values():
        for mode, m in summary["layouts"].get("extra-device", {}).get(f"b{batch}", {}).items():
            h = m.get("acceptance_histogram") or []
            acc = hist.setdefault(mode, [])
            acc.extend([0] * (len(h) - len(acc)))
            for k, c in enumerate(h):
                acc[k] += c
    paths.append(plot_acceptance_histogram(hist, out / "acceptance_length.png",
                                           f"acceptance length, extra-device, batch {batch}, all prompt sets"))
    series: dict[str, list[tuple[str, float | None]]] = {}
    sweep = result.get("sweep")
    if sweep:
        for row in sweep["rows"]:
            name = f"{row['dataset']} K={row['k']} c={row['saguaro_c']:g}"
            series.setdefault(name, []).append((str(row["fan_out"]), row.get("cache_hit_rate")))
    else:
        fan = str(result["args"]["fan_out"])
        for ds, summary in per_ds.items():
            for mode, m in summary["layouts"].get("extra-device", {}).get(f"b{batch}", {}).items():
                if mode.startswith("ssd"):
                    series.setdefault(f"{ds} {mode}", []).append((fan, m.get("cache_hit_rate")))
    paths.append(plot_hit_rate_vs_fan_out(series, out / "hit_rate_vs_fan_out.png", "SSD cache hit rate"))
    speed: dict[str, dict[str, dict[int, float | None]]] = {}
    from suite_summary import geomean

    for layout in ("extra-device", "same-hardware"):
        for b in result["args"]["batch_sizes"]:
            modes = {m for s in per_ds.values() for m in s["layouts"].get(layout, {}).get(f"b{b}", {})}
            for mode in sorted(modes - {"ar"}):
                values = [s["layouts"][layout][f"b{b}"][mode]["speedup_vs_ar"] for s in per_ds.values()
                          if mode in s["layouts"].get(layout, {}).get(f"b{b}", {})]
                speed.setdefault(layout, {}).setdefault(mode, {})[b] = geomean(values)
    if speed:
        paths.append(plot_speedup_vs_batch(speed, out / "speedup_vs_batch.png", "speedup vs AR"))
    return paths


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    data = json.loads(Path(sys.argv[1]).read_text())
    for p in write_plots(data, sys.argv[2] if len(sys.argv) > 2 else Path(sys.argv[1]).parent / "plots"):
        print(f"wrote {p}")
