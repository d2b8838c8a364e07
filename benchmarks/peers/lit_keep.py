"""LitData as `lit.py` uses it, with `drop_last=False`: every rank's share of the epoch is served to its end, the
tail included (its default under torch.distributed drops the epoch's last partial global batch). It warns that
ranks may then run unequal numbers of batches, which the counts here show."""

from __future__ import annotations

from functools import partial

from benchmarks.peers.lit import Lit, _loader


class LitKeep(Lit):
    _loader = staticmethod(partial(_loader, drop_last=False))


PEER = LitKeep()
