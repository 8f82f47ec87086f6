"""A prompt's KV in the pieces the wire carries (rows, whole blocks): copied into a
decode cache [L, Hkv, capacity, D] and read back per layer exactly; malformed
pieces and chunk headers refused."""

from __future__ import annotations

import pytest
import torch

from vertumnus import kv_wire as wire
from vertumnus.decode.prompt_kv import KVPiece, PromptKV

L, H, D, B = 3, 2, 4, 4


def rows(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(L, n, H, D, generator=g), torch.randn(L, n, H, D, generator=g)


def as_blocks(x: torch.Tensor) -> torch.Tensor:
    """[L, m * B, H, D] -> [m, L, B, H, D], as the pool's store keeps blocks."""
    return x.view(L, -1, B, H, D).transpose(0, 1).contiguous()


def test_blocks_and_rows_pieces_land_at_their_positions() -> None:
    k, v = rows(11, seed=0)  # two blocks, then three rows
    pieces = [
        KVPiece(0, as_blocks(k[:, :8]), as_blocks(v[:, :8]), blocked=True),
        KVPiece(8, k[:, 8:], v[:, 8:], blocked=False),
    ]
    prompt = PromptKV(pieces, 11, L, H, D)
    k_cache = torch.full((L, H, 16, D), float("nan"))
    v_cache = torch.full((L, H, 16, D), float("nan"))
    prompt.copy_into(k_cache, v_cache)
    assert torch.equal(k_cache[:, :, :11], k.transpose(1, 2))
    assert torch.equal(v_cache[:, :, :11], v.transpose(1, 2))
    assert torch.isnan(k_cache[:, :, 11:]).all()  # nothing written past the prompt
    for layer, (pk, pv) in enumerate(prompt.layers()):
        assert torch.equal(pk, k[layer]) and torch.equal(pv, v[layer])


def test_from_layers_round_trips() -> None:
    k, v = rows(5, seed=1)
    prompt = PromptKV.from_layers([(k[i], v[i]) for i in range(L)])
    assert prompt.num_tokens == 5 and len(prompt.pieces) == 1
    assert all(torch.equal(pk, k[i]) for i, (pk, _) in enumerate(prompt.layers()))


@pytest.mark.parametrize(
    ("first", "n", "layers", "message"),
    [(1, 4, L, "at token 1"), (0, 4, L + 1, "layers"), (0, 3, L, "3 tokens")],
)
def test_malformed_pieces_are_refused(first: int, n: int, layers: int, message: str) -> None:
    k = torch.zeros(layers, n, H, D)
    with pytest.raises(ValueError, match=message):
        PromptKV([KVPiece(first, k, k, blocked=False)], 4, L, H, D)


def test_chunk_headers_name_their_kind() -> None:
    assert wire.parse_chunk_header(wire.chunk_header(8, wire.CHUNK_BLOCKS), B) == (2, 8)
    assert wire.parse_chunk_header(wire.chunk_header(3), B) == (1, 3)
    assert wire.parse_chunk_header(wire.END, B) is None
    with pytest.raises(wire.WireError, match="blocks of 4"):
        wire.parse_chunk_header(wire.chunk_header(6, wire.CHUNK_BLOCKS), B)
    with pytest.raises(wire.WireError, match="kind 7"):
        wire.parse_chunk_header(wire.chunk_header(4, 7), B)
