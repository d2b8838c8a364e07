"""A tiny causal transformer on two token corpora mixed 70/30, elastic and exactly once: run it under torchrun.

    torchrun --nproc-per-node=4 --max-restarts=3 examples/train_lm.py --run-dir /tmp/lm --ledger \
        --fail-at-step 7 --fail-rank 3 --fail-mode sigkill
    python -m loader audit /tmp/lm --mixture /tmp/lm/mixture.json      # a row per source

The data is what LM preprocessing writes: pre-tokenized uint16 token files, here two synthetic corpora made once
under --data-dir ("web": two files of a random bigram language; "code": one file of counting runs), documents
ending with an EOS token. Each is a `TokenSource` (packed sequences of --seq-len + 1 tokens across files, with
per-token document ids, so attention stays inside a document); a `Mixture` draws `--samples` positions from them
70/30, exactly in every window of 10 positions, each source repeating in a new order once its epoch is used up.
The loader runs the mixture with shuffle=False. The elastic loop, checkpoints, ledger and fault injection are
those of examples/train_elastic.py.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling example, also when loaded by path
import train_elastic  # noqa: E402

from loader.sources import Mixture, TokenSource  # noqa: E402

VOCAB, EOS = 64, 0
WEIGHTS = {"web": 0.7, "code": 0.3}


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


class TinyLM(torch.nn.Module):
    """A causal transformer whose attention never crosses a document boundary (per-token document ids)."""

    def __init__(self, seq_len: int, dim: int = 32, heads: int = 2, layers: int = 2):
        super().__init__()
        self.heads = heads
        self.embed, self.position = torch.nn.Embedding(VOCAB, dim), torch.nn.Embedding(seq_len, dim)
        self.blocks = torch.nn.ModuleList(
            torch.nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.0, batch_first=True, norm_first=True)
            for _ in range(layers))
        self.head = torch.nn.Linear(dim, VOCAB)

    def forward(self, tokens: torch.Tensor, doc_ids: torch.Tensor) -> torch.Tensor:
        length = tokens.shape[1]
        causal = torch.ones(length, length, dtype=torch.bool, device=tokens.device).tril()
        allowed = causal & (doc_ids[:, :, None] == doc_ids[:, None, :])
        blocked = (~allowed).repeat_interleave(self.heads, dim=0)  # (batch * heads, length, length)
        x = self.embed(tokens) + self.position(torch.arange(length, device=tokens.device))
        for block in self.blocks:
            x = block(x, src_mask=blocked)
        return self.head(x)


def mixture(args) -> Mixture:
    """The job's data: rank 0 writes the corpora if they are missing, then every rank opens them."""
    data_dir = args.data_dir or args.run_dir / "data"
    if not (data_dir / "code-000.bin").exists() and dist.get_rank() == 0:
        write_corpora(data_dir)
    dist.barrier()  # a file rewritten under a reader would be refused by TokenSource: write once, then read
    sources = {name: TokenSource(str(data_dir / f"{name}-*.bin"), seq_len=args.seq_len, dtype="uint16", eos_id=EOS)
               for name in WEIGHTS}
    mix = Mixture(list(sources.values()), list(WEIGHTS.values()), num_samples=args.samples, seed=args.seed,
                  names=list(sources))
    if dist.get_rank() == 0:
        mix.plan.save(args.run_dir / "mixture.json")  # for `python -m loader audit RUN_DIR --mixture ...`
    return mix


def lm_task(args) -> train_elastic.Task:
    def loss(model, batch, device):
        tokens, doc_ids = batch["tokens"].to(device), batch["doc_ids"].to(device)
        logits = model(tokens[:, :-1], doc_ids[:, :-1])
        return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1), reduction="sum")

    args.run_dir.mkdir(parents=True, exist_ok=True)
    return train_elastic.Task(mixture(args), TinyLM(args.seq_len), loss, items_per_sample=args.seq_len,
                              shuffle=False)


def add_arguments(p) -> None:
    p.add_argument("--seq-len", type=int, default=16)
    p.add_argument("--data-dir", type=Path, help="where the token files are (made if missing); default RUN_DIR/data")
    p.set_defaults(lr=0.5)


def main(argv=None) -> int:
    args = train_elastic.parse_args(argv, add_arguments, __doc__)
    return train_elastic.run(args, lm_task)


if __name__ == "__main__":
    sys.exit(main())
