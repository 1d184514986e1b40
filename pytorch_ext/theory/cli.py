"""``python -m attnkit theory <name> [options]``: run one theory module's experiment.

Each module ``attnkit.theory.<name>`` that has an experiment defines ``main(argv) -> int``
(its own argparse: ``--quick`` for a smoke run, ``--out DIR`` for the PNG, a progress bar on long
runs) and prints a table of what it measured beside the source's numbers.
"""
from __future__ import annotations

import importlib
import sys

# name -> what it reproduces (the order of the listing)
MODULES = {
    "icl": "in-context linear regression: linear self-attention, GD-step weights, ICL curves",
    "svm": "attention as a max-margin SVM: directional convergence of W to W^mm",
    "memory": "Hopfield capacity: classical, dense polynomial, modern exponential",
    "scaling": "scaling laws: power-law fits, Kaplan et al.'s L(N, D), a small ladder",
    "polynomial": "polynomial degree of attention layers, separation rank, why degree 3",
    "prediction": "universal prediction: LZ78 against Markov predictability and a transformer",
}


def usage() -> str:
    lines = ["usage: python -m attnkit theory <name> [options]   (<name> --help for its options)",
             "", "names:"]
    lines += [f"  {name:<11} {what}" for name, what in MODULES.items()]
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help", "help"):
        sys.stdout.write(usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in MODULES:
        sys.stderr.write(f"python -m attnkit theory: unknown name {name!r}\n\n{usage()}")
        return 2
    module = importlib.import_module(f"attnkit.theory.{name}")
    if not hasattr(module, "main"):
        sys.stderr.write(f"attnkit.theory.{name} has no experiment command yet\n")
        return 2
    return int(module.main(rest) or 0)
