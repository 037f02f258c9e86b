"""How a recurrent layer's state is cut among tensor-parallel ranks (engine/recurrent_state.py
StateLayout) and read and written whole over every rank's part (SlotState), as a P/D hand-off
does: each rank's slices are where its layer keeps them, a part held by every rank (Mamba2's
single group) is the same on each, and a state written whole reads back unchanged, from pools
kept in files as a tensor-parallel worker's are. The hand-offs themselves, rank for rank
against HF transformers: tests/integration/test_hybrid_tp_hand_off.py."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.recurrent_state import RecurrentStates, SlotState, StateLayout

# Gated DeltaNet's q, k, v channels (2 key heads of 4, 4 value heads of 3) and value heads;
# Mamba2's x channels (4 heads of 2) and one group of B and C (state 3), every rank's
DELTA = StateLayout(3, ((8, False), (8, False), (12, False)), ((4, False),), (4, 3))
MAMBA2 = StateLayout(3, ((8, False), (3, True), (3, True)), ((4, False),), (2, 3))
CONV = StateLayout(2, ((6, False),), ((0, False),))  # LFM2's: no matrix state


def test_each_rank_holds_its_slice_of_every_part_in_order():
    conv, heads = DELTA.picks(2, 1)
    assert conv.tolist() == [4, 5, 6, 7, 12, 13, 14, 15, 22, 23, 24, 25, 26, 27]
    assert heads.tolist() == [2, 3]
    assert DELTA.shapes(2) == ((3, 14), (2, 4, 3))
    assert DELTA.shapes(1) == ((3, 28), (4, 4, 3))
    conv, _ = MAMBA2.picks(2, 1)
    assert conv.tolist() == [4, 5, 6, 7, 8, 9, 10, 11, 12, 13]  # (B and C whole)
    assert MAMBA2.shapes(2) == ((3, 10), (2, 2, 3))
    assert CONV.shapes(2) == ((2, 3), (0,))
    with pytest.raises(ValueError, match="does not split across 3 ranks"):
        DELTA.shapes(3)


@pytest.mark.parametrize("layout", [DELTA, MAMBA2, CONV], ids=["delta", "mamba2", "conv"])
def test_a_state_written_whole_reads_back_whole_from_every_ranks_file(tmp_path, layout):
    n, slots = 2, 3
    shapes = [layout.shapes(n)] * 2
    paths = [str(tmp_path / f"rank{r}") for r in range(n)]
    ranks = [RecurrentStates(shapes, slots, "cpu", path) for path in paths]
    seen = [RecurrentStates.mapped(paths[0], shapes, slots)] + ranks[1:]  # (rank 0's view)
    state = SlotState(seen, [layout] * 2, 1, 2)
    whole = torch.randn(state.numel)
    state.write(whole)
    assert torch.equal(torch.cat([t.reshape(-1) for t in state.read()]), whole)
    conv, ssm = layout.shapes(1)
    whole_conv = whole[: conv[0] * conv[1]].view(conv)
    for r, rank in enumerate(ranks):  # (written through the files: each rank's own tensors)
        channels, heads = layout.picks(n, r)
        assert torch.equal(rank.conv[1][2], whole_conv[:, channels])
        assert torch.equal(rank.ssm[1][2], whole[whole_conv.numel() :].view(ssm)[heads])
        assert not rank.conv[0].any() and not rank.conv[1][:2].any()  # (no other slot, layer)


def test_one_rank_reads_its_own_views():
    pool = RecurrentStates([DELTA.shapes(1)], 2, "cpu")
    state = SlotState([pool], [DELTA], 0, 1)
    got = state.read()
    assert got[0].data_ptr() == pool.conv[0][1].data_ptr() and state.numel == 3 * 28 + 48
