from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class AdCandidate(_message.Message):
    __slots__ = ("ad", "campaign")
    AD_FIELD_NUMBER: _ClassVar[int]
    CAMPAIGN_FIELD_NUMBER: _ClassVar[int]
    ad: str
    campaign: str
    def __init__(self, ad: _Optional[str] = ..., campaign: _Optional[str] = ...) -> None: ...

class CheckAdsRequest(_message.Message):
    __slots__ = ("domain", "user", "ads", "event", "identities")
    class IdentitiesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    DOMAIN_FIELD_NUMBER: _ClassVar[int]
    USER_FIELD_NUMBER: _ClassVar[int]
    ADS_FIELD_NUMBER: _ClassVar[int]
    EVENT_FIELD_NUMBER: _ClassVar[int]
    IDENTITIES_FIELD_NUMBER: _ClassVar[int]
    domain: str
    user: str
    ads: _containers.RepeatedCompositeFieldContainer[AdCandidate]
    event: str
    identities: _containers.ScalarMap[str, str]
    def __init__(self, domain: _Optional[str] = ..., user: _Optional[str] = ..., ads: _Optional[_Iterable[_Union[AdCandidate, _Mapping]]] = ..., event: _Optional[str] = ..., identities: _Optional[_Mapping[str, str]] = ...) -> None: ...

class AdVerdict(_message.Message):
    __slots__ = ("ad", "allowed", "remaining", "reset_seconds")
    AD_FIELD_NUMBER: _ClassVar[int]
    ALLOWED_FIELD_NUMBER: _ClassVar[int]
    REMAINING_FIELD_NUMBER: _ClassVar[int]
    RESET_SECONDS_FIELD_NUMBER: _ClassVar[int]
    ad: str
    allowed: bool
    remaining: int
    reset_seconds: int
    def __init__(self, ad: _Optional[str] = ..., allowed: _Optional[bool] = ..., remaining: _Optional[int] = ..., reset_seconds: _Optional[int] = ...) -> None: ...

class CheckAdsResponse(_message.Message):
    __slots__ = ("ads",)
    ADS_FIELD_NUMBER: _ClassVar[int]
    ads: _containers.RepeatedCompositeFieldContainer[AdVerdict]
    def __init__(self, ads: _Optional[_Iterable[_Union[AdVerdict, _Mapping]]] = ...) -> None: ...

class Impression(_message.Message):
    __slots__ = ("id", "user", "ad", "campaign", "event", "identities")
    class IdentitiesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    ID_FIELD_NUMBER: _ClassVar[int]
    USER_FIELD_NUMBER: _ClassVar[int]
    AD_FIELD_NUMBER: _ClassVar[int]
    CAMPAIGN_FIELD_NUMBER: _ClassVar[int]
    EVENT_FIELD_NUMBER: _ClassVar[int]
    IDENTITIES_FIELD_NUMBER: _ClassVar[int]
    id: str
    user: str
    ad: str
    campaign: str
    event: str
    identities: _containers.ScalarMap[str, str]
    def __init__(self, id: _Optional[str] = ..., user: _Optional[str] = ..., ad: _Optional[str] = ..., campaign: _Optional[str] = ..., event: _Optional[str] = ..., identities: _Optional[_Mapping[str, str]] = ...) -> None: ...

class RecordImpressionsRequest(_message.Message):
    __slots__ = ("domain", "impressions")
    DOMAIN_FIELD_NUMBER: _ClassVar[int]
    IMPRESSIONS_FIELD_NUMBER: _ClassVar[int]
    domain: str
    impressions: _containers.RepeatedCompositeFieldContainer[Impression]
    def __init__(self, domain: _Optional[str] = ..., impressions: _Optional[_Iterable[_Union[Impression, _Mapping]]] = ...) -> None: ...

class ImpressionResult(_message.Message):
    __slots__ = ("id", "counted", "duplicate")
    ID_FIELD_NUMBER: _ClassVar[int]
    COUNTED_FIELD_NUMBER: _ClassVar[int]
    DUPLICATE_FIELD_NUMBER: _ClassVar[int]
    id: str
    counted: bool
    duplicate: bool
    def __init__(self, id: _Optional[str] = ..., counted: _Optional[bool] = ..., duplicate: _Optional[bool] = ...) -> None: ...

class RecordImpressionsResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[ImpressionResult]
    def __init__(self, results: _Optional[_Iterable[_Union[ImpressionResult, _Mapping]]] = ...) -> None: ...
