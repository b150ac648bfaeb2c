"""The start-up check of UCX's CUDA transports and the one-time registration of a KV region."""

from __future__ import annotations

import numpy as np
import pytest

from connectors.ucx.device_memory import (
    MemoryRegistration,
    cuda_transport_problem,
    is_device_region,
    region_nbytes,
    transports,
)


def context_info(*tls: str) -> str:
    """The shape of `UCXContext.info` (ucp_context_print_info), one resource per transport."""
    lines = ["#", "# UCP context", "#"]
    lines += [f"#      resource {i}  :  md {i}  dev 0  flags -- {tl}/{'cuda' if 'cuda' in tl else 'memory'}"
              for i, tl in enumerate(tls)]
    return "\n".join(lines)


def test_transports_are_read_from_the_context_description() -> None:
    assert transports(context_info("self", "tcp", "cuda_copy", "cuda_ipc")) == {"self", "tcp", "cuda_copy", "cuda_ipc"}


def test_cuda_copy_and_ipc_pass() -> None:
    assert cuda_transport_problem(context_info("self", "sysv", "cuda_copy", "cuda_ipc"), "") is None
    # across hosts GPUDirect RDMA takes the place of cuda_ipc
    assert cuda_transport_problem(context_info("cuda_copy", "rc_mlx5", "dc_mlx5"), "") is None


def test_no_cuda_transport_names_it_and_the_ucx_tls_to_change() -> None:
    problem = cuda_transport_problem(context_info("self", "tcp", "sysv"), "^cma")
    assert problem is not None
    assert "no cuda_copy transport" in problem and "UCX_TLS=^cma" in problem
    assert "UCX_TLS to include cuda_copy,cuda_ipc" in problem and "--kv-staging host" in problem
    assert "transports seen: self, sysv, tcp" in problem


def test_cuda_copy_alone_would_bounce_through_host_memory() -> None:
    problem = cuda_transport_problem(context_info("self", "tcp", "cuda_copy"), "tcp,cuda_copy")
    assert problem is not None
    assert "neither cuda_ipc" in problem and "UCX_TLS=tcp,cuda_copy" in problem


def test_this_hosts_ucx_has_no_usable_cuda_transport_without_a_gpu() -> None:
    import torch
    import ucxx._lib.libucxx as ucx_api

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: UCX may open CUDA transports here")
    ctx = ucx_api.UCXContext(config_dict={}, feature_flags=(ucx_api.Feature.TAG,))
    problem = cuda_transport_problem(ctx.info, "")
    assert problem is not None and "no cuda_copy transport" in problem


def test_regions_host_and_device() -> None:
    host = np.zeros(64, dtype=np.uint8)
    assert region_nbytes(host) == 64 and not is_device_region(host)
    with pytest.raises(ValueError, match="flat uint8 numpy array"):
        region_nbytes(np.zeros((2, 2), dtype=np.uint8))

    class FakeCudaArray:  # the interface only: what UCX reads from a CUDA tensor
        __cuda_array_interface__ = {"typestr": "|u1", "shape": (128,), "strides": None, "data": (0, False),
                                    "version": 3}

    assert region_nbytes(FakeCudaArray()) == 128 and is_device_region(FakeCudaArray())
    FakeCudaArray.__cuda_array_interface__ = {**FakeCudaArray.__cuda_array_interface__, "typestr": "<f4"}
    with pytest.raises(ValueError, match="flat contiguous uint8 CUDA array"):
        region_nbytes(FakeCudaArray())
    with pytest.raises(ValueError, match="numpy array or a CUDA array"):
        region_nbytes([1, 2, 3])


def test_a_region_is_registered_once_and_released() -> None:
    import ucxx._lib.libucxx as ucx_api

    ctx = ucx_api.UCXContext(config_dict={}, feature_flags=(ucx_api.Feature.TAG,))
    region = np.zeros(1 << 20, dtype=np.uint8)
    registration = MemoryRegistration(ctx, region)
    assert registration.mapped and registration.nbytes == 1 << 20 and not registration.device
    registration.close()
    registration.close()  # idempotent
    assert not registration.mapped
