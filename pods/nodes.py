"""Several pods as the nodes of one torchrun world: `bin/pod run A,B --nodes -- COMMAND`.

Every node runs COMMAND as a detached job (pods/jobs.py) under torchrun, all joined by one c10d
rendezvous on the first node's address as the other nodes reach it, at a port free there. torchrun
reads its settings from PET_* variables (torch/distributed/argparse_util.py `env`, torch 2.13), so
the same environment serves `bin/smoke` (which starts torchrun itself), a user's own `torchrun ...`
(run as `PY -m torch.distributed.run ...`, its arguments kept) and a plain command (wrapped in
`PY -m torch.distributed.run --no-python`). PY is the node's interpreter (`interpreter`): the project
venv's python where deploy made one, else the image's that the probe chose or --python named; never a
bare `python` or `torchrun` from PATH (an image may have only python3, and torch's torchrun script runs
the image's interpreter, outside the venv, or is not on an SSH session's PATH at all).

c10d ignores --node_rank: it ranks nodes by their address (sorted participants,
torch/distributed/elastic/rendezvous/dynamic_rendezvous.py `_mark_rendezvous_complete`), so global
rank 0 (and bin/smoke's summary.json) lands on whichever node sorts first; podkit's node index is
the order the hosts were given (job ids `<run>-n<i>`, PODKIT_NODE_RANK).

A node whose job fails (or whose link drops) stops the others through `jobs.stop`: torchrun's agent
only notices a lost peer inside a collective, and a rank outside one would keep a pod busy.
"""

from __future__ import annotations

import json
import queue
import re
import shlex
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from podkit.envsetup.envfile import venv_python
from podkit.envsetup.fingerprint import Fingerprint
from podkit.pods import jobs
from podkit.pods.connection import PodConnection
from podkit.pods.deploy import PYTHON_FIX, PodOptions, connect, locate
from podkit.pods.errors import PodError
from podkit.pods.hosts import HostSpec
from podkit.pods.ownership import deployed as is_deployed
from podkit.pods.remote_stop import stop_script
from podkit.pods.sync import changed_note, changed_since_deploy

# On the first node: its IPv4 addresses by interface and the one the SSH client reached
# (SSH_CONNECTION, set by sshd); then a listener on a free port that answers every connection with
# a nonce, in the background for LISTEN_S, so the others can prove they reach this node at the very
# port the rendezvous will use (an sshd answering at the same address could be their own: pods often
# share one internal address). SIOCGIFADDR is 0x8915 (linux/sockios.h); Python has no call for an
# interface's address, and `ip` is missing from many images.
LISTEN_S = 60
_SELF = r"""
import fcntl, json, os, socket, struct, sys, time
def addr(name):
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        return socket.inet_ntoa(fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name[:15].encode()))[20:24])
    except OSError:
        return None
    finally:
        s.close()
ifaces = {n: a for _, n in socket.if_nameindex() for a in [addr(n)] if a and not a.startswith("127.")}
ssh = os.environ.get("SSH_CONNECTION", "").split()
srv = socket.socket(); srv.bind(("", 0)); srv.listen(64)
pid = os.fork()
if pid:
    print(json.dumps({"ifaces": ifaces, "ssh_addr": ssh[2] if len(ssh) == 4 else None,
                      "port": srv.getsockname()[1], "listener": pid}))
    sys.exit(0)
null = os.open(os.devnull, os.O_RDWR)
for fd in (0, 1, 2):
    os.dup2(null, fd)
os.setsid()
end = time.monotonic() + float(sys.argv[2])
while time.monotonic() < end:
    srv.settimeout(max(0.1, end - time.monotonic()))
    try:
        c, _ = srv.accept()
    except OSError:
        break
    try:
        c.settimeout(5); c.sendall(sys.argv[1].encode()); c.recv(1)  # the client closes first
    except OSError:
        pass
    c.close()
"""

# On a node: does HOST:PORT answer with the nonce, and through which of this node's addresses
# and interfaces (a UDP connect picks the route without sending anything).
_ROUTE = r"""
import fcntl, json, socket, struct, sys
host, port, nonce = sys.argv[1], int(sys.argv[2]), sys.argv[3].encode()
u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
try:
    u.connect((host, port)); src = u.getsockname()[0]
except OSError:  # no route at all
    print(json.dumps({"reachable": False, "addr": None, "iface": None})); sys.exit(0)
def addr(name):
    try:
        return socket.inet_ntoa(fcntl.ioctl(u.fileno(), 0x8915, struct.pack("256s", name[:15].encode()))[20:24])
    except OSError:
        return None
iface = next((n for _, n in socket.if_nameindex() if addr(n) == src), None)
got = b""
try:
    with socket.create_connection((host, port), timeout=5) as c:
        while len(got) < len(nonce):
            part = c.recv(len(nonce) - len(got))
            if not part:
                break
            got += part
except OSError:
    pass
print(json.dumps({"reachable": got == nonce, "addr": src, "iface": iface}))
"""


@dataclass(frozen=True)
class Node:
    """One pod of the world: its index (the order given), and how the others reach it."""

    index: int
    name: str
    address: str
    """Its address on the route to the first node (torchrun's --local-addr)."""
    interface: str | None
    """The interface carrying that route (gloo's and NCCL's socket interface)."""
    nproc: int


@dataclass(frozen=True)
class Rendezvous:
    """The one c10d rendezvous every node joins."""

    host: str
    port: int
    run_id: str
    nodes: int

    def __post_init__(self):
        if self.nodes < 2:
            raise PodError(f"--nodes needs at least 2 hosts, got {self.nodes}", "name them comma-separated: A,B")
        jobs.valid_id(self.run_id)

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.port}"

    def env(self, node: Node) -> dict[str, str]:
        """What torchrun on `node` reads (PET_<option>), and podkit's own names for the run."""
        return {
            "PET_NNODES": str(self.nodes),
            "PET_NPROC_PER_NODE": str(node.nproc),
            "PET_RDZV_BACKEND": "c10d",
            "PET_RDZV_ENDPOINT": self.endpoint,
            "PET_RDZV_ID": self.run_id,
            # The first node hosts the store: torch guesses that by matching the endpoint to its
            # hostname (c10d_rendezvous_backend.py `_create_tcp_store`), wrong behind NAT or in a container.
            "PET_RDZV_CONF": f"is_host={int(node.index == 0)}",
            # Else the node's FQDN, which another pod may not resolve (dynamic_rendezvous.py `_NodeDescGenerator`).
            "PET_LOCAL_ADDR": node.address,
            "PODKIT_RUN_ID": self.run_id,
            "PODKIT_NODE_RANK": str(node.index),
            "PODKIT_NODES": str(self.nodes),
        }

    @staticmethod
    def env_defaults(node: Node) -> dict[str, str]:
        """Unless the env file sets them: gloo binds to the hostname's address (127.0.0.1 in many
        containers) and NCCL may pick a docker bridge; both must use the route between the nodes."""
        if not node.interface:
            return {}
        return {"GLOO_SOCKET_IFNAME": node.interface, "NCCL_SOCKET_IFNAME": node.interface}


def _check_command(command: tuple[str, ...]) -> None:
    """PodError for a COMMAND --nodes cannot run: bin/smoke -- COMMAND, or a launcher inside COMMAND."""
    if Path(command[0]).name == "smoke" and "--" in command:
        raise PodError("bin/smoke -- COMMAND does not run across nodes yet",
                       "run your script under --nodes directly: bin/pod run A,B --nodes -- python train.py")
    _check_launcher(command)


def _launcher_in(command: tuple[str, ...]) -> str | None:
    """A process launcher that COMMAND runs other than as its first word (launch_command hands those to torchrun
    itself): `env X=1 torchrun`, `python -u -m torch.distributed.run`, `uv run torchrun`, or accelerate's and
    DeepSpeed's own launchers anywhere. None of these reads the PET_* rendezvous --nodes sets up, and each would run
    as a worker of podkit's torchrun, a launcher inside a launcher: one per worker, each waiting on a world that
    never forms. Only the words before the script (the first *.py or *.sh) are the command's own: those after it
    are the script's arguments (`train.py --backend deepspeed`)."""
    names = [Path(w).name for w in command]
    script = next((i for i, n in enumerate(names) if n.endswith((".py", ".sh"))), len(names))
    names = names[:script]
    for i, name in enumerate(names):
        if name == "torchrun" and i > 0:
            return "torchrun"
        if name == "torch.distributed.run" and i > 2:
            return "python -m torch.distributed.run"
        if name in ("accelerate", "accelerate-launch") and (name == "accelerate-launch" or "launch" in names[i + 1:i + 2]):
            return "accelerate launch"
        if name == "deepspeed":
            return "deepspeed"
    return None


def _check_launcher(command: tuple[str, ...]) -> None:
    if Path(command[0]).name == "smoke":
        return
    found = _launcher_in(command)
    if found:
        raise PodError(f"--nodes starts torchrun on every node itself, and COMMAND runs {found} inside it",
                       "give torchrun first with its arguments (--nodes -- torchrun --nproc-per-node 8 train.py) or "
                       "the script alone (--nodes -- python train.py); set variables in .podkit/env, not with env")


def launch_command(command: tuple[str, ...], python: str) -> str:
    """COMMAND as a node runs it, torchrun under `python` (the node's `interpreter`), which reads PET_*:
    bin/smoke starts torchrun itself; `torchrun ARGS` and `python[3] -m torch.distributed.run ARGS` run as
    `python -m torch.distributed.run ARGS`; anything else runs as torchrun's workers. A torchrun or an
    interpreter named by its path is the user's choice, run as given."""
    _check_command(command)
    first = Path(command[0]).name
    if first == "smoke":
        return shlex.join(command)
    torchrun = [python, "-m", "torch.distributed.run"]
    if command[0] == "torchrun":
        return shlex.join([*torchrun, *command[1:]])
    if command[0] in ("python", "python3") and command[1:3] == ("-m", "torch.distributed.run"):
        return shlex.join([*torchrun, *command[3:]])
    if first == "torchrun" or "torch.distributed.run" in command[:3]:
        return shlex.join(command)
    return shlex.join([*torchrun, "--no-python", *command])


def interpreter(conn: PodConnection, fp: Fingerprint, remote_dir: str, given: str | None) -> str:
    """The Python every process --nodes starts on this node runs under: the project venv's where envsetup made
    it (the env file puts its bin first on PATH, so `python` in the job is this one too), else the image's
    interpreter that the probe chose (the one --python or pods.toml named, checked as deploy checks it)."""
    fault = fp.python_fault(given, torch_needed=False)
    if fault:
        raise PodError(f"python {given} {fault} on the pod", PYTHON_FIX)
    venv = venv_python(remote_dir)
    if conn.run(f"[ -x {shlex.quote(venv)} ]", prelude=False).ok:
        return venv
    fault = fp.python_fault(given, torch_needed=True)  # no venv: torchrun runs under this one, which needs torch
    if fault:
        raise PodError(f"python {given} {fault} on the pod, which has no project venv", PYTHON_FIX)
    if fp.python:
        return fp.python
    raise PodError("no Python on the pod (no project venv, and no python3 or conda python found)",
                   "install python3, re-run bin/pod deploy for it, or name its interpreter with --python")


def job_config(command: tuple[str, ...]) -> str | None:
    """The --config of a bin/smoke command, if any (to check its nodes before anything starts)."""
    if Path(command[0]).name != "smoke":
        return None
    for i, word in enumerate(command[1:], 1):
        if word in ("--config", "-c") and i + 1 < len(command):
            return command[i + 1]
        if word.startswith("--config="):
            return word.split("=", 1)[1]
    return None


def check_job(command: tuple[str, ...], hosts: int, nproc: int | None) -> int | None:
    """The job's gpus_per_node, after checking COMMAND (before anything starts) and its job against the hosts
    given and --nproc-per-node. Read from this machine's copy of the project (what deploy synced); None when
    there is none here."""
    _check_command(command)
    path = job_config(command)
    if path is None and Path(command[0]).name == "smoke" and "--from" not in command:
        raise PodError("bin/smoke without --config runs its one-node default job",
                       f"give --config JOB with cluster.nodes = {hosts}")
    if path is None or not Path(path).is_file():
        return None
    from podkit.checks.config import load_job
    from podkit.checks.errors import ConfigError

    try:
        job = load_job(path)
    except ConfigError as exc:
        raise PodError(f"{path}: {exc}") from None
    c = job.cluster
    if c.nodes != hosts:
        raise PodError(f"{path} has cluster.nodes = {c.nodes}, but {hosts} hosts were given",
                       f"set cluster.nodes = {hosts}, or name {c.nodes} host(s)")
    if nproc is not None and nproc != c.gpus_per_node:
        raise PodError(f"--nproc-per-node {nproc} disagrees with {path}'s cluster.gpus_per_node = {c.gpus_per_node}",
                       "leave --nproc-per-node out (the job decides), or change the job")
    return c.gpus_per_node


@dataclass
class Member:
    """A connected node: its spec, connection and how it runs."""

    spec: HostSpec
    conn: PodConnection
    node: Node | None = None
    job_id: str = ""
    changed: list[str] | None = None
    """Project files changed here since its last deploy (pods/sync.changed_since_deploy); None: not known."""
    python: str = "python3"
    """The node's interpreter (`interpreter`): torchrun's, and the network scripts' below."""


def _python(m: Member, script: str, *args: str) -> dict:
    """Run a short Python script on the node, under its interpreter."""
    cmd = shlex.join([m.python, "-c", script, *args])
    result = m.conn.run(cmd, timeout=60)
    lines = [line for line in result.stdout.splitlines() if line.startswith("{")]
    if not result.ok or not lines:
        detail = (result.stderr or result.stdout).strip().splitlines()
        raise PodError(f"could not read the network setup: {detail[-1] if detail else result.exit_code}",
                       f"check that {m.python} runs on the pod (deploy it first)")
    return json.loads(lines[-1])


def connect_all(specs: list[HostSpec], opts: PodOptions, say: Callable[[str], Callable[[str], None]],
                again: Callable[[str], str] = str) -> list[Member]:
    """Connect to every node at once; any that cannot be reached or was never deployed is one error. `again`: a
    pod's name with the reach options given (PodArgs.again), for the hints."""
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise PodError(f"a host is named twice in {','.join(names)}", "name each node once")

    def one(spec: HostSpec) -> Member:
        conn = connect(spec, opts, say(spec.name))
        try:
            fp, _, rdir = locate(conn, spec, opts.project)
            if not is_deployed(conn, rdir):
                raise PodError(f"{rdir} on {spec.name} was never deployed", f"run: bin/pod deploy {again(spec.reach)}, then re-run")
            python = interpreter(conn, fp, rdir, spec.python)
            changed = changed_since_deploy(conn, opts.project, rdir)
            if changed:
                say(spec.name)(changed_note(changed, again(spec.reach)))
        except BaseException:
            conn.close()
            raise
        return Member(spec, conn, changed=changed, python=python)

    with ThreadPoolExecutor(max_workers=min(16, len(specs))) as pool:
        futures = [pool.submit(one, s) for s in specs]
        members, error = [], None
        for spec, f in zip(specs, futures):
            try:
                members.append(f.result())
            except PodError as exc:
                error = error or (exc.on(spec.name) if not exc.host else exc)
    if error:
        for m in members:
            m.conn.close()
        raise error
    return members


def plan(members: list[Member], run_id: str, nproc: int | None) -> Rendezvous:
    """Pick the rendezvous: the first node's address at which every other node reaches a port free
    there; and each node's own address and interface on that route."""
    import secrets

    first, nonce = members[0], secrets.token_hex(16)
    me = _python(first, _SELF, nonce, str(LISTEN_S))
    try:
        candidates = [me["ssh_addr"]] if me["ssh_addr"] and not me["ssh_addr"].startswith("127.") else []
        candidates += [a for a in me["ifaces"].values() if a not in candidates]
        if not candidates:
            raise PodError(f"{first.spec.name} has no IPv4 address besides loopback",
                           "the nodes need a network between them")
        tried = []
        for host in candidates:
            with ThreadPoolExecutor(max_workers=len(members)) as pool:
                routes = list(pool.map(lambda m: _python(m, _ROUTE, host, str(me["port"]), nonce), members))
            if all(r["reachable"] for r in routes[1:]):
                for i, (m, r) in enumerate(zip(members, routes)):
                    m.node = Node(i, m.spec.name, host if i == 0 else r["addr"], r["iface"], nproc or _gpus(m.conn))
                return Rendezvous(host, me["port"], run_id, len(members))
            tried.append(f"{host}:{me['port']} (not from " + ", ".join(
                m.spec.name for m, r in zip(members[1:], routes[1:]) if not r["reachable"]) + ")")
        raise PodError(f"the other nodes cannot reach {first.spec.name}: tried {'; '.join(tried)}",
                       "the pods need a network between them (same region / cluster network, that port open), "
                       "or name first the pod the others reach")
    finally:
        # The port is torchrun's now (the listener never holds a connection's TIME_WAIT: clients close first).
        first.conn.run(f"kill {int(me['listener'])} 2>/dev/null; true", timeout=30)


def run_member(m: Member, run_id: str, again: Callable[[str], str] = str) -> tuple[str, Node, int | None]:
    """The job of run `run_id` on this node (start names it RUN-n<index>), the node it is, and how many nodes the
    run has (its run.json; None for a job started before podkit kept one), for following it again after the run's
    own client went away."""
    ids = [j.id for j in jobs.list_jobs(m.conn) if re.fullmatch(re.escape(run_id) + r"-n\d+", j.id)]
    if len(ids) != 1:
        found = f"{len(ids)} jobs of it ({', '.join(ids)})" if ids else "no job of it"
        raise PodError(f"run {run_id}: {m.spec.name} has {found}",
                       f"list them: bin/pod jobs {again(m.spec.reach)}; attach one by its id")
    index = int(ids[0].rsplit("-n", 1)[1])
    nodes = (jobs.run_of(m.conn, ids[0]) or {}).get("nodes")
    return ids[0], Node(index, m.spec.name, "", None, 0), nodes if isinstance(nodes, int) else None


def _gpus(conn: PodConnection) -> int:
    """torchrun's --nproc-per-node without a job: one process per GPU, one on a CPU pod."""
    result = conn.run("nvidia-smi -L 2>/dev/null | grep -c '^GPU'", timeout=60)
    count = result.stdout.strip()
    return int(count) if count.isdigit() and int(count) > 0 else 1


STOP_GRACE = 10.0
"""Seconds a job of a world that never formed gets between SIGTERM and SIGKILL: it has trained nothing to save."""


def start(members: list[Member], rdzv: Rendezvous, command: tuple[str, ...], say: Callable[[str], None],
          again: Callable[[str], str], opts: PodOptions) -> None:
    """Start COMMAND on every node (launch_command, under each node's interpreter), the rendezvous host first;
    one that cannot start stops the rest, and its own job where that started all the same. `again`: a pod's name
    with the reach options given (PodArgs.again), for the hints; `opts`: how to reach a node again."""
    started: list[Member] = []
    for m in members:
        job_id = f"{rdzv.run_id}-n{m.node.index}"
        try:
            m.job_id = jobs.start(m.conn, launch_command(command, m.python), job_id, again=again(m.spec.reach),
                                  env=rdzv.env(m.node), env_defaults=rdzv.env_defaults(m.node),
                                  run={"run_id": rdzv.run_id, "node": m.node.index, "nodes": rdzv.nodes})
        except PodError as exc:
            why = f"node {m.node.index} ({m.spec.name}) could not start"
            for s in started:
                _stop_job(s.conn, s, s.job_id, say, again, why)
            if isinstance(exc, jobs.StartRefused):
                pass  # nothing started
            elif isinstance(exc, jobs.StartFailed):  # its launcher failed, perhaps after starting the job
                if exc.state != "absent":
                    _stop_job(m.conn, m, job_id, say, again, f"{why} (its launcher failed after starting the job)")
            else:
                _stop_cut_start(m, job_id, opts, say, again, f"{why} (its link failed during the start)")
                # the connection's own fix ("re-run; it continues where it stopped") is a deploy's: a run does not
                # continue, it starts a new world
                exc = PodError(exc.problem, "re-run to start the run again: the lines above say which node's job "
                               "was stopped, and how to stop one that could not be", exc.host, exc.field)
            raise (exc.on(m.spec.name) if not exc.host else exc) from None
        except KeyboardInterrupt:
            # Ctrl-C while starting: a world of some nodes never forms, and re-running would start a second one
            # beside it. Stop what started, and the start in flight as a cut one: its launcher was ended with the
            # connection's other processes (PodConnection.run: stop_remote), but its job may have started.
            for s in started:
                _stop_job(s.conn, s, s.job_id, say, again, "interrupted while starting")
            _stop_cut_start(m, job_id, opts, say, again, "interrupted while starting")
            raise
        started.append(m)
        say(f"job {m.job_id} started on {m.spec.name} (node {m.node.index} of {rdzv.nodes}, {m.node.nproc} "
            f"process(es), via {m.node.address}{' ' + m.node.interface if m.node.interface else ''})")


def _stop_job(conn: PodConnection, m: Member, job_id: str, say: Callable[[str], None], again: Callable[[str], str],
              why: str) -> None:
    """Stop a job of a world that never formed and say so (`why`: what ended it); where that fails, say how the
    user can. A Ctrl-C ends this stop only: the next node's is still tried."""
    try:
        say(f"{why}: job {job_id} on {m.spec.name} {jobs.stop(conn, job_id, STOP_GRACE, again=again(m.spec.reach))}")
    except (PodError, KeyboardInterrupt) as exc:
        say(f"{why}: could not stop job {job_id} on {m.spec.name} ({exc or 'interrupted'}); stop it with: "
            f"bin/pod stop {again(m.spec.reach)} {job_id}")


def _stop_cut_start(m: Member, job_id: str, opts: PodOptions, say: Callable[[str], None],
                    again: Callable[[str], str], why: str) -> None:
    """The node's start was cut (its link failed, or a Ctrl-C) while its job was starting: it may have started, or
    still start once the launcher goes on. Over a fresh connection, end that launcher first (it carries the lost connection's PODKIT_SESSION
    tag, as everything that connection started: pods/connection.py), so that nothing starts after the look;
    then stop the job if it started. Where the node cannot be reached, say how the user can check and stop it."""
    hint = f"check with bin/pod jobs {again(m.spec.reach)}, stop it with: bin/pod stop {again(m.spec.reach)} {job_id}"
    try:
        with connect(m.spec, opts, lambda _line: None) as conn:
            locate(conn, m.spec, opts.project)
            conn.run(stop_script(f"PODKIT_SESSION={m.conn.tag}", STOP_GRACE), timeout=STOP_GRACE + 60)
            state = jobs.start_state(conn, job_id)
            if state == "absent":
                say(f"{why}: job {job_id} did not start on {m.spec.name}")
                return
            _stop_job(conn, m, job_id, say, again, why)
    except (PodError, KeyboardInterrupt) as exc:
        say(f"{why}: job {job_id} may have started on {m.spec.name}, which could not be asked ({exc or 'interrupted'})"
            f": {hint}")


def follow(members: list[Member], opts: PodOptions, printer: Callable[[str], Callable[[str], None]],
           say: Callable[[str], None], grace: float = 30.0, again: Callable[[str], str] = str) -> tuple[int, str | None]:
    """Stream every node's output (prefixed by the printer) until all end. The first node to fail
    (a nonzero exit, or a lost link) has the others stopped. Returns (exit code, error line)."""
    ended: queue.Queue = queue.Queue()

    def watch(m: Member) -> None:
        try:
            ended.put((m, jobs.attach(m.conn, m.job_id, printer(m.spec.name), again=again(m.spec.reach)), None))
        except PodError as exc:
            ended.put((m, None, exc))
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            ended.put((m, None, PodError(f"{type(exc).__name__}: {exc}")))

    threads = [threading.Thread(target=watch, args=(m,), daemon=True, name=f"follow-{m.spec.name}") for m in members]
    for t in threads:
        t.start()
    code, error, stopped = 0, None, False
    for _ in members:
        m, rc, exc = ended.get()
        if exc is not None:
            error = error or f"{m.spec.name}: {exc.problem}; its job {m.job_id} may still run there"
            rc = 2
        why = "lost" if exc else f"exited {rc}"
        if rc is None:  # the job ended without an exit code (killed with its wrapper): a failure, 1 as bin/pod's
            rc, why = 1, "lost its job (no exit code: killed, or the pod restarted)"
        if rc != 0 and not stopped:
            code, stopped = rc, True
            say(f"node {m.node.index} ({m.spec.name}) {why}: stopping the others")
            _stop_others(members, m, opts, say, grace, again)
    for t in threads:
        t.join(timeout=5)
    return code, error


def _stop_others(members: list[Member], failed: Member, opts: PodOptions, say: Callable[[str], None],
                 grace: float, again: Callable[[str], str] = str) -> None:
    """jobs.stop on every other node, each over a connection of its own (the first one is busy
    streaming); in parallel, so a slow node does not hold the rest."""
    def stop(m: Member) -> None:
        try:
            with connect(m.spec, opts, lambda _line: None) as conn:
                locate(conn, m.spec, opts.project)
                say(f"node {m.node.index} ({m.spec.name}): job {m.job_id} "
                    f"{jobs.stop(conn, m.job_id, grace, again=again(m.spec.reach))}")
        except PodError as exc:
            say(f"node {m.node.index} ({m.spec.name}): could not stop job {m.job_id}: {exc} "
                f"(stop it with: bin/pod stop {again(m.spec.reach)} {m.job_id})")

    with ThreadPoolExecutor(max_workers=len(members)) as pool:
        list(pool.map(stop, [m for m in members if m is not failed]))
