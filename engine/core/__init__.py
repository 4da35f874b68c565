"""The core tier: what runs in each step, decided and booked without touching the device. The scheduler
(scheduler.py) over its run queues (run_queues.py), fair shares of a step among tenants (shared_step.py,
fair_share.py), its cost model (step_cost.py) and preemption (preemption.py), with each step's batch as
scheduled_batch.py; the KV block books (block_manager.py over block_pool.py, their numbers in block_stats.py, the
prefix hash chain in block_hash.py, the host tier in host_prefix_cache.py, pinned prefixes in prefix_pins.py); the
facts a started core reports and the request checks (core_info.py); the engine's counters (metrics.py).

It imports only the shared types below it (engine/config.py, sampling_params.py, sequence.py); the loop that drives
it each step is engine/runtime/."""
