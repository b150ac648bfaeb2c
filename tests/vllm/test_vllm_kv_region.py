"""`allocate_like_vllm` and `describe_kv_caches` against vLLM 0.32's own KV allocator (no engine
started): for every `KVCacheLayout`, vLLM's `allocate_kv_cache` over a full-attention group laid
out as `get_kv_cache_config_from_groups` lays it (block-outermost: the layers' pages packed in
each block) gives the strides pdserve's stand-in gives, and the connector reads the layout, the
whole allocation and the block arithmetic back off vLLM's tensors."""

from __future__ import annotations

import pytest

LAYERS, BLOCKS, HEADS, BLOCK, HEAD_DIM = 3, 10, 2, 16, 8


def _vllm_caches(name: str) -> dict:
    import torch
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        KVCacheTensor,
        compute_layout_strides,
    )
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker.utils import allocate_kv_cache

    layout = KVCacheLayout[name]
    spec = FullAttentionSpec(BLOCK, num_kv_heads=HEADS, head_size=HEAD_DIM, dtype=torch.float16)
    names = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
    block_stride = LAYERS * spec.page_size_bytes if layout.is_block_outermost else None
    layer_stride, block_stride, *_ = compute_layout_strides(spec, BLOCKS, LAYERS, layout,
                                                            fixed_strides=(None, block_stride, None, None, None))
    config = KVCacheConfig(num_blocks=BLOCKS, kv_cache_groups=[KVCacheGroupSpec(names, spec)],
                           kv_cache_tensors=[KVCacheTensor(size=LAYERS * BLOCKS * spec.page_size_bytes, layers=names,
                                                           layer_stride=layer_stride, block_stride=block_stride)])
    return allocate_kv_cache(config, torch.device("cpu"), layout)


@pytest.mark.parametrize("name", ["LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC"])
def test_the_stand_in_allocates_as_vllm_does_and_reads_back(name: str) -> None:
    import torch

    from connectors.vllm.kv_region import allocate_like_vllm, describe_kv_caches

    theirs = _vllm_caches(name)
    ours = allocate_like_vllm(name, num_layers=LAYERS, num_blocks=BLOCKS, num_heads=HEADS, block_size=BLOCK,
                              head_dim=HEAD_DIM, dtype=torch.float16)
    for (a_name, a), (b_name, b) in zip(theirs.items(), ours.items(), strict=True):
        assert a_name == b_name and a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype
    base = next(iter(theirs.values())).untyped_storage()
    region = describe_kv_caches(theirs, num_blocks=BLOCKS, block_size=BLOCK, head_dim=HEAD_DIM)
    assert region.layout.name == name and region.nbytes == base.nbytes() == BLOCKS * region.layout.block_nbytes
    assert region.memory.data_ptr() == base.data_ptr()  # the allocation itself, no copy
    # a value written through vLLM's view of layer 2, block 7, head 1 is where the layout says
    theirs["model.layers.2.self_attn.attn"][7, 1].fill_(1.0)
    from connectors.ucx.transport import Segment

    touched = region.memory.nonzero().flatten()
    pieces = region.layout.pieces(Segment(7, 7, 1, 1, 1, 1), remote=False)
    covered = torch.cat([torch.arange(off, off + n) for off, n in pieces])
    assert set(touched.tolist()) <= set(covered.tolist())


def test_a_stated_layout_that_the_strides_contradict_is_refused() -> None:
    from connectors.vllm.kv_region import describe_kv_caches

    with pytest.raises(ValueError, match="says its KV layout is BHLNC"):
        describe_kv_caches(_vllm_caches("LBHNC"), num_blocks=BLOCKS, block_size=BLOCK, head_dim=HEAD_DIM,
                           layout_name="BHLNC")


def test_kv_the_connector_cannot_move_whole_is_refused_with_the_reason() -> None:
    import torch
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        SlidingWindowSpec,
    )

    from connectors.vllm.connector import _check_kv_cache_groups

    full = FullAttentionSpec(BLOCK, num_kv_heads=HEADS, head_size=HEAD_DIM, dtype=torch.float16)
    window = SlidingWindowSpec(BLOCK, num_kv_heads=HEADS, head_size=HEAD_DIM, dtype=torch.float16, sliding_window=64)
    _check_kv_cache_groups(KVCacheConfig(num_blocks=BLOCKS, kv_cache_tensors=[],
                                         kv_cache_groups=[KVCacheGroupSpec(["a"], full)]))
    hybrid = KVCacheConfig(num_blocks=BLOCKS, kv_cache_tensors=[],
                           kv_cache_groups=[KVCacheGroupSpec(["a"], full), KVCacheGroupSpec(["b"], window)])
    with pytest.raises(ValueError, match="moves one KV cache group; this model has 2 .*SlidingWindowSpec"):
        _check_kv_cache_groups(hybrid)
    with pytest.raises(ValueError, match="full-attention KV only; this model's cache is SlidingWindowSpec"):
        _check_kv_cache_groups(KVCacheConfig(num_blocks=BLOCKS, kv_cache_tensors=[],
                                             kv_cache_groups=[KVCacheGroupSpec(["b"], window)]))
