"""The one exception type the estimator raises for bad input."""


class EstimatorInputError(ValueError):
    """A user-facing input problem; its message is one line saying what to change.

    The CLI turns it into ``error: <message>`` and exit code 2, never a traceback.
    """
