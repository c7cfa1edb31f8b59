"""Fixtures of the data tests: ``torchcodec``, which skips a test (naming the extra to install)
where ``data.decoder=torchcodec`` cannot run."""

from __future__ import annotations

import pytest

from videotrain.data.decode_torchcodec import DecoderUnavailable, require_torchcodec


@pytest.fixture(scope="session")
def torchcodec() -> None:
    """Skip unless torchcodec and the FFmpeg libraries it loads are installed (CI installs both:
    ``.ci/run``)."""
    try:
        require_torchcodec()
    except DecoderUnavailable as err:
        pytest.skip(f'torchcodec unavailable: pip install -e ".[torchcodec]" and FFmpeg 4-9 ({err.__cause__})')
