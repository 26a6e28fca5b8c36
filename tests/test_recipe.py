"""The recipe applied to a LightningModule that is not this project's VAE (examples/recipe.py).

The registry entry ``recipe`` runs ``examples/recipe_check.py --check``: one device, four
one-device runs with the samples of each batch permuted (the floor), and DDP on 2 gloo processes
(each its own process): ``examples/recipe.py`` run as it is (the script Home and the recipe page
show whole) and the same with vae_ddp's helpers, in float64 and float32. The site shows that
same execution.
"""

import importlib.util
import re
import sys
from pathlib import Path

import pytest

from vae_ddp.studies.equivalence import FLOOR_FACTOR, verdict


ROOT = Path(__file__).resolve().parents[1]
#: What the recipe test accepts: 2x the floor is the goal (FLOOR_FACTOR); the float64 runs of this
#: module measure 2.3x-2.8x (differences of a few ulps), so the test bounds the ratio at 4x.
RECIPE_BOUND = 4.0


def _recipe():
    spec = importlib.util.spec_from_file_location("recipe_example", ROOT / "examples" / "recipe_check.py")
    mod = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(ROOT / "examples"))  # recipe_check imports recipe
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("variant", ["plain", "helpers"])
def test_recipe_on_a_foreign_module_reaches_the_one_device_floor(generated, dtype, variant):
    r = generated("recipe")
    e = r["dtypes"][dtype]
    assert r["permutations"] >= 4 and len(e["floor_runs"]) == r["permutations"]
    assert e["floor"] == max(e["floor_runs"]) > 0  # reordering alone moves the parameters ...
    if dtype == "float64":
        assert e["floor"] < 1e-9  # ... by rounding only
    d = e["ddp"][variant]
    assert d["ratio_to_floor"] == pytest.approx(d["max_abs_param_diff"] / e["floor"])
    assert d["within_floor"] == (d["ratio_to_floor"] <= FLOOR_FACTOR)
    assert d["verdict"] == verdict(d["ratio_to_floor"])
    # Measured (float64, 30 Adam steps): DDP ends 2.3x (helpers) and 2.8x (plain) the floor, i.e.
    # 2e-15 against 9e-16, a few ulps; float32: 1.0x and 1.8x. The 2x goal is not met in float64
    # for this module (the page says so, worded from the ratio); the bound below catches anything
    # beyond rounding.
    assert d["ratio_to_floor"] <= RECIPE_BOUND, (dtype, variant, d)


def test_recipe_changes_table_matches_the_script():
    """Every `# change N` marked in the script is a row of the table, and the counts in the
    table's heading are the table's own."""
    mod = _recipe()
    marked = {int(n) for n in re.findall(r"# change (\d+)", (ROOT / "examples" / "recipe.py").read_text())}
    numbers = {c[0] for c in mod.CHANGES if c[0] is not None}
    assert marked == numbers == set(range(1, len(numbers) + 1))


def test_recipe_changes_heading_counts_the_rows():
    mod = _recipe()
    table = mod.changes_table()
    rows = [ln for ln in table.splitlines() if ln.startswith("| ") and not ln.startswith("| Change")]
    assert len(rows) == len(mod.CHANGES)
    n_changes = len({ln.split("|")[1].strip() for ln in rows} - {"-"})
    assert table.startswith(f"{n_changes} changes cover the {len(rows)} factors")
