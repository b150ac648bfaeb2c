"""The engine service: what `pdserve prefill` and `pdserve decode` run — the Engine gRPC API
(`servicer`) over an engine backend (`backend`; `native` = pdserve's engine, `vllm` = vLLM's),
picked by `registry` and served by `main`; per-rank agents and their control streams
(`rank_agent`, `control_client`)."""
