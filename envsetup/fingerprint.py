"""A machine's fingerprint, taken in one round trip: OS, Python, GPUs, torch build, disk, CPUs, RAM.

Machine facts live here, in the package that knows the machine; pods/ only carries the script
there (pods/probe.py). `PROBE_SCRIPT` is plain bash that prints `key<TAB>value` lines; it runs the
same way over SSH (`pods.probe.probe(conn)`) and on the machine itself (`probe_local()`, used by
bin/envsetup). `Gpu` is also preflight's model of a detected GPU (checks/host.py). torch facts
that need an import (arch list, C++ ABI) are cached on the pod keyed by torch's version.py, so
only the first probe pays for importing torch.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from dataclasses import asdict, dataclass, field

from podkit.envsetup import arch

# "The image's Python": an explicit PODKIT_PYTHON (--python, PYTHON=, pods.toml's python) is the only
# candidate, never traded for another without a word: what is wrong with it (missing, not executable, not
# running as Python 3) is reported for Fingerprint.python_fault to refuse. Else the candidates are SageMaker's
# pytorch conda envs (notebook instances: /home/ec2-user/anaconda3/envs/pytorch_p310, whoever logs in), the
# base conda env of AWS's deep learning containers (/opt/conda/bin/python: their PATH is set for PID 1 only, an
# SSH session's python3 is the OS one), then python3. The first one with torch wins, else the first that runs.
PROBE_SCRIPT = r'''
set +e
emit() { printf '%s\t%s\n' "$1" "$2"; }
emit user "$(id -un)"
emit home "$HOME"
if [ -r /etc/os-release ]; then . /etc/os-release; emit os "${PRETTY_NAME:-$NAME}"; else emit os "$(uname -s)"; fi
emit kernel "$(uname -r)"
emit machine "$(uname -m)"
emit cpus "$(nproc 2>/dev/null || getconf _NPROCESSORS_ONLN)"
awk '/^MemTotal:/{printf "ram_total_kb\t%s\n",$2} /^MemAvailable:/{printf "ram_available_kb\t%s\n",$2}' /proc/meminfo 2>/dev/null
dir="${PODKIT_PROBE_DIR:-$HOME}"
while [ -n "$dir" ] && [ ! -d "$dir" ]; do dir="$(dirname "$dir")"; done
emit disk_free_kb "$(df -Pk "$dir" 2>/dev/null | awk 'NR==2{print $4}')"
emit disk_path "$dir"
for tool in rsync nvidia-smi nvcc ninja apt-get sudo conda tmux; do
  p="$(command -v $tool 2>/dev/null)"
  [ -z "$p" ] && [ "$tool" = nvcc ] && [ -x /usr/local/cuda/bin/nvcc ] && p=/usr/local/cuda/bin/nvcc
  [ -n "$p" ] && emit "tool_$tool" "$p"
done
nvcc="$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)"
[ -x "$nvcc" ] && emit nvcc_version "$("$nvcc" --version 2>/dev/null | sed -n 's/.*release \([0-9.]*\).*/\1/p')"
if command -v nvidia-smi >/dev/null 2>&1; then
  nvidia-smi --query-gpu=name,memory.total,compute_cap,driver_version --format=csv,noheader,nounits 2>/dev/null \
    | while IFS= read -r line; do emit gpu "$line"; done
fi
pod_id="${RUNPOD_POD_ID:-}"
[ -z "$pod_id" ] && [ -r /proc/1/environ ] && pod_id="$(tr '\0' '\n' < /proc/1/environ 2>/dev/null | sed -n 's/^RUNPOD_POD_ID=//p')"
[ -n "$pod_id" ] && emit runpod_pod_id "$pod_id"
[ -d /workspace ] && emit workspace /workspace
# SageMaker notebook instances keep only /home/ec2-user/SageMaker (their EBS volume) across a stop;
# sagemaker-ssh-helper logs in as root, whose home is elsewhere.
for d in "$HOME/SageMaker" /home/ec2-user/SageMaker; do [ -d "$d" ] && { emit sagemaker "$d"; break; }; done
python_facts() {
"$1" - <<'PY'
import importlib.util, json, os, sys
print("python_version\t%d.%d.%d" % sys.version_info[:3])
print("python_venv\t%s" % int(sys.prefix != sys.base_prefix))
print("python_site\t%s" % json.dumps([p for p in sys.path if p.endswith("-packages")]))
spec = importlib.util.find_spec("torch")
if spec and spec.submodule_search_locations:
    path = list(spec.submodule_search_locations)[0]
    version_file = os.path.join(path, "version.py")
    scope = {}
    try:
        exec(open(version_file).read(), scope)
    except Exception:
        pass
    key = "%s:%s" % (version_file, os.path.getmtime(version_file) if os.path.exists(version_file) else 0)
    cache = os.path.expanduser("~/.cache/podkit/torch-facts.json")
    facts = {}
    try:
        facts = json.load(open(cache))
        if facts.get("key") != key:
            facts = {}
    except Exception:
        facts = {}
    if not facts:
        try:
            import torch
            facts = {"key": key, "arch_list": torch.cuda.get_arch_list() if torch.version.cuda else [],
                     "cxx11_abi": bool(torch._C._GLIBCXX_USE_CXX11_ABI)}
            os.makedirs(os.path.dirname(cache), exist_ok=True)
            json.dump(facts, open(cache, "w"))
        except Exception as exc:
            facts = {"error": "%s: %s" % (type(exc).__name__, exc)}
    print("torch\t" + json.dumps({"version": scope.get("__version__"), "cuda": scope.get("cuda"), "path": path,
                                  "arch_list": facts.get("arch_list"), "cxx11_abi": facts.get("cxx11_abi"),
                                  "error": facts.get("error")}))
for dist in ("bitsandbytes", "torchao", "flash_attn", "nvidia-ml-py"):
    try:
        from importlib.metadata import version
        print("package\t%s=%s" % (dist, version(dist)))
    except Exception:
        pass
PY
}
chosen="" chosen_facts=""
if [ -n "${PODKIT_PYTHON:-}" ]; then
  py="$PODKIT_PYTHON"
  case "$py" in */*) ;; *) py="$(command -v -- "$py" 2>/dev/null || printf '%s' "$py")";; esac  # a name on PATH
  if [ ! -e "$py" ]; then emit python_missing "$PODKIT_PYTHON"
  elif [ -d "$py" ]; then emit python_bad "is a directory"
  elif [ ! -x "$py" ]; then emit python_bad "is not executable (mode $(stat -c %a "$py" 2>/dev/null || echo unknown))"
  else
    facts="$(python_facts "$py" 2>/dev/null)"
    case "$facts" in
      *"python_version"$'\t'*) chosen="$py" chosen_facts="$facts";;
      *) # Its own words for why (a missing libpython, a wrapper's error), only on this failure path.
         why="$(python_facts "$py" 2>&1 >/dev/null)"; rc=$?
         why="$(printf '%s\n' "$why" | sed '/^[[:space:]]*$/d' | tail -n 1 | cut -c1-200)"
         [ -n "$why" ] || why="nothing on stderr"
         emit python_bad "does not run as Python 3 (exit $rc: $why)";;
    esac
  fi
else
  # One path per line (a path may hold a space: a PATH entry such as "/home/me/My Envs/bin").
  candidates="$(ls -d "$HOME"/anaconda3/envs/pytorch*/bin/python /home/ec2-user/anaconda3/envs/pytorch*/bin/python \
    /opt/conda/envs/pytorch*/bin/python /opt/conda/bin/python 2>/dev/null; command -v python3)"
  # One interpreter start per candidate: its facts say whether it has torch.
  while IFS= read -r py; do
    [ -n "$py" ] && [ -x "$py" ] || continue
    facts="$(python_facts "$py" 2>/dev/null)"
    [ -z "$chosen" ] && chosen="$py" chosen_facts="$facts"
    case "$facts" in *$'\ntorch\t'*) chosen="$py" chosen_facts="$facts"; break;; esac
  done <<< "$(printf '%s\n' "$candidates" | awk '!seen[$0]++')"
fi
[ -z "$chosen" ] && exit 0
emit python "$chosen"
printf '%s\n' "$chosen_facts"
# The project's venv may have a torch the image lacks (envsetup installed it there): report it
# apart, so the plan sees it while the venv is still made from the image's interpreter.
venv_py="${PODKIT_PROBE_DIR:-}/.venv/bin/python"
case "$chosen_facts" in *$'\ntorch\t'*) ;; *)
  [ -n "${PODKIT_PROBE_DIR:-}" ] && [ -x "$venv_py" ] && python_facts "$venv_py" 2>/dev/null | sed -n 's/^torch\t/venv_torch\t/p';;
esac
'''


@dataclass(frozen=True)
class Gpu:
    """One GPU as the machine reports it (nvidia-smi here, NVML in checks/host.py)."""

    name: str
    memory_bytes: int
    compute_capability: tuple[int, int] | None
    driver: str = ""

    @property
    def memory_mib(self) -> int:
        return self.memory_bytes // 2**20

    @property
    def sm(self) -> int | None:
        return self.compute_capability[0] * 10 + self.compute_capability[1] if self.compute_capability else None


@dataclass(frozen=True)
class TorchBuild:
    version: str
    cuda: str | None  # e.g. "12.4"; None for a CPU build
    path: str = ""
    arch_list: tuple[str, ...] = ()  # ("sm_80", "sm_90", ...); empty when unknown or CPU
    cxx11_abi: bool | None = None

    @property
    def major_minor(self) -> tuple[int, int]:
        return arch.major_minor(self.version) or (0, 0)

    def supports(self, sm: int) -> bool | None:
        """Whether this build has kernels for sm (SASS for it, or PTX for an older arch it can JIT)."""
        return arch.supports(self.arch_list, sm)


@dataclass
class Fingerprint:
    """What a pod is, as far as installing and running a job is concerned."""

    user: str = ""
    home: str = ""
    os: str = ""
    kernel: str = ""
    machine: str = ""
    cpus: int = 1
    ram_total_mib: int = 0
    ram_available_mib: int = 0
    disk_free_mib: int | None = None
    disk_path: str = ""
    python: str | None = None  # the image's interpreter (the one with torch when there is one)
    python_version: str | None = None
    python_venv: bool = False
    python_site: list[str] = field(default_factory=list)
    python_missing: str | None = None  # an explicit PYTHON= that does not exist
    python_bad: str | None = None  # what is wrong with an explicit PYTHON= that exists ("is not executable ...")
    torch: TorchBuild | None = None  # the image's, or else the project venv's (see venv_torch)
    torch_error: str | None = None
    torch_in_venv: bool = False  # torch came from the project's .venv, not the image
    gpus: list[Gpu] = field(default_factory=list)
    nvcc_version: str | None = None
    tools: dict[str, str] = field(default_factory=dict)
    packages: dict[str, str] = field(default_factory=dict)
    runpod_pod_id: str | None = None
    workspace: str | None = None
    sagemaker: str | None = None

    @property
    def python_tag(self) -> str | None:
        if not self.python_version:
            return None
        major, minor = self.python_version.split(".")[:2]
        return f"cp{major}{minor}"

    def python_fault(self, given: str | None, torch_needed: bool | None = None) -> str | None:
        """What is wrong with the interpreter the user named (`given`: --python, PYTHON=, pods.toml's python),
        in words that follow its path; None when none was named or it will do. The probe never trades a named
        interpreter for another, so deploy and envsetup refuse a bad one here (exit 2) before using it.
        `torch_needed` (default: the machine has a GPU): one without torch is refused too. On a GPU pod torch is
        the image's, never installed by podkit; on a CPU machine envsetup installs the pinned CPU torch into the
        venv (resolve.py), so there a Python without torch will do. The venv's own torch counts, where the probe
        saw it."""
        if torch_needed is None:
            torch_needed = bool(self.gpus)
        if not given:
            return None
        if self.python_missing:
            return "does not exist"
        if self.python_bad:
            return self.python_bad
        if not self.python:  # a probe that did not get this far (not a fault of the interpreter's)
            return None
        if self.torch is None and torch_needed:
            return "has no torch" + (f" (Python {self.python_version})" if self.python_version else "")
        return None

    def summary(self) -> str:
        gpu = f"{len(self.gpus)}x {self.gpus[0].name}" if self.gpus else "no GPU"
        torch = f"torch {self.torch.version}" if self.torch else "no torch"
        py = f"Python {self.python_version}" if self.python_version else "no Python"
        return f"{self.os}, {py}, {torch}, {gpu}, {self.cpus} CPUs, {self.ram_total_mib // 1024} GiB RAM"

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    @classmethod
    def from_json(cls, text: str) -> "Fingerprint":
        """A fingerprint written by to_json; ValueError naming what is wrong for anything else."""
        raw = json.loads(text)
        if not isinstance(raw, dict):
            raise ValueError(f"a fingerprint is a JSON object, this is a JSON {type(raw).__name__}")
        if not any(k in raw for k in ("python", "python_version", "os", "gpus")):
            raise ValueError("it holds none of a probe result's keys (python, os, gpus): not a fingerprint")
        for key in ("gpus", "python_site"):
            if not isinstance(raw.get(key, []), list):
                raise ValueError(f"{key} must be a list")
        torch = raw.get("torch")
        if torch is not None and not (isinstance(torch, dict) and isinstance(torch.get("version"), str)
                                      and re.match(r"^\d+\.\d+", torch["version"])):
            raise ValueError(f"torch.version must be a version such as \"2.5.1+cu124\", got "
                             f"{torch.get('version') if isinstance(torch, dict) else torch!r}")
        for key in ("python_version", "nvcc_version"):
            if raw.get(key) is not None and not (isinstance(raw[key], str) and re.match(r"^\d+\.\d+", raw[key])):
                raise ValueError(f"{key} must be a version such as \"3.11.7\", got {raw[key]!r}")
        for g in raw.get("gpus", []):
            cc = g.get("compute_capability") if isinstance(g, dict) else None
            if not isinstance(g, dict) or not isinstance(g.get("name"), str):
                raise ValueError(f"each of gpus must be an object with a name, got {g!r}")
            if cc is not None and not (isinstance(cc, list) and len(cc) == 2
                                       and all(isinstance(x, int) and not isinstance(x, bool) for x in cc)):
                raise ValueError(f"gpus: compute_capability must be [major, minor], e.g. [9, 0], got {cc!r}")
        raw["gpus"] = [Gpu(g["name"], g.get("memory_bytes", g.get("memory_mib", 0) * 2**20),
                           tuple(g["compute_capability"]) if g.get("compute_capability") else None, g.get("driver", ""))
                       for g in raw.get("gpus", [])]
        if raw.get("torch"):
            t = raw["torch"]
            raw["torch"] = TorchBuild(t["version"], t.get("cuda"), t.get("path", ""), tuple(t.get("arch_list") or ()),
                                      t.get("cxx11_abi"))
        known = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in raw.items() if k in known})


def parse_probe(text: str) -> Fingerprint:
    fp = Fingerprint()
    for line in text.splitlines():
        key, sep, value = line.partition("\t")
        if not sep:
            continue
        value = value.strip()
        if key in ("user", "home", "os", "kernel", "machine", "python", "python_version", "disk_path",
                   "nvcc_version", "runpod_pod_id", "workspace", "sagemaker", "python_missing", "python_bad"):
            setattr(fp, key, value)
        elif key == "cpus" and value.isdigit():
            fp.cpus = int(value)
        elif key in ("ram_total_kb", "ram_available_kb", "disk_free_kb") and value.isdigit():
            setattr(fp, key.replace("_kb", "_mib"), int(value) // 1024)
        elif key == "python_venv":
            fp.python_venv = value == "1"
        elif key == "python_site":
            fp.python_site = json.loads(value)
        elif key.startswith("tool_"):
            fp.tools[key[5:]] = value
        elif key == "package":
            dist, _, ver = value.partition("=")
            fp.packages[dist] = ver
        elif key == "gpu":
            fp.gpus.append(_parse_gpu(value))
        elif key == "venv_torch" and fp.torch is None:
            t = json.loads(value)
            if t.get("version"):
                fp.torch = TorchBuild(t["version"], t.get("cuda"), t.get("path", ""),
                                      tuple(t.get("arch_list") or ()), t.get("cxx11_abi"))
                fp.torch_in_venv = True
        elif key == "torch":
            t = json.loads(value)
            if t.get("version"):
                fp.torch = TorchBuild(t["version"], t.get("cuda"), t.get("path", ""),
                                      tuple(t.get("arch_list") or ()), t.get("cxx11_abi"))
            fp.torch_error = t.get("error")
    return fp


def _parse_gpu(line: str) -> Gpu:
    name, memory, cap, driver = ([p.strip() for p in line.split(",")] + ["", "", "", ""])[:4]
    cc = None
    if cap.replace(".", "").isdigit() and "." in cap:
        major, minor = cap.split(".")
        cc = (int(major), int(minor))
    # nvidia-smi --format=csv,nounits reports memory.total in MiB
    return Gpu(name=name, memory_bytes=int(memory) * 2**20 if memory.isdigit() else 0, compute_capability=cc, driver=driver)


def probe_local(directory: str = "", python: str | None = None) -> Fingerprint:
    env = {**os.environ, "PODKIT_PROBE_DIR": directory or os.getcwd()}
    if python:
        env["PODKIT_PYTHON"] = python
    out = subprocess.run(["bash", "-c", PROBE_SCRIPT], capture_output=True, text=True, env=env, timeout=120)
    return parse_probe(out.stdout)
