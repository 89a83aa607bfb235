"""The constraints the structured-output tests run and benchmarks/structured.py compiles: a spread
of JSON schemas (nested objects, bounded arrays, enums, numeric ranges, patterns and lengths,
optional properties, anyOf), regexes, choices and a Lark grammar. Strings are kept short, so that
a tiny random model's babble ends within a test's max_tokens."""

S = {"type": "string", "maxLength": 6}
SCHEMAS = [
    {"type": "object", "properties": {"name": S, "age": {"type": "integer", "minimum": 0, "maximum": 150}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "additionalProperties": False, "required": ["user"], "properties": {"user": {
        "type": "object", "additionalProperties": False, "required": ["name", "address"], "properties": {
            "name": {"type": "string", "minLength": 1, "maxLength": 5},
            "address": {"type": "object", "additionalProperties": False, "required": ["city", "zip"],
                        "properties": {"city": S, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}}}}}},
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 1, "maxItems": 3},
    {"type": "object", "additionalProperties": False, "required": ["status", "priority"],
     "properties": {"status": {"enum": ["open", "closed", "in_progress", "won't fix"]},
                    "priority": {"type": "integer", "enum": [1, 2, 3]}}},
    {"type": "object", "additionalProperties": False, "required": ["lat", "count"],
     "properties": {"lat": {"type": "number", "minimum": -90, "maximum": 90},
                    "count": {"type": "integer", "minimum": 1, "maximum": 1000}}},
    {"type": "object", "additionalProperties": False, "required": ["code", "label"],
     "properties": {"code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
                    "label": {"type": "string", "minLength": 2, "maxLength": 4}}},
    {"type": "object", "additionalProperties": False, "required": ["a"],
     "properties": {"a": {"type": "boolean"}, "b": S, "c": {"type": "integer", "minimum": 0, "maximum": 9},
                    "d": {"type": "null"}}},
    {"type": "object", "additionalProperties": False, "required": ["value"], "properties": {"value": {"anyOf": [
        {"type": "integer", "minimum": 0, "maximum": 99}, {"type": "string", "maxLength": 3}, {"type": "boolean"}]}}},
    {"type": "array", "maxItems": 2, "items": {"type": "object", "additionalProperties": False,
                                               "required": ["id", "ok"],
                                               "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 99},
                                                              "ok": {"type": "boolean"}}}},
    {"type": "object", "additionalProperties": False, "required": ["tags"],
     "properties": {"tags": {"type": "array", "items": {"enum": ["a", "b", "é", "東"]}, "minItems": 2, "maxItems": 4}}},
]
REGEXES = [r"[0-9]{3}-[a-z]{2,4}", r"(yes|no)!", r"[A-Z][a-z]{1,5} [0-9]{1,2}", r"0x[0-9a-f]{4}", r"(ab|cd)+e"]
CHOICES = [["yes", "no"], ["東京", "大阪", "Zürich"], ["alpha beta", "alpha", "gamma"]]
GRAMMAR = 'start: expr\nexpr: NUMBER (OP NUMBER)*\nOP: "+" | "-" | "*"\nNUMBER: /[1-9][0-9]{0,2}/\n'
