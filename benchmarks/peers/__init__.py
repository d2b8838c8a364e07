"""8. Peers: the other resumable loaders measured side by side with ours, on the same work, in one run.

`faults.py` is the one script of stops and resumes applied to every system; each system has one small adapter
module (`torch_skip`, `stateful`, `mosaic`, `lit`, `grain_index`, `energon`, `ours`) used the way its documentation
says; `section.py` runs the exactly-once table and the costs and builds the rows.
"""

from benchmarks.peers.section import run

__all__ = ["run"]
