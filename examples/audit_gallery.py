"""`vae-ddp audit` on real architectures (examples/gallery.py): which factors bite, the verdict, the time.

    python examples/audit_gallery.py [--only ResNet-18 DCGAN] [--out DIR]
    python examples/audit_gallery.py --out docs/results/audit-gallery   # the page's numbers (many minutes)

Each entry of `gallery.GALLERY` is audited as its user would run it (2 gloo ranks, 3 steps,
float64, the datamodule's global batch of 8), under the project's guard; its exit code, the
audit's findings and its wall time go into `audit_gallery.json`, and `render` turns that into
the page's table (`tables.md`). `EXPECTED` is the diagnosis each entry must get: `check` compares.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "src")]

from examples.gallery import GALLERY  # noqa: E402

#: name -> (the exit code and its meaning, the factors that bite or need a change of the user's code):
#: the diagnosis each must get
EXPECTED: dict[str, tuple[str, frozenset]] = {
    "ResNet-18": ("1 the fixes close it", frozenset({"batchnorm"})),
    "MobileNetV3": ("1 the fixes close it", frozenset({"batchnorm", "noise", "sampler"})),
    "ViT (drop-path)": ("1 the fixes close it", frozenset({"noise", "sampler"})),
    "U-Net": ("1 the fixes close it", frozenset({"batchnorm"})),
    "SimCLR": ("1 your code", frozenset({"batchnorm", "noise"})),
    "SimCLR, views seeded per sample": ("1 the fixes close it", frozenset({"batchnorm"})),
    # unexplained: torch's gloo all_gather backward
    "SimCLR, seeded, keys by a transpose": ("1 unexplained", frozenset()),
    "DCGAN": ("1 your code", frozenset({"noise"})),  # BatchNorm's running statistics follow the ranks' same z
    "DCGAN, z for the global batch": ("1 the fixes close it", frozenset({"noise", "batchnorm"})),
    "GPT-2": ("1 your code", frozenset({"noise", "reduction", "sampler"})),
    "GPT-2, global token mean, no attention dropout": ("1 the fixes close it", frozenset({"noise", "sampler"})),
    "GPT-2, as above, padded per batch": ("1 your code", frozenset({"sampler"})),
    "BERT (masked LM)": ("1 your code", frozenset({"noise", "reduction", "sampler"})),
    "VQ-VAE, EMA codebook": ("1 your code", frozenset({"buffers"})),
    "GPT-2 fixed, learning rate x world size": ("1 your code", frozenset({"noise", "sampler", "update"})),
    "GPT-2 fixed, OneCycleLR sized by the loader": ("1 your code", frozenset({"noise", "sampler", "update"})),
    "GPT-2 fixed, bf16-mixed": ("1 the fixes close it", frozenset({"noise", "sampler"})),
}


def arguments(name: str, steps: int = 3) -> list[str]:
    """The `vae-ddp` arguments that audit ``GALLERY[name]`` (without ``--out``)."""
    model, data, data_args, trainer = GALLERY[name]
    return (["audit", "--model", f"examples/gallery.py:{model}", "--data", f"examples/gallery.py:{data}",
             "--steps", str(steps)] + [f"--data.init_args.{k}={json.dumps(v)}" for k, v in data_args.items()]
            + [f"--trainer.{k}={v}" for k, v in trainer.items()])


def audit_one(name: str, out: Path, steps: int = 3, in_process: bool = False) -> dict:
    """One `vae-ddp audit` of ``GALLERY[name]``: its exit code, findings and wall time (s). In a
    subprocess under the project's guard (the page's times: the whole command, imports included),
    or, ``in_process``, in this process, whose torch and Lightning are imported already (the
    tests; its launched runs are processes either way)."""
    args = [*arguments(name, steps), "--out", str(out)]
    start = time.monotonic()
    if in_process:
        from vae_ddp.cli import main_captured

        code, out_text, err_text = main_captured(args, cwd=ROOT)
    else:
        from vae_ddp import guard

        proc = guard.run([sys.executable, "-m", "vae_ddp.cli", *args], cwd=ROOT, capture_output=True, text=True,
                         timeout=1800)
        code, out_text, err_text = proc.returncode, proc.stdout, proc.stderr
    seconds = time.monotonic() - start
    r = json.loads((out / "audit.json").read_text()) if (out / "audit.json").exists() else {}
    errors = [ln for ln in err_text.splitlines() if ln.startswith("vae-ddp audit: ")]
    return {"name": name, "command": " ".join(["vae-ddp", *arguments(name, steps)]), "exit_code": code,
            "seconds": round(seconds, 1), "error": errors[0] if errors else "",
            **{k: r.get(k) for k in ("ratio_to_floor", "floor", "deterministic", "within_floor", "unexplained",
                                     "largest_differences", "notes")},
            "findings": [{**{k: f[k] for k in ("factor", "exposed", "bites", "contribution", "automatic_fix", "fix",
                                               "evidence", "page")}, "follows": f.get("follows")}
                         for f in r.get("findings", [])],
            "table": _report(out_text)}


def _report(out_text: str) -> str:
    """The audit's report in what it printed (stdout): from its first line, ``exit 0: ...`` or ``exit 1: ...``
    (the user's own output of the reference run may come before it); "" where it printed none."""
    start = re.search(r"^exit [01]: ", out_text, re.M)
    return out_text[start.start():] if start else ""


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", nargs="+", choices=list(GALLERY), default=list(GALLERY))
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--out", type=Path, default=None,
                   help="write audit_gallery.json, tables.md and command.md here (the whole gallery only)")
    args = p.parse_args(argv)
    if args.out and args.only != list(GALLERY):
        p.error("--out writes the whole gallery (the page's table): leave out --only")
    audits = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.only:
            audits.append(audit_one(name, Path(tmp) / f"a{len(audits)}", args.steps))
            print(json.dumps({k: audits[-1][k] for k in ("name", "exit_code", "seconds", "ratio_to_floor", "error")}),
                  flush=True)
    result = {"steps": args.steps, "audits": audits}
    print(render(result))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "audit_gallery.json").write_text(json.dumps(result, indent=1))
        (args.out / "tables.md").write_text(render(result) + "\n")
        (args.out / "command.md").write_text(command_md(result, args.out.as_posix()))
    wrong = check(result)
    for line in wrong:
        print(f"unexpected diagnosis: {line}", file=sys.stderr)
    if wrong:
        sys.exit(1)
    return result


#: factors shown as columns (the optimizer's row follows the noise check), then the audit's own rows of the
#: rest of the step; a column shows only when some audit exposes it
COLUMNS = ("batchnorm", "noise", "sampler", "reduction", "logging", "gradient_scale", "update", "buffers", "parameters")


def cell(f: dict) -> str:
    """One factor of one audit in a word: ``bites`` (its fix changes DDP's gradient by more than 2x
    what is left), ``no effect``, ``not separable``, ``your code`` (no automatic fix: the evidence names
    it), ``follows`` (what follows from other rows, whose fixes close it), ``exposed`` (not judged) or ``-``
    (not exposed)."""
    if not f["exposed"]:
        return "-"
    if f.get("follows"):
        return "follows"
    if not f["automatic_fix"]:
        return "your code"
    if f["contribution"] is None:
        return "exposed"
    return {True: "bites", False: "no effect", None: "not separable"}[f["bites"]]


def verdict(a: dict) -> str:
    """The exit code and what it means (`vae-ddp audit --help`)."""
    if a["exit_code"] == 0:
        return "0 passed"
    if a["exit_code"] == 1:
        if a["deterministic"] and a.get("within_floor") and not a["unexplained"]:
            return "1 the fixes close it"  # DDP as run trains another model; with the fixes, one device's step
        return "1 " + ("not judged" if not a["deterministic"] else "unexplained" if a["unexplained"] else "your code")
    return f"{a['exit_code']} " + ("bad input" if a["exit_code"] == 2 else "run failed")


def fixes(f: dict) -> list[str]:
    """The project's helpers a factor's fix names (``vae_ddp.fixes.NAME`` in the audit's fix text)."""
    return list(dict.fromkeys(re.findall(r"vae_ddp\.fixes\.(\w+)", f["fix"])))


def render(result: dict) -> str:
    """The page's table and the fixes per architecture, from ``audit_gallery.json``."""
    from vae_ddp.fixes.factor import audit_factor

    names = {k: audit_factor(k).name for k in COLUMNS}
    cols = [k for k in COLUMNS
            if any(f["factor"] == k and f["exposed"] for a in result["audits"] for f in a["findings"])]
    lines = ["| architecture | " + " | ".join(names[k] for k in cols) + " | exit code |",
             "|---|" + "---|" * len(cols) + "---|"]
    for a in result["audits"]:
        by = {f["factor"]: f for f in a["findings"]}
        cells = [cell(by[k]) if k in by else "-" for k in cols]
        lines.append(f"| {a['name']} | " + " | ".join(cells) + f" | {verdict(a)} |")
    lines += ["", "What to change, per architecture (the helpers the audit's fix names; every factor that bites, "
                  "needs your code or cannot be separated from what does), and how long its audit took:", ""]
    for a in result["audits"]:
        todo = [f"{names.get(f['factor'], f['factor'])}: " + (", ".join(f"`{x}`" for x in fixes(f)) or "see its page")
                for f in a["findings"] if f["factor"] in cols and cell(f) in ("bites", "your code", "not separable")]
        if a["unexplained"]:
            todo.append("with every fix, none of the known factors explains what is left")
        todo = todo or ["nothing"]
        lines.append(f"- **{a['name']}** ({a['seconds']:.0f} s): " + "; ".join(todo) + ".")
    return "\n".join(lines)


def command_md(result: dict, out: str) -> str:
    """The command line that wrote ``out`` (``command.md`` for the page)."""
    return f"```bash\npython examples/audit_gallery.py --steps {result['steps']} --out {out}\n```\n"


def check(result: dict) -> list[str]:
    """Where an audit's diagnosis differs from ``EXPECTED`` (verdict, the factors that bite or need code)."""
    wrong = []
    for a in result["audits"]:
        want, named = EXPECTED[a["name"]]
        got = frozenset(f["factor"] for f in a["findings"] if cell(f) in ("bites", "your code"))
        if (verdict(a), got) != (want, named):
            wrong.append(f"{a['name']}: {verdict(a)}, {sorted(got)}; expected {want}, {sorted(named)}")
    return wrong


if __name__ == "__main__":
    main()
