"""Rewrite a reference model's ``README.md`` (its model card) from its ``card.json``.

The training run writes both; this renders the card again from the JSON alone, on any machine,
e.g. after a model trained on a GPU comes back as files::

    python -m quantmla_lab.training.card models/qmla-ref-deepseek-v2-deepseek-geometry
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from quantmla_lab.training.train import render_readme


def write_card(model_dir: str | Path) -> Path:
    """Write ``model_dir/README.md`` from ``model_dir/card.json``; returns the README's path."""
    d = Path(model_dir)
    card = json.loads((d / "card.json").read_text())
    path = d / "README.md"
    path.write_text(render_readme(card))
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model_dirs", nargs="+", help="model directories holding card.json")
    args = p.parse_args(argv)
    for d in args.model_dirs:
        print(f"wrote {write_card(d)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
