"""A local stand-in for RunPod's GraphQL API on 127.0.0.1 (the real one cannot be reached from tests).

It answers the shapes RunPod documents and its SDK relies on, nothing more:
  - POST /graphql?api_key=KEY with {"query", "variables"}; a wrong key -> HTTP 401
    (runpod-python runpod/api/graphql.py raises AuthenticationError on 401).
  - faults as HTTP 200 {"errors": [{"message": ...}]} (same file: errors[0].message).
  - podFindAndDeployOnDemand(input) -> { id imageName machineId machine { podHostId } }
    (https://docs.runpod.io/sdks/graphql/manage-pods, runpod-python runpod/api/mutations/pods.py)
  - pod(input: {podId}) / myself { pods } -> id name desiredStatus costPerHr gpuCount
    runtime { uptimeInSeconds ports { ip isIpPublic privatePort publicPort type } } machine { gpuDisplayName }
    (runpod-python runpod/api/queries/pods.py); runtime is null until the container runs.
  - podStop -> { id desiredStatus: "EXITED" }; podTerminate -> null (runpod/api/mutations/pods.py)
  - restart(): a resumed or rebooted pod runs again behind a new public IP/port (RunPod assigns the
    public port of a TCP mapping, docs.runpod.io/pods/configuration/expose-ports; that it changes on
    a restart is issue 15 item 3's premise); `pod()` reports the new mapping.
  - gpuTypes -> id displayName memoryInGb securePrice communityPrice lowestPrice { minimumBidPrice
    uninterruptablePrice } (runpod-python runpod/api/queries/gpus.py); no free GPU -> a null price.
The out-of-stock message is the one RunPod's console and API return for podFindAndDeployOnDemand.

Which operation a request is: the root field named in the query text (the fake does not parse GraphQL).
"""

from __future__ import annotations

import json
import threading
import time
import urllib.parse
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

OUT_OF_STOCK = "There are no longer any instances available with the requested specifications. Please refresh and try again."

GPU_TYPES = [
    # id, displayName, memoryInGb, uninterruptablePrice (illustrative on-demand $/GPU-hour)
    ("NVIDIA GeForce RTX 4090", "RTX 4090", 24, 0.69),
    ("NVIDIA RTX A6000", "RTX A6000", 48, 0.49),
    ("NVIDIA A100 80GB PCIe", "A100 PCIe", 80, 1.64),
    ("NVIDIA H100 80GB HBM3", "H100 SXM", 80, 2.99),
    ("NVIDIA H200", "H200 SXM", 141, 3.99),
]


@dataclass
class FakeRunPod:
    key: str = "rp_test_key"
    ssh_host: str = "127.0.0.1"
    ssh_port: int = 22022
    start_polls: int = 0
    """pod() queries answered with runtime null before the pod runs (a pod that takes time to start)."""
    never_ready: bool = False
    flaky_polls: int = 0
    """pod() queries answered with an error before the real answers (a blip in the API)."""
    create_error: str | None = None
    """Message for podFindAndDeployOnDemand to fail with (a quota, a failed creation)."""
    create_reply_delay: float = 0.0
    """Seconds podFindAndDeployOnDemand waits, after making the pod, before it answers: a client that gives up on
    the reply (Ctrl-C, its timeout) has still made a pod (the server does not undo a mutation it ran)."""
    out_of_stock: set = field(default_factory=set)
    pods: dict = field(default_factory=dict)
    calls: list = field(default_factory=list)
    """(operation, variables) in arrival order; tests assert on them (e.g. the terminate)."""
    keys_seen: set = field(default_factory=set)

    def start(self) -> "FakeRunPod":
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 (http.server's name)
                query = urllib.parse.parse_qs(urllib.parse.urlparse(self.path).query)
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
                key = (query.get("api_key") or [""])[0]
                fake.keys_seen.add(key)
                if urllib.parse.urlparse(self.path).path != "/graphql":
                    return self._send(404, {"errors": [{"message": "not found"}]})
                if key != fake.key:
                    return self._send(401, {"errors": [{"message": "Unauthorized"}]})
                self._send(200, fake.answer(body.get("query", ""), body.get("variables") or {}))

            def _send(self, code, payload):
                data = json.dumps(payload).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):  # keep the test output clean
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def restart(self, pod_id: str, port: int, host: str | None = None) -> None:
        """What a stop and resume (or a host reboot) does to a RunPod pod: running again, with its
        sshd behind a new public port (and maybe IP); runtime null until the next pod() query maps it."""
        pod = self.pods[pod_id]
        pod.update(desiredStatus="RUNNING", runtime=None, _ssh=(host or self.ssh_host, port))

    def ops(self, name: str) -> list[dict]:
        return [v for op, v in self.calls if op == name]

    # ------------------------------------------------------------ operations
    def answer(self, query: str, variables: dict) -> dict:
        for op in ("podFindAndDeployOnDemand", "podStop", "podTerminate", "gpuTypes", "myself", "pod"):
            if f"{op}(" in query or f"{op} " in query or f"{op}{{" in query:
                self.calls.append((op, variables))
                return getattr(self, f"_{op}")(variables)
        return {"errors": [{"message": f"unknown operation in {query[:60]!r}"}]}

    def _gpuTypes(self, _):  # noqa: N802
        return {"data": {"gpuTypes": [
            {"id": i, "displayName": d, "memoryInGb": m, "securePrice": p, "communityPrice": p,
             "lowestPrice": {"minimumBidPrice": None if i in self.out_of_stock else round(p / 2, 2),
                             "uninterruptablePrice": None if i in self.out_of_stock else p}}
            for i, d, m, p in GPU_TYPES]}}

    def _podFindAndDeployOnDemand(self, variables):  # noqa: N802
        inp = variables.get("input") or {}
        if self.create_error:
            return {"errors": [{"message": self.create_error}], "data": {"podFindAndDeployOnDemand": None}}
        gpu = next((g for g in GPU_TYPES if g[0] == inp.get("gpuTypeId")), None)
        if gpu is None:
            return {"errors": [{"message": "Something went wrong. Please try again later or contact support."}]}
        if gpu[0] in self.out_of_stock:
            return {"errors": [{"message": OUT_OF_STOCK}], "data": {"podFindAndDeployOnDemand": None}}
        pod_id = f"fake{len(self.pods) + 1:04d}xyz"
        self.pods[pod_id] = {"id": pod_id, "name": inp.get("name"), "desiredStatus": "RUNNING",
                             "costPerHr": round(gpu[3] * inp.get("gpuCount", 1), 2), "gpuCount": inp.get("gpuCount", 1),
                             "imageName": inp.get("imageName"), "volumeInGb": inp.get("volumeInGb"),
                             "containerDiskInGb": inp.get("containerDiskInGb"), "ports": inp.get("ports"),
                             "runtime": None, "machine": {"gpuDisplayName": gpu[1]}, "_polls": 0}
        if self.create_reply_delay:
            time.sleep(self.create_reply_delay)
        return {"data": {"podFindAndDeployOnDemand": {"id": pod_id, "imageName": inp.get("imageName"),
                                                      "machineId": "m1", "machine": {"podHostId": f"{pod_id}-64410f"}}}}

    def _view(self, pod: dict) -> dict:
        return {k: v for k, v in pod.items() if not k.startswith("_")}

    def _pod(self, variables):
        if self.flaky_polls > 0:
            self.flaky_polls -= 1
            return {"errors": [{"message": "Something went wrong. Please try again later or contact support."}]}
        pod = self.pods.get((variables.get("input") or {}).get("podId"))
        if pod is None:
            return {"data": {"pod": None}}
        pod["_polls"] += 1
        running = pod["desiredStatus"] == "RUNNING" and not self.never_ready and pod["_polls"] > self.start_polls
        if running and "22/tcp" in (pod.get("ports") or ""):
            host, port = pod.get("_ssh") or (self.ssh_host, self.ssh_port)
            pod["runtime"] = {"uptimeInSeconds": 1, "ports": [
                {"ip": "10.0.0.5", "isIpPublic": False, "privatePort": 22, "publicPort": 22, "type": "tcp"},
                {"ip": host, "isIpPublic": True, "privatePort": 22, "publicPort": port, "type": "tcp"}]}
        return {"data": {"pod": self._view(pod)}}

    def _myself(self, _):
        return {"data": {"myself": {"pods": [self._view(p) for p in self.pods.values()]}}}

    def _podStop(self, variables):  # noqa: N802
        pod = self.pods.get((variables.get("input") or {}).get("podId"))
        if pod is None:
            return {"errors": [{"message": "Pod not found"}]}
        pod.update(desiredStatus="EXITED", runtime=None)
        return {"data": {"podStop": {"id": pod["id"], "desiredStatus": "EXITED"}}}

    def _podTerminate(self, variables):  # noqa: N802
        if self.pods.pop((variables.get("input") or {}).get("podId"), None) is None:
            return {"errors": [{"message": "Pod not found"}]}
        return {"data": {"podTerminate": None}}
