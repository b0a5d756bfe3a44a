"""Errors of the ubatch runtime."""


class UBatchTimeoutError(TimeoutError):
    """A ubatch held the turn longer than the run's timeout without handing it back."""

    def __init__(self, stuck_ubatch: int, timeout: float):
        super().__init__(
            f"ubatch {stuck_ubatch} did not hand back the turn within {timeout:g} s "
            f"(blocked in a collective, a receive or a host sync?); the run was aborted"
        )
        self.stuck_ubatch = stuck_ubatch
        self.timeout = timeout


class UBatchAborted(BaseException):
    """Raised inside a ubatch when another ubatch of the same run failed.

    A `BaseException`, like `GreenletExit`, so that model code catching `Exception` does not
    swallow it and carry on with a run that is already lost.
    """
