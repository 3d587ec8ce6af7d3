"""The gate's pull-request comment (issue 43 item 5): `gh pr comment --edit-last` edited
whatever the token's account said last. scripts/pr_comment.py edits only the workflow's own
gate comment (its author and the gate's marker), on any page of the comments, and creates
one otherwise; run against a fake GitHub REST API on loopback that records every call."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlparse

import pytest

from pipelines.gate import MARKER

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "pr_comment.py"
BOT = "github-actions[bot]"
PAGE = 2  # the fake answers two comments a page, whatever per_page asks


class FakeGitHub:
    def __init__(self) -> None:
        self.comments: list[dict[str, Any]] = []
        self.calls: list[tuple[str, str]] = []
        self.tokens: set[str] = set()

    def add(self, login: str, body: str) -> int:
        cid = 1000 + len(self.comments)
        self.comments.append({"id": cid, "user": {"login": login}, "body": body})
        return cid


@pytest.fixture
def github() -> Iterator[tuple[FakeGitHub, str]]:
    fake = FakeGitHub()

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            pass

        def _answer(self, status: int, payload: Any, link: str = "") -> None:
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            if link:
                self.send_header("Link", link)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _body(self) -> Any:
            return json.loads(self.rfile.read(int(self.headers["Content-Length"])))

        def do_GET(self) -> None:  # noqa: N802
            fake.calls.append(("GET", self.path))
            fake.tokens.add(self.headers.get("Authorization", ""))
            url = urlparse(self.path)
            page = int(parse_qs(url.query).get("page", ["1"])[0])
            rows = fake.comments[(page - 1) * PAGE : page * PAGE]
            more = page * PAGE < len(fake.comments)
            link = f'<http://{self.headers["Host"]}{url.path}?page={page + 1}>; rel="next"'
            self._answer(200, rows, link if more else "")

        def do_PATCH(self) -> None:  # noqa: N802
            fake.calls.append(("PATCH", self.path))
            cid = int(self.path.rsplit("/", 1)[1])
            comment = next(c for c in fake.comments if c["id"] == cid)
            comment["body"] = self._body()["body"]
            self._answer(200, {"html_url": f"https://x/{cid}"})

        def do_POST(self) -> None:  # noqa: N802
            fake.calls.append(("POST", self.path))
            cid = fake.add(BOT, self._body()["body"])
            self._answer(201, {"html_url": f"https://x/{cid}"})

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield fake, f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def post(api: str, tmp_path: Path, text: str) -> subprocess.CompletedProcess[str]:
    report = tmp_path / "gate-report.md"
    report.write_text(text)
    env = {"GH_TOKEN": "t0ken", "GITHUB_REPOSITORY": "o/r", "GITHUB_API_URL": api, "PATH": ""}
    return subprocess.run(
        [sys.executable, str(SCRIPT), "7", str(report)],
        env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip


def test_with_no_gate_comment_one_is_created(github: Any, tmp_path: Path) -> None:
    fake, api = github
    fake.add(BOT, "another step's note")  # the bot's, without the marker: not the gate's
    done = post(api, tmp_path, f"{MARKER}\n## gate: PASS")
    assert done.returncode == 0 and done.stdout.startswith("created"), done.stderr
    assert fake.comments[0]["body"] == "another step's note"
    assert fake.comments[-1]["body"] == f"{MARKER}\n## gate: PASS"
    assert fake.tokens == {"Bearer t0ken"}


def test_only_the_workflows_own_gate_comment_is_edited_on_any_page(
    github: Any, tmp_path: Path
) -> None:
    fake, api = github
    fake.add("alice", "first!")
    own = fake.add(BOT, f"{MARKER}\n## gate: FAIL")
    fake.add("alice", f"quoting you:\n{MARKER}\n## gate: FAIL")  # a human quoting it
    fake.add("other-bot[bot]", "coverage 90 %")  # what --edit-last would have edited...
    fake.add(BOT, "a later note of the bot, unmarked")  # ... or this
    done = post(api, tmp_path, "## gate: PASS")  # no marker given: it is added
    assert done.returncode == 0 and done.stdout.startswith("updated"), done.stderr
    bodies = {c["id"]: c["body"] for c in fake.comments}
    assert bodies[own] == f"{MARKER}\n## gate: PASS"
    assert len(fake.comments) == 5 and ("POST", "/repos/o/r/issues/7/comments") not in fake.calls
    assert [c["body"] for c in fake.comments if c["id"] != own] == [
        "first!", f"quoting you:\n{MARKER}\n## gate: FAIL", "coverage 90 %",
        "a later note of the bot, unmarked",
    ]  # fmt: skip
    assert sum(method == "GET" for method, _ in fake.calls) == 3  # every page was read
    # a second push edits the same comment again
    assert post(api, tmp_path, "## gate: FAIL again").stdout.startswith("updated")
    assert len(fake.comments) == 5 and fake.comments[1]["body"].endswith("FAIL again")


def test_without_a_token_or_with_the_api_down_it_says_so(github: Any, tmp_path: Path) -> None:
    _, api = github
    report = tmp_path / "r.md"
    report.write_text("x")
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "7", str(report)],
        env={"PATH": ""}, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 2 and "GH_TOKEN" in done.stderr
    down = post("http://127.0.0.1:9", tmp_path, "x")  # nothing listens on the discard port
    assert down.returncode == 1 and "could not post" in down.stderr
    assert "Traceback" not in down.stderr
