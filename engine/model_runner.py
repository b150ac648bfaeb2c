"""ModelRunner: turns a StepPlan into tensors, runs one rank's model shard, returns logits."""

from __future__ import annotations

import torch

from engine.attention import AttentionMetadata, PrefillSeq
from engine.batch_scheduler import StepPlan
from engine.models.llama import LlamaModel


class ModelRunner:
    def __init__(self, model: LlamaModel, kv_cache: torch.Tensor, block_size: int, device: str = "cpu") -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.device = device

    @torch.inference_mode()
    def execute(self, plan: StepPlan, *, compute_logits: bool = True) -> torch.Tensor | None:
        """Runs the plan's chunks; returns logits [n_sample, vocab] for the chunks with
        sample=True, in plan order (None when compute_logits is False or nothing samples)."""
        if not plan.chunks:
            return None
        input_ids, positions, meta, sample_rows = self._prepare(plan)
        hidden = self.model.forward(input_ids, positions, self.kv_cache, meta)
        if not compute_logits or not sample_rows:
            return None
        rows = torch.tensor(sample_rows, device=self.device)
        # Sampling runs on the host (per-request CPU generators keep seeds device-independent).
        return self.model.compute_logits(hidden[rows]).float().cpu()

    def _prepare(self, plan: StepPlan) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        bs = self.block_size
        tokens: list[int] = []
        positions: list[int] = []
        slot_block: list[int] = []
        decode_rows: list[int] = []
        decode_tables: list[list[int]] = []
        decode_lens: list[int] = []
        prefills: list[PrefillSeq] = []
        sample_rows: list[int] = []
        for chunk in plan.chunks:
            row = len(tokens)
            n = len(chunk.token_ids)
            pos = range(chunk.start_pos, chunk.start_pos + n)
            tokens.extend(chunk.token_ids)
            positions.extend(pos)
            slot_block.extend(chunk.block_ids[p // bs] for p in pos)
            total = chunk.start_pos + n
            used_blocks = chunk.block_ids[: -(-total // bs)]
            if n == 1:
                decode_rows.append(row)
                decode_tables.append(used_blocks)
                decode_lens.append(total)
            else:
                prefills.append(PrefillSeq(row, n, chunk.start_pos,
                                           torch.tensor(used_blocks, device=self.device)))
            if chunk.sample:
                sample_rows.append(row + n - 1)
        pos_t = torch.tensor(positions, device=self.device)
        meta = AttentionMetadata(
            slot_block=torch.tensor(slot_block, device=self.device),
            slot_offset=pos_t % bs,
            decode_rows=None, decode_block_table=None, decode_mask=None,
            prefills=prefills,
            all_decode=not prefills,
        )
        if decode_rows:
            width = max(len(t) for t in decode_tables)
            table = torch.zeros(len(decode_rows), width, dtype=torch.long)
            for i, t in enumerate(decode_tables):
                table[i, : len(t)] = torch.tensor(t)
            lens = torch.tensor(decode_lens)
            mask = torch.arange(width * bs).unsqueeze(0) < lens.unsqueeze(1)
            meta.decode_rows = torch.tensor(decode_rows, device=self.device)
            meta.decode_block_table = table.to(self.device)
            meta.decode_mask = mask[:, None, None, :].to(self.device)
        return torch.tensor(tokens, device=self.device), pos_t, meta, sample_rows
