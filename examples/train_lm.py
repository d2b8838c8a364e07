"""A tiny causal transformer on packed documents of two token corpora mixed by a schedule, elastic and exactly
once: run it under torchrun.

    torchrun --nproc-per-node=4 --max-restarts=3 examples/train_lm.py --run-dir /tmp/lm --ledger \
        --fail-at-step 7 --fail-rank 3 --fail-mode sigkill
    python -m loader audit /tmp/lm --mixture /tmp/lm/mixture.json      # a row per source

The data is what LM preprocessing writes: pre-tokenized uint16 token files, here two synthetic corpora made once
under --data-dir ("web": two files of a random bigram language; "code": one file of counting runs), documents
ending with an EOS token. Each corpus is a `PackedSource` (best fit: windows of whole documents packed into rows of
--seq-len + 1 tokens, a row a pure function of its position, so a resize needs no packing buffer); a `Mixture`
draws `--samples` of its rows from them by a schedule over windows of 10 positions: web text alone for 6 windows,
a ramp to 70/30 over 12, then 70/30, each source repeating in a new order once its epoch is used up. Rank 0 logs
the packing stats and the schedule's change points ("data: ..." lines, shown by `python -m loader demo --lm`).

The model sees the rows' segment ids: attention stays inside each document piece (`document_causal`, a FlexAttention
mask_mod) and position embeddings restart at each piece; the loss counts the targets of `label_mask` only.
`--attention flex` runs the mask through create_block_mask + flex_attention (compiled), on GPUs: torch's CPU
FlexAttention has no backward (torch 2.13), and eager it materialises the scores anyway. The default, `dense`,
evaluates the same mask_mod into a boolean mask for scaled_dot_product_attention (equal logits: tests/test_train_lm.py).
The loader runs the mixture with shuffle=True, which leaves the order to the mixture (loader positions are mixture
positions; a later epoch continues its stream). `--control-every N` adds a small online controller
(`LossController`): every N updates, mixture weights from the last update's loss per source, applied through
`loader.change_mixture` and recorded with the checkpoints. The elastic loop, checkpoints, ledger and fault injection are
those of examples/train_elastic.py.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

try:  # torch >= 2.5
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
except ImportError:
    create_block_mask = flex_attention = None

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling example, also when loaded by path
import train_elastic  # noqa: E402
from train_elastic import log  # noqa: E402

from loader.sources import Mixture, TokenSource  # noqa: E402
from loader.sources.packing import PackedSource, label_mask  # noqa: E402

VOCAB, EOS = 64, 0
NAMES = ("web", "code")
SCHEDULE = [
    {"weights": [1, 0], "windows": 6},  # windows of 10 positions: a warm-up on web text alone,
    {"from": [1, 0], "to": [0.7, 0.3], "windows": 12},  # code rising,
    {"weights": [0.7, 0.3]},
]  # then 70/30 to the end
ROWS_PER_WINDOW, FILL = 16, 0.95  # packing: each window of 0.95 * 16 rows' tokens packs into 16 rows


def write_corpora(directory: Path, seed: int = 0) -> dict[str, list[Path]]:
    """The two corpora as uint16 token files, made from a fixed seed (the same bytes in every run)."""
    rng = np.random.default_rng(seed)
    bigram = rng.dirichlet(np.full(VOCAB - 1, 0.1), size=VOCAB)  # next-token distributions over 1..VOCAB-1

    def web_document() -> list[int]:
        tokens = [int(rng.integers(1, VOCAB))]
        for _ in range(int(rng.integers(5, 40))):
            tokens.append(1 + int(rng.choice(VOCAB - 1, p=bigram[tokens[-1]])))
        return tokens + [EOS]

    def code_document() -> list[int]:
        start, step = int(rng.integers(1, VOCAB)), int(rng.integers(1, 4))
        return [1 + (start + step * i) % (VOCAB - 1) for i in range(int(rng.integers(8, 30)))] + [EOS]

    files = {"web": [directory / "web-000.bin", directory / "web-001.bin"], "code": [directory / "code-000.bin"]}
    directory.mkdir(parents=True, exist_ok=True)
    for name, make, tokens_per_file in (("web", web_document, 1500), ("code", code_document, 900)):
        for path in files[name]:
            tokens: list[int] = []
            while len(tokens) < tokens_per_file:
                tokens += make()
            np.asarray(tokens, dtype=np.uint16).tofile(path)
    return files


def document_causal(segment_ids: torch.Tensor):
    """FlexAttention's mask_mod for packed rows: query q sees key k only in its own document piece and not after
    it. The dense boolean mask is this same function evaluated on index grids, so both paths mask alike."""

    def mask_mod(b, h, q, k):
        return (segment_ids[b, q] == segment_ids[b, k]) & (k <= q)

    return mask_mod


def dense_mask(segment_ids: torch.Tensor) -> torch.Tensor:
    """document_causal as a (batch, 1, length, length) boolean mask for scaled_dot_product_attention."""
    batch, length = segment_ids.shape
    index = torch.arange(length, device=segment_ids.device)
    rows = torch.arange(batch, device=segment_ids.device)[:, None, None]
    return document_causal(segment_ids)(rows, 0, index[None, :, None], index[None, None, :])[:, None]


@functools.cache
def _compiled_flex_attention():
    """flex_attention fused by torch.compile (once per process): eager, it materialises the full score matrix."""
    return torch.compile(flex_attention)


class Block(torch.nn.Module):
    """A pre-norm transformer block whose attention is given per batch (the document mask differs per row)."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = torch.nn.LayerNorm(dim), torch.nn.LayerNorm(dim)
        self.qkv, self.out = torch.nn.Linear(dim, 3 * dim), torch.nn.Linear(dim, dim)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(dim, 4 * dim), torch.nn.GELU(), torch.nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor, attend) -> torch.Tensor:
        batch, length, dim = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(batch, length, 3, self.heads, dim // self.heads).permute(2, 0, 3, 1, 4)
        x = x + self.out(attend(q, k, v).transpose(1, 2).reshape(batch, length, dim))
        return x + self.mlp(self.norm2(x))


class TinyLM(torch.nn.Module):
    """A causal transformer on packed rows: attention stays inside each document piece (segment ids) and position
    embeddings restart at each piece. attention="flex": create_block_mask + flex_attention (compiled on CUDA;
    torch's CPU FlexAttention has no backward, so on CPU it serves inference only); "dense": the same mask as a
    boolean matrix for scaled_dot_product_attention."""

    def __init__(self, seq_len: int, dim: int = 32, heads: int = 2, layers: int = 2, attention: str = "dense"):
        super().__init__()
        self.attention = attention
        self.embed, self.position = torch.nn.Embedding(VOCAB, dim), torch.nn.Embedding(seq_len, dim)
        self.blocks = torch.nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.head = torch.nn.Linear(dim, VOCAB)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, segment_ids: torch.Tensor) -> torch.Tensor:
        if self.attention == "flex":
            batch, length = tokens.shape
            block_mask = create_block_mask(
                document_causal(segment_ids), batch, None, length, length, device=tokens.device
            )
            flex = _compiled_flex_attention() if tokens.is_cuda else flex_attention
            attend = functools.partial(flex, block_mask=block_mask)
        else:
            attend = functools.partial(F.scaled_dot_product_attention, attn_mask=dense_mask(segment_ids))
        x = self.embed(tokens) + self.position(positions)
        for block in self.blocks:
            x = block(x, attend)
        return self.head(x)


def mixture(args) -> Mixture:
    """The job's data: rank 0 writes the corpora if they are missing, then every rank opens and packs them."""
    data_dir = args.data_dir or args.run_dir / "data"
    if not (data_dir / "code-000.bin").exists() and dist.get_rank() == 0:
        write_corpora(data_dir)
    dist.barrier()  # a file rewritten under a reader would be refused by TokenSource: write once, then read
    sources = {
        name: PackedSource(
            TokenSource(str(data_dir / f"{name}-*.bin"), seq_len=args.seq_len, dtype="uint16", eos_id=EOS),
            mode="best_fit",
            rows_per_window=ROWS_PER_WINDOW,
            fill=FILL,
            seed=args.seed,
        )
        for name in NAMES
    }
    mix = Mixture(
        list(sources.values()), None, num_samples=args.samples, seed=args.seed, names=list(sources), schedule=SCHEDULE
    )
    if dist.get_rank() == 0:
        mix.plan.save(args.run_dir / "mixture.json")  # for `python -m loader audit RUN_DIR --mixture ...`
        for name, packed in sources.items():
            s = packed.stats()
            log(
                f"data: {name} packed best fit into {len(packed)} rows of {packed.capacity} tokens: padding "
                f"{s['padding']:.1%}; of {s['documents']} documents {s['cut_at_window_edges']:.1%} cut at a window's "
                f"edge, {s['cut_in_rows']:.1%} in several rows, {s['split_to_fit']:.1%} split to fit"
            )
        log(f"data: {mix.plan.describe()}")
    return mix


class LossController:
    """A small online controller in the spirit of DoReMi: every `every` updates, weights from the last update's
    mean loss per source (all-reduced, so every rank asks for the same), more weight where the loss is higher:
    w_s = 1 + 9 * loss_s / sum(loss), in whole tenths. `loader.change_mixture` applies them from a window no rank
    has prefetched yet, the checkpoint records them, and a replayed step keeps the recorded ones."""

    def __init__(self, names: tuple[str, ...], every: int, plan_file: Path):
        self.names, self.every, self.loader, self.plan_file, self.saved = names, every, None, plan_file, None
        self.sums = torch.zeros(2, len(names), dtype=torch.float64)  # this update's loss and targets per source

    def bind(self, loader) -> None:
        self.loader = loader

    def observe(self, per_row_loss: torch.Tensor, per_row_targets: torch.Tensor) -> None:
        """A micro-batch's rows (summed loss, counted targets), by the source each row came from."""
        if self.loader is None:
            return
        sources = torch.from_numpy(self.loader.dataset.plan.source_of(self.loader.last_indices(), self.loader.epoch))
        for row, values in enumerate((per_row_loss, per_row_targets)):
            self.sums[row].index_add_(0, sources, values.detach().double().cpu())

    def after_update(self, step: int) -> None:
        sums, self.sums = self.sums, torch.zeros_like(self.sums)
        plan = self.loader.dataset.plan
        if dist.get_rank() == 0 and plan.requests != self.saved:  # the plan as changed (and resumed) so far
            plan.save(self.plan_file)  # for `python -m loader audit RUN_DIR --mixture RUN_DIR/mixture.json`
            self.saved = plan.requests
        if step % self.every:
            return
        dist.all_reduce(sums)
        if (sums[1] == 0).any():
            return  # a source without a target in this update: nothing to compare
        mean = sums[0] / sums[1]
        weights = (1 + 9 * mean / mean.sum()).round().int().tolist()
        change = self.loader.change_mixture(weights)
        if change is not None and dist.get_rank() == 0:
            log(
                f"mixture: weights {'/'.join(self.names)} {weights} from position {change.position} (step "
                f"{change.step}), losses {[round(v, 3) for v in mean.tolist()]}"
            )


def lm_task(args) -> train_elastic.Task:
    controller = (
        LossController(NAMES, args.control_every, args.run_dir / "mixture.json") if args.control_every else None
    )

    def loss(model, batch, device):
        tokens, segments = batch["tokens"].to(device), batch["segment_ids"].to(device)
        logits = model(tokens[:, :-1], batch["positions"][:, :-1].to(device), segments[:, :-1])
        per_target = F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1), reduction="none")
        counted = label_mask(segments).reshape(tokens.shape[0], -1)  # no target across a piece's end or padding
        per_row = per_target.view_as(counted) * counted
        if controller is not None:
            controller.observe(per_row.sum(1), counted.sum(1))
        return per_row.sum()

    if args.attention == "flex" and (flex_attention is None or not train_elastic._one_gpu_per_rank()):
        raise SystemExit(
            f"train_lm.py: --attention flex needs torch >= 2.5 (this is {torch.__version__}) and a GPU "
            "per rank (torch's FlexAttention has no backward on the CPU); use --attention dense, the "
            "same mask for scaled_dot_product_attention"
        )
    args.run_dir.mkdir(parents=True, exist_ok=True)
    return train_elastic.Task(
        mixture(args),
        TinyLM(args.seq_len, attention=args.attention),
        loss,
        items_per_sample=args.seq_len,
        shuffle=True,
        controller=controller,
    )


def add_arguments(p) -> None:
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument(
        "--attention",
        choices=("dense", "flex"),
        default="dense",
        help="flex: create_block_mask + flex_attention (CUDA); dense: the same mask for SDPA (default)",
    )
    p.add_argument("--data-dir", type=Path, help="where the token files are (made if missing); default RUN_DIR/data")
    p.add_argument(
        "--control-every",
        type=int,
        default=0,
        help="every N updates, mixture weights from the last update's loss per source (LossController; "
        "default 0: the schedule alone)",
    )
    p.set_defaults(lr=0.5)


def main(argv=None) -> int:
    args = train_elastic.parse_args(argv, add_arguments, __doc__)
    return train_elastic.run(args, lm_task)


if __name__ == "__main__":
    sys.exit(main())
