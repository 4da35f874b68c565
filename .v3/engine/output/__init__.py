"""The output tier: what the engine's sampled ids become. The output types (outputs.py), text and stop strings
(detokenizer.py, output_processor.py), beam search (beam_search.py) and structured output: JSON-schema grammars
(structured_output.py), compiled in worker processes within limits (grammar_worker.py) after a check that the
schema admits a value (schema_check.py)."""
