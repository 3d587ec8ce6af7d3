"""Post the gate report on a pull request as one comment of this workflow's own, updated on
each push (`.github/workflows/release-gate.yml`).

    GH_TOKEN=... GITHUB_REPOSITORY=owner/repo python scripts/pr_comment.py PR REPORT.md

The comment it edits is found by two marks: its author is the workflow's own account
(`github-actions[bot]`, or `--author`) and its body carries the gate's marker
(pipelines/gate.py MARKER). `gh pr comment --edit-last` edited whatever the token's account
said last on the pull request, a comment of another bot or step included; a comment with the
marker written by someone else (quoting the report) is left alone as well. None found: a
new comment. GitHub's REST API through urllib (GITHUB_API_URL, as Actions sets it)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

MARKER = "<!-- shipyard-release-gate -->"  # pipelines/gate.py's (this script imports nothing)
AUTHOR = "github-actions[bot]"


def _call(method: str, url: str, token: str, body: Any = None) -> tuple[Any, str]:
    """(the JSON answer, the next page's URL or "")."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method=method)
    request.add_header("Authorization", f"Bearer {token}")
    request.add_header("Accept", "application/vnd.github+json")
    request.add_header("X-GitHub-Api-Version", "2022-11-28")
    if data is not None:
        request.add_header("Content-Type", "application/json")
    with urllib.request.urlopen(request, timeout=30) as answer:
        link = answer.headers.get("Link", "")
        payload = json.loads(answer.read() or b"null")
    following = [
        part.split(";")[0].strip().strip("<>") for part in link.split(",") if 'rel="next"' in part
    ]
    return payload, following[0] if following else ""


def own_comment(api: str, repo: str, pr: int, token: str, author: str) -> int | None:
    """The id of this workflow's last gate comment on the pull request, or None."""
    url = f"{api}/repos/{repo}/issues/{pr}/comments?per_page=100"
    found = None
    while url:
        page, url = _call("GET", url, token)
        for comment in page:
            if (comment.get("user") or {}).get("login") == author and MARKER in (
                comment.get("body") or ""
            ):
                found = int(comment["id"])
    return found


def post(api: str, repo: str, pr: int, token: str, body: str, author: str = AUTHOR) -> str:
    """Edit the own comment, else create one; what was done and the comment's URL."""
    if MARKER not in body:
        body = f"{MARKER}\n{body}"
    existing = own_comment(api, repo, pr, token, author)
    if existing is not None:
        done, _ = _call(
            "PATCH", f"{api}/repos/{repo}/issues/comments/{existing}", token, {"body": body}
        )
        return f"updated {done.get('html_url', existing)}"
    done, _ = _call("POST", f"{api}/repos/{repo}/issues/{pr}/comments", token, {"body": body})
    return f"created {done.get('html_url', '')}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="post the gate report as the workflow's comment")
    p.add_argument("pr", type=int, help="the pull request's number")
    p.add_argument("report", type=Path, help="the markdown to post (shipyard gate --report)")
    p.add_argument(
        "--author", default=AUTHOR, help=f"the account whose comment is edited ({AUTHOR})"
    )
    args = p.parse_args(argv)
    token = os.environ.get("GH_TOKEN") or os.environ.get("GITHUB_TOKEN")
    repo = os.environ.get("GITHUB_REPOSITORY")
    if not token or not repo:
        print("set GH_TOKEN and GITHUB_REPOSITORY (owner/name)", file=sys.stderr)
        return 2
    api = os.environ.get("GITHUB_API_URL", "https://api.github.com").rstrip("/")
    try:
        print(post(api, repo, args.pr, token, args.report.read_text(encoding="utf-8"), args.author))
    except (urllib.error.URLError, OSError, ValueError) as exc:
        print(f"could not post the comment: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
