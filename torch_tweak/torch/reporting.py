"""What surrounds every ``tt.tune`` call: the progress display, the environment block, the stored report.

:func:`reporting` decorates ``tune``: it records the environment when tuning starts, shows progress
while it runs, and writes the finished report to ``<cache_dir>/reports/<UTC timestamp>.json`` (a folder
made and recorded by :func:`torch_tweak.torch.cache.cache_folder`). Storing the report never fails the
tune (a problem is logged as a warning).
"""

from __future__ import annotations

import datetime
import functools
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from torch_tweak.torch import progress as _progress
from torch_tweak.torch.cache import cache_folder
from torch_tweak.torch.config import config
from torch_tweak.torch.report.environment import collect_environment
from torch_tweak.torch.report.report import TuningReport

logger = logging.getLogger(__name__)

REPORTS_FOLDER = "reports"
F = TypeVar("F", bound=Callable[..., Any])


def reports_dir(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """``<cache_dir>/reports`` (``tt.config.cache_dir`` by default)."""
    return Path(cache_dir if cache_dir is not None else config.cache_dir) / REPORTS_FOLDER


def store_report(report: TuningReport) -> Path:
    """Write ``report`` to ``<cache_dir>/reports/<timestamp>.json`` (owner-only) and return the path."""
    folder = cache_folder(REPORTS_FOLDER)
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%S.%fZ")
    path = folder / f"{stamp}.json"
    suffix = 1
    while path.exists():
        path = folder / f"{stamp}-{suffix}.json"
        suffix += 1
    report.to_json(path)
    return path


def reporting(tune: F) -> F:
    """Decorate ``tune``: progress display, environment block, report stored in the cache folder."""

    @functools.wraps(tune)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        environment = collect_environment()
        with _progress.progress(config.progress):
            report = tune(*args, **kwargs)
        if isinstance(report, TuningReport):
            report.environment = {**environment, **report.environment}  # tune adds the executor block
            report.created = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
            try:
                path = store_report(report)
                logger.info("Tuning report written to %s", path)
            except Exception as exc:  # noqa: BLE001 - a report that cannot be stored must not fail the tune
                logger.warning("Could not write the tuning report to %s: %s", reports_dir(), exc)
        return report

    return wrapper  # type: ignore[return-value]
