import pytest
import torch

from tandem.modular_kernels.sm_partition import comm_sm_partition
from tandem.testing import fake_deep_ep, fake_deep_gemm


@pytest.fixture
def gpu_libraries():
    with fake_deep_ep.installed() as deep_ep, fake_deep_gemm.installed() as deep_gemm:
        yield deep_ep, deep_gemm


def test_splits_sms_inside_and_restores_after(gpu_libraries):
    deep_ep, deep_gemm = gpu_libraries
    before_ep, before_gemm = deep_ep.Buffer.num_sms, deep_gemm.get_num_sms()
    with comm_sm_partition(24, total_sms=132):
        assert deep_ep.Buffer.num_sms == 24
        assert deep_gemm.get_num_sms() == 108
    assert (deep_ep.Buffer.num_sms, deep_gemm.get_num_sms()) == (before_ep, before_gemm)


def test_restores_after_an_exception(gpu_libraries):
    deep_ep, deep_gemm = gpu_libraries
    before = deep_gemm.get_num_sms()
    with pytest.raises(KeyError):
        with comm_sm_partition(20, total_sms=132):
            raise KeyError("ubatch failed")
    assert deep_gemm.get_num_sms() == before


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU behaviour")
def test_is_a_noop_without_a_device(gpu_libraries):
    deep_ep, deep_gemm = gpu_libraries
    before = (deep_ep.Buffer.num_sms, deep_gemm.get_num_sms())
    with comm_sm_partition(24):
        assert (deep_ep.Buffer.num_sms, deep_gemm.get_num_sms()) == before


@pytest.mark.parametrize("comm_sms, message", [(132, "lie in"), (131, "lie in"), (-2, "lie in"), (7, "even")])
def test_bad_counts_are_named(comm_sms, message):
    with pytest.raises(ValueError, match=message):
        with comm_sm_partition(comm_sms, total_sms=132):
            pass


def test_deep_gemm_gets_an_even_count_on_an_odd_device(gpu_libraries):
    """Every DeepGEMM GEMM asserts an even SM count: on a device with an odd count the
    compute share is rounded down."""
    deep_ep, deep_gemm = gpu_libraries
    fake_deep_gemm.install(device_num_sms=131)
    with comm_sm_partition(24, total_sms=131):
        assert deep_ep.Buffer.num_sms == 24 and deep_gemm.get_num_sms() == 106


def test_deep_ep_never_gets_more_sms_than_its_buffers_were_sized_for(gpu_libraries, monkeypatch):
    from tandem.modular_kernels import prepare_deepep

    deep_ep, deep_gemm = gpu_libraries
    monkeypatch.setattr(prepare_deepep, "ht_buffer_sms_limit", lambda: 20)
    with comm_sm_partition(32, total_sms=132):
        assert deep_ep.Buffer.num_sms == 20 and deep_gemm.get_num_sms() == 100


@pytest.mark.parametrize("comm_sms", [7, 0])
def test_the_flag_takes_an_even_count(comm_sms):
    from tandem.config import OverlapConfig

    with pytest.raises(ValueError, match="--comm-sms must be an even count"):
        OverlapConfig(comm_sms=comm_sms)
    assert OverlapConfig(comm_sms=24).comm_sms == 24
