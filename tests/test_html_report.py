"""The HTML report: one self-contained file with its plots, checked as text and rendered in headless Chromium."""

from __future__ import annotations

import base64
import os
import re
import shutil
import subprocess
import xml.etree.ElementTree as ET

import pytest
from report_samples import sample_report

import torch_tweak.torch as tt

pytest.importorskip("matplotlib")

CHROMIUM = shutil.which("chromium") or ("/usr/bin/chromium" if os.path.exists("/usr/bin/chromium") else None)
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--enable-logging=stderr", "--v=0"]
_IMAGE = re.compile(r'<img alt="[^"]*" src="data:image/svg\+xml;base64,([A-Za-z0-9+/=]+)">')


def plots(page: str) -> list[str]:
    return [base64.b64decode(data).decode("utf-8") for data in _IMAGE.findall(page)]


def test_page_is_self_contained_with_four_plots_per_measured_graph(tmp_path):
    page = sample_report().to_html()
    svgs = plots(page)
    # text_encoder: throughput, latency, speed-up, fidelity; head: the same four; vae has no graph
    assert len(svgs) == 8
    for svg in svgs:
        assert ET.fromstring(svg).tag.endswith("svg")
    assert page.count("<img") == 8 and "<script" not in page
    assert "Content-Security-Policy" in page and "default-src 'none'" in page
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", page) and "url(" not in page
    for text in ("Summary", "Environment", "Module text_encoder", "Module head", "Module vae", "2.58x", "1.60x",
                 "Throughput vs batch size", "Latency distribution", "Speed-up vs eager", "Fidelity error",
                 "TuningError: no candidate could be built", torch_version()):
        assert text in page, text


def torch_version() -> str:
    import torch

    return torch.__version__


def test_text_from_the_report_is_escaped():
    report = sample_report()
    report.modules[0].graphs[0].candidates[3].error = "FidelityError: <script>alert(1)</script> & more"
    page = report.to_html()
    assert "<script>alert" not in page and "&lt;script&gt;alert(1)&lt;/script&gt; &amp; more" in page


def test_save_html_repr_html_and_graphs_without_measurements(tmp_path):
    report = sample_report()
    for candidate in report.modules[1].graphs[0].candidates:
        candidate.measurements = None
    path = report.save_html(tmp_path / "r.html")
    assert oct(path.stat().st_mode & 0o777) == "0o600"
    assert len(plots(path.read_text())) == 5  # head keeps only its fidelity plot
    fragment = report._repr_html_()
    assert "<html" not in fragment and fragment.startswith("<style>") and "tt-report" in fragment
    empty = tt.TuningReport(dry_run=True).to_html()
    assert "dry run" in empty and not plots(empty)


def _chromium(tmp_path, url: str, *extra: str) -> subprocess.CompletedProcess:
    profile = tmp_path / f"profile{len(list(tmp_path.glob('profile*')))}"
    return subprocess.run([CHROMIUM, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", *extra, url],
                          capture_output=True, text=True, timeout=120)


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (.ci/run installs it: apt-get install chromium)")
def test_chromium_renders_the_plots_without_console_errors(tmp_path):
    from matplotlib.image import imread

    report = sample_report()
    page = tmp_path / "report.html"
    report.save_html(page)
    shot = tmp_path / "shot.png"
    done = _chromium(tmp_path, page.as_uri(), f"--screenshot={shot}", "--window-size=1200,2000",
                     "--hide-scrollbars")
    assert shot.is_file(), done.stderr[-2000:]
    consoles = [line for line in done.stderr.splitlines() if ":CONSOLE" in line]
    assert not consoles, consoles  # the page has no script: any console message is a blocked load or an error
    pixels = imread(str(shot))
    assert pixels.shape[0] == 2000 and pixels.shape[1] == 1200
    rgb = (pixels[..., :3] * 255).astype("uint8").reshape(-1, 3)
    assert rgb.std() > 10, "the screenshot is blank"
    colours = {tuple(c) for c in rgb[:: 7]}
    assert len(colours) > 200, f"only {len(colours)} colours: the plots did not render"

    # A copy with a probe script (the report itself forbids scripts) counts the images the browser decoded.
    probe = page.read_text().replace("default-src 'none'", "default-src 'none'; script-src 'unsafe-inline'")
    probe = probe.replace("</body>", "<script>window.addEventListener('load', () => {const imgs = [...document.images];"
                          "document.body.dataset.decoded = imgs.filter(i => i.complete && i.naturalWidth > 100).length"
                          " + '/' + imgs.length;});</script></body>")
    probe_path = tmp_path / "probe.html"
    probe_path.write_text(probe)
    dom = _chromium(tmp_path, probe_path.as_uri(), "--dump-dom", "--virtual-time-budget=5000")
    assert 'data-decoded="8/8"' in dom.stdout, dom.stdout[:500] + dom.stderr[-2000:]
