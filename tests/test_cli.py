"""The vae-ddp command on jsonargparse: config files, the flags of RunSpec and of the registry."""

import dataclasses
import itertools
import functools
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from vae_ddp.cli import build_parser, main
from vae_ddp.fixes import registry
from vae_ddp.harness.configs import flag
from helpers import ROOT, load_script


@pytest.mark.parametrize("command", ["compare", "equivalence", "ablation", "seeds"])
def test_print_config_is_accepted_by_config(command, tmp_path, capsys):
    assert main([command, "--steps", "7", "--print_config"]) == 0
    printed = capsys.readouterr().out
    assert "steps: 7" in printed.splitlines()
    (tmp_path / "c.yaml").write_text(printed)
    assert main([command, "--config", str(tmp_path / "c.yaml"), "--print_config"]) == 0
    assert capsys.readouterr().out == printed
    # later flags override the file
    assert main([command, "--config", str(tmp_path / "c.yaml"), "--steps", "9", "--print_config"]) == 0
    assert "steps: 9" in capsys.readouterr().out.splitlines()


def test_documented_flag_names_parse():
    cfg = build_parser().parse_args([
        "compare", "--data", "imagefolder", "--data_dir", "d", "--global_batch_size", "32", "--max_samples", "100",
        "--val_every", "5", "--dp_mode", "emulate", "--exact", "true", "--configs", "[single, ddp]"])
    c = cfg.compare
    assert (c.data_dir, c.global_batch_size, c.max_samples, c.val_every, c.dp_mode, c.exact, c.configs) == (
        "d", 32, 100, 5, "emulate", True, ["single", "ddp"])
    assert build_parser().parse_args(["equivalence", "--world_sizes", "[2, 4]"]).equivalence.world_sizes == [2, 4]
    assert build_parser().parse_args(["seeds", "--num_seeds", "3"]).seeds.num_seeds == 3


def test_each_fix_is_a_switch_and_exact_turns_all_on(monkeypatch, tmp_path):
    """The switches are the registry's; --exact gives RunSpec.exact() (captured, not trained)."""
    import vae_ddp.studies.seeds as seeds

    help_text = build_parser()._subcommands_action.choices["compare"].format_help()
    for f in registry.switches():
        assert flag(f.field) in help_text
    seen = {}
    monkeypatch.setattr(seeds, "seed_study",
                        functools.wraps(seeds.seed_study)(lambda **kw: seen.update(base=kw["base"])))
    assert main(["seeds", "--exact", "true", "--out", str(tmp_path / "o")]) == 0
    for f in registry.switches():
        assert getattr(seen["base"], f.field) == f.fixed
    assert main(["seeds", "--sync_bn", "true", "--noise", "per_rank", "--out", str(tmp_path / "o")]) == 0
    assert seen["base"].fixes() == ["noise=per_rank", "sync_bn"]
    assert dataclasses.asdict(seen["base"])["seeds"] == [0]


def _shown_lines(*extra: Path) -> list[tuple[str, list[str]]]:
    """Every shell line a reader is shown in the README, CONTRIBUTING, the pages and ``extra``
    (bash blocks, continuation lines joined, and inline ``vae-ddp ...`` code), as (file, words)."""
    import re
    import shlex

    files = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *extra,
             *(p for p in sorted((ROOT / "docs").rglob("*.md")) if "generated" not in p.parts)]
    found = []
    for path in files:
        text = path.read_text()
        lines = [ln for block in re.findall(r"```(?:bash|sh)\n(.*?)```", text, re.S)
                 for ln in block.replace("\\\n", " ").splitlines()]
        lines += re.findall(r"`((?:\.venv/bin/)?vae-ddp [^`]+)`", text)
        found += [(str(path.relative_to(ROOT)), shlex.split(line, comments=True)) for line in lines]
    return found


def _documented_commands() -> list[tuple[str, list[str]]]:
    """Every ``vae-ddp SUBCOMMAND ...`` a reader is shown (``_shown_lines``), as (file, argv after
    ``vae-ddp``)."""
    from vae_ddp.studies import COMMANDS

    found = []
    for where, words in _shown_lines():
        for i, w in enumerate(words):
            if w.endswith("vae-ddp") and i + 1 < len(words) and words[i + 1] in COMMANDS:
                argv = list(itertools.takewhile(lambda a: a not in (">", "|", "&&", ";"), words[i + 1:]))
                found.append((where, argv))
    return found


def _lightningcli_commands() -> list[tuple[str, list[str]]]:
    """Every ``examples/vae.py fit ...`` a reader is shown (``_shown_lines``, and the script's own
    docstring, which the reproduce page includes), as (file, the arguments after ``fit``)."""
    return [(where, words[i + 2:]) for where, words in _shown_lines(ROOT / "examples" / "vae.py")
            for i, w in enumerate(words) if w.endswith("examples/vae.py") and words[i + 1:i + 2] == ["fit"]]


def test_every_documented_lightningcli_command_names_its_data_and_builds(cifar_dir, monkeypatch):
    """The report's script's default data class, an ImageFolder tree, has no default folder (the
    project's data is named by no default): each command shown names ``--data.data_dir``, and each
    without shell variables builds its model, data module and ``Trainer`` as shown (``DIR``: the
    CIFAR-10 subset; ``gpu`` read as ``cpu`` on a machine without one), with no training."""
    monkeypatch.delenv("VAE_DDP_CIFAR_SUBSET", raising=False)  # a reader has not set it
    vae = load_script("examples/vae.py")
    commands = _lightningcli_commands()
    assert len(commands) >= 6 and {w for w, _ in commands} >= {"README.md", "examples/vae.py", "docs/scaling.md"}
    for where, args in commands:
        assert "--data.data_dir" in args, (where, args)
        if any("$" in a for a in args):  # a cluster's template (docs/scaling.md)
            continue
        args = [str(cifar_dir) if a == "DIR" else "cpu" if a == "gpu" else a for a in args]
        cli = vae.ReportCLI(vae.VAE, subclass_mode_data=True, run=False, args=args)
        assert cli.datamodule.data_dir == str(cifar_dir) and cli.trainer.max_steps == (
            int(args[args.index("--trainer.max_steps") + 1]) if "--trainer.max_steps" in args else -1), (where, args)


def test_every_documented_command_parses():
    """A reader copies these: each parses as shown (the flags exist, the values are valid)."""
    commands = _documented_commands()
    assert len(commands) >= 15 and {a[0] for _, a in commands} >= {"compare", "equivalence", "seeds", "long-horizon"}
    parser = build_parser()
    for where, argv in commands:
        if "--config" in argv or "-h" in argv:  # a file of the reader's; the help
            continue
        try:
            parser.parse_args(argv)
        except SystemExit as err:  # --print_config prints and exits 0
            assert err.code == 0, (where, argv)
        except Exception as err:
            pytest.fail(f"{where}: vae-ddp {' '.join(argv)}: {err}")


def test_the_help_lists_every_subcommand_without_torch():
    """`vae-ddp -h` is the full parser's help, built without the studies' flags: no study, torch
    or Lightning is imported (about ten seconds of imports on 2 cores)."""
    import subprocess
    import sys

    from vae_ddp.studies import COMMANDS

    assert build_parser(flags=False).format_help() == build_parser().format_help()
    code = ("import sys; from vae_ddp.cli import main; rc = main(['-h']); "
            "print(rc, sorted(m for m in ('torch', 'pytorch_lightning', 'vae_ddp.studies.compare') "
            "if m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.splitlines()[-1] == "0 []", proc.stdout[-2000:] + proc.stderr[-2000:]
    assert all(f"    {name} " in proc.stdout for name in COMMANDS), proc.stdout
    assert proc.stdout.startswith("usage: vae-ddp {audit,"), proc.stdout[:200]  # the usage line names the audit


THREADED = """
import threading

import torch
from pytorch_lightning import LightningModule
from torch import nn
from torch.nn import functional as F


class Threaded(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(8, 1)
        threading.Thread(target=threading.Event().wait, args=(600,), name="users-thread").start()  # not a daemon

    def forward(self, x):
        return self.net(x).squeeze(-1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-2)
"""


@pytest.mark.timeout(300)
def test_a_thread_the_users_model_leaves_running_does_not_hold_the_command(tmp_path):
    """A model whose ``__init__`` starts a thread that is not a daemon (it waits 600 s): the audit wrote
    its report, then the ``vae-ddp`` process waited for that thread at exit (``threading._shutdown``) for
    as long as it ran. The command borrows the model: it exits with its code once the report is written."""
    (tmp_path / "threaded.py").write_text(THREADED)
    out = tmp_path / "o"
    model = f"{tmp_path}/threaded.py:Threaded"
    proc = subprocess.Popen([sys.executable, "-m", "vae_ddp.cli", "audit", "--model", model, "--data",
                             "examples.audit_models.Regression", "--steps", "2", "--effect_batches", "0",
                             "--out", str(out)], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        _, err = proc.communicate(timeout=240)  # the audit alone: about 10 s on an idle machine
    except subprocess.TimeoutExpired:
        pytest.fail(f"still running 240 s after the start; report written: {(out / 'audit.json').exists()}")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0 and (out / "audit.json").exists(), (proc.returncode, err[-2000:])
