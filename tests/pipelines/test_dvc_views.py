"""DVC's own views of a release work offline: `dvc plots show` through the template
`make release` writes (Vega inlined, no CDN), rendered by DVC's renderer."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

MODULES = REPO / ".tools" / "node_modules"


def test_the_offline_plots_template_renders_dvc_plots_without_any_network_script(
    tmp_path: Path,
) -> None:
    from dvc_render import render_html
    from dvc_render.vega import VegaRenderer

    if not (MODULES / "vega-embed").is_dir():
        pytest.fail("the Vega packages are not installed: `make test` installs them (npm)")
    template = tmp_path / "offline.html"
    done = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "plots_template.py"), str(MODULES), str(template)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    points = [{"step": i, "p95_latency_ms": 10.0 + i} for i in range(4)]
    plot = VegaRenderer(points, "latency", template="linear", x="step", y="p95_latency_ms")
    page = Path(render_html([plot], tmp_path / "index.html", str(template))).read_text()
    assert "cdn.jsdelivr" not in page and "<script src=" not in page
    assert "vegaEmbed" in page and page.count("<script>") >= 3
    default = Path(render_html([plot], tmp_path / "default.html")).read_text()
    assert "cdn.jsdelivr" in default  # what DVC's own page does, and this one avoids


def test_the_template_script_names_what_is_missing(tmp_path: Path) -> None:
    script = str(REPO / "scripts" / "plots_template.py")
    done = subprocess.run(
        [sys.executable, script, str(tmp_path), str(tmp_path / "x.html")],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode != 0 and "missing vega/build/vega.min.js" in done.stderr
    assert not (tmp_path / "x.html").exists()
