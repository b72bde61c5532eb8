"""`python -m gpt2forge.tools.plot METRICS.jsonl --out DIR` (console script `gpt2forge-plot`): PNG charts of
a run's metrics file (written by every training run, see gpt2forge/train/metrics/monitor.py).

Charts (WIDTH x HEIGHT pixels, default 900 x 500):
  loss.png        training loss and validation loss vs training tokens
  throughput.png  training tokens/s vs training tokens
  lr.png          learning rate vs host step

A resumed run appends to its file and re-does steps after its checkpoint: the last record of each
step wins. A torn last line (the run was killed while writing it) is skipped with a notice.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from gpt2forge.core import log
from gpt2forge.core.errors import UsageError, cli_main

Series = tuple[list[float], list[float]]


def read_metrics(path: str | Path) -> tuple[list[dict], list[dict]]:
    """(train records, validation records), one per step (the last one written), sorted by step."""
    p = Path(path)
    if not p.is_file():
        raise UsageError(f"{path}: metrics file not found (a training run writes it; see --metrics-file)")
    lines = p.read_text(encoding="utf-8").splitlines()
    kinds: dict[str, dict[int, dict]] = {"train": {}, "validation": {}}
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            if i == len(lines):
                log.notice(f"{path}: line {i} is incomplete (the run stopped while writing it); skipped")
                continue
            raise UsageError(f"{path}: line {i} is not JSON; is this a gpt2forge metrics.jsonl?") from None
        if not isinstance(record, dict) or record.get("kind") not in kinds or "step" not in record:
            raise UsageError(f"{path}: line {i} is not a metrics record (needs kind train|validation and step)")
        kinds[record["kind"]][int(record["step"])] = record
    train = [kinds["train"][s] for s in sorted(kinds["train"])]
    if not train:
        raise UsageError(f"{path}: no training records to plot")
    return train, [kinds["validation"][s] for s in sorted(kinds["validation"])]


def _series(records: list[dict], x: str, y: str) -> Series:
    pairs = [(r[x], r[y]) for r in records if isinstance(r.get(y), (int, float))]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def plot(path: str | Path, out_dir: str | Path, width: int = 900, height: int = 500) -> dict[str, dict[str, Series]]:
    """Write the charts; returns {file name: {line label: (x values, y values)}} read back from the
    plotted lines, so callers (and tests) see exactly what was drawn."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    train, val = read_metrics(path)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    charts = {
        "loss.png": ("training tokens", "loss", [("train loss", _series(train, "tokens", "loss")),
                                                 ("validation loss", _series(val, "tokens", "val_loss"))]),
        "throughput.png": ("training tokens", "tokens/s", [("tokens/s", _series(train, "tokens", "tokens_per_sec"))]),
        "lr.png": ("host step", "learning rate", [("lr", _series(train, "step", "lr")),
                                                  ("muon lr", _series(train, "step", "muon_lr"))]),
    }
    drawn: dict[str, dict[str, Series]] = {}
    dpi = 100
    for name, (xlabel, ylabel, lines) in charts.items():
        fig, ax = plt.subplots(figsize=(width / dpi, height / dpi), dpi=dpi)
        for label, (xs, ys) in lines:
            if xs:
                ax.plot(xs, ys, label=label, marker="o" if len(xs) < 30 else None, markersize=3)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.set_title(f"{Path(path).parent.name or Path(path).stem}: {ylabel}")
        ax.grid(True, alpha=0.3)
        if len(ax.get_lines()) > 1:
            ax.legend()
        fig.tight_layout()
        tmp = out / f".{name}.tmp.png"
        fig.savefig(tmp, dpi=dpi)
        tmp.replace(out / name)
        drawn[name] = {ln.get_label(): ([float(v) for v in ln.get_xdata()], [float(v) for v in ln.get_ydata()])
                       for ln in ax.get_lines()}
        plt.close(fig)
    return drawn


@cli_main
def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="gpt2forge-plot", description=__doc__.split("\n\n")[0])
    p.add_argument("metrics", help="a run's metrics.jsonl")
    p.add_argument("--out", required=True, help="folder for the PNG files")
    p.add_argument("--width", type=int, default=900, help="pixels (default 900)")
    p.add_argument("--height", type=int, default=500, help="pixels (default 500)")
    args = p.parse_args(argv)
    if args.width < 100 or args.height < 100:
        raise UsageError("--width and --height must be at least 100 pixels")
    for name in plot(args.metrics, args.out, args.width, args.height):
        print(Path(args.out) / name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
