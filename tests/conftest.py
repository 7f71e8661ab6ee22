import os
import signal
import textwrap

import pytest

from podkit.checks.config import parse_job

# The Ctrl-C tests send SIGINT to the commands they start. A shell starts a background job
# (`make test &` in a script without job control) with SIGINT ignored, children inherit an ignored
# signal across exec, and Python then installs no KeyboardInterrupt handler: the commands would
# never see the Ctrl-C. Restored here, the children start with SIGINT at its default, as from a terminal.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

# One OpenMP thread per process, set before any test imports torch and inherited by every command a test
# starts: `make test` runs a worker per core, and torch's default of a thread per core in each of them (and in
# each smoke or torchrun rank they start) oversubscribes the cores; OpenMP threads that spin-wait for a busy
# core made CPU training tests 3-10 times slower under the suite than alone.
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture
def job():
    """Build a JobConfig from TOML snippets: job(model='preset="x"', train='micro_batch=2')."""

    def make(model='preset = "llama-3.2-1b"', train="", cluster="", source="<test>"):
        text = f"[model]\n{model}\n[train]\n{textwrap.dedent(train)}\n[cluster]\n{textwrap.dedent(cluster)}\n"
        return parse_job(text, source)

    return make


def pytest_collection_modifyitems(config, items):
    """Files with slow-marked tests first, each file's tests in their order (a stable sort): under `make test`'s
    workers (--dist loadfile hands out whole files in collection order) the longest files start early instead
    of leaving one worker alone at the end."""
    slow = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow)
