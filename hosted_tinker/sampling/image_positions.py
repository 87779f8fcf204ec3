"""Rotary positions of a vision-language model's prompts with images, for prefill and decode.

Qwen-VL models place an image's tokens on a 3-D grid (time, height, width: multimodal rotary
positions, `get_rope_index`), so a row's positions after an image run ahead of or behind its token
count by a per-row offset (its rope delta). The model's forward computes these itself only for a
whole sequence; the engine prefills left-padded rows and decodes one token at a time, so it passes
them explicitly: at prefill the model's own `get_rope_index` over the real tokens, at each decode
step the row's token index plus its delta on all three axes. Position ids go in as [4, rows, len]:
the plain token index first (what the causal mask reads), then the three rotary axes.
"""

from __future__ import annotations

import torch

from ..models.vision import Pixels


def prefill_inputs(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor,
                   pixels: list[Pixels]) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """The image prefill's extra forward arguments (pixels in row order, grids, position ids) and
    each row's rope delta [rows]; a prompt's images that could not be decoded raise their error
    (the engine's prefill then fails that job alone)."""
    for p in pixels:
        if p.error is not None:
            raise p.error
    mm_token_type_ids = (ids == model.config.image_token_id).long()
    grid = torch.cat([p.grid_thw for p in pixels]).to(ids.device)
    rope, deltas = model.model.get_rope_index(ids, mm_token_type_ids, image_grid_thw=grid, attention_mask=mask)
    dtype = next(model.parameters()).dtype
    return {"pixel_values": torch.cat([p.pixel_values for p in pixels]).to(ids.device, dtype),
            "image_grid_thw": grid, "mm_token_type_ids": mm_token_type_ids,
            "position_ids": torch.cat([positions[None], rope])}, deltas[:, 0].to(ids.device)


def decode_positions(positions: torch.Tensor, deltas: torch.Tensor) -> torch.Tensor:
    """[4, rows, 1] position ids of each row's next token: its index `positions` [rows], then that
    index plus the row's rope delta on the three rotary axes."""
    text = positions[None, :, None]
    return torch.cat([text, (text + deltas[None, :, None]).expand(3, -1, -1)])
