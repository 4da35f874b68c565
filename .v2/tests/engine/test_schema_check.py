"""engine/output/schema_check.py: schemas that no finite value satisfies (required recursion) are found; every schema a
model can follow is left alone."""

from __future__ import annotations

import pytest

from engine.output.schema_check import unsatisfiable

NEEDS_ITSELF = {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}


@pytest.mark.parametrize(
    "schema",
    [
        NEEDS_ITSELF,
        {
            "$defs": {
                "node": {
                    "type": "object",
                    "properties": {"next": {"$ref": "#/$defs/node"}},
                    "required": ["next"],
                }
            },
            "$ref": "#/$defs/node",
        },
        {"type": "array", "minItems": 1, "items": {"$ref": "#"}},
        {
            "definitions": {
                "a": {
                    "type": "object",
                    "properties": {"b": {"$ref": "#/definitions/b"}},
                    "required": ["b"],
                },
                "b": {"type": "array", "minItems": 2, "items": {"$ref": "#/definitions/a"}},
            },
            "$ref": "#/definitions/a",
        },
        {
            "anyOf": [
                {"$ref": "#/anyOf/1"},
                {"type": "object", "properties": {"x": {"$ref": "#"}}, "required": ["x"]},
            ]
        },
        False,
    ],
    ids=["self", "defs-chain", "array-of-itself", "mutual", "anyof-all-recursive", "false"],
)
def test_schemas_that_only_recursion_satisfies_are_found(schema):
    assert unsatisfiable(schema)


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "object", "properties": {"a": {"$ref": "#"}}},  # a is optional: {} ends it
        {
            "type": "object",
            "properties": {"a": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}},
            "required": ["a"],
        },
        {"type": "array", "items": {"$ref": "#"}},  # [] ends it
        {"type": ["object", "null"], "properties": {"a": {"$ref": "#"}}, "required": ["a"]},
        {
            "type": "object",
            "properties": {
                "name": {"type": "string"},
                "tags": {"type": "array", "items": {"type": "string"}},
            },
            "required": ["name", "tags"],
        },
        {"enum": ["a", "b"]},
        {"$ref": "#/definitions/missing"},  # left to the grammar library
        True,
    ],
    ids=[
        "optional",
        "nullable-branch",
        "empty-array",
        "nullable-type",
        "plain",
        "enum",
        "unresolved",
        "true",
    ],
)
def test_schemas_with_a_finite_value_pass(schema):
    assert not unsatisfiable(schema)


def test_a_huge_schema_is_left_to_the_grammar_library():
    wide = {
        "type": "object",
        "properties": {f"p{i}": {"type": "object"} for i in range(5000)},
        "required": ["loop"],
        "additionalProperties": {"$ref": "#"},
    }
    assert not unsatisfiable(wide)
