"""Bring a RunPod pod up (and wait for its SSH port), take it down, and keep pods.toml in step.

A pod that never gets ready before the deadline, or whose wait is interrupted, is terminated
before the error is raised: podkit never leaves a pod billing that `bin/pod ls` would not show.
"""

from __future__ import annotations

import difflib
import json
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from podkit.pods.errors import PodError
from podkit.pods.hosts import load_inventory
from podkit.pods.runpod import GpuType, Pod, PodRequest, RunPodClient

PROVIDER = "runpod"
_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")


@dataclass(frozen=True)
class Wait:
    deadline_s: float = 600.0
    """RunPod pulls the image on first start; multi-GB CUDA images take minutes."""
    poll_s: float = 5.0

    def __post_init__(self):
        if self.deadline_s <= 0 or self.poll_s <= 0:
            raise PodError("--deadline and --poll must be positive seconds")


def resolve_gpu(gpu: str, offered: list[GpuType]) -> GpuType:
    """The offered type named by id or display name (case-insensitive); else one line naming the closest."""
    for g in offered:
        if gpu.lower() in (g.id.lower(), g.display_name.lower()):
            return g
    names = {n.lower(): g.id for g in offered for n in (g.id, g.display_name)}
    close = difflib.get_close_matches(gpu.lower(), list(names), n=1, cutoff=0.3)
    hint = f"did you mean '{names[close[0]]}'? (bin/pod gpus lists them)" if close else "bin/pod gpus lists them"
    raise PodError(f"unknown GPU type '{gpu}'", hint)


def up(client: RunPodClient, request: PodRequest, wait: Wait, say: Callable[[str], None]) -> Pod:
    """Create the pod and wait until RunPod reports it RUNNING with a public port for sshd."""
    pod_id = client.create(request)
    say(f"pod up: created {pod_id} ({request.count}x {request.gpu}); waiting up to {wait.deadline_s:.0f}s for SSH")
    start = time.monotonic()
    try:
        while True:
            try:
                pod = client.pod(pod_id)
                state = "not listed yet" if pod is None else (
                    "container starting, no SSH port mapped yet" if pod.status == "RUNNING" else pod.status)
            except PodError as exc:  # a blip in the API is no reason to kill a pod that is starting
                pod, state = None, f"API: {exc}"
            if pod is not None and pod.ready:
                return pod
            elapsed = time.monotonic() - start
            if elapsed >= wait.deadline_s:
                break
            say(f"pod up: waiting ({state}), {elapsed:.0f}s")
            time.sleep(min(wait.poll_s, max(0.0, wait.deadline_s - elapsed)))
    except BaseException:  # Ctrl-C mid-wait: do not leave it billing
        _terminate_quietly(client, pod_id, say)
        raise
    gone = _terminate_quietly(client, pod_id, say)
    raise PodError(f"pod {pod_id} was not ready within {wait.deadline_s:.0f}s; "
                   + ("terminated it (nothing left billing)" if gone else "terminating it FAILED: it may still bill"),
                   "try again, another GPU type, or a longer --deadline" if gone else "terminate it at runpod.io/console/pods")


def _terminate_quietly(client: RunPodClient, pod_id: str, say: Callable[[str], None]) -> bool:
    try:
        client.terminate(pod_id)
        say(f"pod up: terminated {pod_id}")
        return True
    except PodError as exc:
        say(f"pod up: could not terminate {pod_id} ({exc}); terminate it at runpod.io/console/pods")
        return False


# ---------------------------------------------------------------- the inventory (pods.toml)

def check_new_name(name: str, inventory: Path) -> None:
    if not _NAME.match(name):
        raise PodError(f"pod name '{name}' may use only letters, digits, '.', '_' and '-'")
    if name in load_inventory(inventory if inventory.exists() else None).pods:
        raise PodError(f"{inventory} already has a pod named '{name}'", "choose another --name")


def record(pod: Pod, name: str, inventory: Path, client: RunPodClient, say: Callable[[str], None],
           key: str | None = None) -> None:
    """Append [pods.NAME] with the SSH line RunPod mapped, the pod id and provider (so `down` finds it).
    Appended, never rewritten: the rest of the file is the user's."""
    block = (f"\n[pods.{name}]  # bin/pod up\n"
             f"host = {json.dumps(f'root@{pod.ssh_host}:{pod.ssh_port}')}\n"
             f'profile = "runpod"\nprovider = "{PROVIDER}"\npod_id = {json.dumps(pod.id)}\n'
             + (f"key = {json.dumps(key)}\n" if key else ""))
    try:
        with inventory.open("a") as f:
            f.write(block)
    except OSError as exc:  # an unrecorded pod is one `down` cannot find: do not leave it billing
        _terminate_quietly(client, pod.id, say)
        raise PodError(f"cannot record the pod in {inventory} ({exc.strerror}); terminated it", "fix the path or --inventory") from None


def recorded(name: str, inventory: Path) -> str:
    """The pod id podkit recorded for NAME; a pod not brought up by podkit is refused."""
    entry = load_inventory(inventory).raw_pods.get(name) if inventory.exists() else None
    if entry is None:
        raise PodError(f"no pod named '{name}' in {inventory}", "bin/pod ls lists the pods podkit brought up")
    if entry.get("provider") != PROVIDER or not entry.get("pod_id"):
        raise PodError(f"pod '{name}' was not brought up by bin/pod up (no provider/pod_id)", "stop it in the RunPod console")
    return entry["pod_id"]


def forget(name: str, inventory: Path) -> None:
    """Remove the [pods.NAME] block that `record` wrote (only that block; other lines are kept)."""
    lines = inventory.read_text().splitlines(keepends=True)
    out, skipping = [], False
    for line in lines:
        stripped = line.strip()
        if stripped.startswith("["):
            skipping = re.match(rf"^\[pods\.{re.escape(name)}\](\s*#.*)?$", stripped) is not None
        if not skipping:
            out.append(line)
    while out and out[-1].strip() == "":
        out.pop()
    inventory.write_text("".join(out) + ("\n" if out else ""))


def inventory_ids(inventory: Path) -> dict[str, str]:
    """pod id -> inventory name, for the pods podkit brought up."""
    if not inventory.exists():
        return {}
    return {e["pod_id"]: n for n, e in load_inventory(inventory).raw_pods.items()
            if e.get("provider") == PROVIDER and e.get("pod_id")}
