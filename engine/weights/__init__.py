"""Weights formats: GGUF files read in place (memory-mapped), their block formats, and the registry that maps a
(format, device, ISA level) to the linear layer that computes with it."""
