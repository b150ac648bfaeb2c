"""Which UCX transport an endpoint uses (`ucp_ep_print_info`, parsed) and when it is a fallback.

The samples are what libucp 1.21 (the ucxx-cu12 wheel's) printed for endpoints between two
workers of one host under UCX_TLS=^cma and tcp,cma, and between the two namespaced hosts of
bench/two_hosts.py; the RDMA one is that format with mlx5 lanes. The last test asks the real libucp about a real endpoint."""

from __future__ import annotations

import pytest

from connectors.ucx.ep_info import (
    UNKNOWN,
    EndpointInfo,
    TransportExpectation,
    parse_transport,
    transport_rank,
)

SYSV = """#
# UCP endpoint
#
#               peer: <no debug data>
#                 lane[0]:  3:sysv/memory.0 md[2]           -> md[2]/sysv/sysdev[255] seg 4294967295 am
#                 lane[1]:  2:tcp/lo.0 md[1]                -> md[1]/tcp/sysdev[255] seg 4294967295 rma_bw#0
#                 lane[2]:  1:tcp/eth0.0 md[1]              -> md[1]/tcp/sysdev[255] seg 4294967295 rma_bw#1 wireup
#
# +--------------------------------+----------------------------------------------------------------------+
# | ucp_context_0 intra-node cfg#0 | tagged message by ucp_tag_send*(fast-completion) from host memory    |
# +--------------------------------+--------------------------------------------------------+-------------+
# |                          0..92 | eager short                                            | sysv/memory |
# |                       93..8191 | eager copy-in copy-out                                 | sysv/memory |
# |                        8K..inf | (?) rendezvous fragmented copy-in copy-out             | sysv/memory |
# +--------------------------------+--------------------------------------------------------+-------------+
#
# +--------------------------------+----------------------------------------------------------+
# | ucp_context_0 intra-node cfg#0 | tagged message by ucp_tag_send* from host memory         |
# +--------------------------------+--------------------------------------------+-------------+
# |                          0..92 | eager short                                | sysv/memory |
# |                       93..8191 | eager copy-in copy-out                     | sysv/memory |
# |                        8K..inf | (?) rendezvous fragmented copy-in copy-out | sysv/memory |
# +--------------------------------+--------------------------------------------+-------------+
"""

CMA = """#
#                 lane[0]:  1:tcp/lo.0 md[0]                -> md[0]/tcp/sysdev[255] seg 4294967295 am wireup
#                 lane[1]:  2:cma/memory.0 md[1]            -> md[1]/cma/sysdev[255] seg 4294967295 rma_bw#0
#
# +--------------------------------+-----------------------------------------------------+
# | ucp_context_0 intra-node cfg#0 | tagged message by ucp_tag_send* from host memory    |
# +--------------------------------+--------------------------------------------+--------+
# |                        0..8184 | eager short                                | tcp/lo     |
# |                     8185..8191 | multi-frag eager copy-in copy-out          | tcp/lo     |
# |                        8K..inf | (?) rendezvous zero-copy read from remote  | cma/memory |
# +--------------------------------+--------------------------------------------+--------+
"""

TCP_VETH = """#
#                 lane[0]:  1:tcp/pdv0.0 md[1]              -> md[1]/tcp/sysdev[255] seg 4294967295 rma_bw#0 am wireup
#
# +--------------------------------+------------------------------------------------------------+
# | ucp_context_0 inter-node cfg#0 | tagged message by ucp_tag_send* from host memory           |
# +--------------------------------+-------------------------------------------------+----------+
# |                              0 | eager short                                     | tcp/pdv0 |
# |                        1..8191 | eager zero-copy copy-out                        | tcp/pdv0 |
# |                      8K..65520 | (?) rendezvous zero-copy                        | tcp/pdv0 |
# |                     65521..inf | (?) rendezvous zero-copy fenced write to remote | tcp/pdv0 |
# +--------------------------------+-------------------------------------------------+----------+
"""

RDMA_TWO_RAILS = """#
#                 lane[0]:  4:rc_mlx5/mlx5_0:1.0 md[3]      -> md[3]/ib/sysdev[0] rma_bw#0 am am_bw#0 wireup
#                 lane[1]:  5:rc_mlx5/mlx5_1:1.0 md[4]      -> md[4]/ib/sysdev[1] rma_bw#1 am_bw#1
#
# +--------------------------------+-------------------------------------------------------------+
# | ucp_context_0 inter-node cfg#0 | tagged message by ucp_tag_send* from cuda memory            |
# +--------------------------------+------------------------------------------------------------+
# |                       0..8246 | eager zero-copy copy-out            | rc_mlx5/mlx5_0:1 |
# |                        8K..inf | rendezvous zero-copy read from remote | 50% on rc_mlx5/mlx5_0:1 and 50% on rc_mlx5/mlx5_1:1 |
# +--------------------------------+------------------------------------------------------------+
"""

LANES_ONLY = """#
#                 lane[0]:  0:tcp/eth0.0 md[0]              -> md[0]/tcp/sysdev[255] am wireup
#                 lane[1]:  2:cma/memory.0 md[1]            -> md[1]/cma/sysdev[255] rma_bw#0
"""


@pytest.mark.parametrize(("text", "memory", "expected"), [
    (SYSV, "host", "sysv"),
    (CMA, "host", "cma"),
    (TCP_VETH, "host", "tcp"),
    (RDMA_TWO_RAILS, "cuda", "rc_mlx5"),
    (RDMA_TWO_RAILS, "host", "rc_mlx5"),  # no host-memory table: the bandwidth lanes
    (LANES_ONLY, "host", "cma"),
    ("", "host", UNKNOWN),
    ("# garbage | without | a table |\n", "host", UNKNOWN),
], ids=["sysv", "cma-over-tcp-am", "tcp-veth", "rdma-cuda", "rdma-lanes", "lanes-only", "empty", "garbage"])
def test_parse_names_the_transport_of_large_tagged_sends(text: str, memory: str, expected: str) -> None:
    assert parse_transport(text, memory) == expected


def test_ranks_order_shared_memory_over_rdma_over_tcp() -> None:
    assert transport_rank("sysv") == transport_rank("cuda_ipc") == 3
    assert transport_rank("rc_mlx5") == 2
    assert transport_rank("tcp") == 1
    assert transport_rank("cuda_copy+tcp") == 1  # a host-staged pipeline is as slow as its wire
    assert transport_rank("rc_mlx5+tcp") == 1
    assert transport_rank(UNKNOWN) is None


@pytest.mark.parametrize(("spec", "actual", "fallback"), [
    ("rdma", "tcp", True),
    ("rdma", "rc_mlx5", False),
    ("rdma", "sysv", False),  # one host: shared memory is not slower
    ("rc_mlx5", "tcp", True),
    ("rdma,tcp", "tcp", False),  # tcp allowed
    ("shm", "tcp", True),
    ("shm", "rc_verbs", True),
    ("rdma", UNKNOWN, False),  # cannot be told: never claimed
    ("", "tcp", False),  # nothing expected
])
def test_a_fallback_is_a_transport_slower_than_every_expected_one(spec: str, actual: str, fallback: bool) -> None:
    assert TransportExpectation.parse(spec).fallback(actual) is fallback


def test_an_unknown_expected_transport_is_refused_with_the_known_names() -> None:
    with pytest.raises(ValueError, match=r"unknown transport 'infiniband'.*rdma"):
        TransportExpectation.parse("rdma,infiniband")
    assert TransportExpectation.parse(" RDMA , tcp,rdma").label == "rdma,tcp"


def test_the_real_libucp_describes_a_real_endpoint() -> None:
    import ucxx._lib.libucxx as ucx_api

    contexts = [ucx_api.UCXContext(config_dict={"TLS": "tcp"}, feature_flags=(ucx_api.Feature.TAG,)) for _ in range(2)]
    workers = [ucx_api.UCXWorker(c) for c in contexts]
    address = ucx_api.UCXAddress.create_from_buffer(bytes(workers[1].address.tobytes()))
    ep = ucx_api.UCXEndpoint.create_from_worker_address(workers[0], address, False)
    for _ in range(20):
        workers[0].progress()
        workers[1].progress()
    info = EndpointInfo()
    assert "lane[" in info.describe(ep.handle)
    assert info.transport(ep.handle) == "tcp"


def test_the_libucp_asked_is_ucxs_own_when_nixl_maps_another() -> None:
    """NIXL's wheel bundles a second libucp; asking that copy about ucxx's endpoint crashed the
    decode engine (the hetero-TP nixl e2e). Run in a child so this process maps no extra copy."""
    import importlib.util
    import subprocess
    import sys

    if importlib.util.find_spec("nixl_cu12") is None:
        pytest.skip("nixl-cu12 is not installed")
    code = ("import ucxx, nixl_cu12._api as api; api.nixl_agent('probe')\n"
            "from connectors.ucx.ep_info import loaded_libucp\n"
            "maps = {l.rsplit(None, 1)[-1] for l in open('/proc/self/maps') if 'libucp' in l}\n"
            "print(len(maps), loaded_libucp())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    count, path = out.stdout.split()[-2:]
    assert int(count) >= 2, out.stdout  # the case this is about: two copies mapped
    assert path.endswith("/libucx/lib/libucp.so"), out.stdout
