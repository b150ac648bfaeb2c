"""pdserve as a vLLM v1 KV connector: the only package of pdserve that imports vLLM.

vLLM loads `PdserveConnector` by module path (`connectors.vllm.connector`). Its scheduler half
(`scheduler.py`, in vLLM's engine core) matches remote-prefill requests, plans pins and pulls,
and holds a finished prefill's blocks until the pdserve scheduler releases them; its worker half
(`worker.py`, in every vLLM worker rank) moves KV over pdserve's UCX data plane and speaks on
the rank's own control stream. `params.py` is the torch-free contract between the halves and the
engine service (`kv_transfer_params` and the per-step metadata); `kv_region.py` registers vLLM's own KV
allocation in place (its layout read off the tensors) and fences transfers after vLLM's CUDA
compute; `staging.py` is the `--kv-staging host` fallback, a block-major mirror copied in and out; `events.py` forwards
vLLM's block-pool KV events to the pdserve scheduler; `extension.py` is the worker extension
the engine service calls through `collective_rpc`; `engine.py` builds and drives vLLM's
`AsyncLLM` for the engine service.
"""
