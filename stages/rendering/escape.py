"""Escaping for every format Shipyard renders: a value can never add a key, a line or a
heading to a config, whatever it contains. Registered as Jinja filters by the renderer;
tests/stages/test_escaping.py renders every template with hostile values and parses back."""

from __future__ import annotations

import json
import re
from typing import Any, cast

import yaml

# Characters YAML treats as line breaks or refuses; they must be escaped inside quotes.
_YAML_UNSAFE = re.compile('[\x00-\x1f\x7f-\x9f\u2028\u2029\ufeff\ufffe\uffff\ud800-\udfff"\\\\]')
_MD_ALWAYS = set("\\`*_[]<>|~&#")
_MD_LINE_START = set("-+=")
_MD_ORDERED = re.compile(r"^(\d{1,9})([.)])")


def pbtxt(value: Any) -> str:
    """A protobuf text-format string literal: printable ASCII as is, every other byte of
    the UTF-8 encoding as an octal escape (text_format's CUnescape reads them back)."""
    out = ['"']
    for byte in str(value).encode("utf-8", errors="surrogatepass"):
        ch = chr(byte)
        if ch in ('"', "\\"):
            out.append("\\" + ch)
        elif 0x20 <= byte < 0x7F:
            out.append(ch)
        else:
            out.append(f"\\{byte:03o}")
    out.append('"')
    return "".join(out)


def yaml_scalar(value: Any) -> str:
    """A YAML scalar on one line: plain where YAML reads it back as the same string,
    double-quoted with escapes otherwise (numbers, booleans, ':' or '#', newlines, ...)."""
    if not isinstance(value, str):
        return json.dumps(value)
    dumped = yaml.safe_dump(value, width=float("inf"), allow_unicode=True)
    dumped = dumped.removesuffix("\n...\n").removesuffix("\n")
    if "\n" not in dumped and not dumped.startswith(("'", '"', "|", ">")):
        try:
            if yaml.safe_load(dumped) == value:
                return cast(str, dumped)
        except yaml.YAMLError:
            pass
    return '"' + _YAML_UNSAFE.sub(_yaml_escape, value) + '"'


def _yaml_escape(match: re.Match[str]) -> str:
    ch = match.group()
    if ch in ('"', "\\"):
        return "\\" + ch
    code = ord(ch)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def comment(value: Any) -> str:
    """Text for a `#` comment line (YAML, pbtxt): stays on its line, whatever it holds."""
    return json.dumps(str(value), ensure_ascii=True)[1:-1]  # every non-ASCII char escaped


def markdown(value: Any) -> str:
    """Markdown inline text that reads as itself: backslash escapes (valid in CommonMark)
    for every character that can start emphasis, code, links, HTML, entities, tables or
    headings anywhere in a line, and for list, quote and setext markers at its start, so no
    structure can come from a value; line breaks stay line breaks inside the paragraph."""
    lines = str(value).replace("\r\n", "\n").replace("\r", "\n").split("\n")
    return "  \n".join(_md_line(line.strip()) for line in lines if line.strip())


def _md_line(line: str) -> str:
    text = "".join("\\" + c if c in _MD_ALWAYS else c for c in line)
    if text[:1] in _MD_LINE_START:
        text = "\\" + text
    return _MD_ORDERED.sub(r"\1\\\2", text, count=1)


def markdown_cell(value: Any) -> str:
    """Markdown for one table cell: escaped, on one line."""
    return markdown(" ".join(str(value).split()))


FILTERS = {
    "pbtxt": pbtxt,
    "yaml": yaml_scalar,
    "comment": comment,
    "md": markdown,
    "md_cell": markdown_cell,
}
