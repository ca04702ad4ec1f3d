"""The part of distmem's torch backend protocol (distmem.apply.torch.TorchCuda) every fake shares:
availability, the device count, whether CUDA started, which devices have a context, the current
device. tests/unit/apply/test_torch.py (calls recorded) and tests/gpu/progs/fakegpu/fakecuda.py
(a fake GPU shared between processes) build on it."""


class FakeCudaBase:
    def __init__(self, count: int = 2, initialised: bool = False, contexts=()):
        self.count = count
        self.initialised = initialised
        self.ctx = set(contexts)
        self.current = 0

    def available(self):
        return True

    def device_count(self):
        return self.count

    def is_initialized(self):
        return self.initialised

    def contexts(self):
        return sorted(self.ctx)

    def current_device(self):
        return self.current
