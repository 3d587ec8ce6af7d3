"""The error hierarchy. Library code raises these; only the CLI catches and prints them."""

from __future__ import annotations

from typing import Any


class ShipyardError(Exception):
    """Base of every error a user can cause and fix. `exit_code` is the CLI's exit status."""

    exit_code = 1

    def render(self) -> str:
        return str(self)


class SpecError(ShipyardError):
    """A release spec is invalid. Each problem is `file:line: field.path: message`."""

    exit_code = 2

    def __init__(self, path: str, problems: list[str]) -> None:
        self.path = path
        self.problems = problems
        super().__init__("\n".join(problems))


class StageError(ShipyardError):
    """A stage failed for a reason the user can act on."""

    exit_code = 3

    def __init__(self, stage: str, message: str, hint: str = "") -> None:
        self.stage = stage
        self.message = message
        self.hint = hint
        super().__init__(f"{stage}: {message}" + (f"\n  fix: {hint}" if hint else ""))

    def __reduce__(self) -> tuple[Any, tuple[str, str, str]]:
        """Pickled by its parts: a stage's child process raises it to the parent."""
        return (type(self), (self.stage, self.message, self.hint))


class Refused(StageError):
    """A stage failed, raised by code several stages share (stages/onnx, quant, serving,
    loadtesting, tensorrt, bundling). It does not know which stage runs it, and need not:
    the runner reports it as the running stage's failure."""

    def __init__(self, message: str, hint: str = "", stage: str = "") -> None:
        self.stage = stage
        self.message = message
        self.hint = hint
        ShipyardError.__init__(
            self, (f"{stage}: " if stage else "") + message + (f"\n  fix: {hint}" if hint else "")
        )

    def __reduce__(self) -> tuple[Any, tuple[str, str, str]]:
        return (type(self), (self.message, self.hint, self.stage))


class GateError(ShipyardError):
    """A release did not pass the gate."""

    exit_code = 4


class RegistryError(ShipyardError):
    """The registry refused an operation (tampered bundle, digest conflict, unknown channel)."""

    exit_code = 5


# The CLI's exit codes, one per class of mistake, whatever the command (`shipyard --help`
# prints this table; argparse's own usage errors exit 2 as well).
EXIT_CODES: dict[int, str] = {
    0: "done",
    ShipyardError.exit_code: "an error without a class of its own",
    SpecError.exit_code: "a release spec, a flag or an argument is wrong",
    StageError.exit_code: "a stage failed (its report says why)",
    GateError.exit_code: "the gate failed: a stage did not pass or a metric regressed",
    RegistryError.exit_code: "the registry or a bundle refused: tampered, missing, conflicting",
}
