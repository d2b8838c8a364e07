"""Sizes per mode: --smoke (seconds, CI), --quick (minutes on 2 CPU cores) and full; and per device."""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Model:
    """The MLP trained in the training-overhead benchmark: small on CPU, a few ms per step on a GPU."""

    features: int
    hidden: int
    depth: int
    batch_size: int
    steps: int
    num_workers: int


@dataclass(frozen=True)
class Config:
    mode: str
    device: str
    reps: int  # measured rounds per comparison
    warmup: int  # discarded rounds before them
    # 1. throughput
    workers: tuple[int, ...]
    busy_us: float  # the expensive per-sample cost
    run_s: float  # aimed-at duration of one throughput run
    batch_size: int
    features: int
    # 2. training
    model: Model
    # 3. checkpoint costs (positions are fractions of N; `ahead` are micro-batches rank 0 is ahead of rank 1)
    state_sizes: tuple[int, ...]
    state_fractions: tuple[float, ...]
    ahead: tuple[int, ...]
    stateful_state_sizes: tuple[int, ...]
    min_call_s: float  # per_call batches last at least this long
    # 4. resume
    resume_n: int
    resume_positions: tuple[int, ...]
    stateful_resume_sizes: tuple[int, ...]
    stateful_budget_s: float  # no StatefulDataLoader resume predicted longer than this is started
    # 5. order memory (one fresh process per point)
    memory_sizes: tuple[int, ...]
    randperm_cap: int
    memory_timeout_s: float
    # 6. WebDataset
    shards: int
    samples_per_shard: int
    sample_bytes: int
    # 7. LM data: one uint16 token file per mixture source; the mixture whose memory and mapping are measured
    seq_len: int
    tokens_per_source: int
    token_batch_sizes: tuple[int, ...]
    mixture_positions: int
    # 8. restart: the plan, and (except in smoke mode) a real elastic restart through torchrun
    t_launch_s: float
    checkpoint_interval: int
    # 11. scale (--sections scale): world sizes simulated in one process; the lockstep store's simulated ranks,
    # their client threads (each with a TCPStore client of its own) and the steps they take
    scale_worlds: tuple[int, ...]
    store_ranks: tuple[int, ...]
    store_clients: int
    store_steps: int
    # 13. features (issue 30): batches per timed pass of each loader; synthetic lengths whose token-budget padding
    # is measured against a best fit
    feature_batches: int
    budget_samples: int
    measure_restart: bool = True
    # 14. cold start (--sections cold-start): each run a fresh process, so rounds are few
    cold_workers: tuple[int, ...] = (0, 2, 8)
    cold_reps: int = 3
    cold_samples: int = 10**6  # the map-style dataset's length
    cold_tokens: int = 2**22  # the packed pipeline's token file
    cold_timeout_s: float = 300.0  # a bound for a hung child, not for a slow one
    cold_control: bool = False  # DataLoader against itself too: the spread this machine gives a ratio of equals


_CPU_MODEL = Model(features=256, hidden=512, depth=2, batch_size=64, steps=400, num_workers=0)  # ~1 s a run
_CUDA_MODEL = Model(features=1024, hidden=4096, depth=8, batch_size=256, steps=0, num_workers=4)  # steps: mode's

QUICK = Config(
    mode="quick",
    device="cpu",
    reps=9,
    warmup=1,
    workers=(0, 1, 2),
    busy_us=75.0,
    run_s=0.25,
    batch_size=64,
    features=64,
    model=_CPU_MODEL,
    state_sizes=(10**6, 10**7, 10**8, 10**9),
    state_fractions=(0.0, 0.5),
    ahead=(0, 10, 100, 1000),
    stateful_state_sizes=(10**4, 10**6),
    min_call_s=0.02,
    resume_n=10**9,
    resume_positions=(0, 10**3, 10**6, 10**8, 5 * 10**8),
    stateful_resume_sizes=(10**4, 10**5, 10**6, 10**7),
    stateful_budget_s=3.0,
    memory_sizes=(10**6, 10**7, 10**8, 10**9),
    randperm_cap=10**7,
    memory_timeout_s=120.0,
    shards=8,
    samples_per_shard=500,
    sample_bytes=16384,
    seq_len=2048,
    tokens_per_source=2**25,
    token_batch_sizes=(8, 32),
    mixture_positions=10**9,
    t_launch_s=10.0,
    checkpoint_interval=100,
    scale_worlds=tuple(4**k for k in range(9)),
    store_ranks=(1024, 4096, 16384, 65536),
    store_clients=1024,
    store_steps=5,
    feature_batches=1000,
    budget_samples=200_000,
)

FULL = replace(
    QUICK,
    mode="full",
    reps=15,
    workers=(0, 1, 2, 4),
    run_s=0.5,
    model=replace(_CPU_MODEL, steps=1000),
    ahead=(0, 10, 100, 1000, 10000),
    stateful_state_sizes=(10**4, 10**6, 10**7),
    min_call_s=0.05,
    stateful_resume_sizes=(10**4, 10**5, 10**6, 10**7, 5 * 10**7),
    stateful_budget_s=10.0,
    randperm_cap=10**8,
    memory_timeout_s=600.0,
    shards=16,
    samples_per_shard=2000,
    tokens_per_source=2**26,
    token_batch_sizes=(8, 32, 128),
    store_steps=10,
    feature_batches=2000,
    cold_reps=9,
)

SMOKE = replace(
    QUICK,
    mode="smoke",
    reps=1,
    warmup=0,
    run_s=0.01,
    workers=(0, 2),
    model=replace(_CPU_MODEL, steps=5),
    state_sizes=(10**6, 10**9),
    ahead=(0, 10),
    stateful_state_sizes=(10**4,),
    min_call_s=0.001,
    resume_positions=(0, 5 * 10**8),
    stateful_resume_sizes=(10**4, 10**5),
    stateful_budget_s=1.0,
    memory_sizes=(10**6,),
    randperm_cap=10**6,
    memory_timeout_s=60.0,
    shards=2,
    samples_per_shard=128,
    sample_bytes=256,
    seq_len=64,
    tokens_per_source=2**14,
    token_batch_sizes=(8,),
    scale_worlds=(1, 4, 16, 64, 256),
    store_ranks=(256, 1024),
    store_clients=8,
    store_steps=3,
    feature_batches=20,
    budget_samples=2000,
    measure_restart=False,
    cold_workers=(0,),
    cold_reps=1,
    cold_samples=10**4,
    cold_tokens=2**14,
)


def config_for(mode: str, device: str, t_launch_s: float) -> Config:
    """The preset of a mode, with the training model of the device."""
    preset = {"smoke": SMOKE, "quick": QUICK, "full": FULL}[mode]
    model = replace(_CUDA_MODEL, steps=preset.model.steps) if device == "cuda" else preset.model
    return replace(preset, device=device, model=model, t_launch_s=t_launch_s)
