"""MSHNet model: output shapes in both phases, parameter count, the authors' parameter names."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from raytpu.jobs.mshnet.model import MSHNet, upsample

pytestmark = pytest.mark.usefixtures("one_thread")


# name -> shape of a sample of the authors' state_dict entries (model/MSHNet.py of ying-fu/MSHNet)
ORIGINAL_ENTRIES = {
    "conv_init.weight": (16, 3, 1, 1),
    "conv_init.bias": (16,),
    "encoder_0.0.conv1.weight": (16, 16, 3, 3),
    "encoder_0.0.bn1.running_mean": (16,),
    "encoder_0.0.ca.fc1.weight": (1, 16, 1, 1),
    "encoder_0.0.ca.fc2.weight": (16, 1, 1, 1),
    "encoder_0.0.sa.conv1.weight": (1, 2, 7, 7),
    "encoder_1.0.shortcut.0.weight": (32, 16, 1, 1),
    "encoder_1.0.shortcut.1.num_batches_tracked": (),
    "encoder_1.1.sa.conv1.weight": (1, 2, 7, 7),
    "middle_layer.1.bn2.running_var": (256,),
    "decoder_3.0.conv1.weight": (128, 384, 3, 3),
    "decoder_0.0.shortcut.1.bias": (16,),
    "output_0.weight": (1, 16, 1, 1),
    "output_3.bias": (1,),
    "final.weight": (1, 4, 3, 3),
}


def test_parameter_count_and_original_names():
    model = MSHNet()
    assert sum(p.numel() for p in model.parameters()) == 4_065_513
    state = model.state_dict()
    assert len(state) == 340  # as many entries as the authors' model
    for key, shape in ORIGINAL_ENTRIES.items():
        assert tuple(state[key].shape) == shape, key
    assert "encoder_0.0.shortcut.0.weight" not in state  # same width: identity shortcut
    assert not any(key.startswith("encoder_0.1.") or key.startswith("decoder_0.1.") for key in state)


def test_state_dict_round_trip_is_strict():
    source, target = MSHNet(), MSHNet()
    target.load_state_dict(source.state_dict(), strict=True)
    x = torch.randn(1, 3, 32, 32)
    torch.testing.assert_close(source.eval()(x, True)[1], target.eval()(x, True)[1])


def test_output_shapes_in_both_phases():
    model = MSHNet().eval()
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        masks, logits = model(x, True)
        assert [tuple(h.shape) for h in masks] == [(2, 1, 64, 64), (2, 1, 32, 32), (2, 1, 16, 16), (2, 1, 8, 8)]
        assert tuple(logits.shape) == (2, 1, 64, 64)
        head0 = masks[0]
        masks, logits = model(x, False)
    assert masks == [] and tuple(logits.shape) == (2, 1, 64, 64)
    torch.testing.assert_close(logits, head0)  # warm-up returns the level-0 head alone


def test_custom_widths_and_a_clear_error_for_a_wrong_count():
    small = MSHNet(3, [8, 8, 16, 16, 32])
    _, logits = small(torch.randn(1, 3, 32, 32), True)
    assert tuple(logits.shape) == (1, 1, 32, 32)
    with pytest.raises(ValueError, match="5 widths"):
        MSHNet(3, [16, 32, 64])


@pytest.mark.parametrize("factor", [2, 4, 8])
def test_matmul_upsampling_equals_bilinear_align_corners(factor):
    x = torch.randn(2, 3, 5, 7)
    expected = F.interpolate(x, scale_factor=factor, mode="bilinear", align_corners=True)
    torch.testing.assert_close(upsample(x, factor), expected, rtol=1e-5, atol=1e-5)


def test_upsampling_in_bfloat16_keeps_positions_for_large_outputs():
    # the interpolation weights are built in float32: bfloat16 cannot count past 256
    x = torch.randn(1, 1, 64, 64)
    expected = F.interpolate(x, scale_factor=8, mode="bilinear", align_corners=True)
    assert (upsample(x.bfloat16(), 8).float() - expected).abs().max() < 0.1
