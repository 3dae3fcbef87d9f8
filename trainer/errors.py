"""User errors: bad input that stops the run with one clear paragraph and no traceback."""


class UserError(Exception):
    """A problem with the user's input (config, data, topology); the message names what is at fault.

    ``collective`` is true when every rank raised the same error (a deterministic check, or one agreed on with
    a collective), so only rank 0 needs to report it; ``rank`` is then the rank that found it, when known.
    """

    def __init__(self, message: str, *, collective: bool = False, rank: int | None = None) -> None:
        super().__init__(message)
        self.collective = collective
        self.rank = rank


def first_line(exc: BaseException) -> str:
    """``Type: the first line of the message`` (at most 300 characters of it): how an error from the user's code
    or from torch is quoted in a one-paragraph message."""
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0][:300]}" if lines else type(exc).__name__


def error_of(check) -> str | None:
    """The message of the UserError ``check()`` raises, or None: what a rank hands ``agree`` so that every rank
    stops with it."""
    try:
        check()
    except UserError as exc:
        return str(exc)
    return None
