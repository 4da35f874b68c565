"""The worker's tier: what runs a step on the device. The model runner (model_runner.py) with the step's packed
inputs (step_inputs.py), the attention metadata its layers read (forward_context.py) and the decode steps' CUDA
graphs (cuda_graphs.py); loading the weights (loader.py; model_sources.py, the directory they come from;
dummy_model.py, seeded stand-ins; gguf_q4.py for Q4_1 GGUF files); and tensor parallelism's ranks (worker_group.py)
and process group (parallel_state.py)."""
