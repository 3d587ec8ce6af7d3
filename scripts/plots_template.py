"""An HTML template for `dvc plots show` / `dvc plots diff` that works offline: DVC's own
page loads Vega, Vega-Lite and Vega-Embed from a CDN (a blank page without the network);
this one carries them inline (from the npm packages `make release` installs under .tools/)
and has no `{scripts}` placeholder, so DVC adds no CDN tags.

    python scripts/plots_template.py .tools/node_modules .dvc/plots/offline.html
"""

from __future__ import annotations

import sys
from pathlib import Path

LIBRARIES = ("vega/build/vega.min.js", "vega-lite/build/vega-lite.min.js",
             "vega-embed/build/vega-embed.min.js")  # fmt: skip

PAGE = """<!DOCTYPE html>
<html>
<head>
    {refresh_tag}
    <title>DVC Plot</title>
    <meta charset="utf-8">
%s
    <style>
        table {
            border-spacing: 15px;
        }
    </style>
</head>
<body>
    {plot_divs}
</body>
</html>
"""


def template(modules: Path) -> str:
    scripts = []
    for rel in LIBRARIES:
        code = (modules / rel).read_text(encoding="utf-8")
        # inside <script>, only "</script" could end the element early
        scripts.append(
            "    <script>\n" + code.replace("</script", "<\\/script") + "\n    </script>"
        )
    return PAGE % "\n".join(scripts)


def main() -> None:
    modules, target = Path(sys.argv[1]), Path(sys.argv[2])
    missing = [rel for rel in LIBRARIES if not (modules / rel).is_file()]
    if missing:
        sys.exit(f"{modules}: missing {', '.join(missing)} (`make release` installs them)")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(target.name + ".tmp")
    tmp.write_text(template(modules), encoding="utf-8")
    tmp.replace(target)


if __name__ == "__main__":
    main()
