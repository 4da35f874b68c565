"""The server over real HTTP, as any client sees it (the scripts start ``python -m app serve`` themselves unless
given ``--base-url``), and the costs the front pays per request.

- ``serve``: streaming load in the layout of ``vllm bench serve`` (workload ``serve``); with ``--compare-offline``
  the served TPOT and tok/s against the engine's own step (workload ``serve-vs-engine``).
  ``python -m benchmarks.online.serve --concurrency 16 --num-prompts 64``
- ``serve_fronts.sh``: serve-vs-engine with one or more front processes over one engine core.
  ``REDIS_URL=... bash benchmarks/online/serve_fronts.sh OUT_DIR``
- ``multi_turn``: conversations through the session API and the stateless API, per-turn TTFT and cached share
  (workload ``multi-turn``). ``python -m benchmarks.online.multi_turn --with-redis``
- ``fairness``: a light tenant's TPOT and TTFT beside a heavy tenant's n = 128, 64 streams and a connection storm
  (workload ``fairness``). ``python -m benchmarks.online.fairness``
- ``fairness_engine``: the same light-beside-heavy case in process, the engine's share of the served number.
  ``python -m benchmarks.online.fairness_engine --device cpu``
- ``soak``: several tenants, a mixed load and faults on a schedule, the promises checked at the end (workload
  ``soak``). ``python -m benchmarks.online.soak --duration 120``
- ``grammar_compile``: what a large response_format schema costs and where (worker thread, event loop gap).
  ``python -m benchmarks.online.grammar_compile``
- ``request_bodies``: what reading the largest request bodies costs the event loop.
  ``python -m benchmarks.online.request_bodies``

Shared by the scripts above (libraries, no command): ``http_client`` (the server and Redis as subprocesses, one
streamed request timed chunk by chunk, percentiles), ``sse_client`` (clients spread over processes, so the client
is never the bottleneck), ``serve_compare`` (the serve-vs-engine numbers and table).
"""
