"""Write the published site's address into pyproject.toml's ``[project.urls] Documentation``.

The audit and ``DDPAudit`` link each factor's page under that address (``vae_ddp.fixes.factor.docs_url``
reads it from the installed package's metadata); without it they name the page by its title. The Pages
workflow runs this with the address GitHub Pages gives it, before it installs the package and builds the
site, so the outputs the site shows link pages a reader can open.

    python tools/site_address.py https://OWNER.github.io/vae-ddp/ [pyproject.toml]

Bad input (an address that is not http(s), a file without a ``[project]`` table): one line, exit 2.
"""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path

_BLOCK = re.compile(r"^# \[project\.urls\]\n# Documentation = .*\n", re.MULTILINE)
_URLS = re.compile(r"^\[project\.urls\]\n(?:(?!\[).*\n)*", re.MULTILINE)


def set_address(text: str, url: str) -> str:
    """``text`` (a pyproject.toml) with ``[project.urls] Documentation = url``: the commented block filled in,
    an existing ``Documentation`` replaced, or the table added after ``[project]``'s keys."""
    line = f'Documentation = "{url}"\n'
    if _BLOCK.search(text):
        return _BLOCK.sub(lambda m: "[project.urls]\n" + line, text, count=1)
    m = _URLS.search(text)
    if m:
        table = re.sub(r"^Documentation = .*\n", "", m.group(0), flags=re.MULTILINE)
        return text[:m.start()] + table.replace("[project.urls]\n", "[project.urls]\n" + line, 1) + text[m.end():]
    at = re.search(r"^\[(?!project\])", text[text.index("[project]"):], re.MULTILINE)
    end = text.index("[project]") + (at.start() if at else len(text) - text.index("[project]"))
    return text[:end] + "[project.urls]\n" + line + "\n" + text[end:]


def main(argv: list[str]) -> int:
    if len(argv) not in (1, 2) or not re.match(r"https?://\S+$", argv[0]):
        print("site_address.py: error: give the site's address (https://...) and optionally the pyproject.toml",
              file=sys.stderr)
        return 2
    path = Path(argv[1] if len(argv) == 2 else "pyproject.toml")
    text = path.read_text()
    if "[project]" not in text:
        print(f"site_address.py: error: {path} has no [project] table", file=sys.stderr)
        return 2
    new = set_address(text, argv[0].rstrip("/") + "/")
    assert tomllib.loads(new)["project"]["urls"]["Documentation"] == argv[0].rstrip("/") + "/"
    path.write_text(new)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
