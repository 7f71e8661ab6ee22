"""Host specs: what the user types after HOST=, read into one typed `HostSpec` per pod.

Accepted forms, one per host, comma-separated for several:
  user@host[:port]           root@1.2.3.4:22022, [::1]:2222, gpu-box
  an ~/.ssh/config alias     my-a100 (HostName, User, Port, IdentityFile read from the config)
  the line RunPod shows      ssh root@1.2.3.4 -p 22022 -i ~/.ssh/id_ed25519
  an inventory name/group    a100 or train, from pods.toml (see `load_inventory`)

`resolve` turns a spec into an `Endpoint`: the concrete hostname, port, user and key files that
both paramiko and the rsync/ssh child process use, so the two never disagree.
"""

from __future__ import annotations

import os
import re
import shlex
from dataclasses import dataclass, field, replace
from pathlib import Path

from podkit.pods.errors import PodError

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib

# Never only dots: a pod's name is a directory under pod-logs/ (fetch-logs' DEST/<pod>), and '..' or '.' would put
# its runs/ and logs/ outside it; a host of dots is no host.
_HOSTNAME = re.compile(r"^(?!\.+$)[A-Za-z0-9_.%-]+$|^[0-9A-Fa-f:]+$")
_NAME = re.compile(r"^(?!\.+$)[A-Za-z0-9_.-]+$")
PROFILES = ("auto", "runpod", "sagemaker", "generic")


@dataclass(frozen=True)
class HostSpec:
    """One pod as the user named it (before ~/.ssh/config is consulted)."""

    host: str
    """Hostname, IP or ~/.ssh/config alias."""
    user: str | None = None
    port: int | None = None
    key: str | None = None
    """Identity file; None lets the ssh config, agent and default keys decide."""
    name: str = ""
    """Label for output prefixes and pod-logs/<name>/; defaults to host[-port]."""
    profile: str = "auto"
    """runpod | sagemaker | generic | auto (detected from the pod)."""
    remote_dir: str | None = None
    """Project directory on the pod; None = the profile's default."""
    python: str | None = None
    """Interpreter on the pod that has the image's torch; None = detected."""
    pod_id: str | None = None
    """The provider's pod id when `bin/pod up` recorded it: its host key is pinned to this id, and a
    pod that moved (RunPod maps a new IP and port on every restart) is found again through the API."""
    inventory: str | None = None
    """The pods.toml this spec came from (updated when the pod moves)."""

    def __post_init__(self):
        if not self.host or not _HOSTNAME.match(self.host):
            raise PodError(f"host '{self.host}' is not a valid host name", "use user@host[:port]")
        if self.port is not None and not 0 < self.port < 65536:
            raise PodError(f"port {self.port} is out of range", "use a port between 1 and 65535")
        if self.pod_id is not None and not _NAME.match(self.pod_id):
            raise PodError(f"pod_id '{self.pod_id}' may use only letters, digits, '.', '_' and '-', not only dots",
                           "fix pods.toml")
        if self.profile not in PROFILES:
            raise PodError(f"unknown profile '{self.profile}'", "use one of " + ", ".join(PROFILES))
        if not self.name:
            label = self.host if self.port in (None, 22) else f"{self.host}-{self.port}"
            object.__setattr__(self, "name", re.sub(r"[^A-Za-z0-9_.-]", "_", label))
        elif not _NAME.match(self.name):
            raise PodError(f"pod name '{self.name}' may use only letters, digits, '.', '_' and '-', not only dots")

    @property
    def reach(self) -> str:
        """How `bin/pod` reaches this pod again: its pods.toml name, else user@host[:port] as given (`name` of a raw
        host is a label: 'root@10.0.0.1:2222' is named '10.0.0.1-2222', which no command could reach)."""
        if self.inventory is not None:
            return self.name
        host = f"[{self.host}]" if ":" in self.host and self.port else self.host  # [ipv6]:port (_split_port)
        return f"{self.user + '@' if self.user else ''}{host}{f':{self.port}' if self.port else ''}"


@dataclass(frozen=True)
class Endpoint:
    """Where to connect, fully resolved."""

    hostname: str
    port: int
    user: str
    key_files: tuple[str, ...] = ()
    ssh_config: str | None = None  # the config file the alias came from, passed on to ssh -F
    jumps: tuple["Endpoint", ...] = ()  # ProxyJump hops, in order
    proxy_command: str | None = None
    """The ssh config's ProxyCommand, tokens expanded (SSM's `aws ssm start-session`, `sm-ssh start-proxy`)."""
    connect_timeout: float | None = None
    """The ssh config's ConnectTimeout: how long the server's greeting may take (an SSM session
    is set up in tens of seconds; sagemaker-ssh-helper's config says 120)."""
    host_key_alias: str | None = None
    """known_hosts name the host key is pinned under instead of [host]:port (OpenSSH's HostKeyAlias):
    podkit-runpod-<pod id> for a pod `bin/pod up` recorded, so a new IP and port keep the same key."""

    @property
    def display(self) -> str:
        return f"{self.user}@{self.hostname}:{self.port}"

    @property
    def known_hosts_name(self) -> str:
        """The name known_hosts files the key under (OpenSSH's [host]:port for other ports)."""
        return self.hostname if self.port == 22 else f"[{self.hostname}]:{self.port}"


def parse_host(text: str, key: str | None = None) -> HostSpec:
    """One host spec in any accepted form (not an inventory name; see `select_hosts`)."""
    text = text.strip()
    if not text:
        raise PodError("empty host", "give HOST=user@host[:port]")
    if text.startswith("ssh ") or text.startswith("ssh\t"):
        return _parse_ssh_line(text, key)
    if any(c.isspace() for c in text):
        raise PodError(f"host '{text}' contains spaces", "paste the whole RunPod line starting with 'ssh', or use user@host:port")
    user, _, rest = text.rpartition("@") if "@" in text else (None, "", text)
    if user == "":
        raise PodError(f"host '{text}' has an empty user", "use user@host")
    host, port = _split_port(rest, text)
    return HostSpec(host=host, user=user, port=port, key=_expand(key))


def _split_port(rest: str, original: str) -> tuple[str, int | None]:
    if rest.startswith("["):  # [ipv6]:port
        host, _, tail = rest[1:].partition("]")
        if not tail:
            return host, None
        if not tail.startswith(":"):
            raise PodError(f"host '{original}' is malformed", "use [address]:port")
        return host, _port(tail[1:], original)
    if rest.count(":") == 1:
        host, port = rest.split(":")
        return host, _port(port, original)
    return rest, None


def _port(text: str, original: str) -> int:
    if not text.isdigit():
        raise PodError(f"port '{text}' in '{original}' is not a number", "use user@host:port, e.g. root@1.2.3.4:22022")
    return int(text)


def _parse_ssh_line(text: str, key: str | None) -> HostSpec:
    """`ssh root@1.2.3.4 -p 22022 -i ~/.ssh/id_ed25519`, as RunPod's Connect dialog shows it."""
    try:
        words = shlex.split(text)[1:]
    except ValueError as exc:
        raise PodError(f"cannot read the ssh line: {exc}", "paste it exactly as shown") from None
    target, port, user = None, None, None
    i = 0
    while i < len(words):
        word = words[i]
        value = words[i + 1] if i + 1 < len(words) else None
        if word in ("-p", "-i", "-l", "-o"):
            if value is None:
                raise PodError(f"ssh line: {word} needs a value")
            if word == "-p":
                port = _port(value, text)
            elif word == "-i":
                key = key or value
            elif word == "-l":
                user = value
            else:
                opt, _, optval = value.partition("=")
                if opt.lower() == "port":
                    port = _port(optval, text)
                elif opt.lower() == "user":
                    user = optval
                elif opt.lower() == "identityfile":
                    key = key or optval
                # Other -o options (StrictHostKeyChecking=no, ...) are ignored on purpose:
                # podkit verifies host keys itself.
            i += 2
        elif word.startswith("-") and len(word) > 1:
            if word in ("-t", "-T", "-A", "-C", "-v", "-4", "-6", "-q", "-x", "-X"):
                i += 1
            else:
                raise PodError(f"ssh line: option {word} is not understood", "keep only the host, -p and -i")
        else:
            if target is not None:
                raise PodError("ssh line has a remote command", "paste only the connection part")
            target = word
            i += 1
    if target is None:
        raise PodError("ssh line has no host", "paste the line as shown, e.g. ssh root@1.2.3.4 -p 22022")
    spec = parse_host(target, key)
    return HostSpec(host=spec.host, user=user or spec.user, port=port or spec.port, key=spec.key)


def _expand(path: str | None) -> str | None:
    return os.path.expanduser(path) if path else None


# ---------------------------------------------------------------- inventory

@dataclass
class Inventory:
    """pods.toml: named pods and groups of them.

        [pods.a100]
        host = "ssh root@1.2.3.4 -p 22022 -i ~/.ssh/id_ed25519"   # any host spec
        profile = "runpod"                                         # optional
        remote_dir = "/workspace/myproj"                           # optional
        provider = "runpod"                                        # written by bin/pod up,
        pod_id = "abc123"                                          # with the provider's pod id
        [groups]
        train = ["a100", "h100"]
    """

    pods: dict[str, HostSpec] = field(default_factory=dict)
    groups: dict[str, list[str]] = field(default_factory=dict)
    source: str = ""
    raw_pods: dict[str, dict] = field(default_factory=dict)
    """Each [pods.NAME] table as written (provider and pod_id are read by pods.provision)."""


_POD_KEYS = {"host", "key", "profile", "remote_dir", "python", "provider", "pod_id"}


_MAX_INVENTORY_BYTES = 1 << 20
_POD_KEY_EXAMPLES = {"host": "root@203.0.113.7:22", "key": "~/.ssh/id_ed25519", "remote_dir": "/workspace/podkit",
                     "python": "/usr/bin/python3", "profile": "runpod"}


def load_inventory(path: str | Path | None) -> Inventory:
    """The inventory at `path` (or ./pods.toml when it exists); empty when there is none."""
    explicit = path is not None
    path = Path(path) if path else Path("pods.toml")
    if not path.exists():
        if explicit:
            raise PodError(f"inventory {path} does not exist", "give PODS=path/to/pods.toml")
        return Inventory()
    if not path.is_file():
        raise PodError(f"inventory {path} is not a regular file", "give PODS=path/to/pods.toml")
    try:
        with open(path, "rb") as f:
            data = f.read(_MAX_INVENTORY_BYTES + 1)
        if len(data) > _MAX_INVENTORY_BYTES:
            raise PodError(f"inventory {path} is over 1 MiB, not a pods.toml", "give PODS=path/to/pods.toml")
        raw = tomllib.loads(data.decode("utf-8"))
    except UnicodeDecodeError:
        raise PodError(f"inventory {path} is not UTF-8 text", "give PODS=path/to/pods.toml") from None
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise PodError(f"{path}: {exc}", "fix the inventory file") from None
    unknown = set(raw) - {"pods", "groups"}
    if unknown:
        raise PodError(f"{path}: unknown section [{sorted(unknown)[0]}]", "use [pods.<name>] and [groups]")
    for section in ("pods", "groups"):
        if not isinstance(raw.get(section, {}), dict):
            raise PodError(f"{path}: {section} must be a table", f"write [{section}.<name>] sections"
                           if section == "pods" else "write [groups] with name = [\"pod\", ...]")
    inv = Inventory(source=str(path))
    for name, entry in raw.get("pods", {}).items():
        if not isinstance(entry, dict) or "host" not in entry:
            raise PodError(f"{path}: pods.{name} needs host = \"...\"")
        bad = set(entry) - _POD_KEYS
        if bad:
            raise PodError(f"{path}: pods.{name}.{sorted(bad)[0]}: unknown key", "known: " + ", ".join(sorted(_POD_KEYS)))
        for key, value in entry.items():
            if not isinstance(value, str) or not value.strip():
                raise PodError(f"{path}: pods.{name}.{key} must be a non-empty string, got {value!r}",
                               f'e.g. {key} = "{_POD_KEY_EXAMPLES.get(key, "...")}"')
        spec = parse_host(entry["host"], entry.get("key"))
        inv.raw_pods[name] = entry
        inv.pods[name] = replace(
            spec, name=name, profile=entry.get("profile", "auto"),
            remote_dir=entry.get("remote_dir"), python=entry.get("python"),
            pod_id=entry.get("pod_id") if entry.get("provider") == "runpod" else None, inventory=str(path),
        )
    for group, members in raw.get("groups", {}).items():
        if not isinstance(members, list) or not all(m in inv.pods for m in members):
            raise PodError(f"{path}: group {group} must list pod names defined under [pods]")
        inv.groups[group] = members
    return inv


def select_hosts(text: str, inventory: Inventory, key: str | None = None, **overrides) -> list[HostSpec]:
    """HOST=... -> the pods it names. Commas separate hosts, except inside a pasted ssh line."""
    if not text or not text.strip():
        raise PodError("no host given", "use HOST=user@host[:port], an ssh alias or an inventory name")
    items = [text] if text.strip().startswith("ssh ") else [t for t in text.split(",") if t.strip()]
    specs: list[HostSpec] = []
    for item in items:
        item = item.strip()
        if item in inventory.groups:
            specs += [inventory.pods[m] for m in inventory.groups[item]]
        elif item in inventory.pods:
            specs.append(inventory.pods[item])
        else:
            specs.append(parse_host(item, key))
    fixed = {k: v for k, v in overrides.items() if v is not None}
    if key:
        fixed["key"] = _expand(key)
    specs = [replace(s, **fixed) for s in specs]
    names = [s.name for s in specs]
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup:
        raise PodError(f"pod '{dup}' is named twice", "list each host once")
    return specs


# ---------------------------------------------------------------- ~/.ssh/config

def resolve(spec: HostSpec, ssh_config: str | Path | None = None) -> Endpoint:
    """The spec completed from the ssh config exactly as OpenSSH reads it (`ssh -G`: Include,
    Match, Host patterns, tokens, ProxyJump, ProxyCommand), then OpenSSH's key checks on the chosen keys."""
    import shutil

    if ssh_config is not None and not Path(ssh_config).is_file():
        ssh_config = "/dev/null"  # named but absent: no config at all, as `ssh -F` with an empty file
    if shutil.which("ssh") is None:
        raise PodError("OpenSSH's ssh is not installed on this machine (podkit reads ~/.ssh/config through it)",
                       "install openssh-client")
    facts = _ssh_g(spec, ssh_config)
    user = spec.user or facts.get("user", [None])[0] or _local_user()
    port = spec.port or int(facts.get("port", ["22"])[0])
    hostname = facts.get("hostname", [spec.host])[0]
    tokens = _token_values(spec.host, hostname, port, user, facts)
    proxy = facts.get("proxycommand", ["none"])[0]
    proxy_command = None if proxy == "none" else expand_tokens(proxy, tokens, "hnpr", "ProxyCommand")
    jumps: list[Endpoint] = []
    hops = facts.get("proxyjump", ["none"])[0]
    if hops != "none":
        for hop in hops.split(","):
            # each hop is read from the same config, as ssh does (its own ProxyJump not chained)
            hop_spec = parse_host(hop.removeprefix("ssh://"))
            jumps.append(replace(resolve(replace(hop_spec, name=hop_spec.name), ssh_config), jumps=()))
    if spec.key:
        keys = [spec.key]
        if not Path(spec.key).is_file():
            what = "is a directory" if Path(spec.key).is_dir() else "does not exist"
            raise PodError(f"key file {spec.key} {what}", "give KEY=path to your private key")
    else:
        keys = [os.path.expanduser(expand_tokens(k, tokens, "CdhiklLnpru", "IdentityFile"))
                for k in facts.get("identityfile", [])]
        # Behind a ProxyCommand a key may appear only once the proxy runs (sagemaker-ssh-helper's
        # start-proxy writes a fresh ~/.ssh/<host> on each connection; ssh too loads its keys after
        # connecting: OpenSSH ssh.c main(), ssh_connect() then load_public_identity_files()):
        # kept, and read when paramiko authenticates. Otherwise only existing files.
        keys = [k for k in keys if proxy_command or Path(k).is_file()]
    keys = [k for k in keys if not Path(k).is_file() or check_key(k)]
    timeout = facts.get("connecttimeout", ["none"])[0]
    return Endpoint(hostname=hostname, port=port, user=user, key_files=tuple(keys),
                    ssh_config=str(ssh_config) if ssh_config else None, jumps=tuple(jumps), proxy_command=proxy_command,
                    connect_timeout=float(timeout) if timeout.isdigit() else None,
                    host_key_alias=f"podkit-runpod-{spec.pod_id}" if spec.pod_id else None)


def _token_values(host: str, hostname: str, port: int, user: str, facts: dict[str, list[str]]) -> dict[str, str]:
    """ssh_config(5) TOKENS (OpenSSH 9.2) for one connection."""
    import hashlib
    import socket

    local = socket.gethostname()
    values = {"h": hostname, "n": host, "p": str(port), "r": user, "u": _local_user(), "i": str(os.getuid()),
              "d": os.path.expanduser("~"), "k": facts.get("hostkeyalias", [host])[0], "L": local.split(".")[0],
              "l": local}
    values["C"] = hashlib.sha1(f"{local}{hostname}{port}{user}".encode()).hexdigest()  # %C: hash of %l%h%p%r
    return values


def expand_tokens(text: str, values: dict[str, str], allowed: str, keyword: str) -> str:
    """`%h`-style tokens of an ssh config value, as ssh expands them when it connects: `ssh -G`
    prints ProxyCommand and IdentityFile unexpanded (OpenSSH 9.2), so podkit expands them the
    same way (ssh_config(5) TOKENS: which keyword takes which token; `%%` is a literal %)."""
    out, i = [], 0
    while i < len(text):
        if text[i] != "%":
            out.append(text[i])
            i += 1
            continue
        token = text[i + 1:i + 2]
        if token == "%":
            out.append("%")
        elif token and token in allowed:
            out.append(values[token])
        else:
            what = f"an unknown token %{token}" if token else "a lone % at the end"
            raise PodError(f"ssh config: {keyword} '{text}' has {what}",
                           f"{keyword} takes " + ", ".join(f"%{t}" for t in "%" + allowed))
        i += 2
    return "".join(out)


def _local_user() -> str:
    import getpass

    return getpass.getuser()


def _ssh_g(spec: HostSpec, ssh_config: Path | str | None) -> dict[str, list[str]]:
    import subprocess

    argv = ["ssh", "-G"]
    if ssh_config is not None:
        argv += ["-F", str(ssh_config)]
    if spec.port:
        argv += ["-p", str(spec.port)]
    if spec.user:
        argv += ["-l", spec.user]
    out = subprocess.run([*argv, "--", spec.host], capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=30)
    if out.returncode != 0:
        detail = [line for line in out.stderr.splitlines() if line.strip() and "Pseudo-terminal" not in line]
        raise PodError(f"ssh config: {detail[0] if detail else 'ssh -G failed'}", "fix the ssh config")
    facts: dict[str, list[str]] = {}
    for line in out.stdout.splitlines():
        key, _, value = line.partition(" ")
        facts.setdefault(key.lower(), []).append(value)
    return facts


def agent_available() -> bool:
    return bool(os.environ.get("SSH_AUTH_SOCK")) and os.path.exists(os.environ["SSH_AUTH_SOCK"])


def check_key(path: str) -> bool:
    """OpenSSH's checks on a private key file (sshkey.c, sshkey_perm_ok: no group/other access).
    True: usable. False: encrypted, but ssh-agent is running and will be asked instead.
    Anything else is one PodError saying what to do."""
    import stat
    import subprocess

    with open(path, "rb") as f:  # a public key's line (ssh-keygen writes both), before advice on its mode
        if f.read(16).startswith((b"ssh-", b"ecdsa-", b"sk-ssh-", b"sk-ecdsa-")):
            raise PodError(f"key {path} is a public key", "give KEY=path to your private key (the file without .pub)")
    mode = stat.S_IMODE(os.stat(path).st_mode)
    if mode & 0o077 and os.stat(path).st_uid == os.getuid():
        raise PodError(f"key {path} is readable by others (mode {mode:04o}); OpenSSH refuses such a key",
                       f"chmod 600 {path}")
    # OpenSSH's own reading of the file: decrypts with an empty passphrase or says why it cannot.
    out = subprocess.run(["ssh-keygen", "-y", "-P", "", "-f", path], capture_output=True, text=True,
                         stdin=subprocess.DEVNULL, timeout=30)
    if out.returncode == 0:
        return True
    if "passphrase" in out.stderr:
        if agent_available():
            return False
        raise PodError(f"key {path} needs a passphrase and no ssh-agent is running",
                       f"add it to ssh-agent: eval $(ssh-agent); ssh-add {path}")
    raise PodError(f"key {path} is not a private key OpenSSH can read ({(out.stderr.strip().splitlines() or ['?'])[-1]})",
                   "give KEY=path to your private key (not the .pub file)")
    return True
