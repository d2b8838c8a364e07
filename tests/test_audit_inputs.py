"""The audit never shows a traceback: every crafted input exits 2 naming the file and the field (exit 1 is only
"skipped or duplicated"), its memory follows what the ledger recorded, not the dataset's length, and an epoch's end
is learnt from the loader in every flow, without a call of the training loop's."""

import json
import tracemalloc

import numpy as np
import pytest

from loader import ResumableDataLoader
from loader.checkpoint.audit import EXACTLY_ONCE, NO_LEDGER, UNFINISHED, audit
from loader.checkpoint.ledger import Ledger
from loader.cli.main import main as cli
from tests.conftest import IndexDataset


def small_ledger(run_dir, n: int = 12, filtered=()) -> None:
    """One launch of one rank: a step of 4 samples of epoch 0 (and the `filtered` ones the loader's filter dropped
    from its batch), the epoch unfinished."""
    ledger = Ledger.open(run_dir, 0, n)
    ledger.record(0, np.array([0, 1, 2, 3]), True, filtered=np.array(filtered, np.int64))
    ledger.close()


def meta(run_dir, **fields) -> None:
    path = run_dir / "ledger" / "gen-000001" / "meta.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **fields}))


def npy(run_dir, kind: str, values) -> None:
    (run_dir / "ledger" / kind).mkdir(exist_ok=True)
    np.save(run_dir / "ledger" / kind / "epoch-000000.npy", values)


def huge_npy(run_dir) -> None:
    (run_dir / "ledger" / "dropped").mkdir()
    with open(run_dir / "ledger" / "dropped" / "epoch-000000.npy", "wb") as f:
        np.lib.format.write_array_header_1_0(f, {"descr": "<i8", "fortran_order": False, "shape": (10**12,)})
        f.write(bytes(16))


def plan(run_dir, text: str) -> list[str]:
    (run_dir / "mix.json").write_text(text)
    return ["--mixture", str(run_dir / "mix.json")]


def mask(run_dir, values, cut: int = 0) -> list[str]:
    np.save(run_dir / "keep.npy", values, allow_pickle=True)
    if cut:
        data = (run_dir / "keep.npy").read_bytes()
        (run_dir / "keep.npy").write_bytes(data[:-cut])
    return ["--documents", str(run_dir / "keep.npy")]


def record(run_dir, flags: int, ids) -> None:
    with open(run_dir / "ledger" / "gen-000001" / "rank-00000.bin", "ab") as f:
        f.write(np.array([2, 0], "<i8").tobytes() + np.array([len(ids)], "<u4").tobytes() + bytes([flags]))
        f.write(np.asarray(ids, "<i8").tobytes())


PLAN = {
    "kind": "loader.MixturePlan",
    "version": 1,
    "order_version": 2,
    "names": ["a"],
    "lengths": [12],
    "counts": [1],
    "num_samples": 12,
    "seed": 0,
    "shuffle": True,
}

CRAFTED = {  # name: (how the ledger is spoilt, returning extra CLI arguments, the words the message must hold)
    "meta.json of {}": (
        lambda d: (d / "ledger/gen-000001/meta.json").write_text("{}"),
        ["gen-000001/meta.json", "'resumed_step'"],
    ),
    "meta.json not JSON": (
        lambda d: (d / "ledger/gen-000001/meta.json").write_bytes(b"\xff{"),
        ["gen-000001/meta.json", "unreadable"],
    ),
    "meta.json a list": (
        lambda d: (d / "ledger/gen-000001/meta.json").write_text("[1]"),
        ["gen-000001/meta.json", "list"],
    ),
    "num_samples a string": (lambda d: meta(d, num_samples="12"), ["meta.json", "'num_samples'", "'12'"]),
    "world_size a bool": (lambda d: meta(d, world_size=True), ["meta.json", "'world_size'"]),
    "num_samples past 2**62 - 1": (lambda d: meta(d, num_samples=2**62), ["meta.json", "'num_samples'"]),
    "index 10**15": (
        lambda d: record(d, 1, [5, 10**15]),
        ["rank-00000.bin", "index 1000000000000000", "'num_samples'"],
    ),
    "negative index": (lambda d: record(d, 1, [-1]), ["rank-00000.bin", "index -1"]),
    "unknown flags": (lambda d: record(d, 64, [1]), ["rank-00000.bin", "flags 0x40"]),
    "an epoch's end that miscounts": (lambda d: record(d, 16, [5, 1]), ["rank-00000.bin", "counts 5 dropped"]),
    "a filtered index out of range": (
        lambda d: record(d, 32, [5, 12]),
        ["rank-00000.bin", "index 12", "'num_samples'"],
    ),
    "a filtered record flagged complete": (
        lambda d: record(d, 33, [5]),
        ["rank-00000.bin", "flags 0x21", "filtered record"],
    ),
    "a verdict without its key": (lambda d: record(d, 8, []), ["rank-00000.bin", "verdict"]),
    "a rank file's name": (
        lambda d: (d / "ledger/gen-000001/rank-x.bin").write_bytes(b""),
        ["rank-x.bin", "rank-NNNNN.bin"],
    ),
    "dropped out of range": (lambda d: npy(d, "dropped", np.array([3, 12])), ["dropped/epoch-000000.npy", "index 12"]),
    "dropped of floats": (lambda d: npy(d, "dropped", np.array([1.5])), ["dropped/epoch-000000.npy", "float64"]),
    "skipped of floats": (lambda d: npy(d, "skipped", np.array([2.0])), ["skipped/epoch-000000.npy", "float64"]),
    "skipped of two dimensions": (
        lambda d: npy(d, "skipped", np.zeros((2, 2), np.int64)),
        ["skipped/epoch-000000.npy", "shape (2, 2)"],
    ),
    "skipped not an array": (
        lambda d: npy(d, "skipped", np.array([{}], dtype=object)),
        ["skipped/epoch-000000.npy", "object"],
    ),
    "dropped claiming 10**12 values": (huge_npy, ["dropped/epoch-000000.npy", "(1000000000000,)"]),
    "a mixture plan not JSON": (lambda d: plan(d, "{"), ["--mixture", "mix.json"]),
    "a mixture plan a list": (lambda d: plan(d, "[]"), ["--mixture", "mix.json", "list"]),
    "a mixture plan of a huge window": (
        lambda d: plan(d, json.dumps({**PLAN, "counts": [10**12]})),
        ["--mixture", "mix.json", "counts"],
    ),
    "a mixture plan of another length": (
        lambda d: plan(d, json.dumps({**PLAN, "num_samples": 13})),
        ["grouping", "13", "12"],
    ),
    "a missing mixture plan": (lambda d: ["--mixture", str(d / "none.json")], ["--mixture", "none.json"]),
    "a missing keep mask": (
        lambda d: ["--documents", str(d / "none.npy")],
        ["--documents", "none.npy", "not a readable .npy mask", "No such file"],
    ),
    "a keep mask of ints": (lambda d: mask(d, np.ones(12, np.int64)), ["--documents", "keep.npy", "int64", "bool"]),
    "a keep mask of two dimensions": (
        lambda d: mask(d, np.ones((3, 4), bool)),
        ["--documents", "keep.npy", "shape (3, 4)", "one entry per document"],
    ),
    "a keep mask of objects": (
        lambda d: mask(d, np.array([True, {}], dtype=object)),
        ["--documents", "keep.npy", "not a readable .npy mask", "Python objects"],
    ),
    "a keep mask cut short": (lambda d: mask(d, np.ones(1000, bool), cut=100), ["--documents", "keep.npy"]),
}


@pytest.mark.parametrize("case", CRAFTED, ids=list(CRAFTED))
def test_a_crafted_input_exits_2_naming_the_file_and_the_field(tmp_path, capsys, case):
    small_ledger(tmp_path)
    spoil, words = CRAFTED[case]
    extra = spoil(tmp_path)
    status = cli(["audit", str(tmp_path), *(extra if isinstance(extra, list) else [])])
    out, err = capsys.readouterr()
    assert status == NO_LEDGER, out + err
    assert err.startswith("audit: ") and all(word in err for word in words), err
    assert "Traceback" not in out + err and not out


def test_plot_into_a_folder_that_does_not_exist_exits_2_before_auditing(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    small_ledger(tmp_path)
    with pytest.raises(SystemExit) as exit_:
        cli(["audit", str(tmp_path), "--plot", str(tmp_path / "missing" / "run.png")])
    out, err = capsys.readouterr()
    assert exit_.value.code == NO_LEDGER and "missing" in err and "does not exist" in err and not out


@pytest.mark.parametrize("drawn", [False, True], ids=["audit", "audit --plot"])
def test_a_billion_samples_are_audited_in_memory_that_follows_the_records(tmp_path, capsys, drawn):
    """num_samples 10**9 (and 10**13) and a few records, filtered ones among them: no O(N) array (today: bincount of
    N int64, 8 GB, and the picture's status per index, 7.5 GiB). The peak is held to a few MB, the records' own
    order of size."""
    if drawn:
        pytest.importorskip("matplotlib")
    for n in (10**9,) if drawn else (10**9, 10**13):  # the picture once: matplotlib under tracemalloc is slow
        run = tmp_path / str(n)
        small_ledger(run, n, filtered=[n - 1, 4])
        tracemalloc.start()
        try:
            status = cli(["audit", str(run), *(["--plot", str(run / "run.png")] if drawn else [])])
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert status == UNFINISHED and peak < 64 * 2**20, peak
        assert f"4 of {n} samples seen once so far, {n - 6} not yet seen" in capsys.readouterr().out


def test_a_finished_epoch_of_a_billion_lists_its_skipped_samples_without_holding_them(tmp_path, capsys):
    small_ledger(tmp_path, 10**9)
    npy(tmp_path, "dropped", np.array([10**9 - 1]))  # finished: all but 5 indices skipped
    (epoch,) = audit(tmp_path)
    assert epoch.finished and len(epoch.skipped) == 10**9 - 5 and epoch.skipped.head(3).tolist() == [4, 5, 6]
    assert cli(["audit", str(tmp_path), "--limit", "2"]) == 1
    assert "skipped indices: 4, 5, ... (999999995 in all)" in capsys.readouterr().out


# -- an epoch's end, learnt from the loader ----------------------------------------------------------------------


def lockstep(run_dir, n: int, world: int, drop_last: bool) -> list[ResumableDataLoader]:
    """`world` ranks in one process, as a DCP, Lightning or Accelerate job runs them: each with its own ledger file
    of one generation and nothing but iteration (no save_checkpoint, no record_finished), to the epoch's end."""
    ranks = [
        ResumableDataLoader(
            IndexDataset(n), batch_size=2, rank=r, world_size=world, shuffle=True, seed=0, drop_last=drop_last
        )
        for r in range(world)
    ]
    first = Ledger.open(run_dir, 0, n)
    for r, dl in enumerate(ranks):
        dl.ledger = first if r == 0 else Ledger(run_dir, first.path.parent / f"rank-{r:05d}.bin", 0)
    for dl in ranks:
        assert sum(1 for _ in dl) == len(dl)  # its whole share, StopIteration included
    for dl in ranks:
        dl.ledger.close()
    return ranks


def test_an_epoch_the_loader_ended_is_finished_in_the_audit_with_what_it_dropped(tmp_path, capsys):
    """DCP's LoaderState as docs/parallelism.md shows it: no record_finished anywhere. Today: "epoch 0 unfinished ...
    (the job stopped mid-epoch)", exit 3, with the dropped samples counted as not yet seen."""
    lockstep(tmp_path, n=23, world=2, drop_last=True)  # a global batch of 4: the last 3 are dropped by policy
    (epoch,) = audit(tmp_path)
    assert epoch.finished and epoch.clean and (epoch.seen_once, epoch.dropped) == (20, 3)
    assert cli(["audit", str(tmp_path)]) == EXACTLY_ONCE
    assert "audit: every sample exactly once" in capsys.readouterr().out


def test_an_epoch_every_sample_of_which_was_seen_is_never_blamed_on_the_job(tmp_path, capsys):
    """A ledger without an end record (one written before this release): nothing left unseen is not "unfinished"."""
    ledger = Ledger.open(tmp_path, 0, 4)
    ledger.record(0, np.array([0, 1]), True)
    ledger.record(0, np.array([3, 2]), True)
    ledger.close()
    (epoch,) = audit(tmp_path)
    assert epoch.finished and epoch.clean and epoch.seen_once == 4
    assert cli(["audit", str(tmp_path)]) == EXACTLY_ONCE


def test_an_epoch_is_finished_only_when_every_rank_recorded_its_end(tmp_path):
    """A rank that died before the epoch's last step completed: its end, and its last batch, never count; the audit
    says unfinished (a relaunch finishes it), not that the samples of that batch were skipped."""
    ranks = lockstep(tmp_path, n=24, world=3, drop_last=False)
    path = ranks[2].ledger.path  # rank 2's last batch and its end record lost: as if killed mid-step
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - (21 + 2 * 8) - 21])
    (epoch,) = audit(tmp_path)
    assert not epoch.finished and epoch.clean and (epoch.seen_once, epoch.not_yet_seen) == (22, 2)
