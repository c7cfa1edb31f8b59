"""Temporal heads: per-frame features ``(B, T', D)`` at frame positions ``(B, T')`` -> logits.

Heads receive the *positions* of the frames they see, not just their order, because frame
dropout hands them a subset (``T' < T``) at training time and every frame at test time. The
transformer indexes its position embedding by that position, so both cases mean the same
thing to it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn


class MeanHead(nn.Module):
    """TSN consensus: average the frame features, then a linear classifier. Order-blind."""

    def __init__(self, in_dim: int, num_classes: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.drop = nn.Dropout(dropout)
        self.fc = nn.Linear(in_dim, num_classes)

    def forward(self, features: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.fc(self.drop(features.mean(dim=1)))  # (B, T', D) -> (B, K)


class TConvHead(nn.Module):
    """1-D temporal convolutions over the frame axis, then an average over time."""

    def __init__(
        self,
        in_dim: int,
        num_classes: int,
        hidden_dim: int = 256,
        num_layers: int = 2,
        kernel_size: int = 3,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        dim = in_dim
        for _ in range(num_layers):
            layers += [
                nn.Conv1d(dim, hidden_dim, kernel_size, padding=kernel_size // 2),
                nn.BatchNorm1d(hidden_dim),
                nn.ReLU(inplace=True),
            ]
            dim = hidden_dim
        self.net = nn.Sequential(*layers)
        self.drop = nn.Dropout(dropout)
        self.fc = nn.Linear(dim, num_classes)

    def forward(self, features: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.net(features.transpose(1, 2))  # (B, D, T') -> (B, H, T')
        return self.fc(self.drop(x.mean(dim=2)))


def _identical(make: Callable[[], nn.Module], n: int) -> nn.ModuleList:
    """``n`` modules with the same initial weights and one module's draws from the random
    generator: what ``nn.TransformerEncoder``'s deep copies of one layer give, built instead of
    copied. A deep copy of a fake tensor reads its data pointer (torch warns that this is
    deprecated), and the memory simulator builds the model on fake tensors."""
    first = make()
    rest = []
    with torch.random.fork_rng(devices=[]):  # the copies draw nothing, as a deep copy does not
        for _ in range(n - 1):
            rest.append(make())
    for module in rest:
        module.load_state_dict(first.state_dict())
    return nn.ModuleList([first, *rest])


class TransformerHead(nn.Module):
    """A small transformer encoder with a class token and learned *position* embeddings."""

    def __init__(
        self,
        in_dim: int,
        num_classes: int,
        d_model: int = 128,
        num_layers: int = 2,
        num_heads: int = 4,
        mlp_ratio: float = 2.0,
        dropout: float = 0.0,
        max_frames: int = 64,
        pos_init_std: float = 0.2,
    ) -> None:
        super().__init__()
        self.max_frames = max_frames
        self.proj = nn.Sequential(nn.Linear(in_dim, d_model), nn.LayerNorm(d_model))
        self.cls = nn.Parameter(torch.zeros(1, 1, d_model))
        self.pos = nn.Embedding(max_frames, d_model)
        # Order is the only thing the embedding adds, and self-attention is blind to it
        # otherwise; at ViT's usual std of 0.02 it is drowned by the projected features
        # (~unit scale after the input LayerNorm) and the head learns time slowly.
        nn.init.normal_(self.pos.weight, std=pos_init_std)

        def make_layer() -> nn.TransformerEncoderLayer:
            return nn.TransformerEncoderLayer(d_model, num_heads, int(d_model * mlp_ratio),
                                              dropout=dropout, batch_first=True, norm_first=True)

        layers = _identical(make_layer, num_layers)
        self.encoder = nn.TransformerEncoder(layers[0], 0, enable_nested_tensor=False)  # no clones
        self.encoder.layers, self.encoder.num_layers = layers, num_layers
        self.norm = nn.LayerNorm(d_model)
        self.fc = nn.Linear(d_model, num_classes)

    def forward(self, features: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # positions < max_frames: ``VideoClassifier`` checks the clip length (a shape, so no
        # device sync per step, unlike reading positions.max())
        x = self.proj(features) + self.pos(positions)  # (B, T', d)
        x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], dim=1)  # (B, 1 + T', d)
        x = self.encoder(x)
        return self.fc(self.norm(x[:, 0]))


class LSTMHead(nn.Module):
    """An LSTM over the frames in temporal order; the last hidden state(s) classify."""

    def __init__(
        self,
        in_dim: int,
        num_classes: int,
        hidden_dim: int = 128,
        num_layers: int = 1,
        bidirectional: bool = True,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        self.lstm = nn.LSTM(
            in_dim, hidden_dim, num_layers, batch_first=True, bidirectional=bidirectional
        )
        self.drop = nn.Dropout(dropout)
        self.fc = nn.Linear(hidden_dim * (2 if bidirectional else 1), num_classes)

    def forward(self, features: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        order = positions.argsort(dim=1)  # frames may arrive out of order from a strategy
        x = features.gather(1, order[..., None].expand_as(features))  # (B, T', D)
        _, (h, _) = self.lstm(x)  # h: (layers * dirs, B, H)
        last = torch.cat([h[-2], h[-1]], dim=1) if self.lstm.bidirectional else h[-1]
        return self.fc(self.drop(last))
