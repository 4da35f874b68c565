"""Workload ``speculative-cpu`` (shared WORKLOADS.md terms): chat turns that repeat what the conversation holds,
and open questions that do not.

Repetitive: two sessions, eight turns in all, each turn's prompt the conversation so far (earlier prompts, the
model's replies, the new user message) rendered with the chat template, as a session re-sends it:

- a code session: a 30-line Python function given, then "add a docstring", "rename a variable", "add type hints",
  each asking for the whole code back (edit-this-code), and one regeneration of the rename turn;
- a text session: a paragraph, then "quote the sentence that says X, then answer" (twice, quote-and-answer), a
  list to summarise keeping its items, and one regeneration of the summary turn.

A regeneration (``Turn.regenerate``) runs the previous turn's prompt again, sampled at temperature 0.7 with a
fixed seed (so its reply differs from the first), with the first reply as ``speculative_context``, and its reply
takes the first one's place in the conversation (a chat UI's "regenerate"). An edit turn passes the previous
reply of its session as ``speculative_context`` too (it is also in the prompt). Every turn asks for
MIN_TOKENS to MAX_TOKENS new tokens (EOS masked until MIN_TOKENS).

Non-repetitive: eight single-turn open questions (a story, an explanation, a poem ...), same lengths, greedy.
"""

from __future__ import annotations

from dataclasses import dataclass

MIN_TOKENS, MAX_TOKENS = 128, 256
REGENERATE_TEMPERATURE, REGENERATE_SEED = 0.7, 1234

CODE = """```python
def summarize_orders(orders, min_total, region):
    result = {}
    count = 0
    total = 0.0
    for order in orders:
        if order["region"] != region:
            continue
        amount = order["price"] * order["quantity"]
        if order.get("discount"):
            amount = amount * (1 - order["discount"])
        if amount < min_total:
            continue
        customer = order["customer"]
        if customer not in result:
            result[customer] = {"orders": 0, "amount": 0.0}
        result[customer]["orders"] += 1
        result[customer]["amount"] += amount
        count += 1
        total += amount
    average = total / count if count else 0.0
    ranking = sorted(result.items(), key=lambda item: item[1]["amount"], reverse=True)
    top = [name for name, _ in ranking[:3]]
    return {
        "customers": result,
        "count": count,
        "total": round(total, 2),
        "average": round(average, 2),
        "top": top,
    }
```"""

PARAGRAPH = (
    "The old stone bridge over the river was built in 1843 by the town's first mayor. "
    "For more than a century it carried carts, then cars, then buses into the market square. "
    "In the winter of 1961 the bridge was closed because the ice had cracked two of its arches. "
    "The engineer Maria Lindqvist rebuilt the arches with steel cores and widened the footpath on both sides. "
    "When it opened again in 1963, the town held a parade and the school children painted the railings blue. "
    "Today only bicycles and walkers may cross it, and a small museum at its eastern end tells its story."
)

ITEMS = (
    "- Buy flour, eggs and butter for the Saturday bake sale\n"
    "- Call the plumber about the leaking kitchen tap\n"
    "- Return the three library books before Thursday\n"
    "- Book the car in for its yearly service\n"
    "- Send the birthday card to grandmother in Lisbon\n"
    "- Renew the home insurance before the end of the month\n"
    "- Water the tomato plants on the balcony every evening\n"
    "- Pay the electricity bill online"
)


@dataclass(frozen=True, slots=True)
class Turn:
    """A user message in a session, or (``regenerate``) the session's previous turn run again."""

    session: str
    kind: str  # edit | quote | summarise | regenerate | open
    message: str = ""
    regenerate: bool = False


REPETITIVE = (
    Turn(
        "code",
        "edit",
        f"Here is a Python function:\n\n{CODE}\n\nAdd a docstring to it and return the whole code.",
    ),
    Turn(
        "code",
        "edit",
        "Rename the variable `total` to `running_sum` everywhere and return the whole code again.",
    ),
    Turn("code", "regenerate", regenerate=True),
    Turn("code", "edit", "Now add type hints to every parameter and return the whole code."),
    Turn(
        "text",
        "quote",
        f"Read this paragraph:\n\n{PARAGRAPH}\n\nQuote the sentence of this paragraph that says why the "
        "bridge was closed, then answer: how long was it closed?",
    ),
    Turn(
        "text",
        "summarise",
        f"Here is my to-do list:\n\n{ITEMS}\n\nSummarise this list for me, keeping every item, one line each.",
    ),
    Turn("text", "regenerate", regenerate=True),
    Turn(
        "text",
        "quote",
        "Quote the sentence of the paragraph that names the engineer, then answer: what did she change?",
    ),
)

NON_REPETITIVE = tuple(
    Turn(f"open-{i}", "open", question)
    for i, question in enumerate(
        (
            "Write a short story about a lighthouse keeper who finds a message in a bottle.",
            "Explain how a rainbow forms, as you would to a ten-year-old.",
            "Write a poem about the first snow of winter in a big city.",
            "Why do cats purr? Give the main theories.",
            "Describe a day in the life of a medieval blacksmith.",
            "What makes a good team leader? Give your reasons.",
            "Write a letter from a traveller on Mars to a friend on Earth.",
            "Explain why the seasons change over the year.",
        )
    )
)
