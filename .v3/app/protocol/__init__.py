"""Request bodies at the HTTP edge (OpenAI shapes plus vLLM's and our extensions), and their translation to the
engine's SamplingParams: the field types they share (fields.py), chat messages (messages.py), the sampling fields of
every generating request (sampling.py), the chat and completion bodies (completions.py), the session and preset
bodies (sessions.py) and those of /tokenize and /detokenize (tokenization.py).

Types are strict (``"0.5"`` is not a number), unknown fields are ignored as OpenAI-compatible servers do,
and fields that would change the answer but are not supported get a 400 naming them rather than silence.
"""
