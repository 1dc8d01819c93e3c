"""Exceptions that keep the server's error structure: the gRPC code, the message, the
google.rpc.Status details (CacheConfig violations) and the numbers of a RESOURCE_EXHAUSTED."""

from __future__ import annotations

import re
from typing import Any, Optional

import grpc

from ._vendor.google.rpc import error_details_pb2, status_pb2

STATUS_DETAILS_KEY = "grpc-status-details-bin"
_BAD_REQUEST_TYPE = "google.rpc.BadRequest"
_ERROR_INFO_TYPE = "google.rpc.ErrorInfo"


class PagedAttnError(Exception):
    """An RPC failed. `code` is the grpc.StatusCode, `message` the server's message, `status`
    the google.rpc.Status from the trailer when the server sent one (else None)."""

    def __init__(
        self,
        message: str,
        code: Optional[grpc.StatusCode] = None,
        status: Optional[Any] = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.code = code
        self.status = status

    def __str__(self) -> str:
        return f"{self.code.name}: {self.message}" if self.code is not None else self.message


class ClientClosed(PagedAttnError):
    """A call on a client after its close() (or the end of its `with` block): no RPC was sent.
    `code` is None. Make a new client."""


class InvalidArgument(PagedAttnError):
    """INVALID_ARGUMENT: a bad field (shapes, dtypes, spans, a limit)."""


class CacheConfigError(InvalidArgument):
    """INVALID_ARGUMENT for a CacheConfig (or a cache's name: the field "name", listed before
    the config's), with every violation as (field, description) in `violations`, taken from the
    google.rpc.BadRequest in the status details."""

    # (Every argument but the message has a default: unpickling, as a process pool does with a
    # worker's exception, calls cls(message) and then restores the attributes.)
    def __init__(self, message: str, code: Any = None, status: Any = None,
                 violations: Optional[list[tuple[str, str]]] = None) -> None:
        super().__init__(message, code, status)
        self.violations = list(violations or [])

    @property
    def fields(self) -> list[str]:
        """The names of the offending fields, in the server's order."""
        return [f for f, _ in self.violations]


class NotFound(PagedAttnError):
    """NOT_FOUND: an unknown cache or memory region, or an attend-only span on an unknown
    sequence."""


class FailedPrecondition(PagedAttnError):
    """FAILED_PRECONDITION: a span's start leaves a gap after the sequence's length, or device
    tensors (RegisterMemory) asked of a server whose backend is not CUDA."""


class Unauthenticated(PagedAttnError):
    """UNAUTHENTICATED: a missing or unknown bearer token."""


class PermissionDenied(PagedAttnError):
    """PERMISSION_DENIED."""


class Unavailable(PagedAttnError):
    """UNAVAILABLE: the server cannot be reached, or is shutting down."""


class DeadlineExceeded(PagedAttnError):
    """DEADLINE_EXCEEDED: the per-call timeout ran out."""


# RESOURCE_EXHAUSTED messages carry their numbers; each pattern names the attributes it fills.
_NUMBER_PATTERNS = [
    re.compile(
        r"needs (?P<pages_needed>\d+) more pages? of (?P<page_size>\d+) tokens?, "
        r"(?P<free_pages>\d+) of (?P<total_pages>\d+) are free"
    ),
    re.compile(r"need (?P<pages_needed>\d+) more, (?P<free_pages>\d+) of (?P<total_pages>\d+) free"),
    re.compile(
        r"needs (?P<bytes_needed>\d+) bytes \((?P<num_pages>\d+) pages x (?P<bytes_per_page>\d+) "
        r"bytes\) but only (?P<free_bytes>\d+) bytes are free "
        r"(?:on device (?P<device>\d+)|in host memory \(the CPU backend's\)); "
        r"at most (?P<max_pages>\d+) pages"
    ),
    re.compile(
        r"length (?P<sequence_length>\d+) exceeds the cache's capacity of "
        r"(?P<capacity_tokens>\d+) tokens"
    ),
    re.compile(r"could not allocate (?P<bytes_needed>\d+) bytes"),
    re.compile(r"at most (?P<max_caches>\d+) caches? per tenant"),
    re.compile(r"larger than max \((?P<message_bytes>\d+) vs\. (?P<max_message_bytes>\d+)\)"),
]
# Numbers the server sends only as google.rpc.ErrorInfo metadata (no older message states them).
_INFO_ONLY_FIELDS = {
    "budget_bytes", "bytes_in_flight", "max_request_bytes", "request_bytes", "response_bytes"
}
_NUMBER_FIELDS = sorted(
    {name for p in _NUMBER_PATTERNS for name in p.groupindex} | _INFO_ONLY_FIELDS
)


class ResourceExhausted(PagedAttnError):
    """RESOURCE_EXHAUSTED, with its numbers as attributes (None when absent): the server's
    google.rpc.ErrorInfo metadata (`reason` names the case), else the numbers the message states.
    out of pages (OutOfPages): pages_needed, free_pages, total_pages, page_size;
    pool too big (POOL_TOO_LARGE): bytes_needed, num_pages, bytes_per_page, free_bytes, device,
    max_pages; sequence too long (SEQUENCE_TOO_LONG): sequence_length, capacity_tokens;
    cache limit (TOO_MANY_CACHES): max_caches; server busy (SERVER_BUSY): bytes_in_flight,
    bytes_needed, budget_bytes; answer too large (RESPONSE_TOO_LARGE): response_bytes,
    max_message_bytes; request too large to parse (REQUEST_TOO_LARGE: not Forward's or Step's,
    or a health or reflection request past its bound): request_bytes, max_request_bytes; gRPC's
    own message limit: message_bytes, max_message_bytes."""

    budget_bytes: Optional[int]
    bytes_in_flight: Optional[int]
    bytes_needed: Optional[int]
    bytes_per_page: Optional[int]
    capacity_tokens: Optional[int]
    device: Optional[int]
    free_bytes: Optional[int]
    free_pages: Optional[int]
    max_caches: Optional[int]
    max_message_bytes: Optional[int]
    max_pages: Optional[int]
    max_request_bytes: Optional[int]
    message_bytes: Optional[int]
    num_pages: Optional[int]
    page_size: Optional[int]
    pages_needed: Optional[int]
    request_bytes: Optional[int]
    response_bytes: Optional[int]
    sequence_length: Optional[int]
    total_pages: Optional[int]

    reason: Optional[str]  # google.rpc.ErrorInfo's reason ("OUT_OF_PAGES", "SERVER_BUSY", ...)

    def __init__(self, message: str, code: Any = None, status: Any = None) -> None:
        super().__init__(message, code, status)
        for name in _NUMBER_FIELDS:
            setattr(self, name, None)
        info = _error_info(status)
        self.reason = info[0] if info else None
        if info:
            # The server's numbers as it sent them (google.rpc.ErrorInfo metadata).
            for name, value in info[1].items():
                try:
                    setattr(self, name, int(value))
                except ValueError:
                    setattr(self, name, value)
            return
        # Older servers, and gRPC's own limits: the numbers the message states.
        for pattern in _NUMBER_PATTERNS:
            m = pattern.search(message)
            if m:
                for name, value in m.groupdict().items():
                    if value is not None:  # a group of an alternative not taken
                        setattr(self, name, int(value))


class OutOfPages(ResourceExhausted):
    """The cache has too few free pages for a Forward: pages_needed, free_pages, total_pages
    (and page_size). Release finished sequences or create a larger cache."""


_BY_CODE = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument,
    grpc.StatusCode.NOT_FOUND: NotFound,
    grpc.StatusCode.FAILED_PRECONDITION: FailedPrecondition,
    grpc.StatusCode.UNAUTHENTICATED: Unauthenticated,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDenied,
    grpc.StatusCode.UNAVAILABLE: Unavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhausted,
}


def _status_details(trailing_metadata: Any) -> Optional[Any]:
    for key, value in trailing_metadata or ():
        if key == STATUS_DETAILS_KEY:
            status = status_pb2.Status()
            status.ParseFromString(value)
            return status
    return None


def _violations(status: Any) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    if status is None:
        return out
    for detail in status.details:
        if detail.type_url.rsplit("/", 1)[-1] == _BAD_REQUEST_TYPE:
            bad = error_details_pb2.BadRequest()
            bad.ParseFromString(detail.value)
            out += [(v.field, v.description) for v in bad.field_violations]
    return out


def _error_info(status: Any) -> Optional[tuple[str, dict[str, str]]]:
    if status is None:
        return None
    for detail in status.details:
        if detail.type_url.rsplit("/", 1)[-1] == _ERROR_INFO_TYPE:
            info = error_details_pb2.ErrorInfo()
            info.ParseFromString(detail.value)
            return info.reason, dict(info.metadata)
    return None


def from_rpc_error(error: grpc.RpcError) -> PagedAttnError:
    """The pagedattn exception for a failed call (sync grpc.RpcError or grpc.aio.AioRpcError)."""
    code = error.code() if hasattr(error, "code") else grpc.StatusCode.UNKNOWN
    message = (error.details() if hasattr(error, "details") else None) or str(error)
    metadata = error.trailing_metadata() if hasattr(error, "trailing_metadata") else None
    return _exception(code, message, _status_details(metadata))


_CODES = {c.value[0]: c for c in grpc.StatusCode}


def from_status(status: Any) -> PagedAttnError:
    """The pagedattn exception for a google.rpc.Status, e.g. a Step stream's per-layer error
    (StepResponse.error): the same type and attributes as the failed unary call would raise."""
    code = _CODES.get(status.code, grpc.StatusCode.UNKNOWN)
    return _exception(code, status.message, status)


def _exception(code: grpc.StatusCode, message: str, status: Optional[Any]) -> PagedAttnError:
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        violations = _violations(status)
        if violations:
            return CacheConfigError(message, code, status, violations)
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        info = _error_info(status)
        if (info and info[0] == "OUT_OF_PAGES") or (not info and message.startswith("out of KV pages")):
            return OutOfPages(message, code, status)
    return _BY_CODE.get(code, PagedAttnError)(message, code, status)
