"""torchdata's StatefulDataLoader tests with ResumableDataLoader swapped in: the peer suite of issue #11.

Not part of the pytest run: the test file is not in torchdata's wheel. Fetch it and its two test dependencies,
then run this script with the file's path (and, optionally, test names as unittest takes them):

    git clone --depth 1 https://github.com/pytorch/data /tmp/data
    pip install parameterized expecttest
    python tests/torchdata_peer.py /tmp/data/test/stateful_dataloader/test_state_dict.py [TestClass[.test]] ...

Without names it runs the IterableDataset tests (docs/streams.md, "StatefulDataLoader's test suite", lists those
that differ and why).
StatefulDataLoader's own argument snapshot_every_n_steps is accepted and ignored: every state is exact.
"""

from __future__ import annotations

import importlib.util
import sys
import unittest
import warnings
from pathlib import Path

ITERABLE_TESTS = [
    "TestStatefulDataLoaderIterable_shard0",
    "TestStatefulDataLoaderIterable2_shard0",
    "TestStatefulDataLoaderGenerator_shard2",
    "TestStatefulDataLoaderGeneratorNoState_shard2",
    "TestSnapshotZero_shard2.test_generator",
    "TestSnapshotZero_shard2.test_iterable",
    "TestSnapshotEnd_shard2.test_generator",
    "TestSnapshotEnd_shard2.test_generator_no_state",
    "TestSnapshotEnd_shard2.test_iterable",
    "TestFastStateDictRequest_shard3",
    "TestFastStateDictRequestRoundRobin_shard3",
    "TestJsonSerDe_shard3.test_json_serde_single_process",
    "TestJsonSerDe_shard3.test_json_serde_multi_process",
    "TestMultiEpochState_shard0",
    "TestStateInitializationDataset",
    "TestDynamicStateIterableDataset_shard0",
    "TestDatasetIteratorStateDuplication_shard0",
    "TestSingleIterCalled_shard0",
    "TestOutOfOrderWithCheckpointing.test_out_of_order_iterable_ds_one_completed_worker",
    "TestOutOfOrderWithCheckpointing.test_out_of_order_iterable_ds_no_completed_workers",
]


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    warnings.filterwarnings("ignore", message="This DataLoader will create")  # its tests use 3-4 workers anywhere
    from loader import ResumableDataLoader

    class Swapped(ResumableDataLoader):
        def __init__(self, dataset, *args, snapshot_every_n_steps: int = 1, **kwargs):
            super().__init__(dataset, *args, **kwargs)

    spec = importlib.util.spec_from_file_location("peer_test_state_dict", argv[0])
    peer = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(peer)
    peer.StatefulDataLoader = Swapped
    suite = unittest.TestLoader().loadTestsFromNames(argv[1:] or ITERABLE_TESTS, peer)
    return 0 if unittest.TextTestRunner(verbosity=2).run(suite).wasSuccessful() else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
