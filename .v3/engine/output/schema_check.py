"""Does a JSON schema admit any finite value? A schema that requires itself (``{"properties": {"a": {"$ref": "#"}},
"required": ["a"]}``) compiles, and its grammar even allows a first token, but no output can ever end: the
request would run to max_tokens and fail. Such schemas are refused up front (400 naming ``response_format``).

A subschema is *productive* when some finite value satisfies it (the least fixpoint, as for a context-free
grammar's productive nonterminals): a scalar type, an enum or const; an object whose required properties are all
productive; an array whose items are productive or that may be empty; anyOf/oneOf with a productive branch; allOf
with all; a ``$ref`` whose target is productive. Starting from nothing productive, passes over every subschema add
those whose conditions hold, until a pass adds none. This is a check for the recursion trap only: it is
conservative everywhere else (a keyword it does not read never makes a schema unproductive), and schemas with more
than ``MAX_NODES`` subschemas are left to the grammar library.
"""

from __future__ import annotations

from typing import Any

MAX_NODES = 4096


def unsatisfiable(schema: Any) -> bool:
    """True when no finite JSON value satisfies ``schema`` because of required recursion (or ``false``)."""
    nodes = _subschemas(schema)
    if nodes is None:
        return False
    known = {id(node) for node in nodes}
    productive: set[int] = set()
    changed = True
    while changed:
        changed = False
        for node in nodes:
            if id(node) not in productive and _holds(node, schema, productive, known):
                productive.add(id(node))
                changed = True
    return id(schema) not in productive


def _subschemas(schema: Any) -> list[Any] | None:
    """Every dict or bool reachable from ``schema`` through the keywords read here (None: too many)."""
    found: dict[int, Any] = {}
    stack = [schema]
    while stack:
        node = stack.pop()
        if id(node) in found or not isinstance(node, (dict, bool)):
            continue
        found[id(node)] = node
        if len(found) > MAX_NODES:
            return None
        if isinstance(node, dict):
            stack.extend(_children(node))
    return list(found.values())


def _children(node: dict) -> list[Any]:
    children: list[Any] = []
    for key in ("properties", "$defs", "definitions"):
        if isinstance(node.get(key), dict):
            children += node[key].values()
    for key in ("anyOf", "oneOf", "allOf", "prefixItems"):
        if isinstance(node.get(key), list):
            children += node[key]
    for key in ("items", "additionalProperties"):
        if isinstance(node.get(key), (dict, bool)):
            children.append(node[key])
    return children


def _holds(node: Any, root: Any, productive: set[int], known: set[int]) -> bool:
    """Whether ``node`` is productive given the subschemas known productive so far (a reference to a subschema
    outside the keywords read here counts as productive)."""
    if isinstance(node, bool):
        return node

    def ok(child: Any) -> bool:
        return not isinstance(child, (dict, bool)) or id(child) in productive

    if "$ref" in node:
        target = _resolve(root, node["$ref"])
        if target is not None and id(target) in known and not ok(target):
            return False
    if any(not ok(child) for child in node.get("allOf", []) if isinstance(node.get("allOf"), list)):
        return False
    for key in ("anyOf", "oneOf"):
        branches = node.get(key)
        if isinstance(branches, list) and branches and not any(ok(b) for b in branches):
            return False
    types = node.get("type")
    types = types if isinstance(types, list) else [types] if types is not None else []
    if types and all(t in ("object", "array") for t in types):
        return ("object" in types and _object_holds(node, ok)) or (
            "array" in types and _array_holds(node, ok)
        )
    if not types and ("properties" in node or "required" in node):
        return _object_holds(node, ok)
    return True


def _object_holds(node: dict, ok: Any) -> bool:
    properties = node.get("properties") if isinstance(node.get("properties"), dict) else {}
    required = node.get("required") if isinstance(node.get("required"), list) else []
    extra = node.get("additionalProperties", True)
    return all(ok(properties.get(name, extra)) for name in required if isinstance(name, str))


def _array_holds(node: dict, ok: Any) -> bool:
    min_items = node.get("minItems", 0)
    if not isinstance(min_items, int) or min_items <= 0:
        return True
    prefix = node.get("prefixItems") if isinstance(node.get("prefixItems"), list) else []
    needed = prefix[:min_items]
    rest = node.get("items", True)
    return all(ok(item) for item in needed) and (len(prefix) >= min_items or ok(rest))


def _resolve(root: Any, ref: Any) -> Any | None:
    """A local reference (``#``, ``#/$defs/name``, ``#/definitions/name``, any ``#/a/b`` path), else None."""
    if not isinstance(ref, str) or not ref.startswith("#"):
        return None
    node = root
    for part in [p for p in ref[1:].split("/") if p]:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node
