import pytest

EXECUTORS = ["thread", "greenlet"]


@pytest.fixture(params=EXECUTORS)
def executor(request):
    return request.param
