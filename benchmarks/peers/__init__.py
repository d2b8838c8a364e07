"""8. Peers: the other resumable loaders measured side by side with ours, on the same work, in one run.

`faults.py` is the one script of stops and resumes applied to every system; each system has one small adapter
module (`torch_skip`, `stateful`, `mosaic`, `lit`, `lit_keep`, `grain_index`, `grain_elastic`, `energon`, `olmo`,
`ours`) used the way its documentation says; `section.py` runs the exactly-once table and the costs and builds the
rows (`run_exact`: the table alone, no timings). Nothing is imported here: a process that needs one adapter (the
cold-start child, `benchmarks.first_batch`) imports that adapter alone, and times only what the system needs.
"""
