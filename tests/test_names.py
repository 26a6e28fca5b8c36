"""One name per factor: the registry's ``name`` is the factor page's title, its entry in the
site's nav (which tools/site_hooks.py writes from the registry) and the name in the tables that list the
factors (Home's, the recipe's)."""

import ast
import re
from pathlib import Path

import yaml

from vae_ddp.fixes import registry
from helpers import ROOT, load_script


def _site_nav() -> list:
    """The site's ``nav``: mkdocs.yml's, with what the site hook writes into it (``on_config``:
    the factors' section). ``!ENV`` tags read as None."""
    class Loader(yaml.SafeLoader):
        pass

    Loader.add_multi_constructor("!", lambda loader, suffix, node: None)
    config = yaml.load((ROOT / "mkdocs.yml").read_text(), Loader=Loader)
    return load_script("tools/site_hooks.py", "names_site_hooks").on_config(config)["nav"]


def _nav() -> dict[str, str]:
    """``{page: title}`` of every titled page in the site's ``nav``."""
    out: dict[str, str] = {}

    def walk(items):
        for item in items:
            if isinstance(item, dict):
                for title, target in item.items():
                    if isinstance(target, list):
                        walk(target)
                    else:
                        out[target] = title

    walk(_site_nav())
    return out


def _h1(page: Path) -> str:
    """The page's first heading (after its front matter)."""
    text = page.read_text()
    if text.startswith("---\n"):
        text = text[text.index("\n---\n", 4) + 5:]
    match = re.search(r"^# (.+)$", text, re.MULTILINE)
    assert match, f"{page} has no first-level heading"
    return match.group(1).strip()


def test_nav_and_page_titles_are_the_registry_names():
    nav = _nav()
    for f in registry.factors():
        assert nav.get(f.page) == f.name, f"mkdocs.yml nav names {f.page} {nav.get(f.page)!r}, the registry {f.name!r}"
        h1 = _h1(ROOT / "docs" / f.page)
        assert h1 == f.name, f"docs/{f.page} is titled {h1!r}, the registry names it {f.name!r}"


def test_names_are_distinct():
    names = [f.name for f in registry.factors()]
    assert len(set(names)) == len(names), names


def test_factor_examples_take_the_name_from_the_registry():
    """Each factor example's ``"Factor"`` (its row of Home's table) is ``registry.get(KEY).name``
    of its own factor, never a name typed again."""
    for f in registry.factors():
        script = ROOT / "examples" / f"factor_{f.key}.py"
        found = []
        for node in ast.walk(ast.parse(script.read_text())):
            if isinstance(node, ast.Dict):
                for key, value in zip(node.keys, node.values):
                    if isinstance(key, ast.Constant) and key.value == "Factor":
                        found.append(ast.unparse(value))
        assert found == [f'registry.get({f.key!r}).name'], (script.name, found)


def test_recipe_table_uses_the_registry_names(monkeypatch):
    mod = load_script("examples/recipe_check.py", "recipe_names", monkeypatch)  # it imports recipe
    table = mod.changes_table()
    linked = re.findall(r"\| \[([^\]]+)\]\(([^)]+)\) \|", table)
    assert sorted(linked) == sorted((f.name, f.page) for f in registry.factors()), linked


def test_report_scale_names_each_factor_as_the_registry_does():
    from vae_ddp.studies.report_scale import FACTOR_VARIANTS, VARIANTS

    for key, variant in FACTOR_VARIANTS.items():
        assert VARIANTS[variant][2] == registry.get(key).name, (key, VARIANTS[variant])


#: the nav's factor groups (tools/site_hooks.py), by what the report-scale study measures of each factor's one step
GROUPS = {"different": "Change what DDP trains", "same distribution": "Change only the luck",
          "inconclusive": "Not resolved at the report's scale",
          "logging": "Change only the plot", None: "Not a cause at equal per-device batches"}


def test_nav_groups_the_factors_by_their_measured_kind():
    """The nav says which factors change what DDP trains, which only the luck or the plot, and
    which are no cause at equal per-device batches: each factor page sits under the group that the
    committed report-scale study's kind of the factor's step names (the ranking's: the most serious of the
    gradient's, the KL's and the reconstruction's; logging: the plotted value; a factor the study does not
    isolate: no cause)."""
    import json

    from vae_ddp.studies.report_scale import factor_effects

    nav = _site_nav()
    factors = next(item["The factors"] for item in nav if isinstance(item, dict) and "The factors" in item)
    group_of = {page: title for group in factors for title, pages in group.items()
                for entry in pages for page in entry.values()}
    rs = json.loads((ROOT / "docs" / "results" / "report-scale" / "report_scale.json").read_text())
    effects = factor_effects(rs)
    for f in registry.factors():
        e = effects.get(f.key)
        kind = "logging" if f.key == "logging" else (e["kind"] if e else None)
        assert group_of.get(f.page) == GROUPS[kind], (f.key, kind, group_of.get(f.page))
