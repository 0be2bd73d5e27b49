"""Splitting a pytree batch into micro-batches and joining outputs back."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from fpipe import BatchError
from fpipe._runtime.microbatch import batch_size, join, sizes, split


@given(n=st.integers(1, 200), chunks=st.integers(1, 64))
def test_sizes_cover_the_batch_evenly(n, chunks):
    if n < chunks:
        return
    parts = sizes(n, chunks)
    assert len(parts) == chunks and sum(parts) == n
    assert max(parts) - min(parts) <= 1 and min(parts) >= 1
    assert parts == sorted(parts, reverse=True)


@given(n=st.integers(1, 40), chunks=st.integers(1, 40))
def test_split_then_join_is_identity(n, chunks):
    batch = {"x": torch.randn(n, 3), "ids": torch.arange(n), "pair": (torch.randn(n), 7),
             "scalar": torch.tensor(2.0), "name": "batch"}
    if n < chunks:
        with pytest.raises(BatchError, match=f"{n} samples, fewer than chunks={chunks}"):
            split(batch, chunks)
        return
    pieces = split(batch, chunks)
    assert [p["x"].shape[0] for p in pieces] == sizes(n, chunks)
    assert all(p["name"] == "batch" and p["pair"][1] == 7 for p in pieces)
    assert all(p["scalar"] is batch["scalar"] for p in pieces)
    joined = join(pieces)
    assert torch.equal(joined["x"], batch["x"]) and torch.equal(joined["ids"], batch["ids"])
    assert torch.equal(joined["pair"][0], batch["pair"][0])


def test_ten_in_four():
    assert [p.shape[0] for p in split(torch.zeros(10, 2), 4)] == [3, 3, 2, 2]


def test_no_batched_leaf():
    with pytest.raises(BatchError, match="no tensor leaf with a batch dimension"):
        batch_size({"a": 1, "b": torch.tensor(3.0)})


def test_leaves_disagree():
    with pytest.raises(BatchError, match=r"\['a'\] has 4, \['b'\]\[0\] has 5"):
        batch_size({"a": torch.zeros(4), "b": [torch.zeros(5, 2)]}, "input")
