"""Balancing: ``partition`` is exact (against brute force), and the profilers see the costs."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from fpipe.stages import balance, balance_by_size, balance_by_time, partition


def brute_force(costs, parts):
    """The least largest part over every way to cut ``costs`` into ``parts`` runs."""
    n = len(costs)
    best = None
    for cuts in itertools.combinations(range(1, n), parts - 1):
        bounds = (0, *cuts, n)
        worst = max(sum(costs[a:b]) for a, b in zip(bounds, bounds[1:]))
        best = worst if best is None else min(best, worst)
    return best


@st.composite
def costs_and_parts(draw):
    costs = draw(st.lists(st.integers(0, 50), min_size=1, max_size=9))
    return costs, draw(st.integers(1, len(costs)))


@given(costs_and_parts())
def test_partition_is_optimal(case):
    costs, parts = case
    sizes = partition(costs, parts)
    assert len(sizes) == parts
    assert all(size >= 1 for size in sizes)
    assert sum(sizes) == len(costs)
    bounds = [0, *itertools.accumulate(sizes)]
    worst = max(sum(costs[a:b]) for a, b in zip(bounds, bounds[1:]))
    assert worst == brute_force(costs, parts)


@given(st.lists(st.floats(0, 1e6), min_size=1, max_size=8), st.data())
def test_partition_of_float_costs_is_optimal(costs, data):
    parts = data.draw(st.integers(1, len(costs)))
    sizes = partition(costs, parts)
    bounds = [0, *itertools.accumulate(sizes)]
    worst = max(sum(costs[a:b]) for a, b in zip(bounds, bounds[1:]))
    assert worst == pytest.approx(brute_force(costs, parts), rel=1e-9, abs=1e-9)


def test_partition_of_many_layers_is_fast_and_even():
    assert partition([1.0] * 1000, 8) == [125] * 8


@pytest.mark.parametrize("costs, parts, message", [
    ([1, 2], 0, "between 1 and 2 partitions"),
    ([1, 2], 3, "between 1 and 2 partitions"),
    ([], 1, "between 1 and 0"),
    ([1, -1], 1, "costs[1] is -1"),
    ([1, float("nan")], 1, "finite and non-negative"),
])
def test_partition_errors(costs, parts, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        partition(costs, parts)


def heavy_model(width=16, heavy=256):
    """Light layers around one wide layer (in time and in parameter bytes)."""
    layers = [nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width),
              nn.Sequential(nn.Linear(width, heavy), nn.Linear(heavy, heavy),
                            nn.Linear(heavy, width)),
              nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width)]
    return nn.Sequential(*layers)


def test_balance_by_size_gives_the_heavy_layer_its_own_part():
    model = heavy_model()
    balance = balance_by_size(model, torch.randn(4, 16), partitions=3)
    assert balance == [3, 1, 3]


def test_balance_by_time_gives_the_heavy_layer_its_own_part():
    torch.manual_seed(0)
    model = heavy_model(heavy=2048)  # far slower than the light layers together
    before = {k: v.clone() for k, v in model.state_dict().items()}
    # One intra-op thread: on a loaded machine, a parallel region can stall a tiny layer for
    # a whole time slice of the other core, which would make it look heavy.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        balance = balance_by_time(model, torch.randn(64, 16), partitions=3, repeat=10)
    finally:
        torch.set_num_threads(threads)
    assert sum(balance) == len(model) and len(balance) == 3
    bounds = list(itertools.accumulate(balance))
    # The heavy layer (index 3) dominates; it ends up alone, or with at most a light neighbour.
    part = next(i for i, b in enumerate(bounds) if b > 3)
    assert balance[part] <= 2
    assert all(p.grad is None for p in model.parameters())
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, before[k], rtol=0, atol=0)


@pytest.fixture
def seen_costs(monkeypatch):
    """The per-layer costs the profilers hand to ``partition``."""
    seen = []
    monkeypatch.setattr(balance, "partition",
                        lambda costs, parts: seen.append(costs) or partition(costs, parts))
    return seen


def test_balance_by_size_counts_parameters_and_outputs(seen_costs):
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)).double()
    balance_by_size(model, torch.randn(3, 4, dtype=torch.float64), partitions=2, param_scale=2)
    # float64: 8 bytes. Layer 0: 2 * (32 + 8) parameters + 3 * 8 outputs; ReLU: outputs only.
    assert seen_costs == [[8.0 * (2 * 40 + 24), 8.0 * 24, 8.0 * (2 * 18 + 6)]]


def test_balance_by_size_counts_a_tied_parameter_once(seen_costs):
    first, second = nn.Linear(8, 8, bias=False), nn.Linear(8, 8, bias=False)
    second.weight = first.weight
    model = nn.Sequential(first, second, nn.Linear(8, 8, bias=False))
    balance_by_size(model, torch.randn(1, 8), partitions=2)
    matrix, output = 4.0 * 64, 4.0 * 8
    assert seen_costs == [[matrix + output, output, matrix + output]]


@pytest.mark.parametrize("fn", [balance_by_size, balance_by_time])
def test_profiling_errors(fn):
    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    with pytest.raises(ValueError, match="cannot split 2 layers into 3"):
        fn(model, torch.randn(2, 2), partitions=3)
    with pytest.raises(ValueError, match="cannot split 2 layers into 0"):
        fn(model, torch.randn(2, 2), partitions=0)
    with pytest.raises(TypeError, match="nn.Sequential"):
        fn(nn.Linear(2, 2), torch.randn(2, 2), partitions=1)


def test_balance_by_time_profiles_a_copy_of_batchnorm():
    model = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3), nn.Linear(3, 3))
    balance_by_time(model, torch.randn(8, 3), partitions=2, repeat=1)
    assert int(model[1].num_batches_tracked) == 0
    torch.testing.assert_close(model[1].running_mean, torch.zeros(3))


def meta_copy(build):
    with torch.device("meta"):
        return build()


@pytest.mark.parametrize("sample", ["real", "meta"])
def test_balance_by_size_of_a_meta_model_sees_the_costs_of_the_real_one(seen_costs, sample):
    """Shapes are all sizes need: a meta-built model (and a real or meta sample) gives the
    costs of the same model built for real, and nothing is allocated."""
    x = torch.randn(3, 4, dtype=torch.float64)
    balance_by_size(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)).double(), x,
                    partitions=2, param_scale=2)
    model = meta_copy(lambda: nn.Sequential(nn.Linear(4, 8), nn.ReLU(),
                                            nn.Linear(8, 2)).double())
    balance_by_size(model, x if sample == "real" else x.to("meta"), partitions=2, param_scale=2)
    assert seen_costs[0] == seen_costs[1] == [8.0 * (2 * 40 + 24), 8.0 * 24, 8.0 * (2 * 18 + 6)]
    assert all(p.is_meta for p in model.parameters())


def test_balance_by_size_without_a_sample_counts_parameters_only(seen_costs):
    model = meta_copy(heavy_model)
    assert balance_by_size(model, partitions=3) == [3, 1, 3]
    sizes = [4.0 * sum(p.numel() for p in layer.parameters()) for layer in model]
    assert seen_costs == [sizes]
    assert balance_by_size(3, model) == [3, 1, 3]  # torchgpipe's order, no input


def test_balance_by_time_refuses_meta_and_needs_a_sample():
    model = meta_copy(heavy_model)
    with pytest.raises(ValueError, match="balance_by_time times real runs.*balance_by_size"):
        balance_by_time(model, torch.randn(4, 16), partitions=3)
    with pytest.raises(ValueError, match="meta module, sample or device"):
        balance_by_time(heavy_model(), torch.randn(4, 16, device="meta"), partitions=3)
    with pytest.raises(TypeError, match="needs a sample"):
        balance_by_time(heavy_model(), None, partitions=3)


@pytest.mark.parametrize("batch, first", [(10, 3), (9, 3), (5, 2), (3, 1)])
def test_balance_by_size_measures_the_first_micro_batch_torch_chunk_cuts(seen_costs, batch,
                                                                        first):
    """``chunks=4`` of a mini-batch of ``batch`` samples: the activations measured are those
    of ``torch.chunk``'s first micro-batch (``ceil(batch / 4)`` samples), the largest one."""
    assert x_chunk_sizes(batch)[0] == first
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)).double()
    x = torch.randn(batch, 4, dtype=torch.float64)
    balance_by_size(model, x, partitions=2, chunks=4)
    balance_by_size(model, x[:first], partitions=2)
    assert seen_costs[0] == seen_costs[1]


def x_chunk_sizes(batch, chunks=4):
    return [len(piece) for piece in torch.arange(batch).chunk(chunks)]
