"""The distributed driver on NCCL, two GPUs with one rank each (skipped with fewer): the
stall that sends and receives sharing one NCCL stream would cause cannot happen."""

from __future__ import annotations

import pytest
import torch
from distributed_ranks import large_case, local_steps, spawn

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")]


@pytest.mark.parametrize("bind_device", [False, True], ids=["lazy-comms", "eager-comms"])
def test_nccl_1f1b_with_large_activations_matches_local(bind_device):
    """1F1B on two ranks with 8-9 MiB activations and cotangents, far beyond NCCL's buffers,
    the shapes changing on the second step. NCCL runs unbatched p2p on a two-rank
    communicator per pair (lazy) or on the group's own (``device_id`` bound, eager); both
    must finish. A stall would surface as the pipeline's 60 s timeout (a PeerError in
    ``crash``) or as ranks killed after 180 s (exit codes not 0)."""
    results, codes = spawn("large_cuda", 2, timeout=180, backend="nccl",
                           bind_device=bind_device)
    assert codes == [0, 0], results
    assert all(r is not None and "crash" not in r for r in results), results
    stages, schedule, steps = large_case()
    expected = local_steps(stages, schedule, steps)  # float64 on the CPU
    for rank, result in enumerate(results):
        assert result["wire"] == f"cuda:{rank}"  # this rank's stage device carries its tensors
        assert len(result["steps"]) == len(steps)
        for (loss, grads), (rank_loss, rank_grads) in zip(expected, result["steps"]):
            torch.testing.assert_close(rank_loss, loss)
            assert sorted(rank_grads) == [rank]
            torch.testing.assert_close(rank_grads[rank], grads[rank])


@pytest.mark.skipif(torch.cuda.device_count() < 4, reason="needs four GPUs")
def test_nccl_mesh_with_a_tie_across_workers_matches_the_cpu_run():
    """Two replicas x two workers on four GPUs (NCCL): the data-parallel buckets, the tie's
    group, fpipe's gather of objects and the norm's all-reduce all on CUDA tensors; the same
    numbers as the gloo run of tests/test_data_parallel.py (float64)."""
    from test_data_parallel import test_a_tie_across_workers_of_two_replicas_and_its_global_norm

    test_a_tie_across_workers_of_two_replicas_and_its_global_norm(
        scenario="data_parallel_ranks:mesh_ties_cuda", backend="nccl")
