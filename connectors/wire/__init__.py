"""vLLM-compatible KV-event wire codec (msgpack). See `msgpack_codec`."""

from connectors.wire.msgpack_codec import WireFormatError, decode_batch, encode_batch

__all__ = ["WireFormatError", "decode_batch", "encode_batch"]
