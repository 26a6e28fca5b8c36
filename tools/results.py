"""``make results``: run the registered examples and studies, each into ``docs/generated/<name>/``
(one source of truth for every number of the site, which only includes what they wrote).

For each entry of ``docs/examples.yml`` whose inputs changed it writes ``output.md`` (what the
entry printed, or with ``output: tables`` the ``tables.md`` it wrote: a study's titles, tables
and verdicts), ``command.md`` (how it was run) and the files it wrote with ``--out`` (PNG,
JSON); then ``docs/generated/summary/``, the Home page's factor table, from the ``"summary"``
objects of the entries marked ``summary: true``. A failing entry fails with the end of its
stderr. ``VAE_DDP_FULL=1`` runs the full settings (``full_args``) instead of the reduced ones
(``args``); ``VAE_DDP_DOCS_JOBS=2`` runs two entries at once.

Each entry runs as its command line would, in a fork of a zygote that has imported torch and
Lightning once (``vae_ddp.zygote``: one per process that runs entries), under a guard of its own.

``python tools/results.py [NAME ...]``: those entries only (no summary). The tests read the same
folder through this module (``tests/conftest.py``), and ``mkdocs build`` includes it with
pymdownx.snippets.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator, Optional

import yaml

log = logging.getLogger("vae_ddp.results")


class ResultsError(Exception):
    """An entry of the registry is wrong, failed or timed out (the message says which and why)."""

REGISTRY = "docs/examples.yml"
GENERATED = "docs/generated"
STAMP = ".stamp"
OUTPUT_MODES = ("markdown", "tables", "log")
KEYS = {"name", "script", "command", "args", "full_args", "output", "drop", "timeout", "summary", "page", "exit_code"}
#: With ``output: tables`` the entry writes the Markdown it shows into its output folder.
TABLES = "tables.md"
#: Python warnings (``path.py:LINE: Category: message`` and the source line after it) are not output,
#: also where one starts inside a line: the ranks write into one file, and a process whose output is
#: unbuffered writes a line in pieces (``print`` writes the text, then the newline), between which
#: another rank's warning can land.
WARNING_LINE = re.compile(r"^\S+\.py:\d+: |/\S+\.py:\d+: ")


def full_mode() -> bool:
    return os.environ.get("VAE_DDP_FULL", "") not in ("", "0")


def load_registry(root: Path) -> list[dict[str, Any]]:
    """The entries of ``docs/examples.yml``, checked and completed with defaults."""
    path = root / REGISTRY
    data = yaml.safe_load(path.read_text()) or {}
    entries, names = [], set()
    for i, raw in enumerate(data.get("examples") or []):
        where = f"{REGISTRY}, entry {i + 1}"
        if not isinstance(raw, dict):
            raise ResultsError(f"{where}: expected a mapping, got {raw!r}")
        unknown = set(raw) - KEYS
        if unknown:
            raise ResultsError(f"{where}: unknown key(s) {', '.join(sorted(unknown))}; use {', '.join(sorted(KEYS))}")
        if ("script" in raw) == ("command" in raw):
            raise ResultsError(f"{where}: give exactly one of `script` or `command`")
        e = dict(raw)
        if "script" in e:
            script = root / e["script"]
            if not script.is_file():
                raise ResultsError(f"{where}: script {e['script']} does not exist")
            e.setdefault("name", script.stem)
            e.setdefault("output", "markdown")
        else:
            if not isinstance(e["command"], list) or not e["command"]:
                raise ResultsError(f"{where}: `command` must be a non-empty list")
            if "name" not in e:
                raise ResultsError(f"{where}: a `command` entry needs a `name`")
            e.setdefault("output", "tables")
        if e["output"] not in OUTPUT_MODES:
            raise ResultsError(f"{where}: output {e['output']!r} is not one of {', '.join(OUTPUT_MODES)}")
        if not re.fullmatch(r"[A-Za-z0-9_-]+", e["name"]) or e["name"] == "summary":
            raise ResultsError(f"{where}: bad name {e['name']!r} (letters, digits, _ and -; not 'summary')")
        if e["name"] in names:
            raise ResultsError(f"{where}: name {e['name']!r} is registered twice")
        names.add(e["name"])
        for key in ("args", "full_args"):
            odd = [a for a in e.get(key) or [] if not isinstance(a, (str, int, float))]
            if odd:  # e.g. an unquoted {cifar}, which YAML reads as a mapping
                raise ResultsError(f"{where}: `{key}` holds {odd[0]!r}: quote it (\"{{cifar}}\")")
        e["args"] = [str(a) for a in e.get("args") or []]
        e["full_args"] = [str(a) for a in e["full_args"]] if "full_args" in e else e["args"]
        e["timeout"] = float(e.get("timeout", 600))
        e["exit_code"] = int(e.get("exit_code", 0))
        try:
            e["drop"] = [re.compile(k) for k in e.get("drop") or []]
        except re.error as err:
            raise ResultsError(f"{where}: bad `drop` pattern: {err}") from None
        entries.append(e)
    return entries


#: Where the entries read the CIFAR-10 subset (``{cifar}`` in their args): $VAE_DDP_CIFAR_SUBSET,
#: else the folder beside the checkout that CI provides; pages show it as ``CIFAR_SHOWN``, which
#: the line ``CIFAR_SHOWN_LINE`` above the command defines.
CIFAR = os.environ.get("VAE_DDP_CIFAR_SUBSET", "../shared/data/cifar10-jpg-subset")
CIFAR_SHOWN = "DIR"
CIFAR_SHOWN_LINE = "# DIR: the CIFAR-10 subset that .github/scripts/cifar10-subset.sh builds (ImageFolder tree)"


def command_of(e: dict[str, Any], out: str) -> list[str]:
    """The argv of an entry, with ``{out}`` and ``{cifar}`` substituted (or ``--out OUT`` appended)."""
    args = e["full_args"] if full_mode() else e["args"]
    args = [a.replace("{cifar}", CIFAR) for a in args]
    if any("{out}" in a for a in args):
        args = [a.replace("{out}", out) for a in args]
    else:
        args = args + ["--out", out]
    if "script" in e:
        return [sys.executable, e["script"], *args]
    head = list(map(str, e["command"]))
    if head[0] == "vae-ddp":
        head = [sys.executable, "-m", "vae_ddp.cli", *head[1:]]
    return head + args


def display_command(argv: list[str]) -> str:
    """``argv`` as a reader would type it (``python``, ``vae-ddp``, the data folder as
    ``CIFAR_SHOWN``, outputs under ``out/`` rather than the site's own folder)."""
    shown = list(argv)
    if shown[:3] == [sys.executable, "-m", "vae_ddp.cli"]:
        shown = ["vae-ddp", *shown[3:]]
    elif shown and shown[0] == sys.executable:
        shown[0] = "python"
    return shlex.join(a.replace(CIFAR, CIFAR_SHOWN).replace(GENERATED + "/", "out/") for a in shown)


def wrapped_command(argv: list[str], width: int = 88) -> str:
    """``display_command`` broken into shell continuation lines, each flag next to its value."""
    words = shlex.split(display_command(argv))
    groups, i = [], 0
    while i < len(words):
        if words[i].startswith("-") and i + 1 < len(words) and not words[i + 1].startswith("-"):
            groups.append(shlex.join(words[i:i + 2]))
            i += 2
        else:
            groups.append(shlex.quote(words[i]))
            i += 1
    lines, line = [], ""
    for g in groups:
        if line and len(line) + 1 + len(g) > width - 2:
            lines.append(line + " \\")
            line = "    " + g
        else:
            line = f"{line} {g}" if line else g
    return "\n".join(lines + [line])


def command_md(argv: list[str]) -> str:
    """The ``command.md`` of an entry: its command as a bash block, with the line that says what
    ``DIR`` is when the command reads the CIFAR-10 subset."""
    head = CIFAR_SHOWN_LINE + "\n" if any(CIFAR in a for a in argv) else ""
    return f"```bash\n{head}{wrapped_command(argv)}\n```\n"


def digest(root: Path, e: dict[str, Any], argv: list[str]) -> str:
    h = hashlib.sha256()
    # How the output is rendered is not part of the key: output.md is re-rendered from
    # stdout.txt (or tables.md) on every build. Only whether stderr is merged into it is.
    h.update(json.dumps({"argv": display_command(argv), "merged": e["output"] == "log", "full": full_mode()}).encode())
    files = sorted((root / "src" / "vae_ddp").rglob("*.py"))
    if "script" in e:
        files.append(root / e["script"])
    for f in files:
        h.update(str(f.relative_to(root)).encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()


def clean_log(e: dict[str, Any], text: str) -> str:
    """``text`` without Python warnings and without the lines matching ``drop``."""
    out, skip_source = [], False
    for ln in text.splitlines():
        warning = WARNING_LINE.search(ln)
        if warning:
            skip_source = True
            ln = ln[:warning.start()]  # what an interrupted line said before the warning
            if not ln.strip():
                continue
        elif skip_source and ln.startswith("  "):
            continue
        else:
            skip_source = False
        if not any(d.search(ln) for d in e["drop"]):
            out.append(ln)
    return "\n".join(out).strip("\n")


def render_output(e: dict[str, Any], out: Path) -> str:
    """The entry's ``output.md``: from ``stdout.txt``, or ``tables.md`` with ``output: tables``."""
    if e["output"] == "tables":
        tables = out / TABLES
        if not tables.is_file():
            raise ResultsError(f"example {e['name']!r} has `output: tables` but wrote no {TABLES} into its output "
                              f"folder ({out}); a study writes it with vae_ddp.harness.table.write_tables")
        return tables.read_text().rstrip() + "\n"
    stdout = (out / "stdout.txt").read_text()
    if e["output"] == "log":
        return "```text\n" + clean_log(e, stdout) + "\n```\n"
    return stdout.rstrip() + "\n"


#: What the zygote of the entries imports before it forks the first: every entry's process would import them.
PRELOAD = ("torch", "torchvision", "pytorch_lightning")


def run_entry(root: Path, e: dict[str, Any], preload: tuple[str, ...] = PRELOAD) -> str:
    """Run one entry unless its stamp matches; return 'cached' or 'ran'.

    Raises:
        ResultsError: the entry failed or timed out (the message says why)."""
    return generate(root, [e["name"]], preload)[e["name"]]


@contextlib.contextmanager
def _locked(root: Path, name: str) -> Iterator[None]:
    """An exclusive lock on entry ``name`` (``docs/generated/.locks/<name>``): a second process
    that asks for it (a test beside the site build) waits, then reads the cached run instead of
    running it again into the same folder. The wait beats for the guard's watchdog, if any."""
    import fcntl

    from vae_ddp.beats import beat

    locks = root / GENERATED / ".locks"
    locks.mkdir(parents=True, exist_ok=True)
    with open(locks / name, "w") as lock:
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                beat()
                time.sleep(0.5)
        yield


def _cached(root: Path, e: dict[str, Any]) -> bool:
    """Whether the entry's stamp matches its inputs (then its ``output.md`` and ``command.md`` are
    rendered again from what it wrote)."""
    out = root / GENERATED / e["name"]
    argv = command_of(e, f"{GENERATED}/{e['name']}")
    stamp = out / STAMP
    if stamp.is_file() and stamp.read_text() == digest(root, e, argv) and (out / "stdout.txt").is_file():
        write_if_changed(out / "output.md", render_output(e, out))
        write_if_changed(out / "command.md", command_md(argv))
        return True
    return False


def _run_here(root: Path, e: dict[str, Any], preload: tuple[str, ...]) -> None:
    """Run the entry under a guard of its own, as its command line would: a Python command in a
    fork of this process's zygote of ``preload`` (``vae_ddp.guard.run(how="zygote")``: torch and
    Lightning imported once, 8-10 s of CPU here, most of what a small entry spends), a new
    interpreter without ``preload``."""
    from vae_ddp import guard, zygote

    out_rel = f"{GENERATED}/{e['name']}"
    out = root / out_rel
    argv = command_of(e, out_rel)
    key = digest(root, e, argv)  # the inputs it runs from (a file changed while it runs: not cached)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    t0 = time.monotonic()
    merged = e["output"] == "log"  # Lightning logs to stderr or stdout depending on the terminal
    (out / "stderr.txt").write_text("")
    stdout = os.open(out / "stdout.txt", os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    stderr = stdout if merged else os.open(out / "stderr.txt", os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    env = dict(os.environ, PYTHONUNBUFFERED="1", MPLBACKEND="Agg", PYTHONHASHSEED="0")
    env["PYTHONPATH"] = os.pathsep.join([str(root / "src")] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env.pop("LOCAL_RANK", None)
    try:
        how = "zygote" if preload and zygote.usable(argv, preload) else "exec"  # (not a Python command: as it is)
        code = guard.run(argv, timeout=e["timeout"], how=how, preload=preload, cwd=root, env=env, stdout=stdout,
                         stderr=stderr).returncode
    except subprocess.TimeoutExpired:
        code = None
    finally:
        for fd in {stdout, stderr}:
            os.close(fd)
    tail = "\n".join((out / ("stdout.txt" if merged else "stderr.txt")).read_text().rstrip().splitlines()[-40:])
    if code is None:
        raise ResultsError(f"example {e['name']!r} timed out after {e['timeout']:.0f} s (raise its `timeout` "
                           f"in {REGISTRY}): {display_command(argv)}\n{tail}")
    if code != e["exit_code"]:
        raise ResultsError(f"example {e['name']!r} failed (exit code {code}, expected {e['exit_code']}): "
                           f"{display_command(argv)}\n--- stderr (end) ---\n{tail}")
    (out / "output.md").write_text(render_output(e, out))
    (out / "command.md").write_text(command_md(argv))
    (out / STAMP).write_text(key)
    log.info("results: %s ran in %.0f s", e["name"], time.monotonic() - t0)


def _run_stale(root: Path, entries: list[dict[str, Any]], n: int, preload: tuple[str, ...]) -> dict[str, str]:
    """Run each entry that is not cached, under its lock, ``n`` at a time (threads of this process,
    each waiting on its entry's guard); return ``{name: 'cached' or 'ran'}``.

    Raises:
        ResultsError: every entry that failed, and why."""
    import threading

    outcome: dict[str, tuple[str, str]] = {}
    todo, broken = list(entries), []

    def work() -> None:
        while todo and not broken:
            try:
                e = todo.pop(0)
            except IndexError:
                return
            try:
                with _locked(root, e["name"]):  # a test may have run it meanwhile
                    if not _cached(root, e):
                        _run_here(root, e, preload)
                        outcome[e["name"]] = ("ran", "")
                    else:
                        outcome[e["name"]] = ("cached", "")
            except ResultsError as err:
                outcome[e["name"]] = ("failed", str(err))
            except BaseException as err:  # the runner's own fault (a full disk...): raised below, as it is
                broken.append(err)

    if n <= 1:
        work()
    else:  # daemon threads: an interrupt ends this process; the zygote ends with it (it polls its
        # parent), and so do the zygote's guards, each ending its entry's tree
        threads = [threading.Thread(target=work, daemon=True) for _ in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            while t.is_alive():
                t.join(timeout=0.5)
    if broken:
        raise broken[0]
    failed = [outcome[e["name"]][1] for e in entries if outcome[e["name"]][0] == "failed"]
    if failed:
        raise ResultsError("\n\n".join(failed))
    return {name: state for name, (state, _) in outcome.items()}


def write_if_changed(path: Path, text: str) -> None:
    """Write only when the content changes (no rebuild loop under ``mkdocs serve``)."""
    if not path.is_file() or path.read_text() != text:
        path.write_text(text)


#: The factor table's column with the one quantity every training factor is ranked by (Home's
#: report-scale study, committed under docs/results/report-scale/).
REPORT_SCALE_COLUMN = "What it changes in one step at the report's scale (gradient)"


def report_scale_effects(root: Path) -> dict[str, dict]:
    """``{factor key: effect}`` from the committed report-scale study (empty when absent)."""
    path = root / "docs" / "results" / "report-scale" / "report_scale.json"
    if not path.is_file():
        return {}
    from vae_ddp.studies.report_scale import factor_effects

    return factor_effects(json.loads(path.read_text()))


def write_summary(root: Path, entries: list[dict[str, Any]]) -> None:
    """``docs/generated/summary/output.md``: one row per ``summary: true`` entry."""
    rows: list[dict[str, Any]] = []
    for e in entries:
        if not e.get("summary"):
            continue
        path = root / GENERATED / e["name"] / f"{e['name']}.json"
        if not path.is_file():
            raise ResultsError(f"example {e['name']!r} is marked `summary: true` but wrote no {path.relative_to(root)}")
        summary = json.loads(path.read_text()).get("summary")
        if not isinstance(summary, dict):
            raise ResultsError(f"{path.relative_to(root)} has no \"summary\" object (needed by `summary: true`)")
        row = dict(summary)
        if e.get("page"):
            first = next(iter(row)) if row else "factor"
            row[first] = f"[{row.get(first, e['name'])}]({e['page']})"
            effect = report_scale_effects(root).get(Path(e["page"]).stem)
            from vae_ddp.studies.report_scale import effect_cell

            row = {first: row[first], REPORT_SCALE_COLUMN: "-" if effect is None else
                   effect_cell(effect["gradient"]) if "gradient" in effect else "no gradient: the plotted value",
                   **{k: v for k, v in row.items() if k != first}}
        rows.append(row)
    write_factor_effects(root, entries)
    if not rows:
        return
    cols: list[str] = []
    for r in rows:
        cols += [c for c in r if c not in cols]
    cell = lambda v: "-" if v is None else str(v).replace("|", "\\|").replace("\n", " ")  # noqa: E731
    text = "| " + " | ".join(cols) + " |\n|" + "|".join("---" for _ in cols) + "|\n"
    text += "".join("| " + " | ".join(cell(r.get(c)) for c in cols) + " |\n" for r in rows)
    out = root / GENERATED / "summary"
    out.mkdir(parents=True, exist_ok=True)
    write_if_changed(out / "output.md", text)


def factor_effect_line(key: str, effects: dict[str, dict]) -> str:
    """The line a factor page shows under its result: what the factor changes in one step at the
    report's scale (the same words as Home's factor table, with the intervals), or why it has none."""
    home = "../index.md#the-reports-scale"
    if key in effects:
        from vae_ddp.studies.report_scale import effect_line

        how = "every other fix on" if "gradient" in effects[key] else "Lightning's defaults"
        return (f"**At the report's scale** ([one step from the same weights]({home}), {how}): "
                f"{effect_line(effects[key])} The numbers above are this page's own measure of the mechanism.\n")
    from vae_ddp.fixes.registry import get

    names = [get(k).name for k in effects]
    ranked = (", ".join(names[:-1]) + " and " + names[-1]) if len(names) > 1 else (names[0] if names else "no factor")
    return (f"**At the report's scale** this factor has no row: the [one-step comparison]({home}) isolates "
            f"{ranked}. The numbers above are this page's own measure of the mechanism.\n")


def write_factor_effects(root: Path, entries: list[dict[str, Any]]) -> None:
    """``docs/generated/summary/<factor>.md``: ``factor_effect_line`` for each factor page."""
    effects = report_scale_effects(root)
    out = root / GENERATED / "summary"
    out.mkdir(parents=True, exist_ok=True)
    for e in entries:
        if e.get("summary") and e.get("page"):
            key = Path(e["page"]).stem
            write_if_changed(out / f"{key}.md", factor_effect_line(key, effects))


def jobs() -> int:
    """Entries run at once: ``VAE_DDP_DOCS_JOBS`` (default 1; DDP entries start several processes each)."""
    try:
        return max(1, int(os.environ.get("VAE_DDP_DOCS_JOBS", "1")))
    except ValueError:
        raise ResultsError(f"VAE_DDP_DOCS_JOBS must be a number, got {os.environ['VAE_DDP_DOCS_JOBS']!r}") from None


def generate(root: Path, only: Optional[list[str]] = None, preload: tuple[str, ...] = PRELOAD) -> dict[str, str]:
    """Run the registry's entries (``only``: these names) that are not cached, ``jobs()`` at once;
    write the summary. ``preload``: what the entries' zygote imports (``()``: each entry a new
    interpreter)."""
    entries = load_registry(root)
    unknown = set(only or []) - {e["name"] for e in entries}
    if unknown:
        raise ResultsError(f"not in {REGISTRY}: {', '.join(sorted(unknown))}")
    todo = [e for e in entries if not only or e["name"] in only]
    done: dict[str, str] = {}
    for e in todo:
        with _locked(root, e["name"]):
            if _cached(root, e):
                done[e["name"]] = "cached"
    stale = [e for e in todo if e["name"] not in done]
    if stale:
        done.update(_run_stale(root, stale, min(jobs(), len(stale)), preload))
    if not only:
        write_summary(root, entries)
    return {e["name"]: done[e["name"]] for e in todo}


def _terminated(signum, frame) -> None:
    raise KeyboardInterrupt  # SIGTERM ends it as Ctrl-C does: every entry's tree ended, TMPDIR as found


if __name__ == "__main__":
    import signal

    signal.signal(signal.SIGTERM, _terminated)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    t0 = time.monotonic()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    from vae_ddp import zygote
    from vae_ddp.utils import private_tmpdir

    try:  # a TMPDIR of its own for the runs and the zygote (whose imports make inductor's cache folder), removed
        with private_tmpdir():  # however it ends (after a SIGKILL, by its reaper), the zygote ended first: still
            try:  # importing after an interrupt, it made inductor's folder in the removed one again
                done = generate(Path(__file__).resolve().parents[1], sys.argv[1:])
            finally:
                zygote.end_all()
    except ResultsError as err:
        sys.exit(f"error: {err}")
    except KeyboardInterrupt:  # every entry's tree has been ended (its guard); what finished is cached
        sys.exit("results: interrupted; the entries that finished are kept (run it again to go on)")
    log.info("results: %s (%.0f s%s)", ", ".join(f"{k} {v}" for k, v in done.items()), time.monotonic() - t0,
             ", VAE_DDP_FULL" if full_mode() else "")
