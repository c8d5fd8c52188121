"""The plots of docs/benchmarks.md, drawn from the JSON in docs/data/ by each benchmark's own
plot function (the figure a run draws beside its JSON in bench_out/)::

    python benchmarks/plots.py                      # writes docs/img/<figure>.png
    python benchmarks/plots.py --out-dir /tmp/img   # elsewhere

A new run replaces a figure by copying its JSON into docs/data/ under the name below and
running this again. Needs matplotlib (``pip install -e '.[bench]'``); without it the data are
read and nothing is drawn.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from types import SimpleNamespace

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
ROOT = os.path.dirname(HERE)

import _common  # noqa: E402  (before the benchmarks import numpy and torch)
import bench_multinode  # noqa: E402
import bench_pipeline  # noqa: E402
import bench_tables  # noqa: E402
import bench_w1  # noqa: E402
import soak_stream  # noqa: E402


def tables(data: dict, png: str) -> None:
    bench_tables.plot(data["rows"], png)


def w1(data: dict, png: str) -> None:
    bench_w1.plot(data, png)


def multinode(data: dict, png: str) -> None:
    bench_multinode.plot(data["shared_memory"], data["runs"], png)


def pipeline(data: dict, png: str) -> None:
    bench_pipeline.plot(data["results"], png)


def soak(data: dict, png: str) -> None:
    kinds = data["args"]["variants"].split(",")
    soak_stream.plot(png, kinds, data["windows"], SimpleNamespace(**data["args"]))


# figure (docs/img/<name>.png) -> (its JSON in docs/data/, the function that draws it)
FIGURES = {
    "tables": ("tables.json", tables),
    "w1_half": ("w1_half_2dd47ad.json", w1),
    "multinode": ("multinode.json", multinode),
    "pipeline": ("pipeline.json", pipeline),
    "soak_stream_margin": ("soak_stream_margin.json", soak),
    "soak_stream_policies": ("soak_stream_policies.json", soak),
}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data-dir", default=os.path.join(ROOT, "docs", "data"))
    p.add_argument("--out-dir", default=os.path.join(ROOT, "docs", "img"))
    p.add_argument("--only", nargs="*", choices=list(FIGURES), default=list(FIGURES))
    args = p.parse_args(argv)
    os.makedirs(args.out_dir, exist_ok=True)
    drawing = _common.pyplot_or_none(os.path.join(args.out_dir, "*.png")) is not None
    for name in args.only:
        source, draw = FIGURES[name]
        with open(os.path.join(args.data_dir, source)) as f:
            data = json.load(f)
        png = os.path.join(args.out_dir, f"{name}.png")
        if drawing:
            draw(data, png)
            print(f"{source} -> {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
