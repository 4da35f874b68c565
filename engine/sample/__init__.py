"""Sampling: one row of logits per sequence in, one token per sequence out (sampler.py), with the batch's
parameters (sampling_batch.py), the logits processors in their order (logits_processors.py) and the seeded rows'
noise (seeded_noise.py)."""
