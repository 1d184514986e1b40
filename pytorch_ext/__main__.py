"""``python -m attnkit <command>``.

Commands:
  bench   benchmark attnkit's backends against torch SDPA, FlexAttention and plain PyTorch
          (``python -m attnkit bench --help`` for its options)
  theory  rerun a result about attention (``python -m attnkit theory --help``)
  train   train the reference model attnkit.models.CausalLM (``python -m attnkit train --help``)
"""
from __future__ import annotations

import sys

USAGE = """usage: python -m attnkit <command> [options]

commands:
  bench    benchmark attnkit against torch SDPA, FlexAttention and plain PyTorch:
           python -m attnkit bench [--device cpu|cuda] [--family softmax,linear,sparse,hopfield]
                                   [--quick] [--out DIR] [--deadline SECONDS] [--match REGEX]
                                   [--repeats K] [--list]
           prints each case as it finishes, keeps DIR/bench-<device>.json up to date (rewritten
           after every implementation) and writes DIR/bench-<device>.png (default DIR: bench/out/)

  theory   rerun a result about attention (icl, svm, memory, scaling, polynomial, prediction):
           python -m attnkit theory <name> [--quick] [--out DIR]

  train    train the reference causal LM (attnkit.models) on a Markov source or a text file:
           python -m attnkit train [--data markov|PATH] [--attention softmax|linear,sparse,...]
                                   [--steps K] [--device auto|cpu|cuda] [--resume CKPT] [--out DIR]
           progress bar; writes DIR/loss.png, DIR/checkpoint.pt, DIR/losses.json
           (default DIR: bench/out/train)

run `python -m attnkit bench --help` (or `theory <name> --help`, `train --help`) for every option.
"""


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        sys.stdout.write(USAGE)
        return 0
    command, rest = argv[0], argv[1:]
    if command == "bench":
        from .bench.harness import main as bench_main

        return bench_main(rest)
    if command == "theory":
        from .theory.cli import main as theory_main

        return theory_main(rest)
    if command == "train":
        from .models import main as train_main

        return train_main(rest)
    sys.stderr.write(f"python -m attnkit: unknown command {command!r}\n\n{USAGE}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
