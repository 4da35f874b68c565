"""The output tier: what the engine's sampled ids become. The output types (outputs.py), text and stop strings
(detokenizer.py, output_processor.py), beam search (beam_search.py) and structured output: JSON-schema grammars
compiled with llguidance (grammar_compiler.py, over the tokenizer of grammar_tokenizer.py) after a check that the
schema admits a value (schema_check.py), and applied on each step (structured_output.py). The front compiles them in
processes of its own (engine/grammar_worker.py)."""
