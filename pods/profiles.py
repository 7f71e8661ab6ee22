"""Pod profiles: where code and caches live on a kind of pod, and what restores its environment.

Detected from the fingerprint (RunPod sets RUNPOD_POD_ID; a SageMaker notebook instance has
/home/ec2-user/SageMaker, or ~/SageMaker), or named
with PROFILE=. Every remote command runs after the profile's prelude, so a variable set for the
container (RunPod) or a conda env (SageMaker) is there in the SSH session too.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass

from podkit.pods.errors import PodError
from podkit.envsetup.fingerprint import Fingerprint

# RunPod passes the pod's variables (RUNPOD_*, the user's HF_TOKEN, ...) to PID 1 only; SSH
# sessions start without them. Import each one that the session does not already set.
_RUNPOD_ENV = r'''[ -r /etc/rp_environment ] && . /etc/rp_environment
if [ -r /proc/1/environ ]; then
  while IFS= read -r -d '' kv; do k="${kv%%=*}"
    case "$k" in ''|*[!A-Za-z0-9_]*) continue;; esac
    [ -z "${!k+x}" ] && export "$kv"
  done < /proc/1/environ
fi'''


@dataclass(frozen=True)
class PodProfile:
    name: str
    root: str
    """Persistent directory that holds projects and caches ('~' is the remote home)."""
    cache_dir: str | None
    """HF_HOME and friends go under here (None: leave the defaults)."""
    prelude: str = ""

    def remote_dir(self, project: str, home: str) -> str:
        return f"{self.root.replace('~', home, 1)}/{project}"

    def caches(self, home: str) -> str | None:
        return self.cache_dir.replace("~", home, 1) if self.cache_dir else None

    def shell_prelude(self, remote_dir: str, venv: bool = True) -> str:
        """Prepended to every remote command: profile env, then cd and the env file if present."""
        d = shlex.quote(remote_dir)
        lines = [self.prelude] if self.prelude else []
        lines.append(f"cd {d} 2>/dev/null || true")
        if venv:
            lines.append(f"[ -r {d}/.podkit/env ] && . {d}/.podkit/env")
        return "\n".join(lines)


PROFILES = {
    "runpod": PodProfile("runpod", "/workspace", "/workspace/.cache", _RUNPOD_ENV),
    # root and caches: the SageMaker directory the probe found; prelude: the conda env of its python
    "sagemaker": PodProfile("sagemaker", "~/SageMaker", "~/SageMaker/.cache", ""),
    "generic": PodProfile("generic", "~", None),
}


def detect(fp: Fingerprint, name: str = "auto") -> PodProfile:
    if name != "auto":
        if name not in PROFILES:
            raise PodError(f"unknown profile '{name}'", "use PROFILE=runpod, sagemaker or generic")
        profile = PROFILES[name]
    elif fp.runpod_pod_id:
        profile = PROFILES["runpod"]
    elif fp.sagemaker:  # not by user ec2-user: that is any Amazon Linux EC2 instance too
        profile = PROFILES["sagemaker"]
    else:
        profile = PROFILES["generic"]
    if profile.name == "sagemaker" and fp.sagemaker:
        # The directory the probe found (root's login, via sagemaker-ssh-helper, has another home).
        profile = PodProfile(profile.name, fp.sagemaker, f"{fp.sagemaker}/.cache", profile.prelude)
    if profile.name == "sagemaker" and fp.python and "/envs/" in fp.python:
        # conda's bin/activate ENV sources etc/profile.d/conda.sh and runs `conda activate ENV`, so the
        # env's activate.d scripts run (AWS's lifecycle examples: source .../anaconda3/bin/activate ENV).
        env_dir = fp.python.rsplit("/bin/", 1)[0]
        conda = env_dir.split("/envs/")[0]
        activate = f"[ -r {shlex.quote(conda)}/bin/activate ] && . {shlex.quote(conda)}/bin/activate {shlex.quote(env_dir)}"
        profile = PodProfile(profile.name, profile.root, profile.cache_dir, activate)
    return profile
