"""The tests' import path: the model zoo they train (bench/llama_zoo) is not part of the strata
package, so it comes from the checkout, as in bench/ and examples/."""
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "bench"))


try:
    import pytest
    import torch
except ImportError:  # a suite without torch (the C ABI's bindings tests)
    torch = None

if torch is not None:
    @pytest.fixture
    def one_torch_thread():
        """Tiny models: intra-op threads only cost (a step takes 5 ms on one thread and up to
        1.7 s on two busy cores, where OpenMP's barriers spin); restored afterwards."""
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        yield
        torch.set_num_threads(threads)
