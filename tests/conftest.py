import textwrap

import pytest

from podkit.checks.config import parse_job


@pytest.fixture
def job():
    """Build a JobConfig from TOML snippets: job(model='preset="x"', train='micro_batch=2')."""

    def make(model='preset = "llama-3.2-1b"', train="", cluster="", source="<test>"):
        text = f"[model]\n{model}\n[train]\n{textwrap.dedent(train)}\n[cluster]\n{textwrap.dedent(cluster)}\n"
        return parse_job(text, source)

    return make
