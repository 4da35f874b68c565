"""Speculative decoding: draft tokens proposed for a decoding sequence, verified by the next step in one pass.

A proposer suggests up to ``k`` tokens that may follow a sequence's known tokens (ngram.py: the longest recent
n-gram of its own tokens, i.e. the request's prompt, which for a session turn is the whole conversation so far, and
the reply so far). The speculator (speculator.py) appends them to the sequence's ``token_ids`` as drafts and runs
the sequence as ``1 + k`` decode rows in the step (engine/core/scheduled_batch.py); how many drafts a sequence
gets is adaptive (draft_length.py: its acceptance so far against what a draft row costs the step). Every row is
sampled with the sequence's own parameters as plain decoding would sample it at that position; the drafts are
kept while each equals the token sampled before it, and the first row whose sample differs (or the row after the
last draft) gives one more token: between 1 and ``k + 1`` tokens a step.

Why that is exact: a draft from a proposer is a single token (a one-hot draft distribution q). Rejection sampling
accepts it with probability min(1, p(d) / q(d)) = p(d) and otherwise draws from the residual, p without d,
renormalised. A sample x ~ p equals d with probability p(d), and given x != d it is distributed as exactly that
residual; so "draw x ~ p, keep the draft while x == d" is rejection sampling itself, and the output has the
distribution of plain decoding. Greedy rows take the argmax, as plain decoding does; a seeded row's draw at
output position i uses the noise of position i (engine/sample/sampler.py), so seeded output equals plain
decoding's token for token. Rejected drafts' KV stays in slots past ``num_computed_tokens`` and is overwritten by
the next step; the blocks they took stay in the sequence's table (its next tokens' blocks) and are freed with it.
"""
