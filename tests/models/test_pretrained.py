"""`model.pretrained`: weights are resolved from torchvision's enums; offline is a clear error."""

from __future__ import annotations

import urllib.error

import pytest
import torchvision

from videotrain.models.backbones import PretrainedWeightsUnavailable, resnet, vit


def _offline(*args, **kwargs):
    raise urllib.error.URLError("Name or service not known")


def test_offline_pretrained_names_the_setting(monkeypatch):
    # torchvision fetches weights through this function; simulate a machine without internet
    monkeypatch.setattr(torchvision.models._api, "load_state_dict_from_url", _offline)
    with pytest.raises(PretrainedWeightsUnavailable) as err:
        resnet(depth=18, pretrained="DEFAULT")
    msg = str(err.value)
    assert "model.pretrained" in msg and "model.pretrained=null" in msg
    assert "resnet18" in msg and "URLError" in msg


def test_unknown_weights_name_lists_the_choices():
    with pytest.raises(ValueError, match="model.pretrained='NOPE'.*IMAGENET1K_V1"):
        resnet(depth=18, pretrained="NOPE")


def test_no_weights_for_custom_shapes():
    with pytest.raises(ValueError, match="model.pretrained"):
        resnet(layers=[1, 1, 1, 1], pretrained="DEFAULT")
    with pytest.raises(ValueError, match="model.pretrained"):
        vit(image_size=32, patch_size=8, num_layers=1, num_heads=1, hidden_dim=8, mlp_dim=8,
            pretrained="DEFAULT")
