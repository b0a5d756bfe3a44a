"""Constrained decoding: a request whose output must be JSON matching a JSON schema.

The grammar library is xgrammar (vLLM's default backend; `pip install 'tandem[structured]'`),
imported on first use so that a server without it runs every other request.

Per request, a `GrammarConstraint` (an xgrammar matcher) lives in the request's
`RequestSampler`, beside its random stream: it is made when the scheduler admits the request and
survives preemption untouched (recompute replays the prompt and the output so far, which the
matcher has already accepted). Per step:

- `mask_logits` fills one token bitmask for the step's constrained rows on the host, copies
  it to the logits' device without blocking, and sets the disallowed logits to -inf there,
  all rows at once. Rows without a constraint are not touched, and a step without any
  constrained row does nothing at all.
- `advance_constraints` feeds each constrained request the token the step sampled, from the
  host copy of the sampled ids the step reads anyway: no extra device read.

JSON is generated compactly (`{"a": 1, "b": [2, 3]}`: one space after `:` and `,`, none
elsewhere): free whitespace lets a weak model emit newlines forever inside a valid document.
Schemas compile in xgrammar's strict mode (no properties or items beyond the schema's). A
schema keyword xgrammar would silently ignore (`UNENFORCED_KEYWORDS`) is refused instead, so
that every reply that ends validates against the schema it was asked for.
"""

from __future__ import annotations

import json
import re
from collections import OrderedDict
from typing import Any, Sequence

import torch

from tandem.config import SchedulerConfig

#: Where the grammar library comes from, as an error names it.
INSTALL_HINT = "pip install 'tandem[structured]' (the xgrammar package)"


class StructuredOutputUnavailable(RuntimeError):
    """xgrammar is not installed here."""


def import_xgrammar():
    try:
        import xgrammar
    except ImportError as exc:
        raise StructuredOutputUnavailable(f"structured output needs the xgrammar package: {INSTALL_HINT}") from exc
    return xgrammar


def _grammar_options() -> dict[str, Any]:
    return {"any_whitespace": False, "strict_mode": True}


#: Keywords xgrammar's JSON-schema converter accepts but does not enforce (measured: random
#: walks through its masks produce documents that break them). `oneOf` is enforced as `anyOf`
#: (exclusivity unchecked, as with vLLM), which is exact for discriminated unions.
UNENFORCED_KEYWORDS = (
    "not", "uniqueItems", "contains", "minContains", "maxContains", "if", "then", "else",
    "dependentRequired", "dependentSchemas", "unevaluatedProperties", "unevaluatedItems",
)
#: Members that hold one subschema, a list of them, or a map of names to them.
_SUBSCHEMA = ("items", "additionalItems", "additionalProperties", "propertyNames")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems", "items")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")


def _subschemas(schema: dict, where: str):
    for key in _SUBSCHEMA:
        if isinstance(schema.get(key), dict):
            yield schema[key], f"{where}/{key}"
    for key in _SUBSCHEMA_LISTS:
        if isinstance(schema.get(key), list):
            yield from ((sub, f"{where}/{key}/{i}") for i, sub in enumerate(schema[key]))
    for key in _SUBSCHEMA_MAPS:
        if isinstance(schema.get(key), dict):
            yield from ((sub, f"{where}/{key}/{name}") for name, sub in schema[key].items())


def unenforced_keyword(schema: Any, where: str = "#") -> tuple[str, str] | None:
    """The first (JSON pointer, keyword) of `schema` that constrained decoding would not
    enforce, or None."""
    if not isinstance(schema, dict):
        return None
    for keyword in UNENFORCED_KEYWORDS:
        if keyword in schema:
            return where, keyword
    if "multipleOf" in schema and schema.get("type") != "integer":
        return where, "multipleOf"  # enforced on integers only
    if isinstance(schema.get("allOf"), list) and len(schema["allOf"]) > 1:
        return where, "allOf"  # one member only
    for sub, path in _subschemas(schema, where):
        found = unenforced_keyword(sub, path)
        if found is not None:
            return found
    return None


#: The character class xgrammar 0.2 repeats for a string with `minLength`/`maxLength`: it lets
#: raw control characters through, which JSON forbids inside strings (a random model writes
#: them often). `_json_schema_grammar` swaps in the class JSON allows.
_LENGTH_BOUNDED_STRING_CHAR = r'[^\"\\\r\n]'
_JSON_STRING_CHAR = r'[^\0-\x1f\"\\]'


def _json_schema_grammar(xgr, schema_text: str):
    grammar = xgr.Grammar.from_json_schema(schema_text, **_grammar_options())
    ebnf = str(grammar)
    if _LENGTH_BOUNDED_STRING_CHAR not in ebnf:
        return grammar
    return xgr.Grammar.from_ebnf(ebnf.replace(_LENGTH_BOUNDED_STRING_CHAR, _JSON_STRING_CHAR))


def _clean_error(exc: Exception) -> str:
    # xgrammar prefixes its messages with a timestamp and a C++ source location.
    return re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", str(exc).strip())


def check_json_schema(schema: Any) -> None:
    """Raise `ValueError` saying why no grammar can be built from `schema` (a decoded JSON
    schema); `StructuredOutputUnavailable` without xgrammar."""
    xgr = import_xgrammar()
    if not isinstance(schema, dict):
        raise ValueError("a JSON schema must be a JSON object")
    unenforced = unenforced_keyword(schema)
    if unenforced is not None:
        raise ValueError(f"'{unenforced[1]}' (at {unenforced[0]}) cannot be enforced by constrained decoding")
    try:
        _json_schema_grammar(xgr, json.dumps(schema))
    except Exception as exc:  # noqa: BLE001 - xgrammar raises RuntimeError/ValueError for a bad schema
        raise ValueError(_clean_error(exc)) from None


class GrammarConstraint:
    """One request's grammar state across steps (an xgrammar matcher)."""

    def __init__(self, matcher, vocab_size: int):
        self._matcher = matcher
        self.vocab_size = vocab_size
        #: Why the grammar refused a token its own mask allowed (a bug, but one request's): the
        #: engine fails this request alone, and no mask is built for it again.
        self.refusal: str | None = None

    @property
    def terminated(self) -> bool:
        """The grammar accepted a whole document and its end token, or refused a token:
        nothing more may follow."""
        return self.refusal is not None or self._matcher.is_terminated()

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        self._matcher.fill_next_token_bitmask(bitmask, row)

    def advance(self, token: int) -> None:
        # A terminated grammar only sees the late token of a request that already ended (the
        # overlapped loop planned one more step for it): that token is dropped anyway.
        if not self.terminated and not self._matcher.accept_token(token):
            self.refusal = f"the grammar refused token {token}, which its own mask allowed"


#: What a compiled grammar costs a serving rank over its own `memory_size_bytes`. Filling the
#: cache, glibc's in-use bytes grow 1.38x (tiny-moe's 258-token vocabulary; 1.30x with 8,192):
#: many small blocks, chunk headers and rounding. Once the cache is full and evicts, the holes
#: the evicted grammars leave between live blocks add ~6 % more that malloc keeps and cannot
#: return (sub-page; `malloc_trim` gave nothing back): in a rank serving a flood of distinct
#: schemas, in-use bytes stayed flat while freed-but-kept bytes rose, and at 1.4x the rank
#: settled at 1.07x its 512 MB bound (`benchmarks/grammar_flood.py`). Charging the settled cost
#: keeps a rank's real growth within `--grammar-cache-mb`.
ALLOCATOR_OVERHEAD = 1.5


class GrammarCompiler:
    """Compiles JSON schemas for one tokenizer (one per rank) and keeps the compiled grammars,
    keyed by schema text, until they hold `cache_mb`, least recently used out first: a client
    that sends a new schema per call would otherwise grow the rank for good. The bound counts
    each grammar's own `memory_size_bytes` times `ALLOCATOR_OVERHEAD`; xgrammar's built-in cache
    is off because its count missed most of a grammar (about 1 KB of 24 KB for a small schema). Nothing is imported or
    built until the first constrained request."""

    def __init__(self, tokenizer, eos_token_ids: Sequence[int], *, cache_mb: int = SchedulerConfig.grammar_cache_mb):
        self.tokenizer = tokenizer
        self.eos_token_ids = sorted(eos_token_ids)
        self.cache_limit_bytes = cache_mb << 20
        self.cache_bytes = 0
        #: Schemas compiled so far (a cache hit compiles nothing).
        self.compiles = 0
        self._cache: OrderedDict[str, tuple[Any, int]] = OrderedDict()
        self._compiler = None
        self._vocab_size = 0

    def _build(self):
        xgr = import_xgrammar()
        from transformers import PreTrainedTokenizerFast

        # The fast tokenizer seen through transformers: xgrammar reads its vocabulary and detects
        # its encoding (byte-level, byte-fallback, raw) from it.
        self._vocab_size = max(self.tokenizer.get_vocab(with_added_tokens=True).values()) + 1
        wrapped = PreTrainedTokenizerFast(tokenizer_object=self.tokenizer)
        info = xgr.TokenizerInfo.from_huggingface(
            wrapped, vocab_size=self._vocab_size, stop_token_ids=self.eos_token_ids or None
        )
        self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)

    def _compiled(self, json_schema: str):
        hit = self._cache.get(json_schema)
        if hit is not None:
            self._cache.move_to_end(json_schema)
            return hit[0]
        xgr = import_xgrammar()
        try:
            compiled = self._compiler.compile_grammar(_json_schema_grammar(xgr, json_schema))
        except Exception as exc:  # noqa: BLE001
            raise ValueError(f"invalid JSON schema: {_clean_error(exc)}") from None
        self.compiles += 1
        size = int(compiled.memory_size_bytes * ALLOCATOR_OVERHEAD) + len(json_schema)
        if size <= self.cache_limit_bytes:
            self._cache[json_schema] = (compiled, size)
            self.cache_bytes += size
            while self.cache_bytes > self.cache_limit_bytes:
                _, (_, evicted) = self._cache.popitem(last=False)
                self.cache_bytes -= evicted
        return compiled

    def constraint(self, json_schema: str) -> GrammarConstraint:
        """A fresh matcher for `json_schema` (JSON text); `ValueError` for a schema xgrammar
        cannot compile."""
        if self._compiler is None:
            self._build()
        return GrammarConstraint(import_xgrammar().GrammarMatcher(self._compiled(json_schema)), self._vocab_size)


def mask_logits(logits: torch.Tensor, rows: Sequence[int], constraints: Sequence[GrammarConstraint]) -> None:
    """Set to -inf, in place, every logit of `rows` that `constraints` (one per row) disallow
    next; logits past the tokenizer's vocabulary (a padded head) are disallowed too."""
    live = [(r, c) for r, c in zip(rows, constraints) if not c.terminated]
    if not live:
        return
    vocab, device = logits.shape[-1], logits.device
    known = min(c.vocab_size for _, c in live)
    words = -(-known // 32)
    bitmask = torch.full((len(live), words), -1, dtype=torch.int32)
    if device.type != "cpu":
        bitmask = bitmask.pin_memory()  # so the copy below does not block
    for i, (_, c) in enumerate(live):
        c.fill(bitmask, i)
    bits = bitmask.to(device, non_blocking=True)
    shifts = torch.arange(32, dtype=torch.int32, device=device)
    # Past the tokenizer's last id the bits are not the grammar's: where it allows most tokens
    # xgrammar sets a whole word and clears the rejected ids, so the last word's padding reads
    # as allowed. Only the first `known` bits count.
    allowed = ((bits[:, :, None] >> shifts) & 1).flatten(1).bool()[:, : min(known, vocab)]
    if allowed.shape[1] < vocab:
        allowed = torch.cat([allowed, allowed.new_zeros(len(live), vocab - allowed.shape[1])], dim=1)
    index = torch.tensor([r for r, _ in live], dtype=torch.int64).to(device, non_blocking=True)
    logits[index] = logits[index].masked_fill(~allowed, float("-inf"))


def advance_constraints(constraints: Sequence[GrammarConstraint | None], tokens: Sequence[int | None]) -> None:
    """Feed each constrained request the token the step sampled for it (host ids)."""
    for constraint, token in zip(constraints, tokens):
        if constraint is not None and token is not None:
            constraint.advance(int(token))


__all__ = [
    "GrammarCompiler",
    "GrammarConstraint",
    "INSTALL_HINT",
    "StructuredOutputUnavailable",
    "advance_constraints",
    "UNENFORCED_KEYWORDS",
    "check_json_schema",
    "import_xgrammar",
    "mask_logits",
    "unenforced_keyword",
]
