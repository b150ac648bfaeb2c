"""The engine service: what `pdserve prefill` and `pdserve decode` run (Engine gRPC API, engine
loop, per-rank agents and their control streams)."""
