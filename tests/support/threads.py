import pytest
import torch


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny tensors: one thread is faster and immune to a busy machine's OpenMP stalls."""
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(prev)
