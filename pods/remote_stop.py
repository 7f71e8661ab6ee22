"""Stopping a tree of processes on the pod by the tag in their environment.

A process tree cannot be found by parentage alone: torchrun puts each worker in a session of its
own and a killed parent leaves its children to PID 1. The environment is inherited through all of
that, so podkit tags what it starts (PODKIT_SESSION for an invocation's commands, PODKIT_JOB_ID
for a detached job) and stops whatever carries the tag: SIGTERM first, so training writes its
summary, SIGKILL for what is left after the grace period. A detached job is also found by its
session (its wrapper is started with setsid): a process that cleared its environment (`env -i`) but
never left the session is still the job's.
"""

from __future__ import annotations

import shlex

# grep -z reads /proc/PID/environ's NUL-separated entries as lines; zombies have an empty environ.
_SCRIPT = r'''
{session}tagged() {{ {{ grep -lzxF {tag} /proc/[0-9]*/environ 2>/dev/null | sed 's|/proc/\([0-9]*\)/environ|\1|'; in_session; }} | sort -u | grep -vx -e "$$" {spare}; }}
pids=$(tagged); [ -z "$pids" ] && {{ echo "stopped 0"; exit 0; }}
n=$(echo $pids | wc -w)
kill -TERM $pids 2>/dev/null
i=0
while [ $i -lt {ticks} ]; do sleep 0.5; pids=$(tagged); [ -z "$pids" ] && {{ echo "stopped $n"; exit 0; }}; i=$((i+1)); done
kill -KILL $pids 2>/dev/null; sleep 0.5
pids=$(tagged); [ -z "$pids" ] && {{ echo "killed $n"; exit 0; }}
echo "left $pids"; exit 1
'''


# /proc/PID/stat: "pid (comm) state ppid pgrp session ...", comm perhaps holding spaces and ") ": the fields are
# matched after the last ") ". The session is taken only from a wrapper that still carries the job's tag and
# leads its own session, never from a pid reused by another process after the wrapper died. A zombie (state Z:
# dead, its parent yet to reap it) is no process to stop, and would read as one left running.
_SESSION = r'''sid=
if grep -qzxF {tag} /proc/${spare}/environ 2>/dev/null; then
  sid=$(sed -n 's/.*) [^ ]* [^ ]* [^ ]* \([0-9]*\) .*/\1/p' /proc/${spare}/stat 2>/dev/null)
  [ "$sid" = "${spare}" ] || sid=
fi
in_session() {{ [ -n "$sid" ] || return 0
  grep -s -H '' /proc/[0-9]*/stat | sed -n "s|^/proc/\([0-9]*\)/stat:.*) [^Z ] [^ ]* [^ ]* $sid .*|\1|p"; }}
'''


def stop_script(tag: str, grace: float, spare_var: str = "") -> str:
    """Shell that stops every process whose environment holds `tag` (NAME=value), except the pid
    in shell variable `spare_var` (set by the caller's script). With `spare_var`, the processes of that
    pid's session too: it is a detached job's wrapper, which setsid made a session leader."""
    session = _SESSION.format(tag=shlex.quote(tag), spare=spare_var) if spare_var else "in_session() { true; }\n"
    return _SCRIPT.format(tag=shlex.quote(tag), ticks=max(1, int(grace * 2)), session=session,
                          spare=f'-e "${{{spare_var}:-0}}"' if spare_var else "")
