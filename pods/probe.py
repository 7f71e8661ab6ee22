"""Probing a pod over its connection: envsetup/fingerprint.py's script, carried there in one round trip."""

from __future__ import annotations

import shlex

from podkit.envsetup.fingerprint import PROBE_SCRIPT, Fingerprint, parse_probe


def probe(conn, remote_dir: str = "", python: str | None = None) -> Fingerprint:
    """Fingerprint the pod behind `conn` (a PodConnection) in one round trip."""
    env = ""
    if remote_dir:
        env += f"PODKIT_PROBE_DIR={shlex.quote(remote_dir)} "
    if python:
        env += f"PODKIT_PYTHON={shlex.quote(python)} "
    result = conn.run(f"{env}bash -s <<'PODKIT_PROBE'\n{PROBE_SCRIPT}\nPODKIT_PROBE", timeout=120)
    return parse_probe(result.stdout)
