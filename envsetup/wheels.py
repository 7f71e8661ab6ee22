"""flash-attn's prebuilt wheels, found the way flash-attn's own setup.py finds them, not in a table.

flash-attention's setup.py (`get_wheel_url`, v2.8.3) names its release wheels
  flash_attn-{version}+cu{CUDA major}torch{torch major.minor}cxx11abi{TRUE|FALSE}-{cpXY}-{cpXY}-linux_{machine}.whl
under https://github.com/Dao-AILab/flash-attention/releases/download/v{version}/. The versions come
from the package index (PEP 691 JSON, or PEP 503 HTML), newest first, and a wheel is chosen only
after a HEAD request says it exists. Standard library only (envsetup runs before any venv).
"""

from __future__ import annotations

import json
import os
import re
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from functools import lru_cache

from podkit.envsetup.arch import version_tuple

RELEASES = "https://github.com/Dao-AILab/flash-attention/releases/download"
INDEX = "https://pypi.org/simple"
_FINAL = re.compile(r"^\d+(\.\d+)*(\.post\d+)?$")  # no a/b/rc/dev pre-releases


def flash_attn_wheel_name(version: str, cuda: str, torch: str, cxx11_abi: bool, python_tag: str,
                          machine: str = "x86_64") -> str:
    cuda_major = version_tuple(cuda)[0]
    mm = version_tuple(torch)[:2]
    return (f"flash_attn-{version}+cu{cuda_major}torch{mm[0]}.{mm[1]}cxx11abi{str(cxx11_abi).upper()}"
            f"-{python_tag}-{python_tag}-linux_{machine}.whl")


@dataclass(frozen=True)
class WheelSource:
    """Where to look. PIP_INDEX_URL and PODKIT_FLASH_ATTN_RELEASES point it at a mirror."""

    index_url: str = field(default_factory=lambda: os.environ.get("PIP_INDEX_URL", INDEX).rstrip("/"))
    releases_url: str = field(default_factory=lambda: os.environ.get("PODKIT_FLASH_ATTN_RELEASES", RELEASES).rstrip("/"))
    timeout: float = 15.0

    def flash_attn_url(self, version: str, name: str) -> str:
        return f"{self.releases_url}/v{version}/{urllib.request.quote(name)}"

    @lru_cache(maxsize=None)
    def versions(self, project: str) -> tuple[str, ...]:
        """Final releases of `project` on the index, newest first; () when the index cannot be read."""
        req = urllib.request.Request(f"{self.index_url}/{project}/", headers={
            "Accept": "application/vnd.pypi.simple.v1+json, text/html;q=0.1"})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                body = resp.read().decode(errors="replace")
                kind = resp.headers.get("Content-Type", "")
        except (OSError, urllib.error.URLError, ValueError):
            return ()
        if "json" in kind:
            data = json.loads(body)
            found = set(data.get("versions") or ()) or {_version_of(f["filename"], project) for f in data.get("files", [])}
        else:  # PEP 503: one anchor per file
            found = {_version_of(name, project) for name in re.findall(r">([^<>]+)</a>", body)}
        final = [v for v in found if v and _FINAL.match(v)]
        return tuple(sorted(final, key=version_tuple, reverse=True))

    @lru_cache(maxsize=None)
    def exists(self, url: str) -> bool:
        req = urllib.request.Request(url, method="HEAD")
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:  # follows GitHub's redirect
                return resp.status == 200
        except (OSError, urllib.error.URLError, ValueError):
            return False


def _version_of(filename: str, project: str) -> str | None:
    """'flash_attn-2.8.3.tar.gz' -> '2.8.3' (sdists; wheels carry the version the same way)."""
    stem = re.sub(r"(\.tar\.gz|\.zip|\.whl)$", "", filename)
    prefix = re.sub(r"[-_.]+", "_", project).lower() + "-"
    normal = re.sub(r"[-_.]+", "_", stem.split("-", 1)[0]).lower() + "-" + stem.split("-", 1)[1] if "-" in stem else ""
    if not normal.startswith(prefix):
        return None
    return normal[len(prefix):].split("-")[0]
