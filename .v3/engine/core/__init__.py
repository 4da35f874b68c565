"""The engine core's tier: what decides each step and keeps its books, without touching the device. The step loop
(engine_core.py) and its process (core_process.py, with the front's messages in core_messages.py and the facts it
reports in core_info.py); the scheduler (scheduler.py, fair shares of a step in shared_step.py and fair_share.py,
its cost model in step_cost.py, preemption.py); the KV block books (block_manager.py over block_pool.py, the
prefix hash chain in block_hash.py, the host tier in host_prefix_cache.py); sequences (sequence.py), beam
requests (beam_requests.py) and the engine's counters (metrics.py)."""
