"""A finished run exits with code 0 on every rank: nothing (a pending collective, the process group's
backend threads) is left for interpreter shutdown to tear down, which could abort the process with
"terminate called without an active exception" (issue 14, item 13)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

APP = os.path.join(os.path.dirname(__file__), "exit_app.py")
pytestmark = pytest.mark.timeout(240)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(tmp_path, *args: str) -> list[tuple[int, str]]:
    """Both ranks started from here (as torchrun would), so that each one's exit code is seen: under
    Lightning's own launcher rank 1 is rank 0's child, and its code is lost."""
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()),
           "WORLD_SIZE": "2", "NODE_RANK": "0"}
    procs = [subprocess.Popen([sys.executable, APP, "--out", str(tmp_path), *args], env={**env, "LOCAL_RANK": str(r)},
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) for r in range(2)]
    try:
        return [(p.returncode, err) for p in procs for _, err in [p.communicate(timeout=180)]]
    finally:
        for p in procs:
            p.kill()


def test_finished_fit_exits_cleanly(tmp_path):
    # rank 1 exits last, after its peer has closed its sockets: where the abort was seen most (with plain torch,
    # 4 in 24 runs before the fix; it is rare, so this guards against its return more than it proves the fix)
    for rank, (code, err) in enumerate(run_ranks(tmp_path, "--steps", "3", "--linger-rank", "1")):
        assert "terminate called" not in err and code == 0, f"rank {rank} exited with {code}:\n{err[-3000:]}"
