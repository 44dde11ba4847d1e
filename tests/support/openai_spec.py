"""OpenAI's OpenAPI document as a validator of what Paralon answers.

The document (about 3 MB of YAML) is read from outside the project, never
copied into it: `PARALON_OPENAI_SPEC`, else `../shared/specs/openai-openapi.yaml`
beside the repository, else `/work/shared/specs/openai-openapi.yaml`. It is
parsed once per test process and every `$ref` is resolved over the whole
document (a `referencing` registry), with JSON Schema 2020-12, which OpenAPI
3.1 schemas are.

Two things in the document are OpenAPI rather than JSON Schema:
- `nullable: true` (OpenAPI 3.0, still on about a hundred schemas, e.g. the
  stream chunk's `logprobs`) means "or null": rewritten to
  `anyOf: [schema, {type: null}]` so that a null the document allows passes;
- `discriminator`, `example`, `x-*` are annotations: JSON Schema ignores
  unknown keywords, so they change nothing.
No other rewriting: a schema that says `additionalProperties: false` keeps
saying it, so a field Paralon adds there fails validation loudly.

One schema is derived, by name, because the document is wrong about it:
`CreateCompletionResponse` claims streamed and whole completions share one
shape, with a non-null `finish_reason`; OpenAI (and vLLM) stream `null` there
on every chunk but the last. `CompletionStreamChunk` is that schema with only
`choices[].finish_reason` also allowing null. Likewise the document describes
embeddings only as arrays of floats, while `encoding_format: "base64"` (which
the openai SDK asks for by default) answers each as a base64 string:
`CreateEmbeddingBase64Response` is `CreateEmbeddingResponse` with only
`data[].embedding` a string."""
from __future__ import annotations

import copy
import functools
import os
from pathlib import Path

import yaml
from jsonschema import Draft202012Validator
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT202012

SPEC_ENV = "PARALON_OPENAI_SPEC"
SPEC_NAME = "openai-openapi.yaml"
REPO_ROOT = Path(__file__).resolve().parents[2]
FALLBACK_PATH = Path("/work/shared/specs") / SPEC_NAME
DOCUMENT_URI = "urn:paralon:openai-openapi"
ERRORS_SHOWN_MAX = 5


class SpecMissing(RuntimeError):
    """OpenAI's OpenAPI document is not where the tests look for it."""


class SpecViolation(AssertionError):
    """A body does not match the schema OpenAI's document gives it."""


def spec_path() -> Path:
    candidates = [Path(p) for p in [os.environ.get(SPEC_ENV)] if p]
    candidates += [REPO_ROOT.parent / "shared" / "specs" / SPEC_NAME, FALLBACK_PATH]
    for path in candidates:
        if path.is_file():
            return path
    raise SpecMissing(f"OpenAI's OpenAPI document was not found; looked at {', '.join(map(str, candidates))}. "
                      f"Set {SPEC_ENV} to the path of openai-openapi.yaml (github.com/openai/openai-openapi).")


class _Loader(yaml.CSafeLoader if hasattr(yaml, "CSafeLoader") else yaml.SafeLoader):
    """YAML as JSON sees it: `2026-10-23` stays a string (a JSON Schema `const`, `enum` or example is JSON)."""


_Loader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag != "tag:yaml.org,2002:timestamp"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}


def _rewrite_nullable(node):
    """OpenAPI 3.0's `nullable: true` as JSON Schema says it, everywhere in the tree."""
    if isinstance(node, list):
        return [_rewrite_nullable(item) for item in node]
    if not isinstance(node, dict):
        return node
    rewritten = {key: _rewrite_nullable(value) for key, value in node.items()}
    if rewritten.pop("nullable", False) is True:
        return {"anyOf": [rewritten, {"type": "null"}]}
    return rewritten


COMPLETION_STREAM_CHUNK = "CompletionStreamChunk"


def _add_completion_stream_chunk(schemas: dict) -> None:
    chunk = copy.deepcopy(schemas["CreateCompletionResponse"])
    finish_reason = chunk["properties"]["choices"]["items"]["properties"]["finish_reason"]
    chunk["properties"]["choices"]["items"]["properties"]["finish_reason"] = {"anyOf": [finish_reason, {"type": "null"}]}
    schemas[COMPLETION_STREAM_CHUNK] = chunk


EMBEDDING_BASE64_RESPONSE = "CreateEmbeddingBase64Response"


def _add_embedding_base64_response(schemas: dict) -> None:
    embedding = copy.deepcopy(schemas["Embedding"])
    embedding["properties"]["embedding"] = {"type": "string", "contentEncoding": "base64"}
    schemas["EmbeddingBase64"] = embedding
    response = copy.deepcopy(schemas["CreateEmbeddingResponse"])
    response["properties"]["data"]["items"] = {"$ref": "#/components/schemas/EmbeddingBase64"}
    schemas[EMBEDDING_BASE64_RESPONSE] = response


@functools.cache
def document() -> dict:
    with spec_path().open("rb") as file:
        loaded = _rewrite_nullable(yaml.load(file, Loader=_Loader))
    _add_completion_stream_chunk(loaded["components"]["schemas"])
    _add_embedding_base64_response(loaded["components"]["schemas"])
    return loaded


@functools.cache
def _registry() -> Registry:
    return Registry().with_resource(DOCUMENT_URI, Resource(contents=document(), specification=DRAFT202012))


@functools.cache
def validator(schema_name: str) -> Draft202012Validator:
    if schema_name not in document()["components"]["schemas"]:
        raise KeyError(f"OpenAI's document has no component schema {schema_name!r}")
    reference = {"$ref": f"{DOCUMENT_URI}#/components/schemas/{schema_name}"}
    return Draft202012Validator(reference, registry=_registry())


def violations(body, schema_name: str) -> list[str]:
    """Each way `body` breaks the schema, as `path: message` (empty when it conforms)."""
    found = sorted(validator(schema_name).iter_errors(body), key=lambda e: list(e.absolute_path))
    return [_describe(error) for error in found]


def _describe(error) -> str:
    path = "/".join(str(p) for p in error.absolute_path) or "(root)"
    detail = error.message
    if error.context:  # anyOf/oneOf: the closest branch says most
        best = min(error.context, key=lambda e: (len(list(e.relative_schema_path)), e.message))
        detail += f" (closest: {'/'.join(str(p) for p in best.absolute_path)}: {best.message[:300]})"
    return f"{path}: {detail[:600]}"


def validate(body, schema_name: str, where: str = "") -> None:
    """Raise SpecViolation naming the schema, where the body came from and what is wrong."""
    wrong = violations(body, schema_name)
    if wrong:
        shown = "\n  ".join(wrong[:ERRORS_SHOWN_MAX])
        more = f"\n  … and {len(wrong) - ERRORS_SHOWN_MAX} more" if len(wrong) > ERRORS_SHOWN_MAX else ""
        raise SpecViolation(f"{where or 'a body'} does not match OpenAI's {schema_name}:\n  {shown}{more}")
