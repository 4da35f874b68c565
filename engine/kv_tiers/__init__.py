"""The KV tiers below the device and the host: a block's KV in a checksummed file on disk, or in Redis (shared by
replicas and kept across restarts), written and read by a thread of their own, off the step loop. The core's books
(engine/core/tier_blocks.py) decide which blocks go down and come back up."""
