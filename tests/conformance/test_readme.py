"""The README's "Use it from your code" snippets, run as they are written
against the serve (PARALON_BASE_URL, PARALON_API_KEY and PARALON_MODEL are the
only things they are given), so the documentation cannot drift from what
works. What they received is checked like any other client's traffic."""
from __future__ import annotations

import re
from pathlib import Path

import openai
import pytest

from tests.conformance.conftest import AGENT_MODEL, CLIENT_WARNINGS_ARE_ERRORS, LITELLM_SCHEMA_WARNING

pytestmark = [*CLIENT_WARNINGS_ARE_ERRORS, LITELLM_SCHEMA_WARNING]  # the snippets run litellm too

README = Path(__file__).resolve().parents[2] / "README.md"
HEADING = "## Use it from your code"
FENCE = re.compile(r"^```python\n(.*?)^```$", re.MULTILINE | re.DOTALL)


def readme_snippets() -> list[str]:
    text = README.read_text()
    if HEADING not in text:
        raise AssertionError(f"README.md has no section {HEADING!r}")
    section = text.split(HEADING, 1)[1].split("\n## ", 1)[0]
    return FENCE.findall(section)


SNIPPETS = readme_snippets()


def test_the_section_shows_every_client():
    sources = "\n".join(SNIPPETS)
    for client in ("from openai import OpenAI", "from langchain_openai import ChatOpenAI", "import litellm"):
        assert client in sources, f"the README section has no snippet with {client!r}"


@pytest.mark.parametrize("snippet", SNIPPETS, ids=[f"snippet{i}" for i in range(len(SNIPPETS))])
def test_a_readme_snippet_runs_as_written(paralon, monkeypatch, capsys, snippet):
    # The agent model stops on its own and answers tools with tool calls: what the snippets show.
    monkeypatch.setenv("PARALON_MODEL", AGENT_MODEL)
    namespace: dict = {"__name__": "readme_snippet"}
    try:
        exec(compile(snippet, f"{README.name}: {HEADING}", "exec"), namespace)
    finally:
        for value in namespace.values():
            if isinstance(value, openai.OpenAI):
                value.close()  # the snippet's own client: no socket left to the garbage collector
    assert capsys.readouterr().out.strip(), "the snippet printed nothing"
    assert paralon.recorder.exchanges, "the snippet sent nothing to the serve"
    paralon.check()
