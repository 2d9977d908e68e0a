"""The ``torch-tweak`` command line."""

from __future__ import annotations

import argparse
import sys


def _demo(args: argparse.Namespace) -> int:
    import torch_tweak.torch as tt
    from torch_tweak.demo import small_cnn
    from torch_tweak.torch.backend import TorchEagerBackend

    model, samples = small_cnn()
    wrapped = tt.Module(model, name="demo_cnn", strategy=tt.OneBackendStrategy(TorchEagerBackend()))
    report = tt.tune(wrapped, samples, batch_sizes=[1, 2, 4])
    print(report)
    for name, backend in wrapped.backends.items():
        print(f"demo_cnn graph {name}: chose {backend.describe()}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``torch-tweak``."""
    parser = argparse.ArgumentParser(prog="torch-tweak", description="Tune PyTorch models for inference.")
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="tune a built-in CNN and print the result")
    demo.set_defaults(func=_demo)
    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except Exception as exc:  # noqa: BLE001 - the CLI reports errors as one line
        print(f"torch-tweak {args.command}: error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
