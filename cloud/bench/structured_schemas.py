"""The schemas `ctxfuse bench structured` compiles: the shapes clients send as response_format
(extraction, classification, API payloads, configuration), with nested objects, arrays, enums,
anyOf, $ref/$defs (recursive too), patterns, formats and numeric bounds, and a few large ones; and
the schema constrained decoding follows, whose shortest valid output is far longer than any run."""

from __future__ import annotations

from typing import Any

Schema = dict[str, Any]


def _obj(props: dict[str, Any], **extra: Any) -> Schema:
    """An object whose every property is required (as OpenAI's strict mode asks)."""
    return {"type": "object", "properties": props, "required": list(props), **extra}


STR: Schema = {"type": "string"}
INT: Schema = {"type": "integer"}
NUM: Schema = {"type": "number"}
BOOL: Schema = {"type": "boolean"}
EMAIL: Schema = {"type": "string", "format": "email"}
DATE: Schema = {"type": "string", "format": "date"}
DATETIME: Schema = {"type": "string", "format": "date-time"}
UUID: Schema = {"type": "string", "format": "uuid"}
URI: Schema = {"type": "string", "format": "uri"}
CURRENCY: Schema = {"type": "string", "pattern": "^[A-Z]{3}$"}
PHONE: Schema = {"type": "string", "pattern": r"^\+?[0-9]{7,15}$"}


def _strs(max_items: int | None = None) -> Schema:
    s: Schema = {"type": "array", "items": STR}
    return s if max_items is None else {**s, "maxItems": max_items}


def _enum(*values: str) -> Schema:
    return {"type": "string", "enum": list(values)}


ADDRESS = _obj(
    {
        "street": STR,
        "city": STR,
        "postcode": {"type": "string", "pattern": "^[0-9]{5}(-[0-9]{4})?$"},
        "country": _enum("US", "GB", "DE", "FR", "JP", "IN", "BR", "CA"),
    }
)
LINE_ITEM = _obj(
    {
        "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
        "quantity": {"type": "integer", "minimum": 1, "maximum": 999},
        "unit_price": {"type": "number", "minimum": 0},
    }
)
COUNTRIES = [f"{a}{b}" for a in "ABCDEFGHIJ" for b in "ABCDEFGHIJ"]  # a 100-value enum


def _big_form(n: int) -> Schema:
    """A flat form of n fields cycling through the common field kinds (a long intake form)."""
    kinds: list[Schema] = [
        STR,
        {"type": "integer", "minimum": 0, "maximum": 10000},
        BOOL,
        _enum("low", "medium", "high"),
        DATE,
        {"type": "number", "minimum": -1000, "maximum": 1000},
        EMAIL,
        {"type": "array", "items": STR, "maxItems": 5},
        {"anyOf": [STR, {"type": "null"}]},
        {"type": "string", "maxLength": 40},
    ]
    return _obj({f"field_{i:02d}": kinds[i % len(kinds)] for i in range(n)})


def _catalog() -> Schema:
    """A product catalogue: twelve definitions that reference each other."""
    money = _obj({"amount": {"type": "number", "minimum": 0}, "currency": CURRENCY})
    defs = {
        "money": money,
        "dimension": _obj({"value": NUM, "unit": _enum("mm", "cm", "m", "in")}),
        "size": _obj({f: {"$ref": "#/$defs/dimension"} for f in ("width", "height", "depth")}),
        "image": _obj({"url": URI, "alt": STR}),
        "review": _obj(
            {"author": STR, "stars": {"type": "integer", "minimum": 1, "maximum": 5}, "text": STR}
        ),
        "variant": _obj({"sku": STR, "colour": STR, "price": {"$ref": "#/$defs/money"}}),
        "supplier": _obj({"name": STR, "email": EMAIL, "address": ADDRESS}),
        "stock": _obj({"warehouse": STR, "count": {"type": "integer", "minimum": 0}}),
        "category": _enum("tools", "garden", "kitchen", "toys", "books", "audio", "sport"),
        "discount": {"anyOf": [_obj({"percent": NUM}), _obj({"fixed": {"$ref": "#/$defs/money"}})]},
        "shipping": _obj({"weight_kg": NUM, "size": {"$ref": "#/$defs/size"}}),
        "product": _obj(
            {
                "id": UUID,
                "name": STR,
                "category": {"$ref": "#/$defs/category"},
                "price": {"$ref": "#/$defs/money"},
                "variants": {"type": "array", "items": {"$ref": "#/$defs/variant"}},
                "images": {"type": "array", "items": {"$ref": "#/$defs/image"}, "maxItems": 4},
                "reviews": {"type": "array", "items": {"$ref": "#/$defs/review"}},
                "supplier": {"$ref": "#/$defs/supplier"},
                "stock": {"type": "array", "items": {"$ref": "#/$defs/stock"}},
                "discount": {"anyOf": [{"$ref": "#/$defs/discount"}, {"type": "null"}]},
                "shipping": {"$ref": "#/$defs/shipping"},
            }
        ),
    }
    return {"$defs": defs, **_obj({"products": {"type": "array", "items": {"$ref": "#/$defs/product"}}})}


SCHEMAS: dict[str, Schema] = {
    "person": _obj({"name": STR, "age": {"type": "integer", "minimum": 0, "maximum": 130}, "email": EMAIL}),
    "address": ADDRESS,
    "sentiment": _obj(
        {
            "label": _enum("positive", "negative", "neutral"),
            "score": {"type": "number", "minimum": 0, "maximum": 1},
        }
    ),
    "classification": _obj(
        {
            "category": _enum(
                "billing", "shipping", "returns", "technical", "account", "sales", "other", "spam"
            ),
            "confidence": {"type": "number", "minimum": 0, "maximum": 1},
            "reasons": _strs(3),
        }
    ),
    "entities": _obj(
        {
            "entities": {
                "type": "array",
                "items": _obj(
                    {
                        "text": STR,
                        "type": _enum("PERSON", "ORG", "LOC", "DATE", "MONEY"),
                        "start": {"type": "integer", "minimum": 0},
                        "end": {"type": "integer", "minimum": 0},
                    }
                ),
            }
        }
    ),
    "order": _obj(
        {
            "order_id": {"type": "string", "pattern": "^ORD-[0-9]{6}$"},
            "date": DATE,
            "items": {"type": "array", "items": LINE_ITEM, "minItems": 1},
            "status": _enum("pending", "paid", "shipped", "delivered", "cancelled"),
            "shipping_address": ADDRESS,
        }
    ),
    "event": _obj(
        {
            "title": STR,
            "start": DATETIME,
            "end": DATETIME,
            "attendees": {"type": "array", "items": EMAIL},
            "location": _obj({"name": STR, "lat": NUM, "lon": NUM}),
        }
    ),
    "product": _obj(
        {
            "name": STR,
            "price": {"type": "number", "exclusiveMinimum": 0},
            "currency": _enum("USD", "EUR", "GBP", "JPY"),
            "tags": _strs(8),
            "dimensions": _obj({"w": NUM, "h": NUM, "d": NUM}),
        }
    ),
    "weather": _obj(
        {
            "location": STR,
            "unit": _enum("celsius", "fahrenheit"),
            "forecast": {
                "type": "array",
                "items": _obj(
                    {
                        "day": DATE,
                        "high": {"type": "number", "minimum": -90, "maximum": 60},
                        "low": {"type": "number", "minimum": -90, "maximum": 60},
                        "condition": _enum("sunny", "cloudy", "rain", "snow", "storm", "fog"),
                    }
                ),
                "maxItems": 7,
            },
        }
    ),
    "customer_defs": {
        "$defs": {"address": ADDRESS},
        **_obj(
            {
                "name": STR,
                "email": EMAIL,
                "billing": {"$ref": "#/$defs/address"},
                "shipping": {"$ref": "#/$defs/address"},
            }
        ),
    },
    "tree_recursive": {
        "$defs": {
            "node": _obj({"label": STR, "children": {"type": "array", "items": {"$ref": "#/$defs/node"}}})
        },
        "$ref": "#/$defs/node",
    },
    "invoice": {
        "$defs": {"item": LINE_ITEM, "party": _obj({"name": STR, "vat_id": STR, "address": ADDRESS})},
        **_obj(
            {
                "number": {"type": "string", "pattern": "^INV-[0-9]{4}-[0-9]{5}$"},
                "issued": DATE,
                "due": DATE,
                "seller": {"$ref": "#/$defs/party"},
                "buyer": {"$ref": "#/$defs/party"},
                "lines": {"type": "array", "items": {"$ref": "#/$defs/item"}, "minItems": 1},
                "total": {"type": "number", "minimum": 0},
                "currency": CURRENCY,
            }
        ),
    },
    "booking": _obj(
        {"id": UUID, "room": {"type": "integer", "minimum": 100, "maximum": 999}, "from": DATE, "to": DATE}
    ),
    "log_entry": _obj(
        {
            "timestamp": DATETIME,
            "level": _enum("debug", "info", "warning", "error", "critical"),
            "message": STR,
            "service": {"type": "string", "pattern": "^[a-z][a-z0-9-]{2,30}$"},
        }
    ),
    "api_result": {
        "anyOf": [
            _obj({"ok": {"const": True}, "data": _obj({"id": INT, "value": STR})}),
            _obj({"ok": {"const": False}, "error": _obj({"code": INT, "message": STR})}),
        ]
    },
    "shape_union": _obj(
        {
            "shape": {
                "anyOf": [
                    _obj({"kind": {"const": "circle"}, "radius": {"type": "number", "exclusiveMinimum": 0}}),
                    _obj({"kind": {"const": "rect"}, "width": NUM, "height": NUM}),
                    _obj({"kind": {"const": "triangle"}, "a": NUM, "b": NUM, "c": NUM}),
                ]
            }
        }
    ),
    "recipe": _obj(
        {
            "title": STR,
            "servings": {"type": "integer", "minimum": 1, "maximum": 24},
            "ingredients": {
                "type": "array",
                "items": _obj(
                    {"name": STR, "amount": NUM, "unit": _enum("g", "kg", "ml", "l", "tsp", "tbsp", "cup")}
                ),
            },
            "steps": {"type": "array", "items": STR, "minItems": 1},
        }
    ),
    "movie_review": _obj(
        {
            "title": STR,
            "year": {"type": "integer", "minimum": 1888, "maximum": 2100},
            "rating": {"type": "number", "minimum": 0, "maximum": 10},
            "genres": {"type": "array", "items": _enum("drama", "comedy", "horror", "sci-fi", "romance")},
            "reviewer": _obj({"name": STR, "email": EMAIL}),
        }
    ),
    "job_posting": _obj(
        {
            "title": STR,
            "company": STR,
            "salary": _obj({"min": INT, "max": INT, "currency": CURRENCY}),
            "remote": BOOL,
            "skills": _strs(10),
            "posted": DATE,
        }
    ),
    "flight": _obj(
        {
            "flight": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{1,4}$"},
            "from": {"type": "string", "pattern": "^[A-Z]{3}$"},
            "to": {"type": "string", "pattern": "^[A-Z]{3}$"},
            "departure": DATETIME,
            "passengers": {
                "type": "array",
                "items": _obj({"name": STR, "seat": {"type": "string", "pattern": "^[0-9]{1,2}[A-K]$"}}),
            },
        }
    ),
    "vitals": _obj(
        {
            "patient": _obj({"id": UUID, "born": DATE}),
            "heart_rate": {"type": "integer", "minimum": 20, "maximum": 250},
            "blood_pressure": {"type": "string", "pattern": "^[0-9]{2,3}/[0-9]{2,3}$"},
            "temperature_c": {"type": "number", "minimum": 30, "maximum": 45},
        }
    ),
    "issue": _obj(
        {
            "title": STR,
            "body": STR,
            "labels": _strs(),
            "assignees": _strs(5),
            "milestone": {"anyOf": [STR, {"type": "null"}]},
            "priority": {"type": "integer", "minimum": 0, "maximum": 4},
        }
    ),
    "chat_message": _obj(
        {
            "role": _enum("system", "user", "assistant"),
            "content": {
                "anyOf": [
                    STR,
                    {
                        "type": "array",
                        "items": {
                            "anyOf": [
                                _obj({"type": {"const": "text"}, "text": STR}),
                                _obj({"type": {"const": "image_url"}, "image_url": _obj({"url": URI})}),
                            ]
                        },
                    },
                ]
            },
        }
    ),
    "geo_point": _obj(
        {
            "lat": {"type": "number", "minimum": -90, "maximum": 90},
            "lon": {"type": "number", "minimum": -180, "maximum": 180},
            "ip": {"type": "string", "format": "ipv4"},
        }
    ),
    "contact_card": _obj(
        {
            "name": STR,
            "phones": {
                "type": "array",
                "items": _obj({"kind": _enum("home", "work", "mobile"), "number": PHONE}),
            },
            "emails": {"type": "array", "items": EMAIL},
            "website": URI,
        }
    ),
    "transaction": _obj(
        {
            "iban": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{2}[A-Z0-9]{11,30}$"},
            "amount": {"type": "number", "minimum": -1000000, "maximum": 1000000},
            "currency": CURRENCY,
            "booked": DATE,
            "counterparty": STR,
        }
    ),
    "survey": _obj(
        {
            "respondent": UUID,
            "answers": {
                "type": "array",
                "items": {"anyOf": [{"type": "integer", "minimum": 1, "maximum": 5}, STR, BOOL]},
            },
        }
    ),
    "service_config": _obj(
        {
            "server": _obj(
                {
                    "host": {"type": "string", "format": "hostname"},
                    "port": {"type": "integer", "minimum": 1, "maximum": 65535},
                    "tls": _obj({"enabled": BOOL, "cert_path": STR}),
                }
            ),
            "database": _obj(
                {
                    "url": URI,
                    "pool": _obj(
                        {"min": {"type": "integer", "minimum": 0}, "max": {"type": "integer", "minimum": 1}}
                    ),
                }
            ),
            "log_level": _enum("debug", "info", "warning", "error"),
        }
    ),
    "country_enum": _obj(
        {"country": {"enum": COUNTRIES}, "neighbours": {"type": "array", "items": {"enum": COUNTRIES}}}
    ),
    "expression_recursive": {
        "$defs": {
            "expr": {
                "anyOf": [
                    _obj({"number": NUM}),
                    _obj(
                        {
                            "op": _enum("+", "-", "*", "/"),
                            "left": {"$ref": "#/$defs/expr"},
                            "right": {"$ref": "#/$defs/expr"},
                        }
                    ),
                ]
            }
        },
        "$ref": "#/$defs/expr",
    },
    "meeting_notes": _obj(
        {
            "date": DATE,
            "attendees": _strs(),
            "decisions": _strs(),
            "action_items": {
                "type": "array",
                "items": _obj({"owner": STR, "task": STR, "due": {"anyOf": [DATE, {"type": "null"}]}}),
            },
        }
    ),
    "sql_query": _obj(
        {
            "table": {"type": "string", "pattern": "^[a-z_][a-z0-9_]*$"},
            "columns": {"type": "array", "items": STR, "minItems": 1},
            "filters": {
                "type": "array",
                "items": _obj(
                    {
                        "column": STR,
                        "op": _enum("=", "!=", "<", ">", "<=", ">=", "like"),
                        "value": {"anyOf": [STR, NUM, BOOL, {"type": "null"}]},
                    }
                ),
            },
            "limit": {"type": "integer", "minimum": 1, "maximum": 1000},
        }
    ),
    "form_50_fields": _big_form(50),
    "catalog_defs": _catalog(),
}

# Constrained decoding: at least 200 records of about 20 tokens each, so a run of a few hundred
# tokens always ends by length, never by completing the value, and generates as many tokens as the
# unconstrained run beside it.
DECODE_SCHEMA: Schema = {
    "type": "array",
    "items": _obj(
        {
            "id": {"type": "integer", "minimum": 0, "maximum": 9999},
            "name": {"type": "string", "maxLength": 12},
            "status": _enum("active", "inactive", "pending"),
            "qty": {"type": "integer", "minimum": 0, "maximum": 500},
        }
    ),
    "minItems": 200,
}
