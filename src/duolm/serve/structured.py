"""Structured output on POST /v1/completions: the constraint a request asks for, in OpenAI's field (response_format:
json_object or json_schema) or vLLM's (guided_choice, guided_regex, guided_json, or the structured_outputs object that
replaced them), compiled against the served model's vocabulary (duolm.generation.grammar), one Constraint a row.

At most one constraint a request: two fields that constrain are a 400 naming the second, and so is a grammar the
engine cannot compile (naming its field). Each draw of a constrained row is masked to the tokens its grammar allows
(draws.next_tokens); its log-probabilities stay the model's own, before the mask, as they are before penalties."""
from __future__ import annotations

from duolm.generation.grammar import Grammar, Vocabulary
from duolm.serve.schemas import APIError, CompletionRequest


def requested(req: CompletionRequest) -> tuple[str, Grammar] | None:
    """(the field that asks, its Grammar), or None when the request asks for no structure; APIError(400) when two
    fields do, or response_format's type json_schema comes without its json_schema."""
    found = []
    fmt = req.response_format
    if fmt is not None and fmt.type == "json_object":
        found.append(("response_format", Grammar("json_object")))
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None:
            raise APIError(400, "response_format: type json_schema needs its json_schema ({\"name\": ..., "
                                "\"schema\": {...}})", "response_format")
        found.append(("response_format", Grammar("json", fmt.json_schema.schema_)))
    for field, kind in (("guided_choice", "choice"), ("guided_regex", "regex"), ("guided_json", "json")):
        if getattr(req, field) is not None:
            found.append((field, Grammar(kind, getattr(req, field))))
    so = req.structured_outputs
    if so is not None:
        asked = [(f"structured_outputs.{name}", Grammar(kind, value)) for name, kind, value in (
            ("choice", "choice", so.choice), ("regex", "regex", so.regex), ("json", "json", so.json_))
            if value is not None]
        if so.json_object:
            asked.append(("structured_outputs.json_object", Grammar("json_object")))
        if not asked:
            raise APIError(400, "structured_outputs: give one of choice, regex, json, json_object",
                           "structured_outputs")
        found += asked
    if len(found) > 1:
        raise APIError(400, f"{found[1][0]}: {found[0][0]} constrains the output already; give one constraint",
                       found[1][0].split(".")[0])
    return found[0] if found else None


def constraints(req: CompletionRequest, tokenizer, vocab_size: int, rows: int) -> list:
    """One Constraint for each of the request's `rows` (a new state each), or [None] * rows without structure;
    APIError(400) naming the field for a grammar the engine cannot compile."""
    asked = requested(req)
    if asked is None:
        return [None] * rows
    field, grammar = asked
    top = field.split(".")[0]
    try:
        vocab = Vocabulary.of(tokenizer, vocab_size)
        source = vocab.compile(grammar)
        return [vocab.constraint(source) for _ in range(rows)]
    except ImportError as e:
        raise APIError(400, f"{field}: {e}", top) from None
    except ValueError as e:
        raise APIError(400, f"{field}: cannot compile it: {e}", top) from None
