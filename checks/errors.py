"""The one error type a user sees for bad input: a message naming the field and the fix."""


class ConfigError(ValueError):
    """Bad input (config, model, GPU name, CLI option). Every command maps it to exit code 2."""

    def __init__(self, field: str, problem: str, fix: str = ""):
        from podkit.envsetup.secrets import without_tokens  # an error may quote a value a token was folded into

        self.field = without_tokens(field)
        self.problem = without_tokens(problem)
        self.fix = without_tokens(fix)
        super().__init__(str(self))

    def to_json(self) -> dict:
        """What --json prints on stdout for bad input (the one line still goes to stderr)."""
        return {"ok": False, "status": "bad-input", "exit_code": 2,
                "error": {"field": self.field, "problem": self.problem, "fix": self.fix}}

    def __str__(self) -> str:
        where = f"{self.field}: " if self.field else ""
        fix = f" ({self.fix})" if self.fix else ""
        return f"{where}{self.problem}{fix}"


def closest(name: str, choices) -> str:
    """'did you mean X?' for a mistyped name, or '' when nothing is close."""
    import difflib

    lowered = {c.lower(): c for c in choices}
    # A name that is the start of exactly one choice means that one ('fp16' is 'fp16-mixed', not 'bf16').
    prefixed = [c for c in lowered if c.startswith(name.lower())] if name else []
    if len(prefixed) == 1:
        return f"did you mean '{lowered[prefixed[0]]}'?"
    match = difflib.get_close_matches(name.lower(), list(lowered), n=1, cutoff=0.5)
    return f"did you mean '{lowered[match[0]]}'?" if match else ""
