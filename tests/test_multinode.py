"""Two "nodes" on this machine: the Lightning app launched once per node with NODE_RANK, as on a real cluster
without a scheduler (README, multi-node), each node starting its second rank itself. Hybrid sharding's default
shard groups are then the nodes; it matches DDP on the same 4 ranks."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from lightning_shard.tools import free_port
from tests.test_lightning import APP, assert_matches_ddp

pytestmark = pytest.mark.timeout(900)


def test_two_nodes_by_node_rank_hybrid_matches_ddp(tmp_path):
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    command = [sys.executable, APP, "--out", str(tmp_path), "--num-nodes", "2", "--devices", "2", "--sharding", "hybrid",
               "--accumulate", "2", "--clip", "0.05", "--epochs", "3"]
    nodes = []
    for node in (0, 1):  # output to files: a full pipe would block a node, and its peers in their collectives
        log = open(tmp_path / f"node{node}.log", "w")
        nodes.append((subprocess.Popen(command, env={**env, "NODE_RANK": str(node)}, stdout=log, stderr=subprocess.STDOUT),
                      log))
    try:
        codes = [process.wait(timeout=800) for process, _ in nodes]
    finally:
        for process, log in nodes:
            process.kill()
            log.close()
    logs = [(tmp_path / f"node{node}.log").read_text() for node in (0, 1)]
    assert codes == [0, 0], "\n".join(log[-4000:] for log in logs)
    results = torch.load(tmp_path / "results.pt", weights_only=True)
    assert_matches_ddp(results, "hybrid")  # its sharded checkpoint's round trips: tests/test_hybrid.py
    assert "sharding='hybrid' (shard groups of 2 ranks, 2 replicas)" in logs[0]
    comm = results["hybrid"]["comm"]  # the last step's: within the nodes, and the gradient shards between them
    assert comm["in_group_bytes"] > 0 and 0 < comm["cross_group_bytes"] < comm["reduce_scatter_bytes"]
