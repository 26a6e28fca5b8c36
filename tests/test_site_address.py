"""tools/site_address.py: the Pages workflow writes the site's address into pyproject.toml's
[project.urls] (where the installed package's messages read it: vae_ddp.fixes.factor.docs_url)."""

import subprocess
import sys
import tomllib

from helpers import ROOT

sys.path.insert(0, str(ROOT / "tools"))
import site_address  # noqa: E402

URL = "https://owner.github.io/vae-ddp/"


def test_the_commented_block_is_filled_in_and_nothing_else_changes():
    text = (ROOT / "pyproject.toml").read_text()
    new = site_address.set_address(text, URL)
    before, after = tomllib.loads(text), tomllib.loads(new)
    assert after["project"].pop("urls") == {"Documentation": URL}
    assert after == before
    assert site_address.set_address(new, "https://x.org/").count("Documentation = ") == 1  # replaced, not added


def test_a_project_without_urls_gets_the_table():
    text = '[project]\nname = "p"\nversion = "1"\n\n[tool.x]\na = 1\n'
    new = tomllib.loads(site_address.set_address(text, URL))
    assert new["project"]["urls"] == {"Documentation": URL} and new["tool"] == {"x": {"a": 1}}


def test_bad_input_is_one_line_and_exit_2(tmp_path):
    for args in (["not-a-url"], []):
        proc = subprocess.run([sys.executable, str(ROOT / "tools" / "site_address.py"), *args], capture_output=True,
                              text=True, timeout=60, cwd=tmp_path)
        assert proc.returncode == 2 and len(proc.stderr.splitlines()) == 1 and "error:" in proc.stderr
