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
The loader runs the mixture with shuffle=False. The elastic loop, checkpoints, ledger and fault injection are
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
SCHEDULE = [{"weights": [1, 0], "windows": 6},                 # windows of 10 positions: a warm-up on web text alone,
            {"from": [1, 0], "to": [0.7, 0.3], "windows": 12},  # code rising,
            {"weights": [0.7, 0.3]}]                            # then 70/30 to the end
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
            block_mask = create_block_mask(document_causal(segment_ids), batch, None, length, length,
                                           device=tokens.device)
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
    sources = {name: PackedSource(TokenSource(str(data_dir / f"{name}-*.bin"), seq_len=args.seq_len, dtype="uint16",
                                              eos_id=EOS), mode="best_fit", rows_per_window=ROWS_PER_WINDOW,
                                  fill=FILL, seed=args.seed)
               for name in NAMES}
    mix = Mixture(list(sources.values()), None, num_samples=args.samples, seed=args.seed, names=list(sources),
                  schedule=SCHEDULE)
    if dist.get_rank() == 0:
        mix.plan.save(args.run_dir / "mixture.json")  # for `python -m loader audit RUN_DIR --mixture ...`
        for name, packed in sources.items():
            s = packed.stats()
            log(f"data: {name} packed best fit into {len(packed)} rows of {packed.capacity} tokens: padding "
                f"{s['padding']:.1%}; of {s['documents']} documents {s['cut_at_window_edges']:.1%} cut at a window's "
                f"edge, {s['cut_in_rows']:.1%} in several rows, {s['split_to_fit']:.1%} split to fit")
        log(f"data: {describe_schedule(mix.plan)}")
    return mix


def describe_schedule(plan) -> str:
    """The schedule's pieces by position range: each source's slots per window, constant or a ramp."""
    ends = [piece.start * plan.window for piece in plan.schedule[1:]] + [plan.num_samples]
    parts = [f"{piece.start * plan.window}-{min(end, plan.num_samples) - 1} " + "/".join(map(str, piece.first))
             + ("" if piece.first == piece.last else " -> " + "/".join(map(str, piece.last)))
             for piece, end in zip(plan.schedule, ends) if piece.start * plan.window < plan.num_samples]
    names = "/".join(plan.names)
    return f"mixture schedule, {names} slots per window of {plan.window}, by position: {', '.join(parts)}"


def lm_task(args) -> train_elastic.Task:
    def loss(model, batch, device):
        tokens, segments = batch["tokens"].to(device), batch["segment_ids"].to(device)
        logits = model(tokens[:, :-1], batch["positions"][:, :-1].to(device), segments[:, :-1])
        per_target = F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1), reduction="none")
        return (per_target * label_mask(segments).reshape(-1)).sum()  # no target across a piece's end or padding

    if args.attention == "flex" and (flex_attention is None or not train_elastic._one_gpu_per_rank()):
        raise SystemExit(f"train_lm.py: --attention flex needs torch >= 2.5 (this is {torch.__version__}) and a GPU "
                         "per rank (torch's FlexAttention has no backward on the CPU); use --attention dense, the "
                         "same mask for scaled_dot_product_attention")
    args.run_dir.mkdir(parents=True, exist_ok=True)
    return train_elastic.Task(mixture(args), TinyLM(args.seq_len, attention=args.attention), loss,
                              items_per_sample=args.seq_len, shuffle=False)


def add_arguments(p) -> None:
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--attention", choices=("dense", "flex"), default="dense",
                   help="flex: create_block_mask + flex_attention (CUDA); dense: the same mask for SDPA (default)")
    p.add_argument("--data-dir", type=Path, help="where the token files are (made if missing); default RUN_DIR/data")
    p.set_defaults(lr=0.5)


def main(argv=None) -> int:
    args = train_elastic.parse_args(argv, add_arguments, __doc__)
    return train_elastic.run(args, lm_task)


if __name__ == "__main__":
    sys.exit(main())
