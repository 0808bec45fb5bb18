"""Fixtures every Python suite may use. The import path (tests/python/support, bench/ for the
model zoo) is pyproject.toml's [tool.pytest.ini_options] pythonpath."""


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


    @pytest.fixture
    def offload():
        """st.offload(model) on the suites' device (torch_parity_models.DEVICE), every block
        streaming unless a test keeps some resident (on a GPU the default would); each session
        closed when the test ends."""
        import strata.torch as st
        from torch_parity_models import DEVICE
        models = []

        def _offload(model, **kwargs):
            kwargs.setdefault("device", DEVICE)
            kwargs.setdefault("resident_blocks", 0)
            out = st.offload(model, **kwargs)
            models.append(out)
            return out

        yield _offload
        for model in models:
            session = getattr(model, "strata", None)
            if session is not None:
                try:
                    session.close()
                except Exception:
                    pass
