"""normgrad.Error and its subclass per gRPC code (normgrad.InvalidArgumentError, ...): what a
failed call raises, with the gRPC code's name and the server's message unchanged."""


class Error(Exception):
    """A failed call: .code is the gRPC status code's name ("INVALID_ARGUMENT", ...), .message
    the server's (or the C++ client's) message, unchanged."""

    __module__ = "normgrad"

    code = "UNKNOWN"

    def __init__(self, code, message):
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


def _error_class(code):
    name = "".join(part.capitalize() for part in code.split("_")) + "Error"
    return type(name, (Error,), {"code": code, "__module__": "normgrad",
                                 "__doc__": f"normgrad.Error with code {code}."})


# One subclass per gRPC code, e.g. normgrad.InvalidArgumentError for INVALID_ARGUMENT.
_ERROR_CLASSES = {code: _error_class(code) for code in (
    "CANCELLED", "UNKNOWN", "INVALID_ARGUMENT", "DEADLINE_EXCEEDED", "NOT_FOUND",
    "ALREADY_EXISTS", "PERMISSION_DENIED", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION",
    "ABORTED", "OUT_OF_RANGE", "UNIMPLEMENTED", "INTERNAL", "UNAVAILABLE", "DATA_LOSS",
    "UNAUTHENTICATED")}


def _make_error(code, message):
    return _ERROR_CLASSES.get(code, Error)(code, message)
