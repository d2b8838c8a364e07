"""The docs run: every ```python block of README.md and docs/*.md is executed, and every relative link resolves, so
the docs cannot rot.

Each block runs in a process of its own (forked from an interpreter that has imported torch and the project,
nothing else), in an empty temporary directory, within a time bound, with the project's own warnings as errors
(pyproject's `error::` filters). A block that is complete runs as it is. A block that is a
fragment of a training script says so in an HTML comment on the line before it (GitHub shows none of it):

- `<!-- doc-test: setup=NAME -->`: the setup `NAME` below runs first, in the same interpreter and directory, and
  defines the names the block uses (a dataset, a model, shard files) on small data. A setup may also scale the block
  down (`smaller`: a text of the block and what runs instead, e.g. a 10,000,000-sample budget of 400); each text
  must occur in the block, so a change to the block cannot silently drop it.
- `<!-- doc-test: skip (REASON) -->`: the block cannot run here; REASON says why and names the test that covers what
  it shows. Skips are for what needs more than this machine (several nodes, a GPU).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import queue
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK_TIMEOUT_S = 300  # the slowest block (Lightning's DDP fit) takes about 20 s here, alone
FENCE = re.compile(r"^(?P<indent> *)```(?P<lang>[\w-]*)\s*$")
DIRECTIVE = re.compile(r"^\s*<!-- doc-test: (?P<what>.*) -->\s*$")
SETUP = re.compile(r"^setup=(?P<name>\w+)$")
SKIP = re.compile(r"^skip \((?P<reason>.+)\)$")
LINK = re.compile(r"\]\((?P<target>[^)\s]+)\)")


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # of the opening fence, 1-based
    code: str
    directive: str | None  # the text of the doc-test comment before it, if any

    @property
    def name(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def python_blocks(page: Path) -> list[Block]:
    """The ```python blocks of a page (also indented ones, in lists), dedented, each with its directive."""
    lines, blocks, i = page.read_text().splitlines(), [], 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if opening is None:
            i += 1
            continue
        indent = opening["indent"]
        end = next((j for j in range(i + 1, len(lines)) if re.fullmatch(rf"{indent}```\s*", lines[j])), None)
        assert end is not None, f"{page.relative_to(ROOT)}:{i + 1}: a code block that never closes"
        if opening["lang"] == "python":
            before = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
            directive = DIRECTIVE.match(before)
            code = "\n".join(line[len(indent) :] for line in lines[i + 1 : end]) + "\n"
            blocks.append(Block(page, i + 1, code, directive and directive["what"]))
        i = end + 1
    return blocks


BLOCKS = [block for page in PAGES for block in python_blocks(page)]


# --- setups: what a fragment's surroundings would define, on small data -------------------------------------------


@dataclass(frozen=True)
class Setup:
    make: Callable[[], dict]  # runs in the block's directory; returns the names the block uses
    smaller: dict[str, str]


SETUPS: dict[str, Setup] = {}


def doc_setup(smaller: dict[str, str] | None = None):
    def register(make: Callable[[], dict]) -> Callable[[], dict]:
        SETUPS[make.__name__] = Setup(make, smaller or {})
        return make

    return register


def _one_rank_group() -> None:
    """A real gloo group of one rank, as torchrun would have set up before the script's loop."""
    import torch.distributed as dist

    from tests.distributed import free_port

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    atexit.register(lambda: dist.is_initialized() and dist.destroy_process_group())  # unless the block left it


def _regression(samples: int):
    import torch
    from torch.utils.data import TensorDataset

    torch.manual_seed(0)
    x = torch.randn(samples, 4)
    return TensorDataset(x, x.sum(1, keepdim=True))


@doc_setup()
def training() -> dict:
    """A script under torchrun before its loop: a dataset, a DDP model, its optimizer and scheduler, a loader, and a
    checkpoint taken by an earlier launch (one batch into the epoch)."""
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    from loader import ResumableDataLoader

    _one_rank_group()
    dataset = _regression(256)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    earlier = ResumableDataLoader(dataset, batch_size=32, shuffle=True, seed=0)
    next(iter(earlier))
    return {
        "dataset": dataset,
        "model": model,
        "ddp": DDP(model),
        "optimizer": optimizer,
        "opt": optimizer,
        "sched": torch.optim.lr_scheduler.StepLR(optimizer, step_size=10),
        "loss_fn": torch.nn.functional.mse_loss,
        "ckpt": {"loader": earlier.state_dict()},
        "run_dir": str(Path("run").absolute()),
        "every": 5,
        "epochs": 2,
        "dl": ResumableDataLoader(dataset, batch_size=8, shuffle=True, seed=0, grad_accum=2),
    }


@doc_setup()
def ledger() -> dict:
    """A run directory whose ledger holds one finished epoch, trained and checkpointed in one process."""
    import torch

    from loader import ResumableDataLoader
    from loader.checkpoint import Ledger, save_checkpoint

    dataset, model, run_dir = _regression(64), torch.nn.Linear(4, 1), str(Path("run").absolute())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    dl = ResumableDataLoader(dataset, batch_size=8, shuffle=True, seed=0)
    dl.ledger = Ledger.open(run_dir, 0, len(dataset))
    step = sum(1 for _ in dl)
    save_checkpoint(run_dir, step, model=model, optimizer=optimizer, loader=dl, ledger=dl.ledger)
    dl.ledger.close()
    return {"run_dir": run_dir}


def _jpeg_shards(directory: str, shards: int) -> None:
    """`shards` WebDataset tar shards of 2 samples each: an 8x8 JPEG and its class."""
    import webdataset
    from PIL import Image

    os.makedirs(directory)
    with webdataset.ShardWriter(f"{directory}/train-%06d.tar", maxcount=2, verbose=0) as sink:
        for i in range(2 * shards):
            sink.write({"__key__": f"s{i:05d}", "jpg": Image.new("RGB", (8, 8), (i % 256, 0, 0)), "cls": i % 10})


def _offline_hugging_face() -> None:
    os.environ["HF_DATASETS_OFFLINE"] = os.environ["HF_HUB_OFFLINE"] = "1"


@doc_setup()
def shards() -> dict:
    """128 local tar shards under data/, and text files as JSON lines (`files`) and plain lines (`paths`)."""
    _jpeg_shards("data", 128)
    _offline_hugging_face()
    files, paths = [], []
    for i in range(4):
        files.append(f"part-{i}.jsonl")
        Path(files[-1]).write_text("".join(f'{{"text": "record {i}.{j}"}}\n' for j in range(50)))
        paths.append(f"part-{i}.txt")
        Path(paths[-1]).write_text("".join(f"record {i}.{j}\n" for j in range(50)))
    return {"files": files, "paths": paths}


@doc_setup(smaller={"{000000..000127}": "{000000..000007}", '"/local/nvme/cache"': '"cache"'})
def s3() -> dict:
    """8 shards in a bucket of moto's S3 server on loopback, running until the block's interpreter exits."""
    import fsspec

    from tests.servers import CREDENTIALS, moto_server, s3_options, upload

    _jpeg_shards("local", 8)
    servers = contextlib.ExitStack()
    atexit.register(servers.close)
    endpoint = servers.enter_context(moto_server())
    fs, _ = fsspec.url_to_fs("s3://bucket", **s3_options(endpoint))
    upload(fs, "local", "bucket")
    return {"endpoint": endpoint, **CREDENTIALS}


@doc_setup(smaller={"num_samples=10_000_000": "num_samples=400"})
def tokens() -> dict:
    """Two token corpora of 2 files each (uint16, 40 sequences of 2048 tokens per file), and a run directory."""
    import numpy as np

    rng = np.random.default_rng(0)
    for corpus in ("web", "code"):
        os.makedirs(f"data/{corpus}")
        for part in range(2):
            rng.integers(0, 50_000, 40 * 2048 + 1, dtype=np.uint16).tofile(f"data/{corpus}/{part}.bin")
    os.makedirs("run")
    return {"run_dir": "run"}


@doc_setup()
def arrow() -> dict:
    """Two Hugging Face datasets of 2049-token rows saved with save_to_disk under data/."""
    _offline_hugging_face()
    import datasets

    for name, rows in (("books", 24), ("papers", 8)):
        datasets.Dataset.from_dict({"input_ids": [[i] * 2049 for i in range(rows)]}).save_to_disk(f"data/{name}")
    return {}


@doc_setup()
def lightning() -> dict:
    """A LightningModule and its dataset, on one CPU device."""
    import lightning as L
    import torch

    class Regression(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Linear(4, 1)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    return {"model": Regression(), "dataset": _regression(256), "N": 1}


@doc_setup()
def accelerate() -> dict:
    """A model, its optimizer and dataset, 2 accumulation steps and a checkpoint every update."""
    import torch

    model = torch.nn.Linear(4, 1)
    return {
        "model": model,
        "optimizer": torch.optim.SGD(model.parameters(), lr=0.01),
        "dataset": _regression(128),
        "loss_fn": torch.nn.functional.mse_loss,
        "K": 2,
        "every": 1,
        "run_dir": "run",
    }


@doc_setup()
def dcp() -> dict:
    """torchtitan's objects in a one-rank gloo group: the model and optimizers as DCP Statefuls, a loader of 6
    steps, the training step, and a checkpoint every 3 steps."""
    import torch
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )
    from torch.distributed.checkpoint.stateful import Stateful

    from loader import ResumableDataLoader

    _one_rank_group()
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)

    class ModelWrapper(Stateful):
        def state_dict(self):
            return get_model_state_dict(model)

        def load_state_dict(self, state):
            set_model_state_dict(model, state)

    class OptimizersContainer(Stateful):
        def state_dict(self):
            return get_optimizer_state_dict(model, optimizer)

        def load_state_dict(self, state):
            set_optimizer_state_dict(model, optimizer, state)

    def train_step(batch):
        x, y = batch
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()

    return {
        "model_wrapper": ModelWrapper(),
        "optimizers": OptimizersContainer(),
        "train_step": train_step,
        "dl": ResumableDataLoader(_regression(48), batch_size=8, shuffle=True, seed=0),
        "every": 3,
        "run_dir": str(Path("run").absolute()),
    }


# --- the tests ------------------------------------------------------------------------------------------------------


def directive_of(block: Block) -> tuple[str, str] | None:
    """("setup", NAME), ("skip", REASON) or None for a block that runs as it is; anything else fails the test."""
    if block.directive is None:
        return None
    for kind, pattern, group in (("setup", SETUP, "name"), ("skip", SKIP, "reason")):
        found = pattern.match(block.directive)
        if found:
            return kind, found[group]
    raise AssertionError(
        f"{block.name}: {block.directive!r} is no doc-test directive: write "
        f"'<!-- doc-test: setup=NAME -->' or '<!-- doc-test: skip (REASON) -->'"
    )


# One interpreter imports torch and the project once (most of a block's time), then forks a child per block that
# runs it as `python -c` would: in the block's directory, stdout and stderr to files beside it, the project's own
# warnings as errors (the categories, given as arguments, are the project's modules: `python -W` would import them
# before the path is set up, and refuses), and the interpreter's own exit (atexit handlers, the traceback, the exit
# code). For each directory it reads, the server answers the child's pid, then its exit code.
SERVER = """
import importlib, os, runpy, sys, warnings
import torch, loader  # what nearly every block imports: once, before the forks

def serve():
    for request in sys.stdin:
        pid = os.fork()
        if pid == 0:
            return request.rstrip("\\n")
        print(pid, flush=True)
        print(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), flush=True)
    sys.exit(0)

os.chdir(serve())  # the block's process from here on
os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
for fd, name in ((1, "../stdout"), (2, "../stderr")):
    os.dup2(os.open(name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
for category in sys.argv[1:]:
    module, _, name = category.rpartition(".")
    warnings.simplefilter("error", getattr(importlib.import_module(module), name))
runpy.run_path("block.py", run_name="__main__")
"""


class BlockRunner:
    """The SERVER process; a thread reads its answers, so that every wait for one is bounded."""

    def __init__(self, categories: list[str], directory: Path):
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        self.process = subprocess.Popen(
            [sys.executable, "-c", SERVER, *categories],
            cwd=directory,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.answers: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.process.stdout:
            self.answers.put(int(line))
        self.answers.put(None)  # the server is gone

    def _answer(self, timeout: float) -> int:
        answer = self.answers.get(timeout=timeout)
        assert answer is not None, f"the block runner exited with {self.process.wait(timeout=30)}"
        return answer

    def run(self, directory: Path, timeout: float) -> int | None:
        """The exit code of the block in `directory`, or None when it ran past `timeout` (it is killed then)."""
        self.process.stdin.write(f"{directory}\n")
        self.process.stdin.flush()
        try:
            pid = self._answer(120)  # the first block waits for the server's imports
        except queue.Empty:  # its answers would go to the next block: no next block here
            self.process.kill()
            raise AssertionError("the block runner started no block within 120 s") from None
        try:
            return self._answer(timeout)
        except queue.Empty:
            os.kill(pid, signal.SIGKILL)
            self._answer(30)
            return None

    def close(self) -> None:
        self.process.stdin.close()
        try:
            self.process.wait(timeout=30)
        finally:
            if self.process.poll() is None:
                self.process.kill()
                self.process.wait(timeout=30)


def project_warnings(config: pytest.Config) -> list[str]:
    """The warning categories that are errors in the test suite (pyproject's `error::` filters)."""
    return [entry.removeprefix("error::") for entry in config.getini("filterwarnings") if entry.startswith("error::")]


def script_of(block: Block) -> str:
    """The block as it runs: after its setup, scaled down as the setup says."""
    directive = directive_of(block)
    if directive is None:
        return block.code
    setup = SETUPS[directive[1]]
    code = block.code
    for text, smaller in setup.smaller.items():
        assert text in code, f"{block.name}: setup {directive[1]!r} scales down {text!r}, which the block lacks"
        code = code.replace(text, smaller)
    return f"from tests.test_docs import SETUPS\nglobals().update(SETUPS[{directive[1]!r}].make())\n{code}"


def marks_of(block: Block) -> list:
    """Every block is slow (a process of its own: 1-10 s); a skipped one says why."""
    try:
        directive = directive_of(block)
    except AssertionError:
        directive = None  # test_the_block_runs fails with the reason
    if directive is not None and directive[0] == "skip":
        return [pytest.mark.skip(reason=f"{block.name}: {directive[1]}")]
    return [pytest.mark.slow]


@pytest.fixture(scope="module")
def runner(pytestconfig, tmp_path_factory):
    runner = BlockRunner(project_warnings(pytestconfig), tmp_path_factory.mktemp("runner"))
    yield runner
    runner.close()


@pytest.mark.parametrize("block", [pytest.param(b, id=b.name, marks=marks_of(b)) for b in BLOCKS])
def test_the_block_runs(block: Block, tmp_path, runner):
    directory = tmp_path / "block"
    directory.mkdir()
    (directory / "block.py").write_text(script_of(block))
    code = runner.run(directory, BLOCK_TIMEOUT_S)
    stderr = (tmp_path / "stderr").read_text()[-4000:]
    assert code is not None, f"{block.name} ran past {BLOCK_TIMEOUT_S} s:\n{stderr}"
    assert code == 0, f"{block.name} failed (exit {code}):\n{stderr}"


def test_every_block_is_run_or_skipped_with_a_reason_that_names_its_test():
    assert len(BLOCKS) >= 20, f"only {len(BLOCKS)} python blocks found in {[p.name for p in PAGES]}"
    for block in BLOCKS:
        directive = directive_of(block)
        if directive is None:
            continue
        kind, value = directive
        if kind == "setup":
            assert value in SETUPS, f"{block.name}: no setup named {value!r} in tests/test_docs.py"
        else:
            named = re.findall(r"(tests/\w+\.py)(?:::(\w+))?", value)
            assert named, f"{block.name}: the reason to skip must name the test that covers the block (tests/...)"
            for path, test in named:
                assert (ROOT / path).exists(), f"{block.name}: the reason to skip names {path}, which does not exist"
                assert not test or f"def {test}(" in (ROOT / path).read_text(), f"{block.name}: no {path}::{test}"


def test_every_setup_is_used():
    used = {directive_of(b)[1] for b in BLOCKS if directive_of(b) and directive_of(b)[0] == "setup"}
    assert used == set(SETUPS), f"setups no block uses: {sorted(set(SETUPS) - used)}"


def anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation but hyphens removed, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = re.sub(r"^ *```.*?^ *```", "", page.read_text(), flags=re.M | re.S)  # no headings in code blocks
    return {anchor(m[1]) for m in re.finditer(r"^#+ (.+)$", text, flags=re.M)}


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_every_relative_link_resolves(page: Path):
    text = re.sub(r"^ *```.*?^ *```", "", page.read_text(), flags=re.M | re.S)
    for link in LINK.finditer(text):
        target = link["target"]
        if re.match(r"[a-z]+:", target):
            continue  # a URL
        path, _, fragment = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        assert resolved.exists(), f"{page.relative_to(ROOT)}: {target} links to a file that does not exist"
        if fragment and resolved.suffix == ".md":
            assert fragment in anchors(resolved), f"{page.relative_to(ROOT)}: {target}: no heading #{fragment}"
