"""RunPod's API, and nothing else: list GPU types, create, read, list, stop and terminate pods.

Follows RunPod's documented GraphQL API (one endpoint, POST {base}/graphql?api_key=KEY):
  https://docs.runpod.io/sdks/graphql/manage-pods  (podFindAndDeployOnDemand, podStop, podTerminate,
  pod(input: {podId}), myself { pods }, gpuTypes)
and the field selections RunPod's own SDK sends (runpod-python, runpod/api/queries/pods.py,
runpod/api/queries/gpus.py, runpod/api/mutations/pods.py; runpod/api/graphql.py for the transport:
the key as the `api_key` query parameter, HTTP 401 for a refused key, `errors[0].message` otherwise).
Values travel as GraphQL variables instead of being pasted into the query text, so a name or image
can never change the query. Written on urllib (one POST shape) rather than the `runpod` SDK, which
pulls in aiohttp/boto3 and prints nothing we could keep to one line. tests/runpod_fake.py serves these
same shapes on 127.0.0.1.

The key comes from RUNPOD_API_KEY or the project's env file (.podkit/env), never argv, and is never
printed: errors carry the endpoint without the query string.
"""

from __future__ import annotations

import http.client
import json
import os
import shlex
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from podkit.pods.errors import PodError

KEY_VAR = "RUNPOD_API_KEY"
# Same variable RunPod's SDK reads for its base URL (runpod-python, runpod/api/graphql.py); the tests
# point it at tests/runpod_fake.py.
BASE_VAR = "RUNPOD_API_BASE_URL"
DEFAULT_BASE = "https://api.runpod.io"
ENV_FILE = Path(".podkit") / "env"

# RunPod's message when no machine has the GPU free (seen in podFindAndDeployOnDemand errors).
_OUT_OF_STOCK = ("no longer any instances available", "no instances available", "out of stock")

_POD_FIELDS = """
  id name desiredStatus costPerHr gpuCount imageName volumeInGb containerDiskInGb
  runtime { uptimeInSeconds ports { ip isIpPublic privatePort publicPort type } }
  machine { gpuDisplayName }
"""


def api_key(project: Path = Path(".")) -> str:
    """RUNPOD_API_KEY from the environment, else from the env file (`[export] RUNPOD_API_KEY=...`)."""
    key = os.environ.get(KEY_VAR, "").strip()
    env_file = project / ENV_FILE
    if not key and env_file.is_file():
        for line in env_file.read_text().splitlines():
            try:
                words = shlex.split(line, comments=True)
            except ValueError:  # an unbalanced quote: not a line this reader can use
                continue
            if words and words[0] == "export":
                words = words[1:]
            if words and words[0].startswith(f"{KEY_VAR}="):
                key = words[0].split("=", 1)[1].strip()
    if not key:
        raise PodError(f"no RunPod API key: {KEY_VAR} is not set and {ENV_FILE} has none",
                       f"export {KEY_VAR}=... (runpod.io console > Settings > API Keys) or add it to {ENV_FILE}")
    return key


@dataclass(frozen=True)
class GpuType:
    id: str
    """What pods are created with, e.g. 'NVIDIA A100 80GB PCIe'."""
    display_name: str
    memory_gb: int
    price_per_hour: float | None
    """lowestPrice.uninterruptablePrice for one GPU (on-demand); None when none is free to rent now."""

    def to_json(self) -> dict:
        return {"id": self.id, "display_name": self.display_name, "memory_gb": self.memory_gb,
                "price_per_hour": self.price_per_hour}


@dataclass(frozen=True)
class Pod:
    id: str
    name: str
    status: str
    """desiredStatus: RUNNING, EXITED, TERMINATED (RunPod's PodStatus)."""
    cost_per_hour: float
    gpu_count: int
    gpu: str
    ssh_host: str | None
    """Public IP and port that RunPod maps to the pod's TCP port 22; None until the runtime has them."""
    ssh_port: int | None

    @property
    def ready(self) -> bool:
        return self.status == "RUNNING" and self.ssh_host is not None

    def to_json(self) -> dict:
        return {"id": self.id, "name": self.name, "status": self.status, "cost_per_hour": self.cost_per_hour,
                "gpu_count": self.gpu_count, "gpu": self.gpu, "ssh_host": self.ssh_host, "ssh_port": self.ssh_port}

    @classmethod
    def from_api(cls, raw: dict) -> "Pod":
        host = port = None
        for p in ((raw.get("runtime") or {}).get("ports") or []):
            if p.get("privatePort") == 22 and p.get("type") == "tcp" and p.get("isIpPublic"):
                host, port = p.get("ip"), p.get("publicPort")
        return cls(id=raw["id"], name=raw.get("name") or "", status=raw.get("desiredStatus") or "?",
                   cost_per_hour=float(raw.get("costPerHr") or 0.0), gpu_count=int(raw.get("gpuCount") or 0),
                   gpu=(raw.get("machine") or {}).get("gpuDisplayName") or "", ssh_host=host,
                   ssh_port=int(port) if port else None)


@dataclass(frozen=True)
class PodRequest:
    """What `bin/pod up` asks RunPod for (podFindAndDeployOnDemand's input)."""

    name: str
    gpu: str
    count: int = 1
    image: str = "runpod/pytorch:2.4.0-py3.11-cuda12.4.1-devel-ubuntu22.04"
    volume_gb: int = 50
    disk_gb: int = 40

    def __post_init__(self):
        if not 1 <= self.count <= 16:
            raise PodError(f"--count {self.count} is out of range", "give 1 to 16 GPUs per pod")
        if self.volume_gb < 0 or self.disk_gb < 1:
            raise PodError("--volume-gb must be >= 0 and --disk-gb >= 1")
        if not self.image or any(c.isspace() for c in self.image):
            raise PodError(f"image '{self.image}' is not an image reference", "e.g. runpod/pytorch:2.4.0-py3.11-cuda12.4.1-devel-ubuntu22.04")

    def to_input(self) -> dict:
        # startSsh/supportPublicIp as runpod-python's mutation sends them; 22/tcp so RunPod maps a public port to sshd.
        return {"name": self.name, "imageName": self.image, "gpuTypeId": self.gpu, "gpuCount": self.count,
                "cloudType": "ALL", "volumeInGb": self.volume_gb, "containerDiskInGb": self.disk_gb,
                "volumeMountPath": "/workspace", "ports": "22/tcp", "startSsh": True, "supportPublicIp": True}


class RunPodClient:
    def __init__(self, key: str, base_url: str | None = None, timeout: float = 30.0):
        self._key = key
        self.base_url = (base_url or os.environ.get(BASE_VAR) or DEFAULT_BASE).rstrip("/")
        self.timeout = timeout
        try:
            parts = urllib.parse.urlsplit(self.base_url)
            host = parts.hostname
        except ValueError:  # 'http://[::1': an unclosed IPv6 bracket
            parts, host = None, None
        if parts is None or parts.scheme not in ("http", "https") or not host:
            raise PodError(f"{BASE_VAR} {self.base_url!r} is not an http(s) URL", f"e.g. {DEFAULT_BASE}, or unset it")

    def _call(self, query: str, variables: dict | None = None) -> dict:
        endpoint = f"{self.base_url}/graphql"
        url = f"{endpoint}?{urllib.parse.urlencode({'api_key': self._key})}"
        body = json.dumps({"query": query, "variables": variables or {}}).encode()
        try:
            # In the try: urllib names the whole URL, key and all, in some of its errors; none is shown as is.
            req = urllib.request.Request(url, data=body, method="POST",
                                         headers={"Content-Type": "application/json", "User-Agent": "podkit"})
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                payload = json.loads(resp.read() or b"{}")
        except urllib.error.HTTPError as exc:
            if exc.code in (401, 403):
                raise PodError(f"RunPod refused the API key (HTTP {exc.code})",
                               f"check {KEY_VAR}: create a key at runpod.io > Settings > API Keys") from None
            raise PodError(f"RunPod API at {endpoint} answered HTTP {exc.code}", "try again in a minute") from None
        except (urllib.error.URLError, OSError, ValueError, http.client.HTTPException) as exc:
            reason = str(getattr(exc, "reason", exc) or type(exc).__name__).replace(self._key, "***")
            raise PodError(f"cannot reach the RunPod API at {endpoint}: {reason}",
                           f"check the network (or {BASE_VAR})") from None
        if payload.get("errors"):
            raise _api_error(str(payload["errors"][0].get("message", "unknown error")), variables)
        return payload.get("data") or {}

    def gpu_types(self) -> list[GpuType]:
        data = self._call("query GpuTypes { gpuTypes { id displayName memoryInGb securePrice communityPrice "
                          "lowestPrice(input: {gpuCount: 1}) { minimumBidPrice uninterruptablePrice } } }")
        out = []
        for g in data.get("gpuTypes") or []:
            price = (g.get("lowestPrice") or {}).get("uninterruptablePrice")
            out.append(GpuType(g["id"], g.get("displayName") or g["id"], int(g.get("memoryInGb") or 0),
                               float(price) if price is not None else None))
        return out

    def create(self, request: PodRequest) -> str:
        data = self._call("mutation Deploy($input: PodFindAndDeployOnDemandInput) { podFindAndDeployOnDemand(input: $input) "
                          "{ id imageName machineId machine { podHostId } } }", {"input": request.to_input()})
        pod = data.get("podFindAndDeployOnDemand")
        if not pod or not pod.get("id"):
            raise PodError(f"RunPod created no pod for {request.count}x {request.gpu}", "try again, or another GPU type (bin/pod gpus)")
        return pod["id"]

    def pod(self, pod_id: str) -> Pod | None:
        data = self._call(f"query Pod($input: PodFilter) {{ pod(input: $input) {{ {_POD_FIELDS} }} }}", {"input": {"podId": pod_id}})
        return Pod.from_api(data["pod"]) if data.get("pod") else None

    def pods(self) -> list[Pod]:
        data = self._call(f"query MyPods {{ myself {{ pods {{ {_POD_FIELDS} }} }} }}")
        return [Pod.from_api(p) for p in (data.get("myself") or {}).get("pods") or []]

    def stop(self, pod_id: str) -> None:
        self._call("mutation Stop($input: PodStopInput!) { podStop(input: $input) { id desiredStatus } }",
                   {"input": {"podId": pod_id}})

    def terminate(self, pod_id: str) -> None:
        self._call("mutation Terminate($input: PodTerminateInput!) { podTerminate(input: $input) }", {"input": {"podId": pod_id}})


def _api_error(message: str, variables: dict | None) -> PodError:
    gpu = ((variables or {}).get("input") or {}).get("gpuTypeId")
    if gpu and any(s in message.lower() for s in _OUT_OF_STOCK):
        return PodError(f"no {gpu} is free to rent right now (RunPod: {message})",
                        "try another GPU type or count (bin/pod gpus lists prices), or later")
    return PodError(f"RunPod refused: {message}")
