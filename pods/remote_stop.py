"""Stopping a tree of processes on the pod by the tag in their environment.

A process tree cannot be found by parentage alone: torchrun puts each worker in a session of its
own and a killed parent leaves its children to PID 1. The environment is inherited through all of
that, so podkit tags what it starts (PODKIT_SESSION for an invocation's commands, PODKIT_JOB_ID
for a detached job) and stops whatever carries the tag: SIGTERM first, so training writes its
summary, SIGKILL for what is left after the grace period. A detached job is also found by its
session (its wrapper is started with setsid): a process that cleared its environment (`env -i`) but
never left the session is still the job's. One that did both (`sudo` under Debian's `Defaults use_pty`
drops the tag and runs the command in a session of its own; `setsid env -i CMD`) is found by parentage:
a process with no podkit tag of its own is its parent's, taken before any signal is sent and kept while it
is the same process (its start time), since the SIGKILL of its parent hands it to PID 1. A process
with a tag of its own is never its parent's: a detached job or the cost guard, started from an
invocation's shell, is not stopped with that invocation. `jobs` counts what a job left running by the
same rule (owners_script).
"""

from __future__ import annotations

import shlex

# The tags podkit gives what it starts (pods/shell.py, jobs.py, cost_guard.py): a process that carries one is
# that tag's, never its parent's.
_TAGS = ("PODKIT_SESSION", "PODKIT_SHELL", "PODKIT_JOB_ID", "PODKIT_GUARD")

# _procs: every live process as "P PID <its /proc/PID/stat after the comm>", so that field N of stat (proc(5)) is
# awk's $N: 3 state, 4 parent pid, 22 start time (clock ticks after boot: a pid reused by another process has
# another); then "T PID NAME=value" for each podkit tag in its environment (grep -z reads environ's NUL-separated
# entries as lines). The comm may hold spaces and ") ": the fields are matched after the last ") ".
# _owned (awk): a process's tags are its own, or else, tagless, its parent's (and so on up): what cleared its
# environment is still the process that started it. Fed "S PID" (a member of the job's session: in_session) and
# "K PID START" (found by an earlier look: still the tag's while its start time is the same, as the SIGKILL of
# its parent hands it to PID 1) as the tag's too. With `want`, it prints "PID START" of the tag's processes, else
# each process's tags one a line. Never the stop's own shell ($$) or anything under it (its pipeline), nor
# `spare`, nor a zombie (state Z: dead, its parent yet to reap it; no process to stop, and it would read as one
# left running). The depth limit guards against a loop in a snapshot read while pids were reused.
# LC_ALL=C: under a UTF-8 locale GNU grep takes a file with a byte sequence that is no UTF-8 (a comm the kernel cut
# inside a character, a Latin-1 environment value) for binary and prints no line of it (grep 3.8), and sed's `.`
# matches no such byte: that process would be no process here.
_DEFS = r'''export LC_ALL=C
_procs() {{ grep -s -H '' /proc/[0-9]*/stat | sed -n 's|^/proc/\([0-9]*\)/stat:.*) |P \1 |p'
  grep -s -H -z {tags} /proc/[0-9]*/environ | tr '\0' '\n' | sed -n 's|^/proc/\([0-9]*\)/environ:|T \1 |p'; }}
_owned='
function add(p, t) {{ if (index(tags[p] SUBSEP, SUBSEP t SUBSEP) == 0) tags[p] = tags[p] SUBSEP t }}
function owners(p, d) {{ if (p in tags) return tags[p]; return (d < 64 && (p in up)) ? owners(up[p], d + 1) : "" }}
function mine(p, d) {{ return p == self || (d < 64 && (p in up) && mine(up[p], d + 1)) }}
$1 == "P" {{ state[$2] = $3; up[$2] = $4; start[$2] = $22; next }}
$1 == "T" {{ t = $0; sub(/^T [0-9]+ /, "", t); add($2, t); next }}
$1 == "S" {{ add($2, want); next }}
$1 == "K" {{ was[$2] = $3 }}
END {{ for (p in was) if (p in start && start[p] == was[p]) add(p, want)
  for (p in state) if (state[p] != "Z" && p != spare && !mine(p, 0)) {{
    n = split(owners(p, 0), got, SUBSEP)
    for (i = 2; i <= n; i++) if (want == "") print got[i]; else if (got[i] == want) print p, start[p] }} }}'
'''.format(tags=" ".join(f"-e '^{t}='" for t in _TAGS))

# `kept` holds the "PID START" lines of the last look, so each look keeps what the one before found (see _owned).
_SCRIPT = r'''
{defs}{session}kept=
tagged() {{ {{ _procs; in_session | sed 's/^/S /'; printf '%s\n' "$kept" | sed -n 's/^[0-9]/K &/p'; }} | awk -v want={tag} -v self=$$ -v spare={spare} "$_owned"; }}
pids() {{ printf '%s\n' "$kept" | cut -d' ' -f1 | sort -n; }}
kept=$(tagged); [ -z "$kept" ] && {{ echo "stopped 0"; exit 0; }}
n=$(pids | wc -l)
kill -TERM $(pids) 2>/dev/null
i=0
while [ $i -lt {ticks} ]; do sleep 0.5; kept=$(tagged); [ -z "$kept" ] && {{ echo "stopped $n"; exit 0; }}; i=$((i+1)); done
kill -KILL $(pids) 2>/dev/null; sleep 0.5
kept=$(tagged); [ -z "$kept" ] && {{ echo "killed $n"; exit 0; }}
echo "left" $(pids); exit 1
'''


# The session is taken only from a wrapper that still carries the job's tag and leads its own session, never from
# a pid reused by another process after the wrapper died; zombies are left out (see _owned).
_SESSION = r'''sid=
if grep -qzxF {tag} /proc/${spare}/environ 2>/dev/null; then
  sid=$(sed -n 's/.*) [^ ]* [^ ]* [^ ]* \([0-9]*\) .*/\1/p' /proc/${spare}/stat 2>/dev/null)
  [ "$sid" = "${spare}" ] || sid=
fi
in_session() {{ [ -n "$sid" ] || return 0
  grep -s -H '' /proc/[0-9]*/stat | sed -n "s|^/proc/\([0-9]*\)/stat:.*) [^Z ] [^ ]* [^ ]* $sid .*|\1|p"; }}
'''


def stop_script(tag: str, grace: float, spare_var: str = "") -> str:
    """Shell that stops every process of `tag` (NAME=value): those whose environment holds it, and what they
    started that carries no tag of its own, except the pid in shell variable `spare_var` (set by the caller's
    script). With `spare_var`, the processes of that pid's session too: it is a detached job's wrapper, which
    setsid made a session leader."""
    session = _SESSION.format(tag=shlex.quote(tag), spare=spare_var) if spare_var else "in_session() { true; }\n"
    return _SCRIPT.format(tag=shlex.quote(tag), ticks=max(1, int(grace * 2)), session=session, defs=_DEFS,
                          spare=f'"${{{spare_var}:-0}}"' if spare_var else "0")


def owners_script() -> str:
    """Shell that prints, for every live process, each tag (NAME=value) it is a process of by stop_script's rule,
    one a line: what `jobs` counts as left running by a job that no longer runs is what `stop` would stop."""
    return _DEFS + '_procs | awk -v want= -v self=$$ -v spare=0 "$_owned"\n'
