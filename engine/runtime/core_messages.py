"""The messages between the front (the server's process) and the engine core process, and their encoding.

msgpack through msgspec, tagged structs, over ZeroMQ PUSH/PULL sockets bound by the core (front -> core, one socket
every front connects to: requests, aborts, utility calls; core -> front, one socket per front: one ``StepOutputs``
per step carrying the new token ids of every sample that front submitted). A front is a *client* of the core,
numbered from 0; requests and calls name theirs, and the core sends each one's answers to that front only. Utility calls
carry a pickled callable (a core method's name, or a module-level function taking the core): they are rare (pins,
tests), and the sockets are private to the two processes (a 0700 directory).
"""

from __future__ import annotations

import msgspec

from engine.core.core_info import CoreInfo
from engine.core.metrics import EngineStats
from engine.output.outputs import SampleDelta
from engine.sampling_params import SamplingParams


class AddRequest(msgspec.Struct, tag=True, array_like=True):
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    cache_salt: str | None = None
    client: int = 0  # the front that submitted it: its outputs go there
    tenant: str = ""  # who sent it: the core shares steps fairly among tenants
    priority: int = 0  # among the tenant's requests, lower first
    retain: bool = (
        False  # a session's turn: its blocks outrank one-off ones, kept on the lower KV tiers
    )


class AbortRequest(msgspec.Struct, tag=True, array_like=True):
    request_id: str
    # one sample only (the front ended it: a stop string), else the whole request
    index: int | None = None
    reason: str = "abort"  # abort | stop | error


class UtilityCall(msgspec.Struct, tag=True, array_like=True):
    call_id: int
    payload: bytes  # pickle of (method name or function, args)
    client: int = 0  # the front that called: the result goes there


class Shutdown(msgspec.Struct, tag=True, array_like=True):
    pass


class Ready(msgspec.Struct, tag=True, array_like=True):
    info: CoreInfo
    stats: EngineStats


class StartFailed(msgspec.Struct, tag=True, array_like=True):
    message: str
    config_error: bool  # a ValueError (a bad option, a missing model): the operator's to fix


class StepOutputs(msgspec.Struct, tag=True, array_like=True, gc=False):
    deltas: list[SampleDelta]
    stats: EngineStats | None = None  # a fresh snapshot, at most every few tens of milliseconds


class AddFailed(msgspec.Struct, tag=True, array_like=True):
    request_id: str
    message: str
    invalid: bool  # a ValueError (the request's fault: 400), else the request failed (500)


class UtilityResult(msgspec.Struct, tag=True, array_like=True):
    call_id: int
    ok: bool
    payload: bytes  # pickle of the result, or of the exception


class CoreFailed(msgspec.Struct, tag=True, array_like=True):
    message: str  # the step failed as a whole: the core exits


ToCore = AddRequest | AbortRequest | UtilityCall | Shutdown
FromCore = Ready | StartFailed | StepOutputs | AddFailed | UtilityResult | CoreFailed

encoder = msgspec.msgpack.Encoder()
to_core_decoder = msgspec.msgpack.Decoder(ToCore)
from_core_decoder = msgspec.msgpack.Decoder(FromCore)
