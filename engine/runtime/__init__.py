"""The runtime tier: the loop that drives the core (what to run) and the worker (how to run it). The engine core
(engine_core.py: requests in, one step at a time, token-id deltas out), its requests' samples and stop rules
(requests.py) and beam-search requests (beam_requests.py); the engine core's process (core_process.py) and the
messages between it and the fronts (core_messages.py). Kept outside engine/core/, above the scheduler it drives."""
