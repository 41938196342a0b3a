"""The demo's model: a small CNN for 8x8 grey-scale digits (about 40k parameters).

No dropout and no batch normalisation, on purpose: both make a rank's result depend on what
else is in *its* slice of the global batch or on its own random stream, so training on N ranks
would no longer match training on 1 rank with the same global batch (the parity test in
tests/test_demo.py). With them, use ``torch.nn.SyncBatchNorm`` and seed dropout per sample.
"""
from __future__ import annotations

import torch
from torch import nn


class DigitsCNN(nn.Module):
    """conv(1->16) relu conv(16->32) relu maxpool(2) -> fc(512->64) relu fc(64->10).

    Input: float tensor [B, 1, 8, 8] with pixels in 0..1; output: logits [B, 10].
    """

    def __init__(self, num_classes: int = 10, width: int = 16, hidden: int = 64):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, width, kernel_size=3, padding=1), nn.ReLU(),
            nn.Conv2d(width, 2 * width, kernel_size=3, padding=1), nn.ReLU(),
            nn.MaxPool2d(2))
        self.classifier = nn.Sequential(
            nn.Flatten(), nn.Linear(2 * width * 4 * 4, hidden), nn.ReLU(),
            nn.Linear(hidden, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


def build_model(seed: int, dtype: torch.dtype = torch.float32) -> DigitsCNN:
    """The CNN with weights drawn from ``seed`` (the same on every rank and every world size)."""
    g_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        model = DigitsCNN()
    finally:
        torch.random.set_rng_state(g_state)
    return model.to(dtype)
