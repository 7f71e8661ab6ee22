"""The cost guard's watchdog: runs ON the pod and stops it through RunPod when its condition is met.

Standard library only (it runs under whatever python3 the pod's image has, before any deploy), so
it is sent to the pod as this one file (`pods/cost_guard.py` writes it into
<project>/.podkit/guard/ and starts it detached with setsid/nohup). It holds when the laptop is
closed: nothing on the laptop takes part once it runs.

    python3 guard.py DIR        DIR holds settings.json (written by the laptop); the watchdog
                                writes pid, state.json and guard.log there.

Conditions (any that is set; the first one met stops the pod):
  deadline      an absolute time (`bin/pod up --stop-after HOURS`)
  after_smoke   a bin/smoke run started after the guard (runs/<id>/summary.json) has a final
                status, anything but "running" (train/smoke.py writes "running" first)
  idle_s        no podkit job (logs/jobs/<id>/: a live pid and no exit_code, pods/jobs.py) for
                that many seconds

How a pod stops itself (RunPod's docs): every pod has RUNPOD_POD_ID in its environment and comes
with runpodctl "installed with a Pod-scoped API key" (docs.runpod.io/runpodctl/reference/runpodctl);
"runpodctl stop pod $RUNPOD_POD_ID" stops it (docs.runpod.io/docs/create-pod, "Stop a Pod after a
specific time"). The watchdog first sends the documented GraphQL podStop mutation
(docs.runpod.io/sdks/graphql/manage-pods) with that key (RUNPOD_API_KEY, read from its own
environment or PID 1's, never from argv) to RUNPOD_API_BASE_URL (default https://api.runpod.io,
the variable RunPod's SDK reads), and falls back to runpodctl when that fails.
"""

from __future__ import annotations

import glob
import http.client
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request

KEY_VAR, POD_VAR, BASE_VAR = "RUNPOD_API_KEY", "RUNPOD_POD_ID", "RUNPOD_API_BASE_URL"
FINAL_WAIT_S = 30.0  # the longest pause between checks: a guard of hours needs no finer clock
RUNPODCTL_TIMEOUT_S = 120.0  # runpodctl's own HTTP client may wait on a dead network for good


def log(d: str, line: str) -> None:
    with open(os.path.join(d, "guard.log"), "a") as f:
        f.write(time.strftime("%Y-%m-%dT%H:%M:%SZ ", time.gmtime()) + line + "\n")


def write_state(d: str, **fields) -> None:
    path = os.path.join(d, "state.json")
    try:
        with open(path) as f:
            state = json.load(f)
    except (OSError, ValueError):
        state = {}
    state.update(fields)
    with open(path + ".tmp", "w") as f:
        json.dump(state, f)
    os.replace(path + ".tmp", path)  # `bin/pod ls` reads it at any moment: never half-written


def pid1_env(name: str) -> str:
    """RunPod passes the pod's variables to PID 1 only (pods/profiles.py reads them the same way)."""
    try:
        with open("/proc/1/environ", "rb") as f:
            for kv in f.read().split(b"\0"):
                k, _, v = kv.decode(errors="replace").partition("=")
                if k == name:
                    return v
    except OSError:
        pass
    return ""


def env(name: str) -> str:
    return os.environ.get(name, "") or pid1_env(name)


# ---------------------------------------------------------------- conditions

def job_running(project: str) -> bool:
    """A podkit job is running: its wrapper's pid is alive, still that job's (PODKIT_JOB_ID=<id> in its environment:
    after a restart the pid file may name any other process), and it has no exit code yet (pods/jobs.py)."""
    for d in glob.glob(os.path.join(project, "logs", "jobs", "*", "")):
        if os.path.exists(os.path.join(d, "exit_code")):
            continue
        tag = f"PODKIT_JOB_ID={os.path.basename(os.path.dirname(d))}".encode()
        try:
            with open(os.path.join(d, "pid")) as f:
                pid = int(f.read().strip())
            with open(f"/proc/{pid}/environ", "rb") as f:
                if tag in f.read().split(b"\0"):
                    return True
        except (OSError, ValueError):
            continue
    return False


def run_dirs(project: str) -> set[str]:
    return {os.path.basename(os.path.dirname(p)) for p in glob.glob(os.path.join(project, "runs", "*", ""))}


def smoke_finished(project: str, before: set[str]) -> str | None:
    """A smoke run that was not there when the guard started and whose summary has a final status."""
    for run in sorted(run_dirs(project) - before):
        try:
            with open(os.path.join(project, "runs", run, "summary.json")) as f:
                status = json.load(f).get("status")
        except (OSError, ValueError):
            continue  # not written yet, or being written right now: read it on the next tick
        if status and status != "running":
            return f"{run} ({status})"
    return None


# ---------------------------------------------------------------- the stop

def stop_pod(pod_id: str) -> str:
    """Stop this pod through RunPod; returns how, raises RuntimeError with why not."""
    key, errors = env(KEY_VAR), []
    if key:
        base = (env(BASE_VAR) or "https://api.runpod.io").rstrip("/")
        body = json.dumps({"query": "mutation Stop($input: PodStopInput!) { podStop(input: $input) { id desiredStatus } }",
                           "variables": {"input": {"podId": pod_id}}}).encode()
        url = f"{base}/graphql?{urllib.parse.urlencode({'api_key': key})}"
        try:
            req = urllib.request.Request(url, data=body, method="POST",
                                         headers={"Content-Type": "application/json", "User-Agent": "podkit-guard"})
            with urllib.request.urlopen(req, timeout=30) as resp:
                payload = json.loads(resp.read() or b"{}")
            if not payload.get("errors"):
                return f"podStop through {base}/graphql"
            errors.append(f"RunPod refused podStop: {payload['errors'][0].get('message')}")
        except (urllib.error.URLError, OSError, ValueError, http.client.HTTPException) as exc:
            # urllib puts the whole URL, key and all, into some messages ("unknown url type: '...?api_key=...'"):
            # this one goes to guard.log, state.json and `bin/pod ls`.
            why = str(getattr(exc, "code", "") or getattr(exc, "reason", exc))
            errors.append(f"podStop at {base}/graphql: {why.replace(key, '***')}")
    else:
        errors.append(f"no {KEY_VAR} in the pod's environment")
    runpodctl = shutil.which("runpodctl")
    if runpodctl:
        try:
            out = subprocess.run([runpodctl, "stop", "pod", pod_id], capture_output=True, text=True,
                                 timeout=RUNPODCTL_TIMEOUT_S)
        except (OSError, subprocess.SubprocessError) as exc:  # hung on the network, or not runnable: retried, not fatal
            errors.append(f"runpodctl stop pod: {exc}")
        else:
            if out.returncode == 0:
                return "runpodctl stop pod"
            errors.append(f"runpodctl stop pod: {(out.stderr or out.stdout).strip()[:200]}")
    else:
        errors.append("no runpodctl on PATH")
    raise RuntimeError("; ".join(errors))


# ---------------------------------------------------------------- the loop

def reason_to_stop(settings: dict, before: set[str], last_busy: float, now: float) -> str | None:
    project = settings["project"]
    if settings.get("deadline") and now >= settings["deadline"]:
        return f"stop-after: deadline {time.strftime('%H:%M:%SZ', time.gmtime(settings['deadline']))} reached"
    if settings.get("after_smoke"):
        run = smoke_finished(project, before)
        if run:
            return f"after-smoke: run {run} finished"
    if settings.get("idle_s") and now - last_busy >= settings["idle_s"]:
        return f"idle-stop: no podkit job for {settings['idle_s']:.0f} s"
    return None


def main(d: str) -> int:
    with open(os.path.join(d, "settings.json")) as f:
        settings = json.load(f)
    pod_id = settings["pod_id"]
    if env(POD_VAR) != pod_id:  # never stop some other pod: the id must be this pod's own
        log(d, f"refusing: {POD_VAR}={env(POD_VAR)!r} is not {pod_id!r}")
        write_state(d, status="refused", reason=f"{POD_VAR} is not {pod_id}")
        return 2

    def on_term(*_):
        write_state(d, status="off", ended=time.time())
        log(d, "cancelled (SIGTERM)")
        sys.exit(0)

    signal.signal(signal.SIGTERM, on_term)
    before = run_dirs(settings["project"])  # runs from before the guard are not the smoke run it waits for
    last_busy = time.time()
    # The finest condition sets the clock: a tenth of it, between 0.2 s (tests use seconds) and 30 s.
    if settings.get("stop_after_s"):  # fixed on the pod's clock, now
        settings["deadline"] = time.time() + settings["stop_after_s"]
    spans = [s for s in (settings.get("idle_s"), settings.get("stop_after_s")) if s and s > 0]
    tick = min([FINAL_WAIT_S] + [max(0.2, s / 10) for s in spans] + ([2.0] if settings.get("after_smoke") else []))
    write_state(d, status="watching", pid=os.getpid(), since=time.time(), deadline=settings.get("deadline"))
    log(d, f"watching pod {pod_id}: {settings.get('describe', '')}; checking every {tick:.1f} s")
    backoff = tick
    while True:
        now = time.time()
        if job_running(settings["project"]):
            last_busy = now
        reason = reason_to_stop(settings, before, last_busy, now)
        if reason:
            try:
                how = stop_pod(pod_id)
            except RuntimeError as exc:  # keep trying: a guard that gives up lets the pod bill
                try:  # a full disk (checkpoints) must not end the retries either
                    log(d, f"{reason}; stopping FAILED: {exc}; retrying")
                    write_state(d, status="stop-failing", reason=reason, error=str(exc)[:300])
                except OSError:
                    pass
                time.sleep(backoff)
                backoff = min(60.0, backoff * 2)
                continue
            write_state(d, status="fired", reason=reason, fired=time.time(), how=how)
            log(d, f"{reason}: stopped the pod ({how})")
            return 0
        time.sleep(tick)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
