"""Protobuf <-> backend dataclasses for the Engine API (the only place that knows both)."""

from __future__ import annotations

from connectors.ucx.handshake import KVTransferDescriptor
from engine.request import SamplingParams
from pdserve.v1 import engine_pb2 as pb
from pdserve.v1 import generation_pb2 as gen_pb
from services.engine.backend import DecodeInput, PrefillInput, PrefillResult, TokenDelta

DEFAULT_MAX_TOKENS = 16
FINISH = {"stop": gen_pb.FINISH_REASON_STOP, "length": gen_pb.FINISH_REASON_LENGTH,
          "abort": gen_pb.FINISH_REASON_ABORT, None: gen_pb.FINISH_REASON_UNSPECIFIED}


def sampling_from_proto(p: gen_pb.SamplingParams) -> SamplingParams:
    """Engine sampling params from the wire; unset tunables take the engine defaults."""
    params = SamplingParams(max_tokens=p.max_tokens if p.HasField("max_tokens") else DEFAULT_MAX_TOKENS,
                            stop=list(p.stop), stop_token_ids=[int(t) for t in p.stop_token_ids])
    if p.HasField("temperature"):
        params.temperature = p.temperature
    if p.HasField("top_p"):
        params.top_p = p.top_p
    if p.HasField("top_k"):
        params.top_k = p.top_k
    if p.HasField("seed"):
        params.seed = p.seed
    if p.HasField("ignore_eos"):
        params.ignore_eos = p.ignore_eos
    return params


def descriptor_from_proto(d: pb.TransferDescriptor) -> KVTransferDescriptor:
    return KVTransferDescriptor(d.engine_id, d.epoch, d.request_id, tuple(d.block_ids), d.num_tokens, d.tp_size,
                                d.block_size, d.num_kv_heads, d.lease_expires_unix_ms)


def descriptor_to_proto(d: KVTransferDescriptor) -> pb.TransferDescriptor:
    return pb.TransferDescriptor(engine_id=d.engine_id, epoch=d.epoch, request_id=d.request_id,
                                 block_ids=list(d.block_ids), num_tokens=d.num_tokens, tp_size=d.tp_size,
                                 block_size=d.block_size, num_kv_heads=d.num_kv_heads,
                                 lease_expires_unix_ms=d.lease_expires_unix_ms)


def prefill_from_proto(request: pb.PrefillRequest) -> PrefillInput:
    return PrefillInput(request.request_id, list(request.prompt_token_ids), sampling_from_proto(request.sampling),
                        request.decode_tp_size, request.peer_fetch)


def prefill_to_proto(request_id: str, result: PrefillResult) -> pb.PrefillResponse:
    return pb.PrefillResponse(request_id=request_id, first_token_id=result.first_token_id,
                              descriptor=descriptor_to_proto(result.descriptor),
                              num_cached_tokens=result.num_cached_tokens, finish_reason=FINISH[result.finish_reason],
                              first_token_text=result.first_token_text)


def decode_from_proto(request: pb.DecodeRequest, trace_carrier: dict[str, str] | None = None) -> DecodeInput:
    descriptor = descriptor_from_proto(request.descriptor) if request.HasField("descriptor") else None
    return DecodeInput(request.request_id, list(request.prompt_token_ids), sampling_from_proto(request.sampling),
                       output_token_ids=list(request.output_token_ids), descriptor=descriptor,
                       trace_carrier=trace_carrier)


def delta_to_proto(request_id: str, delta: TokenDelta) -> pb.DecodeResponse:
    response = pb.DecodeResponse(request_id=request_id, token_ids=delta.token_ids, text=delta.text,
                                 finish_reason=FINISH[delta.finish_reason])
    if delta.num_cached_tokens is not None:
        response.num_cached_tokens = delta.num_cached_tokens
    if delta.num_transferred_tokens is not None:
        response.num_transferred_tokens = delta.num_transferred_tokens
    return response
