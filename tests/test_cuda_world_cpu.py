"""tests/cuda_world_scenarios.py's combinations that no other CPU test runs (prefetch 2 with accumulation and
clipping, offloaded parameters with prefetch 2 and accumulation, a unit of two dtypes with prefetch 2 and clipping),
on 3 gloo CPU ranks against DDP; the GPU runs the whole list (tests/test_cuda.py)."""

import pytest

from tests.cuda_world_scenarios import CPU_ONLY_HERE, against_ddp, assert_like_ddp
from tests.world import run_world

pytestmark = pytest.mark.timeout(300)


def test_the_cuda_world_scenarios_not_run_elsewhere_match_ddp_on_three_cpu_ranks():
    reports = run_world(against_ddp, 3, "cpu", CPU_ONLY_HERE, timeout=240)
    assert_like_ddp(reports, CPU_ONLY_HERE)
    for report in reports:
        assert all(report[name]["streams"] == "HostStreams" for name in CPU_ONLY_HERE)
