"""The token-exact conversation (app/sessions/conversation.py): a session's next prompt extends the stored token ids,
and for a prefix-stable template (SmolLM2's ChatML) it equals the stateless full render whenever the stored ids
are what a full render would give. The oracle is the tokenizer's own chat template over the whole conversation."""

from __future__ import annotations

import pytest

from app.sessions import conversation

pytestmark = pytest.mark.slow

SYSTEM = {"role": "system", "content": "You answer in one short sentence."}
U1 = {"role": "user", "content": "What is the capital of France?"}
A1 = {"role": "assistant", "content": "The capital of France is Paris."}
U2 = {"role": "user", "content": "And of Germany?"}


def full(tokenizer, messages, generation_prompt=True) -> list[int]:
    text = tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=generation_prompt
    )
    return tokenizer.encode(text, add_special_tokens=False)


def eos_id(tokenizer) -> int:
    return tokenizer.convert_tokens_to_ids("<|im_end|>")


@pytest.mark.parametrize("head", [[SYSTEM], []], ids=["system", "template-default-system"])
def test_first_turn_equals_the_full_render(tokenizer, head):
    ids = conversation.first_turn_ids(tokenizer, head[0]["content"] if head else None, [U1])
    assert ids == full(tokenizer, head + [U1])


def test_first_turn_starts_with_the_system_prefix_a_preset_pins(tokenizer):
    prefix = conversation.system_prefix_ids(tokenizer, SYSTEM["content"])
    ids = conversation.first_turn_ids(tokenizer, SYSTEM["content"], [U1])
    assert ids[: len(prefix)] == prefix and len(ids) > len(prefix)
    assert tokenizer.decode(prefix) == f"<|im_start|>system\n{SYSTEM['content']}<|im_end|>\n"


def test_next_turn_after_an_eos_reply_equals_the_full_render(tokenizer):
    # stored: the first prompt, the reply as generated, and the EOS token the model ended it with
    stored = full(tokenizer, [SYSTEM, U1]) + tokenizer.encode(
        A1["content"], add_special_tokens=False
    )
    stored.append(eos_id(tokenizer))
    ids = conversation.next_turn_ids(
        tokenizer, stored, [SYSTEM, U1, A1], [U2], (eos_id(tokenizer),)
    )
    assert ids[: len(stored)] == stored
    assert ids == full(tokenizer, [SYSTEM, U1, A1, U2])


def test_next_turn_after_a_cut_reply_closes_it_as_the_template_does(tokenizer):
    cut = {"role": "assistant", "content": "The capital of"}  # max_tokens or a client abort: no EOS
    stored = full(tokenizer, [SYSTEM, U1]) + tokenizer.encode(
        cut["content"], add_special_tokens=False
    )
    ids = conversation.next_turn_ids(
        tokenizer, stored, [SYSTEM, U1, cut], [U2], (eos_id(tokenizer),)
    )
    assert ids[: len(stored)] == stored
    rendered = tokenizer.apply_chat_template(
        [SYSTEM, U1, cut, U2], tokenize=False, add_generation_prompt=True
    )
    assert tokenizer.decode(ids) == rendered


def test_stored_ids_are_kept_even_when_retokenizing_the_reply_would_differ(tokenizer):
    # the model produced " Paris" as two pieces; a re-render would merge them: the session keeps the original
    pieces = tokenizer.encode(" Par", add_special_tokens=False) + tokenizer.encode(
        "is", add_special_tokens=False
    )
    assert pieces != tokenizer.encode(" Paris", add_special_tokens=False)
    stored = full(tokenizer, [U1]) + pieces + [eos_id(tokenizer)]
    reply = {"role": "assistant", "content": " Paris"}
    ids = conversation.next_turn_ids(tokenizer, stored, [U1, reply], [U2], (eos_id(tokenizer),))
    assert ids[: len(stored)] == stored
    # the stateless render drifts here; the session does not
    assert ids != full(tokenizer, [U1, reply, U2])


class _CountingTemplate:
    """A template that numbers the conversation in its header: never a prefix of a longer render."""

    def apply_chat_template(self, messages, tokenize, add_generation_prompt):
        body = "".join(f"<{m['role']}>{m['content']}" for m in messages)
        return f"[{len(messages)} messages]{body}" + (
            "<assistant>" if add_generation_prompt else ""
        )

    def encode(self, text, add_special_tokens):
        return [ord(c) for c in text]

    def decode(self, ids, skip_special_tokens=False):
        return "".join(map(chr, ids))


def test_a_template_that_is_not_prefix_stable_is_detected():
    template = _CountingTemplate()
    with pytest.raises(conversation.NotAnExtension):
        conversation.next_turn_ids(template, [1, 2], [U1, A1], [U2], ())
    assert conversation.full_render_ids(template, [U1]) == [
        ord(c) for c in "[1 messages]<user>" + U1["content"] + "<assistant>"
    ]
