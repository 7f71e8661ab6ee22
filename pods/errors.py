"""The one error a pod command shows: what went wrong on which host, and what to do. Exit code 2."""


class PodError(Exception):
    """Bad host input or a connection/transfer fault. Printed as one line; never a traceback."""

    def __init__(self, problem: str, fix: str = "", host: str = "", field: str = ""):
        self.problem = problem
        self.fix = fix
        self.host = host
        self.field = field  # the input at fault, for --json's error.field (e.g. a job key); the line says it in problem
        super().__init__(str(self))

    def on(self, host: str) -> "PodError":
        """The same error, labelled with the pod it happened on."""
        return PodError(self.problem, self.fix, host, self.field)

    def __str__(self) -> str:
        where = f"{self.host}: " if self.host else ""
        fix = f" ({self.fix})" if self.fix else ""
        return f"{where}{self.problem}{fix}"


class Unreachable(PodError):
    """Nothing answered as this pod's sshd at its address (refused, silent, unresolvable): for a pod
    podkit brought up, the cue to ask the provider where it went (pods/provision.relocate)."""


class OutputClosed(Exception):
    """This side's stdout was closed by its reader (`bin/pod run ... | head`): not the link's fault."""
