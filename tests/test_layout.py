"""Single-process tests of the sharding arithmetic (no process group)."""

from __future__ import annotations

import pytest
import torch

from fullshard.layout import GroupLayout, ParamLayout


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 37])
@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 8])
def test_rows_match_torch_chunk(rows: int, world_size: int) -> None:
    lay = ParamLayout((rows, 3), 0, world_size)
    chunks = torch.arange(rows * 3).view(rows, 3).chunk(world_size)
    for rank in range(world_size):
        expected = chunks[rank].shape if rank < len(chunks) else (0, 3)
        assert lay.local_shape(rank) == tuple(expected)
    assert sum(lay.rows_on(r) for r in range(world_size)) == rows
    assert lay.unsharded_numel >= rows * 3 and lay.unsharded_numel - rows * 3 < world_size * 3


def test_two_rank_example_from_the_note() -> None:
    group = GroupLayout((ParamLayout((5,), 0, 2), ParamLayout((2,), 0, 2)))
    assert group.shard_numels == (3, 1)
    assert group.shard_offsets == (0, 3)
    assert group.shard_numel == 4
    assert group.unsharded_offsets == (0, 6)
    assert group.unsharded_numel == 8


def test_shard_dim_one() -> None:
    lay = ParamLayout((4, 6), 1, 3)
    assert lay.chunk_shape == (4, 2)
    assert lay.shard_numel == 8
    assert lay.padded_shape == (4, 6)
    assert lay.is_even


def test_subset_repacks() -> None:
    group = GroupLayout((ParamLayout((5,), 0, 2), ParamLayout((2,), 0, 2), ParamLayout((4, 2), 0, 2)))
    sub = group.subset((True, False, True))
    assert sub.shard_numels == (3, 4)
    assert sub.shard_offsets == (0, 3)
    with pytest.raises(ValueError, match="mask of length 2 for 3 parameters"):
        group.subset((True, False))


def test_replicated_scalar_layout() -> None:
    """A 0-dim parameter: one row per rank, each rank's copy whole ([Note: Replicated scalars])."""
    lay = ParamLayout((), 0, 3)
    assert lay.replicated and not ParamLayout((1,), 0, 3).replicated
    assert (lay.chunk_rows, lay.shard_numel, lay.padded_shape, lay.unsharded_numel) == (1, 1, (3,), 3)
    assert [lay.rows_on(r) for r in range(3)] == [1, 1, 1] and lay.local_shape(2) == ()
    group = GroupLayout((ParamLayout((5,), 0, 3), lay, ParamLayout((2, 2), 0, 3)))
    assert group.shard_offsets == (0, 2, 3) and group.shard_numel == 5 and group.replicated_offsets == (2,)
    assert group.subset((False, True, True)).replicated_offsets == (0,)


def test_bad_layouts() -> None:
    with pytest.raises(ValueError, match=r"shard dim 1 is out of range for shape \(\)"):
        ParamLayout((), 1, 2)
    with pytest.raises(ValueError, match="shard dim 2 is out of range for shape"):
        ParamLayout((3, 3), 2, 2)
    with pytest.raises(ValueError, match="rank 2 is outside world size 2"):
        ParamLayout((3,), 0, 2).rows_on(2)
    with pytest.raises(ValueError, match="disagree on the world size"):
        GroupLayout((ParamLayout((3,), 0, 2), ParamLayout((3,), 0, 4)))
