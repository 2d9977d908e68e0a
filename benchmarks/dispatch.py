"""Per-call dispatch overhead of a tuned module (eager backend) over calling the module directly.

    python benchmarks/dispatch.py [--calls 2000]

Both paths run the same tiny MLP at batch 1 under no_grad; blocks of calls alternate between the two
variants (same runtime, so no thread-pool interference) and the median per-call time is reported.
"""

from __future__ import annotations

import argparse
import tempfile

import torch
from _timing import load_average, time_calls
from torch import nn

import torch_tweak.torch as tt
from torch_tweak.torch.backend import TorchEagerBackend


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args()
    torch.set_num_threads(1)
    tt.config.cache_dir = tempfile.mkdtemp(prefix="tt_dispatch_")
    torch.manual_seed(0)
    reference = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4)).eval()
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4)).eval()
    model.load_state_dict(reference.state_dict())
    wrapped = tt.Module(model, name="tiny_mlp", strategy=tt.OneBackendStrategy(TorchEagerBackend()))
    tt.tune(wrapped, [torch.randn(16) for _ in range(4)])
    x = torch.randn(1, 16)
    with torch.no_grad():
        rounds = [(time_calls(lambda: reference(x), args.calls), time_calls(lambda: wrapped(x), args.calls))
                  for _ in range(3)]
    direct = sorted(r[0][0] for r in rounds)[1]
    tuned = sorted(r[1][0] for r in rounds)[1]
    spread = max(r[1][1] for r in rounds)
    print(f"load average: {load_average():.2f}")
    print("| path | µs per call (median) |")
    print("|---|---|")
    print(f"| original module, called directly | {direct:.2f} |")
    print(f"| tuned tt.Module (eager backend) | {tuned:.2f} (spread {spread:.2f}) |")
    print(f"| overhead | {tuned - direct:.2f} µs ({tuned / direct:.2f}x) |")


if __name__ == "__main__":
    main()
