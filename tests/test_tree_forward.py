"""The one forward with parents: tree batches see only their ancestors, and
commit_path gathers the accepted path's KV and delta-net state (no replay)."""
import numpy as np
import pytest
from spec_steps import commit_and_chain_states

from dflash27b import Decoder, DFlashError


@pytest.fixture(scope="module")
def dec(synth_gguf):
    with Decoder(synth_gguf("q4_k_m"), kv_type="q8_0", ctx=128, threads=2) as d:
        yield d


def test_tree_nodes_equal_their_own_chain(dec):
    ctx = dec.context
    prefix = [11, 22, 33, 44, 55]
    # tree:   0 -> 1 -> 2
    #          \-> 3 -> 4
    toks = [100, 101, 102, 201, 202]
    parent = [-1, 0, 1, 0, 3]
    pos = [5, 6, 7, 6, 7]
    ctx.reset()
    ctx.forward(prefix)
    tree, _ = ctx.forward(toks, pos=pos, parent=parent, commit=False)
    for path in ([0, 1, 2], [0, 3, 4]):
        ctx.reset()
        ctx.forward(prefix)
        chain, _ = ctx.forward([toks[i] for i in path])
        assert np.array_equal(chain, tree[path])


def test_commit_path_equals_autoregressive_state(dec):
    ctx = dec.context
    prefix = [7, 8, 9]
    toks, parent, pos = [50, 60, 61, 70], [-1, 0, 0, 2], [3, 4, 4, 5]
    ctx.reset()
    ctx.forward(prefix)
    ctx.forward(toks, pos=pos, parent=parent, commit=False)
    ctx.commit_path([0, 2, 3])
    assert ctx.n_past == 6
    after, _ = ctx.forward([99, 98])
    ctx.reset()
    ref, _ = ctx.forward(prefix + [50, 61, 70, 99, 98])
    assert np.array_equal(after, ref[-2:])


@pytest.mark.parametrize("path", [[0], [0, 2], [0, 2, 3], [0, 2, 3, 5, 6], [0, 1, 4, 7]])
def test_commit_rebuilds_the_sequential_state_bitwise(dec, path):
    """Commit keeps only each node's update (conv input, keys, delta, decay) and rebuilds the accepted node's
    conv window and recurrent state from the committed ones: the committed state (every byte: KV rows, conv
    windows, recurrent states) equals the one a chain of the same tokens leaves, == not close — paths
    shorter and longer than the conv window, from either branch."""
    got, chain = commit_and_chain_states(dec.context, path)
    assert got == chain


def test_commit_path_rejects_non_paths(dec):
    ctx = dec.context
    ctx.reset()
    ctx.forward([1, 2])
    ctx.forward([3, 4, 5], pos=[2, 3, 3], parent=[-1, 0, 0], commit=False)
    with pytest.raises(DFlashError, match="not a root-to-node path"):
        ctx.commit_path([0, 1, 2])
    with pytest.raises(DFlashError, match="outside the verified batch"):
        ctx.commit_path([0, 7])


def test_bad_parents_rejected(dec):
    ctx = dec.context
    ctx.reset()
    with pytest.raises(DFlashError, match="parent 2 of batch index 1"):
        ctx.forward([1, 2], pos=[0, 1], parent=[-1, 2], commit=False)
    with pytest.raises(DFlashError, match="committing forward takes a chain"):
        ctx.forward([1, 2, 3], pos=[0, 1, 1], parent=[-1, 0, 0], commit=True)
