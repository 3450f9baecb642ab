import datetime

from google.protobuf import duration_pb2 as _duration_pb2
from google.protobuf import timestamp_pb2 as _timestamp_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RecordState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    RECORD_STATE_UNSPECIFIED: _ClassVar[RecordState]
    RECORD_STATE_CLAIMED: _ClassVar[RecordState]
    RECORD_STATE_COMMITTED: _ClassVar[RecordState]
    RECORD_STATE_RELEASED: _ClassVar[RecordState]

class ClaimOutcome(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CLAIM_OUTCOME_UNSPECIFIED: _ClassVar[ClaimOutcome]
    CLAIM_OUTCOME_CLAIMED: _ClassVar[ClaimOutcome]
    CLAIM_OUTCOME_DUPLICATE: _ClassVar[ClaimOutcome]
    CLAIM_OUTCOME_IN_PROGRESS: _ClassVar[ClaimOutcome]
    CLAIM_OUTCOME_FINGERPRINT_MISMATCH: _ClassVar[ClaimOutcome]
    CLAIM_OUTCOME_STALE: _ClassVar[ClaimOutcome]

class CommitOutcome(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    COMMIT_OUTCOME_UNSPECIFIED: _ClassVar[CommitOutcome]
    COMMIT_OUTCOME_COMMITTED: _ClassVar[CommitOutcome]
    COMMIT_OUTCOME_ALREADY_COMMITTED: _ClassVar[CommitOutcome]
    COMMIT_OUTCOME_LEASE_LOST: _ClassVar[CommitOutcome]

class ReleaseOutcome(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    RELEASE_OUTCOME_UNSPECIFIED: _ClassVar[ReleaseOutcome]
    RELEASE_OUTCOME_RELEASED: _ClassVar[ReleaseOutcome]
    RELEASE_OUTCOME_ALREADY_RELEASED: _ClassVar[ReleaseOutcome]
    RELEASE_OUTCOME_NOT_FOUND: _ClassVar[ReleaseOutcome]
    RELEASE_OUTCOME_LEASE_LOST: _ClassVar[ReleaseOutcome]
RECORD_STATE_UNSPECIFIED: RecordState
RECORD_STATE_CLAIMED: RecordState
RECORD_STATE_COMMITTED: RecordState
RECORD_STATE_RELEASED: RecordState
CLAIM_OUTCOME_UNSPECIFIED: ClaimOutcome
CLAIM_OUTCOME_CLAIMED: ClaimOutcome
CLAIM_OUTCOME_DUPLICATE: ClaimOutcome
CLAIM_OUTCOME_IN_PROGRESS: ClaimOutcome
CLAIM_OUTCOME_FINGERPRINT_MISMATCH: ClaimOutcome
CLAIM_OUTCOME_STALE: ClaimOutcome
COMMIT_OUTCOME_UNSPECIFIED: CommitOutcome
COMMIT_OUTCOME_COMMITTED: CommitOutcome
COMMIT_OUTCOME_ALREADY_COMMITTED: CommitOutcome
COMMIT_OUTCOME_LEASE_LOST: CommitOutcome
RELEASE_OUTCOME_UNSPECIFIED: ReleaseOutcome
RELEASE_OUTCOME_RELEASED: ReleaseOutcome
RELEASE_OUTCOME_ALREADY_RELEASED: ReleaseOutcome
RELEASE_OUTCOME_NOT_FOUND: ReleaseOutcome
RELEASE_OUTCOME_LEASE_LOST: ReleaseOutcome

class Record(_message.Message):
    __slots__ = ("namespace", "correlation_id", "state", "fencing_token", "lease_expires_at", "attempt", "event_type", "consumer_version", "owner", "payload_fingerprint", "claimed_at", "committed_at", "retain_until", "response", "ordering_key", "sequence", "response_erased")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    CORRELATION_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    FENCING_TOKEN_FIELD_NUMBER: _ClassVar[int]
    LEASE_EXPIRES_AT_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    EVENT_TYPE_FIELD_NUMBER: _ClassVar[int]
    CONSUMER_VERSION_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    CLAIMED_AT_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_AT_FIELD_NUMBER: _ClassVar[int]
    RETAIN_UNTIL_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    ORDERING_KEY_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_ERASED_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    correlation_id: str
    state: RecordState
    fencing_token: int
    lease_expires_at: _timestamp_pb2.Timestamp
    attempt: int
    event_type: str
    consumer_version: str
    owner: str
    payload_fingerprint: str
    claimed_at: _timestamp_pb2.Timestamp
    committed_at: _timestamp_pb2.Timestamp
    retain_until: _timestamp_pb2.Timestamp
    response: bytes
    ordering_key: str
    sequence: int
    response_erased: bool
    def __init__(self, namespace: _Optional[str] = ..., correlation_id: _Optional[str] = ..., state: _Optional[_Union[RecordState, str]] = ..., fencing_token: _Optional[int] = ..., lease_expires_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., attempt: _Optional[int] = ..., event_type: _Optional[str] = ..., consumer_version: _Optional[str] = ..., owner: _Optional[str] = ..., payload_fingerprint: _Optional[str] = ..., claimed_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., committed_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., retain_until: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., response: _Optional[bytes] = ..., ordering_key: _Optional[str] = ..., sequence: _Optional[int] = ..., response_erased: _Optional[bool] = ...) -> None: ...

class ClaimRequest(_message.Message):
    __slots__ = ("namespace", "correlation_id", "lease_ttl", "retention", "event_type", "consumer_version", "owner", "payload_fingerprint", "ordering_key", "sequence", "request_id")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    CORRELATION_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_FIELD_NUMBER: _ClassVar[int]
    RETENTION_FIELD_NUMBER: _ClassVar[int]
    EVENT_TYPE_FIELD_NUMBER: _ClassVar[int]
    CONSUMER_VERSION_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    ORDERING_KEY_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    correlation_id: str
    lease_ttl: _duration_pb2.Duration
    retention: _duration_pb2.Duration
    event_type: str
    consumer_version: str
    owner: str
    payload_fingerprint: str
    ordering_key: str
    sequence: int
    request_id: str
    def __init__(self, namespace: _Optional[str] = ..., correlation_id: _Optional[str] = ..., lease_ttl: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., retention: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., event_type: _Optional[str] = ..., consumer_version: _Optional[str] = ..., owner: _Optional[str] = ..., payload_fingerprint: _Optional[str] = ..., ordering_key: _Optional[str] = ..., sequence: _Optional[int] = ..., request_id: _Optional[str] = ...) -> None: ...

class ClaimResponse(_message.Message):
    __slots__ = ("outcome", "lease_token", "fencing_token", "lease_expires_at", "attempt", "recovered", "retry_after", "record", "highest_committed_sequence")
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    LEASE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    FENCING_TOKEN_FIELD_NUMBER: _ClassVar[int]
    LEASE_EXPIRES_AT_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    RECOVERED_FIELD_NUMBER: _ClassVar[int]
    RETRY_AFTER_FIELD_NUMBER: _ClassVar[int]
    RECORD_FIELD_NUMBER: _ClassVar[int]
    HIGHEST_COMMITTED_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    outcome: ClaimOutcome
    lease_token: str
    fencing_token: int
    lease_expires_at: _timestamp_pb2.Timestamp
    attempt: int
    recovered: bool
    retry_after: _duration_pb2.Duration
    record: Record
    highest_committed_sequence: int
    def __init__(self, outcome: _Optional[_Union[ClaimOutcome, str]] = ..., lease_token: _Optional[str] = ..., fencing_token: _Optional[int] = ..., lease_expires_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., attempt: _Optional[int] = ..., recovered: _Optional[bool] = ..., retry_after: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., record: _Optional[_Union[Record, _Mapping]] = ..., highest_committed_sequence: _Optional[int] = ...) -> None: ...

class CommitRequest(_message.Message):
    __slots__ = ("namespace", "correlation_id", "lease_token", "response", "retention")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    CORRELATION_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    RETENTION_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    correlation_id: str
    lease_token: str
    response: bytes
    retention: _duration_pb2.Duration
    def __init__(self, namespace: _Optional[str] = ..., correlation_id: _Optional[str] = ..., lease_token: _Optional[str] = ..., response: _Optional[bytes] = ..., retention: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ...) -> None: ...

class CommitResponse(_message.Message):
    __slots__ = ("outcome", "record")
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    RECORD_FIELD_NUMBER: _ClassVar[int]
    outcome: CommitOutcome
    record: Record
    def __init__(self, outcome: _Optional[_Union[CommitOutcome, str]] = ..., record: _Optional[_Union[Record, _Mapping]] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("namespace", "correlation_id", "lease_token")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    CORRELATION_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    correlation_id: str
    lease_token: str
    def __init__(self, namespace: _Optional[str] = ..., correlation_id: _Optional[str] = ..., lease_token: _Optional[str] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("outcome",)
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    outcome: ReleaseOutcome
    def __init__(self, outcome: _Optional[_Union[ReleaseOutcome, str]] = ...) -> None: ...

class RenewRequest(_message.Message):
    __slots__ = ("namespace", "correlation_id", "lease_token", "lease_ttl")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    CORRELATION_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    correlation_id: str
    lease_token: str
    lease_ttl: _duration_pb2.Duration
    def __init__(self, namespace: _Optional[str] = ..., correlation_id: _Optional[str] = ..., lease_token: _Optional[str] = ..., lease_ttl: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ...) -> None: ...

class RenewResponse(_message.Message):
    __slots__ = ("lease_expires_at",)
    LEASE_EXPIRES_AT_FIELD_NUMBER: _ClassVar[int]
    lease_expires_at: _timestamp_pb2.Timestamp
    def __init__(self, lease_expires_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("namespace", "correlation_id")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    CORRELATION_ID_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    correlation_id: str
    def __init__(self, namespace: _Optional[str] = ..., correlation_id: _Optional[str] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("found", "record")
    FOUND_FIELD_NUMBER: _ClassVar[int]
    RECORD_FIELD_NUMBER: _ClassVar[int]
    found: bool
    record: Record
    def __init__(self, found: _Optional[bool] = ..., record: _Optional[_Union[Record, _Mapping]] = ...) -> None: ...

class ForgetRequest(_message.Message):
    __slots__ = ("namespace", "correlation_id")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    CORRELATION_ID_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    correlation_id: str
    def __init__(self, namespace: _Optional[str] = ..., correlation_id: _Optional[str] = ...) -> None: ...

class ForgetResponse(_message.Message):
    __slots__ = ("existed",)
    EXISTED_FIELD_NUMBER: _ClassVar[int]
    existed: bool
    def __init__(self, existed: _Optional[bool] = ...) -> None: ...

class ClaimBatchRequest(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[ClaimRequest]
    def __init__(self, items: _Optional[_Iterable[_Union[ClaimRequest, _Mapping]]] = ...) -> None: ...

class ClaimBatchResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[ClaimResponse]
    def __init__(self, results: _Optional[_Iterable[_Union[ClaimResponse, _Mapping]]] = ...) -> None: ...

class CommitBatchRequest(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[CommitRequest]
    def __init__(self, items: _Optional[_Iterable[_Union[CommitRequest, _Mapping]]] = ...) -> None: ...

class CommitBatchResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[CommitResponse]
    def __init__(self, results: _Optional[_Iterable[_Union[CommitResponse, _Mapping]]] = ...) -> None: ...

class ReleaseBatchRequest(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[ReleaseRequest]
    def __init__(self, items: _Optional[_Iterable[_Union[ReleaseRequest, _Mapping]]] = ...) -> None: ...

class ReleaseBatchResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[ReleaseResponse]
    def __init__(self, results: _Optional[_Iterable[_Union[ReleaseResponse, _Mapping]]] = ...) -> None: ...

class RekeyRequest(_message.Message):
    __slots__ = ("cursor", "page_size", "retire_old_keys")
    CURSOR_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    RETIRE_OLD_KEYS_FIELD_NUMBER: _ClassVar[int]
    cursor: bytes
    page_size: int
    retire_old_keys: bool
    def __init__(self, cursor: _Optional[bytes] = ..., page_size: _Optional[int] = ..., retire_old_keys: _Optional[bool] = ...) -> None: ...

class RekeyResponse(_message.Message):
    __slots__ = ("examined", "resealed", "current", "erased", "unreadable", "next_cursor", "retired_old_keys")
    EXAMINED_FIELD_NUMBER: _ClassVar[int]
    RESEALED_FIELD_NUMBER: _ClassVar[int]
    CURRENT_FIELD_NUMBER: _ClassVar[int]
    ERASED_FIELD_NUMBER: _ClassVar[int]
    UNREADABLE_FIELD_NUMBER: _ClassVar[int]
    NEXT_CURSOR_FIELD_NUMBER: _ClassVar[int]
    RETIRED_OLD_KEYS_FIELD_NUMBER: _ClassVar[int]
    examined: int
    resealed: int
    current: int
    erased: int
    unreadable: int
    next_cursor: bytes
    retired_old_keys: bool
    def __init__(self, examined: _Optional[int] = ..., resealed: _Optional[int] = ..., current: _Optional[int] = ..., erased: _Optional[int] = ..., unreadable: _Optional[int] = ..., next_cursor: _Optional[bytes] = ..., retired_old_keys: _Optional[bool] = ...) -> None: ...
