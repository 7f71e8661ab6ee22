"""Bring a RunPod pod up (and wait for its SSH port), take it down, and keep pods.toml in step.

A pod that never gets ready before the deadline, or whose wait is interrupted, is terminated
before the error is raised: podkit never leaves a pod billing that `bin/pod ls` would not show.
"""

from __future__ import annotations

import difflib
import fcntl
import json
import math
import re
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

from podkit.pods.errors import PodError
from podkit.pods.hosts import HostSpec, load_inventory
from podkit.pods.runpod import GpuType, Pod, PodRequest, RunPodClient, api_key

PROVIDER = "runpod"
# A pods.toml table key as `record` writes it, bare: a '.' would make [pods.my.pod] a nested table.
_NAME = re.compile(r"^[A-Za-z0-9_-]+$")


@dataclass(frozen=True)
class Wait:
    deadline_s: float = 600.0
    """RunPod pulls the image on first start; multi-GB CUDA images take minutes."""
    poll_s: float = 5.0

    def __post_init__(self):
        if not (0 < self.deadline_s < math.inf and 0 < self.poll_s < math.inf):  # NaN too: it never times out
            raise PodError("--deadline and --poll must be positive seconds")


@dataclass
class Made:
    """What an `up` has made so far, kept up to date as it goes: what it says, in `up --json`'s object, when it is
    stopped part way (Ctrl-C, SIGTERM, a closed terminal)."""
    pod_id: str | None = None
    status: str | None = None
    """RunPod's desiredStatus as `up` left the pod (RUNNING, EXITED, TERMINATED); None: no pod, or not known."""
    billing: bool | None = False
    """The pod runs, billing by the hour; None: that cannot be told (a create cut short, its pod not found yet)."""
    inventory_name: str | None = None
    said: bool = False
    """What it leaves was said on stderr already."""

    def created(self, pod_id: str) -> None:
        self.pod_id, self.status, self.billing = pod_id, "RUNNING", True

    def terminated(self, gone: bool) -> None:
        """After _terminate_quietly: gone, or still there (and billing)."""
        self.status, self.billing = ("TERMINATED", False) if gone else (self.status, True)


def resolve_gpu(gpu: str, offered: list[GpuType]) -> GpuType:
    """The offered type named by id or display name (case-insensitive); else one line naming the closest."""
    for g in offered:
        if gpu.lower() in (g.id.lower(), g.display_name.lower()):
            return g
    names = {n.lower(): g.id for g in offered for n in (g.id, g.display_name)}
    close = difflib.get_close_matches(gpu.lower(), list(names), n=1, cutoff=0.3)
    hint = f"did you mean '{names[close[0]]}'? (bin/pod gpus lists them)" if close else "bin/pod gpus lists them"
    raise PodError(f"unknown GPU type '{gpu}'", hint)


# After a create cut short (Ctrl-C, a reply past the client's timeout), RunPod may still make the pod: how long
# to look for it by its name before saying it may exist.
CREATE_SETTLE_S = 20.0


def _create(client: RunPodClient, request: PodRequest, say: Callable[[str], None], made: Made | None = None) -> str:
    """client.create, but a create cut short after the request left (Ctrl-C, no reply in time) does not leave a
    pod billing unrecorded: the pods of that name RunPod lists afterwards that were not there before are this
    request's, and are terminated."""
    made = made if made is not None else Made()
    before = {p.id for p in client.pods() if p.name == request.name}
    try:
        pod_id = client.create(request)
        made.created(pod_id)
        return pod_id
    except (KeyboardInterrupt, PodError) as exc:
        if isinstance(exc, PodError) and not _maybe_made(exc):
            raise  # RunPod answered: it refused, and made nothing
        say = quiet_on_hangup(say)  # after SIGHUP the terminal is gone: the check must still run
        say(f"pod up: the create was cut short; checking whether RunPod made pod '{request.name}' anyway "
            f"(up to {CREATE_SETTLE_S:.0f}s; Ctrl-C again to stop checking)")
        found = _settle(client, request.name, before)
        made.billing = None  # unless the one pod it made is found, and terminated
        if found is not None and len(found) == 1:  # this request makes one pod
            made.created(found[0])
            made.terminated(_terminate_quietly(client, found[0], say))
        elif found:  # more than one new pod of that name: another `up` of the same name runs too
            say(f"pod up: RunPod lists {len(found)} new pods named '{request.name}' ({', '.join(found)}): another "
                "bin/pod up of that name may own one; terminate the one it did not record at runpod.io/console/pods")
        else:
            say(f"pod up: {'none appeared yet' if found == [] else 'stopped checking'}; if bin/pod ls later shows a "
                f"pod '{request.name}' not podkit's, terminate it at runpod.io/console/pods (it bills)")
        raise


def _maybe_made(exc: PodError) -> bool:
    """A create that failed after its request may have reached RunPod: no answer, or a gateway's instead of
    RunPod's (502/503/504/524 come from the proxies in front of it, which cut a reply short)."""
    return exc.problem.startswith("cannot reach the RunPod API") or any(
        f"answered HTTP {code}" in exc.problem for code in (502, 503, 504, 524))


def quiet_on_hangup(say: Callable[[str], None]) -> Callable[[str], None]:
    def safe(line: str) -> None:
        try:
            say(line)
        except OSError:  # EIO: the terminal hung up
            pass
    return safe


def _settle(client: RunPodClient, name: str, before: set[str]) -> list[str] | None:
    """Ids of the pods named `name` that appear within CREATE_SETTLE_S and were not in `before`; None when
    the check itself was interrupted or failed."""
    deadline = time.monotonic() + CREATE_SETTLE_S
    try:
        while True:
            new = [p.id for p in client.pods() if p.name == name and p.id not in before]
            if new or time.monotonic() >= deadline:
                return new
            time.sleep(2.0)
    except (KeyboardInterrupt, PodError):
        return None


def up(client: RunPodClient, request: PodRequest, wait: Wait, say: Callable[[str], None],
       made: Made | None = None) -> Pod:
    """Create the pod and wait until RunPod reports it RUNNING with a public port for sshd. `made` follows what
    there is (the pod, terminated or not), for a caller stopped part way."""
    made = made if made is not None else Made()
    pod_id = _create(client, request, say, made)
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
        made.terminated(_terminate_quietly(client, pod_id, say))
        raise
    gone = _terminate_quietly(client, pod_id, say)
    made.terminated(gone)
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
        raise PodError(f"pod name '{name}' may use only letters, digits, '_' and '-'", "e.g. --name a100-run1")
    if name in load_inventory(inventory if inventory.exists() else None).pods:
        raise PodError(f"{inventory} already has a pod named '{name}'", "choose another --name")


def record(pod: Pod, name: str, inventory: Path, client: RunPodClient, say: Callable[[str], None],
           key: str | None = None, remote_dir: str | None = None, made: Made | None = None) -> str:
    """Append [pods.NAME] with the SSH line RunPod mapped, the pod id and provider (so `down` finds it).
    Appended, never rewritten: the rest of the file is the user's. Returns the name recorded: NAME, or NAME-2,
    NAME-3... when another `bin/pod up` recorded NAME while this one waited (its pod bills too: both are kept,
    each findable)."""
    made = made if made is not None else Made()
    written = False
    try:
        with inventory.open("a") as f:
            # pods.toml itself is the lock (flock, released when closed): two `bin/pod up` at once each see the
            # other's name before writing theirs.
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                taken = set(load_inventory(inventory).pods) if inventory.stat().st_size else set()
            except PodError:  # a pods.toml the user broke by hand: appended to as before, its names unread
                taken = set()
            final = next(n for n in (name, *(f"{name}-{i}" for i in range(2, 1000))) if n not in taken)
            f.write(_block(pod, final, key, remote_dir))
            written = True
            made.inventory_name = final
    except OSError as exc:  # an unrecorded pod is one `down` cannot find: do not leave it billing
        if written:
            raise
        made.terminated(_terminate_quietly(client, pod.id, quiet_on_hangup(say)))
        raise PodError(f"cannot record the pod in {inventory} ({exc.strerror}); terminated it", "fix the path or --inventory") from None
    except BaseException:  # stopped while waiting for the lock: it would bill unrecorded
        if not written:
            made.terminated(_terminate_quietly(client, pod.id, quiet_on_hangup(say)))
        raise
    if final != name:
        say(f"pod up: '{name}' was recorded by another bin/pod up meanwhile; this pod is '{final}'")
    return final


def _block(pod: Pod, name: str, key: str | None, remote_dir: str | None) -> str:
    return (f"\n[pods.{name}]  # bin/pod up\n"
             f"host = {json.dumps(f'root@{pod.ssh_host}:{pod.ssh_port}')}\n"
             f'profile = "runpod"\nprovider = "{PROVIDER}"\npod_id = {json.dumps(pod.id)}\n'
             + (f"key = {json.dumps(key)}\n" if key else "")
             + (f"remote_dir = {json.dumps(remote_dir)}\n" if remote_dir else ""))


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


_INVENTORY_WRITE = threading.Lock()  # a parallel deploy can find two moved pods at once


def set_host(name: str, inventory: Path, host: str) -> None:
    """Rewrite the `host = ...` line of [pods.NAME] (the pod moved); every other line is kept as it was."""
    with _INVENTORY_WRITE:
        _set_host(name, inventory, host)


def _set_host(name: str, inventory: Path, host: str) -> None:
    out, inside, done = [], False, False
    for line in inventory.read_text().splitlines(keepends=True):
        stripped = line.strip()
        if stripped.startswith("["):
            inside = re.match(rf"^\[pods\.{re.escape(name)}\](\s*#.*)?$", stripped) is not None
        elif inside and not done and re.match(r"^host\s*=", stripped):
            line, done = f"host = {json.dumps(host)}\n", True
        out.append(line)
    if not done:
        raise PodError(f"{inventory} has no host line for [pods.{name}]", "fix pods.toml")
    tmp = inventory.with_name(inventory.name + ".tmp")
    tmp.write_text("".join(out))
    tmp.replace(inventory)  # never a half-written pods.toml


def relocate(spec: HostSpec, unreachable: PodError, say: Callable[[str], None]) -> HostSpec:
    """A pod `bin/pod up` recorded did not answer: ask RunPod where its sshd is now (a restart maps a
    new public IP and port), update pods.toml, and return the spec to retry once. Raises one PodError
    saying why not (no key, stopped, gone) or, when the address is unchanged, `unreachable` itself."""
    if not spec.pod_id or not spec.inventory:
        raise unreachable
    try:
        pod = RunPodClient(api_key()).pod(spec.pod_id)
    except PodError as exc:
        raise PodError(f"{unreachable.problem}; could not ask RunPod where pod {spec.pod_id} went: {exc.problem}",
                       exc.fix or unreachable.fix) from None
    if pod is None:
        raise PodError(f"{unreachable.problem}; RunPod has no pod {spec.pod_id} any more (terminated?)",
                       f"bin/pod ls lists the account's pods; remove [pods.{spec.name}] from {spec.inventory}")
    if pod.status != "RUNNING":
        raise PodError(f"pod {spec.name} ({spec.pod_id}) is {pod.status} on RunPod, not running",
                       "resume it in the RunPod console (a resumed pod gets a new port; podkit finds it), then re-run")
    if not pod.ready:
        raise PodError(f"pod {spec.name} ({spec.pod_id}) is starting: RunPod has not mapped its SSH port yet",
                       "re-run in a minute")
    if (pod.ssh_host, pod.ssh_port) == (spec.host, spec.port):
        raise unreachable
    host = f"{spec.user or 'root'}@{pod.ssh_host}:{pod.ssh_port}"
    set_host(spec.name, Path(spec.inventory), host)
    say(f"{spec.name}: moved from {spec.host}:{spec.port} to {pod.ssh_host}:{pod.ssh_port} (RunPod re-mapped it after a "
        f"restart); updated {spec.inventory}")
    return replace(spec, host=pod.ssh_host, port=pod.ssh_port)
