"""User-facing errors: the CLI prints their message as one line and exits non-zero."""


class GrpoError(Exception):
    """A user-facing error: the CLI prints its message as one line and exits 2."""


class SignalStop(BaseException):
    """SIGTERM (or SIGINT) outside the training loop's step boundaries, e.g. during an
    evaluation stage of `grpo pipeline`: raised by the application's signal handler, so it
    unwinds like KeyboardInterrupt. Code that isolates user functions (rewards, environments,
    plug-ins) lets it through, never reporting it as the function's error."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum
