"""LaunchSpec validation: every bad value is refused with a message naming the option."""

import math

import pytest

from sgpu_magic.errors import SpecError
from sgpu_magic.spec import DEFAULT_TIMEOUT_S, make_spec


def test_defaults_follow_the_serverless_api():
    spec = make_spec(2)
    assert (spec.gpus, spec.gpu_type, spec.timeout_s, spec.port) == (2, None, DEFAULT_TIMEOUT_S, None)
    assert DEFAULT_TIMEOUT_S == 10800


@pytest.mark.parametrize("gpus", [0, -1, 2.0, "2", True, None, 10**6])
def test_bad_gpus(gpus):
    with pytest.raises(SpecError, match=r"gpus must be"):
        make_spec(gpus)


@pytest.mark.parametrize("timeout", [0, -5, float("nan"), "1h", True])
def test_bad_timeout(timeout):
    with pytest.raises(SpecError, match=r"timeout must be a number of seconds > 0, or None for no limit"):
        make_spec(1, timeout=timeout)


def test_timeout_none_and_inf_mean_no_limit():
    assert make_spec(1, timeout=None).timeout_s is None
    assert make_spec(1, timeout=math.inf).timeout_s is None
    assert make_spec(1, timeout=1.5).timeout_s == 1.5


@pytest.mark.parametrize("gpu_type", ["", "   ", 3])
def test_bad_gpu_type(gpu_type):
    with pytest.raises(SpecError, match=r"gpu_type must be a non-empty string"):
        make_spec(1, gpu_type=gpu_type)


@pytest.mark.parametrize("port", [0, 70000, "29500", 1.5])
def test_bad_port(port):
    with pytest.raises(SpecError, match=r"port must be an int between 1 and 65535"):
        make_spec(1, port=port)


def test_spec_is_frozen():
    spec = make_spec(1)
    with pytest.raises(AttributeError):
        spec.gpus = 2


@pytest.mark.parametrize(
    "gpu_ids, message",
    [
        ("0,1", r"gpu_ids must be a list of GPU indices such as \[0, 1\]"),
        ([0, -1], r"gpu_ids must be a non-empty list of GPU indices >= 0"),
        ([1, 1], r"gpu_ids lists a GPU twice: \[1, 1\]; give each GPU once"),
        ([0, 1, 2], r"gpu_ids names 3 GPU\(s\) \(\[0, 1, 2\]\) but gpus=2; give one GPU index per rank"),
    ],
)
def test_bad_gpu_ids_are_refused(gpu_ids, message):
    with pytest.raises(SpecError, match=message):
        make_spec(2, gpu_ids=gpu_ids)
