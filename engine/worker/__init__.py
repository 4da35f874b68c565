"""The worker tier: how a step runs on the device. The model runner (model_runner.py) with the step's packed
inputs (step_inputs.py), its sampling (step_sampler.py) and the decode steps' CUDA graphs (cuda_graphs.py);
loading the weights (loader.py; model_sources.py, the directory or GGUF file they come from; dummy_model.py,
seeded stand-ins); tensor parallelism's other ranks (worker_group.py, rank 0's handle on them, and tp_worker.py, a
rank's own process)."""
