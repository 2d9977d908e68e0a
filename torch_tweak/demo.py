"""Built-in demo models and the ``torch-tweak demo`` run.

The demo tunes a small CNN and a small transformer encoder (:func:`torch_tweak.tiny_models.small_encoder`)
with every CPU backend available here through the default strategy (:class:`HighestThroughputStrategy`),
then writes the combined report (JSON and HTML) and a checkpoint of the tuned modules.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

logger = logging.getLogger(__name__)


class SmallCNN(nn.Module):
    """A mini ResNet-like classifier for 3x32x32 images."""

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU())
        self.block = nn.Sequential(
            nn.Conv2d(32, 64, 3, stride=2, padding=1), nn.BatchNorm2d(64), nn.ReLU(),
            nn.Conv2d(64, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(),
        )
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(self.stem(x)))


def small_cnn() -> tuple[nn.Module, list[torch.Tensor]]:
    """The demo CNN (eval mode, fixed seed) and a few sample images."""
    torch.manual_seed(0)
    model = SmallCNN().eval()
    return model, [torch.randn(3, 32, 32) for _ in range(4)]


class DemoPipeline:
    """The two tuned modules of the demo, as one object to save (``tt.save`` walks its attributes)."""

    def __init__(self, cnn: Any, encoder: Any) -> None:
        self.cnn = cnn
        self.encoder = encoder


@dataclass
class DemoResult:
    """What :func:`run_demo` produced: the combined report and where its files are."""

    report: Any
    json_path: Path
    html_path: Path | None
    checkpoint_path: Path | None
    checkpoint_error: str | None = None


def _strategy(quick: bool) -> Any:
    import torch_tweak.torch as tt
    from torch_tweak.torch.backend import TorchEagerBackend
    from torch_tweak.torch.profiling import ProfilingConfig

    if not quick:
        return tt.HighestThroughputStrategy()
    profiling = ProfilingConfig(warmup_calls=1, min_calls=5, window_size=5, min_time_s=0.0, max_time_s=0.05,
                                max_calls=200, pause_s=0.0)
    return tt.HighestThroughputStrategy([TorchEagerBackend()], profiling=profiling)


def combine(reports: list[Any]) -> Any:
    """One report holding the modules of several ``tt.tune`` runs (environment and time of the last)."""
    from torch_tweak.torch.report import TuningReport

    return TuningReport(
        modules=[m for r in reports for m in r.modules], device=reports[-1].device,
        batch_sizes=sorted({b for r in reports for b in r.batch_sizes}), dry_run=any(r.dry_run for r in reports),
        duration_s=sum(r.duration_s for r in reports), environment=reports[-1].environment,
        created=reports[-1].created,
    )


def run_demo(out_dir: str | Path, quick: bool = False) -> DemoResult:
    """Tune the demo CNN and encoder, write ``report.json``, ``report.html`` and ``demo.tt`` into ``out_dir``.

    Args:
        out_dir: folder for the outputs (created owner-only).
        quick: eager only with short measurements (seconds instead of minutes; for tests).
    """
    import torch_tweak.torch as tt
    from torch_tweak.tiny_models import small_encoder
    from torch_tweak.torch.executor import resolve_executor
    from torch_tweak.utils.permissions import secure_mkdir

    out = secure_mkdir(Path(out_dir).expanduser())
    start = time.perf_counter()
    cnn_model, images = small_cnn()
    encoder_model, sentences = small_encoder()
    cnn = tt.Module(cnn_model, name="demo_cnn", strategy=_strategy(quick))
    encoder = tt.Module(encoder_model, name="demo_encoder", strategy=_strategy(quick))
    with resolve_executor(tt.config.executor)[0] as executor:  # one worker process serves both tunes
        reports = [tt.tune(cnn, images * 2, batch_sizes=[1, 2, 4], executor=executor),
                   tt.tune(encoder, sentences, batch_sizes=[1, 2], executor=executor)]
    report = combine(reports)
    logger.info("Demo tuned in %.1fs", time.perf_counter() - start)
    json_path = out / "report.json"
    report.to_json(json_path)
    html_path = report.save_html(out / "report.html")
    checkpoint_path, checkpoint_error = None, None
    save = getattr(tt, "save", None)
    if save is not None:
        try:
            checkpoint_path = Path(save(DemoPipeline(cnn, encoder), out / "demo.tt"))
        except Exception as exc:  # noqa: BLE001 - the report stays useful without a checkpoint
            checkpoint_error = f"{type(exc).__name__}: {exc}"
            logger.warning("The demo checkpoint could not be saved: %s", checkpoint_error)
    return DemoResult(report, json_path, html_path, checkpoint_path, checkpoint_error)
