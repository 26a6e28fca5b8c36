"""Several nodes, for real: the report's script on 2 nodes started by `torchrun`, against one device.

Trains `examples/vae.py` (LightningCLI) in float64 with every fix on, as flags, in these layouts:

- one device, global batch B (the reference);
- one node with 2 devices, started by Lightning's own launcher;
- 2 nodes x 1 device and 2 nodes x 2 devices, each node one `torchrun` process with a c10d
  rendezvous (Lightning sees `TorchElasticEnvironment` and starts no process of its own).

Here the "nodes" are two `torchrun` processes on one machine (gloo on CPUs), which is how
`torchrun` runs on real nodes, with `--rdzv-endpoint` the address of one of them. Every layout
keeps the global batch B (per-device batch B / (nodes x devices)); the script loads each
run's final weights and prints the largest parameter difference from the single device.

    python examples/several_nodes.py --out DIR [--steps 3] [--layouts 2x1 2x2]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
VAE_SCRIPT = ROOT / "examples" / "vae.py"
LAYOUTS = {"1x1": (1, 1), "1x2": (1, 2), "2x1": (2, 1), "2x2": (2, 2)}  # nodes x devices per node


def fit_args(nodes: int, devices: int, global_batch: int, steps: int, out: Path) -> list[str]:
    """`examples/vae.py fit` with every fix on, float64, saving the final weights under ``out``."""
    return [
        "fit", "--seed_everything", "1234", "--model.enc_type", "small", "--model.sync_dist_logging", "true",
        "--data", "vae_ddp.data.DigitsDataModule", "--data.batch_size", str(global_batch // (nodes * devices)),
        "--data.sampler", "global", "--trainer.use_distributed_sampler", "false",
        "--trainer.accelerator", "cpu", "--trainer.strategy", "ddp",
        "--trainer.num_nodes", str(nodes), "--trainer.devices", str(devices), "--trainer.precision", "64-true",
        "--trainer.plugins", "vae_ddp.fixes.GlobalSyncBatchNorm",
        "--trainer.callbacks+=vae_ddp.fixes.GlobalBatchNoise", "--trainer.callbacks.seed=1234",
        "--trainer.callbacks+=pytorch_lightning.callbacks.ModelCheckpoint", f"--trainer.callbacks.dirpath={out}",
        "--trainer.callbacks.filename=final", f"--trainer.callbacks.every_n_train_steps={steps}",
        "--trainer.callbacks.save_weights_only=true",
        "--trainer.max_steps", str(steps), "--trainer.limit_val_batches", "0",
        "--trainer.enable_progress_bar", "false", "--trainer.logger", "false", f"--trainer.default_root_dir={out}",
    ]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_command(nodes: int, devices: int, port: int) -> list[str]:
    """One node's `torchrun` (the same on every node): c10d rendezvous at localhost:port."""
    return ["torchrun", "--nnodes", str(nodes), "--nproc-per-node", str(devices), "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"localhost:{port}", "--rdzv-id", "vae-ddp-nodes"]


def run_layout(name: str, global_batch: int, steps: int, out: Path) -> tuple[list[str], Path]:
    """Run one layout; returns the command of one node and the final checkpoint."""
    nodes, devices = LAYOUTS[name]
    run_dir = out / name
    shutil.rmtree(run_dir, ignore_errors=True)
    args = fit_args(nodes, devices, global_batch, steps, run_dir)
    # one intra-op thread in every process of every layout: torchrun with one process per node leaves
    # the thread count to Lightning (the cores), Lightning's own launcher of 2 ranks gives each half;
    # MKL's matrix products round differently at another thread count, and 2 x 1 would differ from 1 x 2
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    if nodes == 1:
        cmd = [sys.executable, str(VAE_SCRIPT), *args]
        procs = [subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)]
    else:
        torchrun = shutil.which("torchrun") or str(Path(sys.executable).with_name("torchrun"))
        port = free_port()
        head = torchrun_command(nodes, devices, port)
        cmd = [torchrun, *head[1:], str(VAE_SCRIPT), *args]
        procs = [subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                 for _ in range(nodes)]  # one `torchrun` per node: each is one node's agent
    try:
        logs = [p.communicate(timeout=1800)[0] for p in procs]
    finally:  # on a timeout or an interrupt, leave no process behind
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, log in zip(procs, logs):
        if p.returncode != 0:
            raise SystemExit(f"layout {name} failed (exit {p.returncode}):\n{log[-3000:]}")
    shown = (head if nodes > 1 else ["python"]) + ["examples/vae.py", *args]
    shown = [a.replace(str(run_dir), f"runs/{name}") for a in shown]
    return [a.replace(f"localhost:{port}", "localhost:$PORT") for a in shown] if nodes > 1 else shown, \
        run_dir / "final.ckpt"


def parameters(ckpt: Path) -> dict[str, torch.Tensor]:
    state = torch.load(ckpt, map_location="cpu", weights_only=True)["state_dict"]
    return {k: v for k, v in state.items() if v.is_floating_point() and "running" not in k}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--global-batch-size", type=int, default=32)
    p.add_argument("--layouts", nargs="+", default=["2x1", "2x2"], choices=["2x1", "2x2"],
                   help="several-node layouts (nodes x devices); one node (1x2) always runs, as the floor")
    args = p.parse_args(argv)
    if args.global_batch_size % 4:
        p.error(f"--global-batch-size {args.global_batch_size} must be a multiple of 4 (up to 4 devices)")
    args.out.mkdir(parents=True, exist_ok=True)
    _, ref_ckpt = run_layout("1x1", args.global_batch_size, args.steps, args.out)
    ref = parameters(ref_ckpt)
    scale = max(float(v.abs().max()) for v in ref.values())
    layouts = ["1x2"] + [name for name in args.layouts if name != "1x2"]  # one node first: the floor
    rows, commands, diffs, gaps = [], {}, {}, {}
    for name in layouts:
        nodes, devices = LAYOUTS[name]
        commands[name], ckpt = run_layout(name, args.global_batch_size, args.steps, args.out)
        theta = parameters(ckpt)
        diffs[name] = max(float((theta[k] - ref[k]).abs().max()) for k in ref)
        if name == "1x2":
            one_node = theta
            same = "—"
        else:
            gaps[name] = gap = max(float((theta[k] - one_node[k]).abs().max()) for k in ref)
            same = "0 (bit for bit)" if gap == 0 else f"{gap:.3g}"
        launcher = "Lightning" if nodes == 1 else f"{nodes} x torchrun"
        rows.append(f"| {nodes} | {devices} | {launcher} | {nodes * devices} | "
                    f"{args.global_batch_size // (nodes * devices)} | {diffs[name]:.3g} | {same} |")
    print(f"Global batch {args.global_batch_size}, {args.steps} Adam steps, float64, every fix on; "
          f"largest parameter {scale:.3g} in absolute value.\n")
    print("| nodes | devices per node | started by | world size | per-device batch "
          "| max abs(θ − θ single device) | max abs(θ − θ one node) |")
    print("|---|---|---|---|---|---|---|")
    print("\n".join(rows))
    floor = diffs["1x2"]
    multi = {k: v for k, v in diffs.items() if k != "1x2"}
    worst = max(multi.values(), default=floor)
    if worst <= floor:
        verdict = f"no further from the single device than one node is ({floor:.3g})"
    else:
        verdict = f"{worst / floor:.3g} times as far from the single device as one node is ({worst:.3g} vs {floor:.3g})"
    print(f"\nSeveral nodes are {verdict}.")
    for name in layouts:
        nodes, devices = LAYOUTS[name]
        if nodes > 1:
            print(f"\nEach of the {nodes} nodes of the {nodes} x {devices} run was started with (PORT: a free port "
                  f"on the first node):\n")
            print("```bash\n" + " \\\n    ".join(_wrap(commands[name])) + "\n```")
            break
    (args.out / "report_script.md").write_text(report_script(commands["1x2"], floor, args))
    result = {"diffs": diffs, "from_one_node": gaps, "one_node": floor, "scale": scale, "steps": args.steps,
              "global_batch_size": args.global_batch_size}
    (args.out / "several_nodes.json").write_text(json.dumps(result, indent=1))
    return result


def report_script(command: list[str], floor: float, args) -> str:
    """``report_script.md`` (Home): the report's script with every change, as this run started it on one
    node with 2 devices, and how far its weights ended from one device's."""
    return ("The report's script, `examples/vae.py` (its [Lightning 2.x port](reproduce.md)), with every change as "
            "flags, as it ran here on one node with 2 devices, on the bundled digits with the small model:\n\n"
            "```bash\n" + " \\\n    ".join(_wrap(command)) + "\n```\n\n"
            f"After {args.steps} Adam steps at a global batch of {args.global_batch_size} its weights are within "
            f"{floor:.3g} of one device's (`--trainer.devices 1 --data.batch_size {args.global_batch_size}`, float64). "
            "For the report's run: `--model.enc_type resnet18 --data vae_ddp.data.ImageFolderDataModule "
            "--data.data_dir DIR --data.batch_size 128`. [Several nodes](scaling.md) runs it on 2 nodes too.\n")


def _wrap(cmd: list[str]) -> list[str]:
    """The command as a few lines of flags (for the page)."""
    lines, cur = [], []
    for a in cmd:
        if a.startswith("--") and len(" ".join(cur + [a])) > 80 and cur:
            lines.append(" ".join(cur))
            cur = []
        cur.append(a)
    return lines + [" ".join(cur)]


if __name__ == "__main__":
    main()
