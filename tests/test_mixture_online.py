"""A Mixture under shuffle=True orders itself (each loader epoch continues its stream), and its weights change
online, at an update boundary, from the training loop: every position once, every source a permutation per source
epoch, the changes recorded with the checkpoint and replayed as recorded."""

from collections import defaultdict

import numpy as np
import pytest
import torch

from loader import ResumableDataLoader, SampleIndex
from loader.core.state import StateError
from loader.sources import Mixture, MixturePlan

LENGTHS = (23, 9, 14)


def sources():
    """Sample = source * 1000 + index: a batch shows which source and index each position drew."""
    return [torch.utils.data.TensorDataset(torch.arange(n) + 1000 * s) for s, n in enumerate(LENGTHS)]


def permutations_per_source_epoch(samples_in_stream_order: list[int]) -> None:
    """Each source's samples, in mixture-position order, cut into runs of its length: every whole run is a
    permutation of the source, the last (partial) run has no repeat."""
    by_source = defaultdict(list)
    for v in samples_in_stream_order:
        by_source[v // 1000].append(v % 1000)
    for s, drawn in by_source.items():
        n = LENGTHS[s]
        for start in range(0, len(drawn), n):
            run = drawn[start:start + n]
            assert len(set(run)) == len(run) and (len(run) < n or sorted(run) == list(range(n))), (s, start)


def test_shuffle_true_leaves_the_order_to_the_mixture_and_each_epoch_continues_its_stream():
    """Loader position p of epoch e is mixture position e N + p: every epoch has windows (arrangements) of its own,
    each source's draws running on, so over three epochs each source is a permutation per source epoch (a shuffled
    loader order served epoch 1 the same samples as epoch 0, in another order)."""
    mix = Mixture(sources(), [0.5, 0.2, 0.3], 40, seed=5, window=10)
    dl = ResumableDataLoader(mix, batch_size=4, shuffle=True, seed=1, collate_fn=list)
    stream = []
    for epoch in range(3):
        dl.set_epoch(epoch)
        served = [(p, int(s[0])) for batch in dl for p, s in zip(dl.last_indices().tolist(), batch)]
        assert [p for p, _ in served] == list(range(40))  # the loader's order is the identity
        assert [v for _, v in served] == [int(mix[SampleIndex(p, epoch=epoch)][0]) for p in range(40)]
        stream += [v for _, v in served]
    assert stream[:40] != stream[40:80]  # another epoch, other samples (draws running on)
    permutations_per_source_epoch(stream)
    assert mix.plan.epochs_continue and MixturePlan.from_dict(mix.plan.to_dict()) == mix.plan
    assert mix.plan.to_dict()["version"] == 3  # a release that reads versions 1 and 2 refuses it


def test_a_state_of_a_shuffled_mixture_order_is_refused_naming_the_release():
    """A checkpoint of an earlier release's shuffle=True Mixture run holds positions of a shuffled order, which name
    other samples now: refused, never resumed under the new meaning. shuffle_blocks= and lanes= are refused."""
    mix = Mixture(sources(), [0.5, 0.2, 0.3], 40, seed=5, window=10)
    dl = ResumableDataLoader(mix, batch_size=4, shuffle=True, seed=1)
    state = dl.state_dict()
    earlier = {**state, "base": {**state["base"], "fingerprint": {**state["base"]["fingerprint"], "shuffle": "global"}}}
    with pytest.raises(StateError, match="leaves the order to a Mixture .* resume it with the release that saved it"):
        ResumableDataLoader(mix, batch_size=4, shuffle=True, seed=1).load_state_dict(earlier)
    with pytest.raises(StateError, match="saved by a loader with shuffle=True over a Mixture"):
        ResumableDataLoader(Mixture(sources(), [0.5, 0.2, 0.3], 40, seed=5, window=10), batch_size=4,
                            shuffle=False, seed=1).load_state_dict(state)
    for option in ({"shuffle_blocks": 10}, {"lanes": 2}):
        with pytest.raises(ValueError, match="leaves the order to a Mixture .* drop them"):
            ResumableDataLoader(mix, batch_size=4, shuffle=True, **option)
