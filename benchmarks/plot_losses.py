"""Overlay the loss curves of several `fullshard train` runs (their metrics.jsonl) in one PNG.

    python benchmarks/plot_losses.py --out curves.png adamw=runs/adamw muon=runs/muon
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", help="LABEL=RUN_FOLDER")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    fig, ax = plt.subplots(figsize=(7, 4))
    for spec in args.runs:
        label, folder = spec.split("=", 1)
        rows = [json.loads(line) for line in (Path(folder) / "metrics.jsonl").read_text().splitlines()]
        by_step = {r["step"]: r for r in rows}  # a resumed run repeats steps: keep the last
        steps = sorted(by_step)
        ax.plot(steps, [by_step[s]["loss"] for s in steps], label=f"{label} (train)", alpha=0.6)
        evals = [s for s in steps if "eval_loss" in by_step[s]]
        ax.plot(evals, [by_step[s]["eval_loss"] for s in evals], "o-", label=f"{label} (held out)")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats per byte)")
    ax.set_ylim(top=4)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.out, dpi=100)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
