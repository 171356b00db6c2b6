import pytest

from daftrain import CompressionConfig


def test_defaults_are_valid_and_frozen():
    cfg = CompressionConfig()
    # 4 bits: the fewest fixed bits that matched FP32 on every parity task (docs/results.md)
    assert (cfg.bits, cfg.group_size) == (4, 256)
    with pytest.raises(AttributeError):
        cfg.bits = 2  # type: ignore[misc]


@pytest.mark.parametrize("bits", [1, 2, 4, 8, None])
def test_supported_bits(bits):
    assert CompressionConfig(bits=bits).bits == bits


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"bits": 3}, ValueError, "bits must be one of"),
        ({"bits": 0}, ValueError, "bits must be one of"),
        ({"bits": True}, ValueError, "bits must be one of"),
        ({"bits": 2.0}, ValueError, "bits must be one of"),
        ({"bits": "2"}, ValueError, "bits must be one of"),
        ({"group_size": 100}, ValueError, "multiple of 32"),
        ({"group_size": 0}, ValueError, "multiple of 32"),
        ({"group_size": 1 << 17}, ValueError, "multiple of 32"),
        ({"group_size": 256.0}, TypeError, "group_size must be an int"),
        ({"min_numel": -1}, ValueError, "min_numel"),
        ({"pack_bool": 1}, TypeError, "pack_bool"),
        ({"pack_integers": 1}, TypeError, "pack_integers"),
        ({"column_groups": "yes"}, TypeError, "column_groups"),
        ({"fitted_grids": 1}, TypeError, "fitted_grids"),
        ({"double_backward": "yes"}, TypeError, "double_backward must be a bool"),
        ({"seed": -5}, ValueError, "seed"),
        ({"bits": "Auto"}, ValueError, "bits must be one of"),
        ({"bits": 2, "avg_bits": 2.0}, ValueError, "only apply with bits='auto'"),
        ({"bits": None, "packed_bytes": 1000}, ValueError, "only apply with bits='auto'"),
        ({"bits": "auto", "avg_bits": 2.0, "packed_bytes": 1000}, ValueError, "not both"),
        ({"bits": "auto", "avg_bits": 2.0, "error_share": 0.01}, ValueError, "avg_bits or as error_share, not both"),
        ({"bits": 4, "error_share": 0.01}, ValueError, "only apply with bits='auto'"),
        ({"bits": "auto", "error_share": 0.0}, ValueError, "error_share must be a number in"),
        ({"bits": "auto", "error_share": 1.5}, ValueError, "error_share must be a number in"),
        ({"bits": "auto", "error_share": True}, ValueError, "error_share must be a number in"),
        ({"bits": "auto", "avg_bits": 0.5}, ValueError, "avg_bits must be a number in"),
        ({"bits": "auto", "avg_bits": 33}, ValueError, "avg_bits must be a number in"),
        ({"bits": "auto", "avg_bits": True}, ValueError, "avg_bits must be a number in"),
        ({"bits": "auto", "avg_bits": "2"}, ValueError, "avg_bits must be a number in"),
        ({"bits": "auto", "packed_bytes": 0}, ValueError, "packed_bytes must be a positive int"),
        ({"bits": "auto", "packed_bytes": 10.5}, ValueError, "packed_bytes must be a positive int"),
        ({"bits": "auto", "adapt_interval": 0}, ValueError, "adapt_interval"),
        ({"bits": "auto", "variance_warning": 0}, ValueError, "variance_warning"),
    ],
)
def test_bad_values_are_rejected_with_a_clear_message(kwargs, error, message):
    with pytest.raises(error, match=message):
        CompressionConfig(**kwargs)


def test_auto_bits_config():
    cfg = CompressionConfig(bits="auto", avg_bits=2.5, adapt_interval=50)
    assert cfg.auto and (cfg.avg_bits, cfg.adapt_interval) == (2.5, 50)
    assert CompressionConfig(bits="auto", packed_bytes=1 << 20).packed_bytes == 1 << 20
    assert CompressionConfig(bits="auto").avg_bits is None  # means 2.0, see importance.py
    assert not CompressionConfig(bits=2).auto
