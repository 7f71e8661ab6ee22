"""The cost guard from the laptop's side: arm, read and cancel the watchdog (pods/guard.py) on a pod.

The watchdog lives in <project>/.podkit/guard/ on the pod: guard.py (sent over the connection's
stdin), settings.json (what it waits for), pid, state.json (what it did) and guard.log. It runs
under setsid/nohup with PODKIT_GUARD=<pod id> in its environment instead of the invocation's
PODKIT_SESSION, so a Ctrl-C on the laptop never stops it; `cancel` does, and `status` (shown by
`bin/pod ls`) says whether it is alive. It only ever stops the pod whose RUNPOD_POD_ID is the one
pods.toml recorded.
"""

from __future__ import annotations

import json
import math
import re
import shlex
import time
from dataclasses import dataclass
from pathlib import Path

from podkit.pods.connection import PodConnection
from podkit.pods.errors import PodError

GUARD_DIR = ".podkit/guard"
_SOURCE = Path(__file__).with_name("guard.py")


@dataclass(frozen=True)
class GuardPlan:
    """What stops the pod; any condition set, the first one met wins."""

    after_smoke: bool = False
    """Stop when the first bin/smoke run started after arming has a final summary."""
    stop_after_h: float | None = None
    """Stop this many hours after arming (the pod's clock)."""
    idle_min: float | None = None
    """Stop when no podkit job (bin/pod run) has run for this many minutes."""

    def __post_init__(self):
        for flag, value, unit in (("--stop-after", self.stop_after_h, "HOURS"), ("--idle-stop", self.idle_min, "MINUTES")):
            if value is not None and (not math.isfinite(value) or value <= 0):
                raise PodError(f"{flag} {value:g} is not a positive number of {unit.lower()}", f"give {flag} {unit}, e.g. {flag} 2")
        if self.stop_after_h is not None and self.stop_after_h > 24 * 90:
            raise PodError(f"--stop-after {self.stop_after_h:g} hours is over 90 days", "give a shorter time")
        if self.idle_min is not None and self.idle_min > 60 * 24 * 90:  # 1e308 minutes became Infinity in --json
            raise PodError(f"--idle-stop {self.idle_min:g} minutes is over 90 days", "give a shorter time")
        if not self.armed:
            raise PodError("no guard condition given", "give --stop-after-smoke, --stop-after HOURS or --idle-stop MINUTES")

    @property
    def armed(self) -> bool:
        return self.after_smoke or self.stop_after_h is not None or self.idle_min is not None

    def describe(self) -> str:
        parts = (["after-smoke"] if self.after_smoke else []) + \
                ([f"stop-after {self.stop_after_h:g} h"] if self.stop_after_h is not None else []) + \
                ([f"idle-stop {self.idle_min:g} min"] if self.idle_min is not None else [])
        return ", ".join(parts)

    def settings(self, pod_id: str, project: str) -> dict:
        # The deadline is fixed on the pod's clock when the watchdog starts (stop_after_s), so a
        # laptop whose clock is off cannot move it.
        return {"pod_id": pod_id, "project": project, "after_smoke": self.after_smoke,
                "stop_after_s": self.stop_after_h * 3600 if self.stop_after_h is not None else None,
                "idle_s": self.idle_min * 60 if self.idle_min is not None else None, "describe": self.describe()}


def plan_from_options(after_smoke: bool, stop_after_h: float | None, idle_min: float | None) -> GuardPlan | None:
    if not (after_smoke or stop_after_h is not None or idle_min is not None):
        return None
    return GuardPlan(after_smoke, stop_after_h, idle_min)


# A guard is ours when its pid is alive and runs this guard.py (a reused pid is someone else's).
_ALIVE = r'''pid=$(cat "$d/pid" 2>/dev/null); alive=0
if [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null && tr '\0' '\n' < /proc/$pid/cmdline 2>/dev/null | grep -qxF "$d/guard.py"; then alive=1; fi
'''
_CANCEL = _ALIVE + r'''if [ $alive = 1 ]; then kill -TERM "$pid"; i=0
  while kill -0 "$pid" 2>/dev/null && [ $i -lt 50 ]; do sleep 0.1; i=$((i+1)); done
  kill -KILL "$pid" 2>/dev/null; echo cancelled; else echo none; fi
rm -f "$d/pid"
'''


def _dir(remote_dir: str) -> str:
    return shlex.quote(f"{remote_dir}/{GUARD_DIR}")


def install(conn: PodConnection, remote_dir: str, plan: GuardPlan, pod_id: str, python: str | None) -> dict:
    """Start (or replace) the watchdog; returns its status. One PodError when it cannot stop this pod."""
    settings = json.dumps(plan.settings(pod_id, remote_dir))
    py = shlex.quote(python or "python3")
    script = (
        f"d={_dir(remote_dir)}\n"
        f"[ \"${{RUNPOD_POD_ID:-}}\" = {shlex.quote(pod_id)} ] || {{ echo \"podid:${{RUNPOD_POD_ID:-}}\"; exit 4; }}\n"
        "[ -n \"${RUNPOD_API_KEY:-}\" ] || command -v runpodctl >/dev/null 2>&1 || { echo nokey; exit 5; }\n"
        "mkdir -p \"$d\" && chmod 700 \"$d\" || exit 3\n"
        + _CANCEL +
        "cat > \"$d/guard.py.tmp\" && mv \"$d/guard.py.tmp\" \"$d/guard.py\" || exit 3\n"
        f"printf '%s\\n' {shlex.quote(settings)} > \"$d/settings.json\" && rm -f \"$d/state.json\"\n"
        # setsid: out of the SSH session (its hangup never reaches it); PODKIT_SESSION and PODKIT_SHELL dropped
        # so the laptop's Ctrl-C cleanup and a later command's timeout spare it (pods/connection.py); PODKIT_GUARD
        # tags it. The key stays in the environment.
        f"env -u PODKIT_SESSION -u PODKIT_SHELL PODKIT_GUARD={shlex.quote(pod_id)} setsid nohup {py} \"$d/guard.py\" \"$d\" "
        ">> \"$d/guard.log\" 2>&1 < /dev/null &\n"
        "echo $! > \"$d/pid\"\n"
        # up to 5 s for its first state line: a guard that dies at once is reported now, not at the deadline
        "i=0; while [ ! -s \"$d/state.json\" ] && kill -0 $(cat \"$d/pid\") 2>/dev/null && [ $i -lt 50 ]; do sleep 0.1; i=$((i+1)); done\n"
        "kill -0 $(cat \"$d/pid\") 2>/dev/null || { echo dead; tail -n 3 \"$d/guard.log\"; exit 6; }\n"
    )
    result = conn.run(script, stdin=_SOURCE.read_text())
    out = result.stdout.strip().splitlines()
    if result.exit_code == 4:
        found = out[-1].split(":", 1)[1] if out and out[-1].startswith("podid:") else ""
        raise PodError(f"this pod's RUNPOD_POD_ID is {found!r}, not {pod_id!r} as pods.toml records; no guard armed",
                       "a guard stops only the pod bin/pod up recorded: check pods.toml's host for this name")
    if result.exit_code == 5:
        raise PodError("the pod cannot stop itself: no RUNPOD_API_KEY in its environment and no runpodctl; no guard armed",
                       "RunPod sets both on its pods; on another image stop it with: bin/pod down NAME")
    if result.exit_code != 0:
        detail = (result.stderr or result.stdout).strip().splitlines()
        raise PodError(f"the guard did not start on the pod: {detail[-1] if detail else result.exit_code}",
                       f"see {remote_dir}/{GUARD_DIR}/guard.log on the pod")
    return status(conn, remote_dir)


def cancel(conn: PodConnection, remote_dir: str) -> bool:
    """Stop the watchdog (its state says 'off'); False when none was running."""
    script = f"d={_dir(remote_dir)}\n[ -d \"$d\" ] || {{ echo none; exit 0; }}\n" + _CANCEL  # its SIGTERM handler writes "off"
    result = conn.run(script, check=True)
    return "cancelled" in result.stdout


def status(conn: PodConnection, remote_dir: str) -> dict | None:
    """The guard as the pod sees it, or None when none was ever armed there."""
    script = (f"d={_dir(remote_dir)}\n[ -r \"$d/settings.json\" ] || {{ echo none; exit 0; }}\n" + _ALIVE +
              "echo \"$alive ${pid:-0}\"; head -c 4096 \"$d/settings.json\" | tr -d '\\n'; echo\n"
              "head -c 4096 \"$d/state.json\" 2>/dev/null | tr -d '\\n'; echo\n")  # one JSON object a line
    lines = conn.run(script, check=True).stdout.splitlines()
    if not lines or lines[0].strip() == "none":
        return None
    alive, _, pid = lines[0].partition(" ")
    try:
        settings = json.loads(lines[1])
        state = json.loads(lines[2]) if len(lines) > 2 and lines[2].strip() else {}
    except (ValueError, IndexError):
        return {"conditions": "?", "alive": alive == "1", "status": "unreadable"}
    return to_view(settings, state, alive == "1")


def to_view(settings: dict, state: dict, alive: bool) -> dict:
    deadline = state.get("deadline")
    kinds = [k for k, on in (("after-smoke", settings.get("after_smoke")), ("stop-after", settings.get("stop_after_s")),
                             ("idle-stop", settings.get("idle_s"))) if on]
    return {"kinds": kinds, "conditions": settings.get("describe", ""), "after_smoke": bool(settings.get("after_smoke")),
            "deadline": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(deadline)) if deadline else None,
            "idle_minutes": settings["idle_s"] / 60 if settings.get("idle_s") else None,
            "alive": alive, "status": state.get("status", "starting" if alive else "dead"),
            "reason": state.get("reason"), "how": state.get("how"), "error": state.get("error")}


def line(view: dict | None) -> str:
    """One cell for `bin/pod ls`: what it waits for and whether the watchdog is alive."""
    if view is None:
        return "guard: none"
    if "unknown" in view:
        return f"guard: ? ({view['unknown']})"
    conditions = view["conditions"]
    if view.get("deadline"):
        conditions = re.sub(r"(stop-after [^,]+ h)", rf"\1 (by {view['deadline'][11:16]}Z)", conditions)
    state = "alive" if view["alive"] else "NOT running"
    if view["status"] == "off":
        return f"guard: off (was {view['conditions']})"
    if view["status"] in ("fired", "refused", "stop-failing"):
        state += f", {view['status']}" + (f": {view['reason']}" if view.get("reason") and view["status"] != "off" else "")
    return f"guard: {conditions} ({state})"
