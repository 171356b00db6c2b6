import pytest

from daftrain import CompressionConfig


def test_defaults_are_valid_and_frozen():
    cfg = CompressionConfig()
    assert (cfg.bits, cfg.group_size) == (2, 256)
    with pytest.raises(AttributeError):
        cfg.bits = 4  # type: ignore[misc]


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
        ({"seed": -5}, ValueError, "seed"),
    ],
)
def test_bad_values_are_rejected_with_a_clear_message(kwargs, error, message):
    with pytest.raises(error, match=message):
        CompressionConfig(**kwargs)
