"""JSON schemas of varied shape for the real-model structured-output tests and benchmark: (what to
describe, schema). Nested objects, arrays, enums, bounded numbers, required and optional
properties, const, anyOf/oneOf, $ref, nullable types and the string formats xgrammar supports."""

from __future__ import annotations

S = {"type": "string"}
INT = {"type": "integer"}
NUM = {"type": "number"}
BOOL = {"type": "boolean"}


def obj(properties: dict, required: list[str] | None = None, **extra) -> dict:
    return {"type": "object", "properties": properties,
            "required": list(properties) if required is None else required, **extra}


SCHEMAS: list[tuple[str, dict]] = [
    ("a person", obj({"name": S, "age": INT})),
    ("a postal address in the USA", obj({"street": S, "city": S, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}})),
    ("a product in a shop", obj({"id": {"type": "integer", "minimum": 1}, "price": {"type": "number", "minimum": 0,
                                                                                  "maximum": 10000},
                                 "in_stock": BOOL})),
    ("your favourite colour", obj({"color": {"enum": ["red", "green", "blue"]}})),
    ("three fruits", obj({"fruits": {"type": "array", "items": S, "minItems": 3, "maxItems": 3}})),
    ("a user account", obj({"user": obj({"name": S, "email": {"type": "string", "format": "email"}}),
                            "active": BOOL})),
    ("a famous book", obj({"title": S, "author": S, "year": {"type": "integer", "minimum": 1000, "maximum": 2100}})),
    ("an article, with an optional subtitle", obj({"title": S, "subtitle": S}, required=["title"])),
    ("the weather in a city", obj({"city": S, "temperature": NUM, "unit": {"enum": ["C", "F"]}})),
    ("a shopping list", obj({"items": {"type": "array", "maxItems": 3,
                                       "items": obj({"name": S, "quantity": {"type": "integer", "minimum": 1,
                                                                             "maximum": 100}})}})),
    ("a meeting date", obj({"date": {"type": "string", "format": "date"}})),
    ("a database record id", obj({"id": {"type": "string", "format": "uuid"}})),
    ("the API version", obj({"version": {"const": "1.0"}, "status": {"enum": ["ok", "error"]}})),
    ("a list of prime numbers", {"type": "array", "items": INT, "minItems": 2, "maxItems": 5}),
    ("a measured value, text or number", obj({"value": {"anyOf": [S, INT]}})),
    ("a positive count", obj({"count": {"type": "integer", "exclusiveMinimum": 0, "maximum": 1000}})),
    ("a probability", obj({"p": {"type": "number", "minimum": 0, "maximum": 1}})),
    ("whether the sky is blue", {"type": "boolean"}),
    ("a phone contact", obj({"name": S, "phone": {"type": "string", "pattern": "^[0-9]{3}-[0-9]{3}-[0-9]{4}$"}})),
    ("a 2x2 matrix", obj({"matrix": {"type": "array", "minItems": 2, "maxItems": 2,
                                     "items": {"type": "array", "items": INT, "minItems": 2, "maxItems": 2}}})),
    ("a dice roll", obj({"roll": {"enum": [1, 2, 3, 4, 5, 6]}})),
    ("a laptop", obj({"brand": S, "ram_gb": {"type": "integer", "minimum": 2, "maximum": 128}, "ssd": BOOL,
                      "weight_kg": {"type": "number", "minimum": 0.5, "maximum": 5}}, additionalProperties=False)),
    ("a pancake recipe", obj({"name": S, "ingredients": {"type": "array", "items": S, "minItems": 1, "maxItems": 5},
                              "minutes": {"type": "integer", "minimum": 1, "maximum": 240}})),
    ("a movie", obj({"title": S, "year": {"type": "integer", "minimum": 1900, "maximum": 2030},
                     "genres": {"type": "array", "maxItems": 3, "items": {"enum": ["drama", "comedy", "action",
                                                                                   "horror", "sci-fi"]}}})),
    ("a concert", obj({"band": S, "start": {"type": "string", "format": "date-time"}})),
    ("an employee", obj({"id": INT, "department": {"enum": ["sales", "engineering", "support"]},
                         "salary": {"type": "number", "minimum": 0}, "manager": {"type": ["string", "null"]}})),
    ("the location of Paris", obj({"lat": {"type": "number", "minimum": -90, "maximum": 90},
                                   "lon": {"type": "number", "minimum": -180, "maximum": 180}})),
    ("the answer to 17 + 25", obj({"answer": INT})),
    ("the sentiment of 'I love this phone'", obj({"label": {"enum": ["positive", "negative", "neutral"]},
                                                 "confidence": {"type": "number", "minimum": 0, "maximum": 1}})),
    ("a translation of 'hello' to French", obj({"source_lang": S, "target_lang": S, "text": S})),
    ("a to-do list", obj({"tasks": {"type": "array", "maxItems": 3, "items": obj({"title": S, "done": BOOL})}})),
    ("a country", obj({"name": S, "capital": S, "population": {"type": "integer", "minimum": 0}})),
    ("a line segment", {"$defs": {"point": obj({"x": NUM, "y": NUM})}, **obj({"start": {"$ref": "#/$defs/point"},
                                                                             "end": {"$ref": "#/$defs/point"}})}),
    ("a short nickname", obj({"nickname": {"type": "string", "minLength": 2, "maxLength": 12}})),
    ("a shape, a circle or a square", obj({"shape": {"oneOf": [obj({"radius": NUM}), obj({"side": INT})]}})),
    ("a pet", obj({"name": S, "species": {"enum": ["dog", "cat", "bird"]},
                   "age": {"type": "integer", "minimum": 0, "maximum": 40}})),
    ("a car", obj({"make": S, "model": S, "year": {"type": "integer", "minimum": 1950, "maximum": 2030},
                   "electric": BOOL})),
    ("an email message", obj({"to": {"type": "string", "format": "email"},
                              "subject": {"type": "string", "maxLength": 60},
                              "body": {"type": "string", "maxLength": 200}})),
    ("a logging configuration", obj({"debug": BOOL, "level": {"enum": ["info", "warning", "error"]},
                                     "retries": {"type": "integer", "minimum": 0, "maximum": 10}})),
    ("a web server", obj({"host": {"type": "string", "format": "ipv4"},
                          "port": {"type": "integer", "minimum": 1, "maximum": 65535}})),
    ("an alarm", obj({"time": {"type": "string", "format": "time"}, "repeat": BOOL})),
    ("a company", obj({"company": obj({"name": S, "address": obj({"city": S, "country": S})})})),
    ("a temperature reading", obj({"celsius": {"type": "number", "minimum": -100, "maximum": 100},
                                   "sensor": {"type": "string", "pattern": "^[A-Z][0-9]{2}$"}})),
    ("a score board", obj({"scores": {"type": "array", "minItems": 1, "maxItems": 4,
                                      "items": obj({"player": S, "points": {"type": "integer", "minimum": 0}})}})),
    ("a yes or no answer to 'Is water wet?'", obj({"answer": {"enum": ["yes", "no"]}, "reason": S},
                                                  required=["answer"])),
]
