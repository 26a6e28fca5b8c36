"""The forked CPU ranks (vae_ddp.ranks): each rank runs once with Lightning's environment, and a
rank that fails ends every rank instead of leaving the others waiting."""

import json
import os
import sys
import textwrap

from vae_ddp import guard

SCRIPT = textwrap.dedent("""
    import json, os, signal, sys
    from vae_ddp.ranks import run_ranks

    out, mode = sys.argv[1], sys.argv[2]

    def main():
        rank = int(os.environ["LOCAL_RANK"])
        keys = ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "WORLD_SIZE", "VAE_DDP_FORKED_RANK")
        with open(f"{out}/rank-{rank}.json", "w") as f:
            json.dump({"pid": os.getpid(), "ppid": os.getppid(), **{k: os.environ.get(k) for k in keys}}, f)
        if mode == "fail" and rank == 2:
            raise RuntimeError("rank 2 failed on purpose")
        if mode == "fail":
            signal.pause()  # the others wait, as in a collective that rank 2 never joins
        if mode == "rank0" and rank == 0:
            raise ValueError("rank 0 failed on purpose")
        if mode == "rank0":
            signal.pause()
        return 0

    sys.exit(run_ranks(3, main))
""")


def _run(tmp_path, mode: str):
    script = tmp_path / "ranks.py"
    script.write_text(SCRIPT)
    return guard.run([sys.executable, str(script), str(tmp_path), mode], capture_output=True, text=True, timeout=90)


def test_every_rank_runs_once_with_lightnings_environment(tmp_path):
    proc = _run(tmp_path, "ok")
    assert proc.returncode == 0, proc.stderr
    ranks = [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in range(3)]
    assert len({r["pid"] for r in ranks}) == 3
    assert ranks[1]["ppid"] == ranks[2]["ppid"] == ranks[0]["pid"]  # forks of rank 0
    for r in ranks:
        assert r["MASTER_ADDR"] == "127.0.0.1" and r["NODE_RANK"] == "0" and r["WORLD_SIZE"] == "3"
        assert r["MASTER_PORT"] == ranks[0]["MASTER_PORT"] and r["VAE_DDP_FORKED_RANK"] == "1"
    assert "Traceback" not in proc.stderr


def test_a_failing_rank_ends_every_rank(tmp_path):
    proc = _run(tmp_path, "fail")  # the others wait for ever: only the observer ends them
    assert proc.returncode not in (0, guard.TIMED_OUT), proc.stderr
    assert "rank 2 failed on purpose" in proc.stderr
    assert "rank 2 (PID" in proc.stderr and "ending every rank" in proc.stderr


def test_rank_0_failing_ends_the_forked_ranks(tmp_path):
    proc = _run(tmp_path, "rank0")
    assert proc.returncode == 1, proc.stderr
    assert "rank 0 failed on purpose" in proc.stderr


def test_one_rank_or_a_launched_rank_runs_main_here(monkeypatch):
    from vae_ddp.ranks import run_ranks

    calls = []
    assert run_ranks(1, lambda: calls.append(1)) == 0
    monkeypatch.setenv("LOCAL_RANK", "1")  # started by Lightning's launcher or torchrun: no fork
    assert run_ranks(2, lambda: calls.append(2) or 3) == 3
    monkeypatch.delenv("LOCAL_RANK")
    import threading

    stop = threading.Event()
    other = threading.Thread(target=stop.wait)
    other.start()
    try:  # a thread runs: no fork either (Lightning's launcher would start the ranks)
        assert run_ranks(2, lambda: calls.append(os.environ.get("LOCAL_RANK")) or 0) == 0
    finally:
        stop.set()
        other.join()
    assert calls == [1, 2, None]


def test_forked_ranks_keep_lightnings_own_environment(monkeypatch):
    """A forked rank's Trainer gets LightningEnvironment: the rank and address this module set,
    even where Lightning would detect another cluster (a SLURM job's variables)."""
    from vae_ddp.ranks import FORKED_RANK, cluster_plugins

    monkeypatch.delenv(FORKED_RANK, raising=False)
    assert cluster_plugins() == []
    monkeypatch.setenv(FORKED_RANK, "1")
    [env] = cluster_plugins()
    assert type(env).__name__ == "LightningEnvironment"


def test_a_line_read_back_is_written_in_one_piece(monkeypatch):
    """``beats.say``: the lines that name a run or a rank reach the shared file in one write (an
    unbuffered ``print`` writes its text and its newline apart, and another rank's line can land
    between them: ``launch`` would then not read them back)."""
    import io

    from vae_ddp import beats

    class Raw(io.RawIOBase):
        def __init__(self) -> None:
            self.writes: list[bytes] = []

        def writable(self) -> bool:
            return True

        def write(self, b) -> int:
            self.writes.append(bytes(b))
            return len(b)

    raw = Raw()
    monkeypatch.setattr(sys, "stderr", io.TextIOWrapper(raw, write_through=True))  # as under PYTHONUNBUFFERED
    print("a print", file=sys.stderr, flush=True)
    assert raw.writes == [b"a print", b"\n"]  # the hazard: two writes
    raw.writes.clear()
    beats.say("vae-ddp: PID 7 starts run 'single'")
    assert raw.writes == [b"vae-ddp: PID 7 starts run 'single'\n"]
