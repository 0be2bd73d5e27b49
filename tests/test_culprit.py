"""A rank late for a step is the rank every other rank names, whichever rank waited, and the
time quoted is the time waited. Before, the ranks that waited named the rank of stage 0
(itself, on that rank: "waited 10 s for the batch size from rank 0 ... rank 0 is stuck")."""

from __future__ import annotations

import re

import pytest
from culprit_ranks import TIMEOUT
from distributed_ranks import spawn


@pytest.mark.parametrize("world", [4])  # (2 ranks: test_distributed's silent rank; CI time)
def test_a_late_rank_is_named_by_every_rank(world):
    results, codes = spawn("culprit_ranks:late", world, timeout=120)
    assert codes == [0] * world, results
    late = world - 1
    for rank, result in enumerate(results):
        assert result["type"] == "PeerError", (rank, result)
        assert result["rank"] == late, (rank, result)
        assert f"rank {late} is late, stuck or gone" in result["message"], result
        waited = re.search(r"waited ([0-9.]+) s", result["message"])
        assert waited is not None, result
        assert TIMEOUT <= float(waited.group(1)) < 4 * TIMEOUT, result  # measured, not assumed
